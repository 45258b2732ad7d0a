"""megaray: full-precision LLM training on one GPU, layers streamed from host memory.

The core library (this package) holds the model templates, configs, schedules and
shared-memory plumbing; it imports neither Ray actors nor CUDA streams. The Ray actors
live in ``megaray.actors`` and the job entrypoints in ``megaray.pipelines``; in the source
tree those are the top-level ``actors/`` and ``pipelines/`` folders, mapped by
pyproject.toml when installed.
"""
from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# In a source checkout (PYTHONPATH=repo root, as on the GPU machine) make the top-level
# actors/, pipelines/ and configs/ folders importable as megaray.actors etc., exactly as
# the installed distribution maps them.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
    _os.path.join(_root, "actors", "__init__.py")
):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821
