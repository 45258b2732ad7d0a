"""The package's import graph, read from the installed sources with ``ast``: no cycle among
megaray's modules (function-level imports included), and the core below the actors."""
from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import megaray

PACKAGES = ("megaray", "megaray.actors", "megaray.pipelines", "megaray.hf", "megaray.bench", "megaray.driver")
# The core library: neither Ray nor the actors and the driver above it.
CORE = {"megaray.errors", "megaray.shapes", "megaray.model_config", "megaray.optim_config", "megaray.config",
        "megaray.loader", "megaray.layout", "megaray.attention", "megaray.fused", "megaray.moe", "megaray.model",
        "megaray.rope", "megaray.init_weights",
        "megaray.hf", "megaray.hf.read", "megaray.hf.export", "megaray.leftovers", "megaray.shm", "megaray.protocol",
        "megaray.buffers", "megaray.memory", "megaray.cost", "megaray.machine", "megaray.plan",
        "megaray.fitting",
        "megaray.lr_schedule", "megaray.clipping", "megaray.adamw", "megaray.parts", "megaray.checkpoint",
        "megaray.corpus", "megaray.packing",
        "megaray.dataset", "megaray.tokenizer", "megaray.step", "megaray.compare"}
ABOVE_CORE = ("ray", "megaray.actors", "megaray.driver", "megaray.bench", "megaray.pipelines", "megaray.cli")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        out[pkg] = Path(mod.__file__)
        for info in pkgutil.iter_modules(mod.__path__):
            if not info.ispkg:
                name = f"{pkg}.{info.name}"
                out[name] = Path(importlib.util.find_spec(name).origin)
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``name`` imports (anywhere in the file), resolved to a known module where
    the name is megaray's, else the top-level package."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            out.add(t if t in known else t.split(".")[0])
    out.discard(name)
    return out


def test_no_import_cycle():
    mods = _modules()
    known = set(mods)
    graph = {m: {d for d in _imports(m, p, known) if d in known and d not in PACKAGES} for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for d in graph[m]:
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert len(graph) > 30                  # the walk saw the whole package


def test_the_core_imports_neither_ray_nor_what_sits_above_it():
    mods = _modules()
    known = set(mods)
    assert CORE <= known, CORE - known
    for m in sorted(CORE):
        bad = {d for d in _imports(m, mods[m], known) if any(d == a or d.startswith(a + ".") for a in ABOVE_CORE)}
        assert not bad, f"{m} imports {sorted(bad)}"


def test_the_source_tree_is_not_importable_by_accident():
    """megaray's folders join one package only when installed: the core package itself has no
    path tricks, so ``megaray.actors`` resolves to the installed actors/."""
    assert len(megaray.__path__) == 1
    actors = importlib.import_module("megaray.actors")
    assert Path(actors.__file__).parent.name == "actors"
