"""megaray: full-precision LLM training on one GPU, layers streamed from host memory.

The installed package has four parts, each a folder of the repository:
- ``megaray`` (``megaray/``): the core library: configs, layout, model templates, the memory
  model and plan, the shared-memory protocol, the AdamW kernel, data, checkpoints, and the
  driver's loop. The model code imports neither Ray nor CUDA streams.
- ``megaray.actors`` (``actors/``): the Ray actors and the session that starts them.
- ``megaray.pipelines`` (``pipelines/``): the entrypoints of ``megaray`` and ``ray job submit``.
- ``megaray.configs`` (``configs/``): the shipped YAML configs.

pyproject.toml maps the folders to these names, so megaray is used installed
(``pip install .``, or ``pip install -e .`` to work on it); ARCHITECTURE.md has the design.
"""
from __future__ import annotations

__version__ = "0.2.0"
