"""YAML to ``RunConfig``: the one loader, with overrides, shipped configs and ``model.from``.

``load_config(path, overrides)`` reads a YAML file (or a shipped config's name: ``demo``,
``debug``), applies ``section.key=value`` overrides, fills ``model`` from a Hugging Face
directory's config.json when ``model.from`` is set, type-checks every field against its
annotation, refuses unknown keys and builds the dataclasses of ``megaray.config``, whose
cross-field checks then run. Every failure is a ``ConfigError`` naming the dotted key.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from megaray.config import ModelConfig, RunConfig
from megaray.errors import ConfigError
from megaray.hf.read import read_hf_config
from megaray.shapes import SHAPES

log = logging.getLogger("megaray")

_SECTIONS = {f.name: f for f in dataclasses.fields(RunConfig)}


def _type_ok(value: Any, annotation: Any) -> bool:
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, annotation)


def _as_number(value: Any, annotation: Any) -> Any:
    """YAML 1.1 reads ``1e-8`` (no dot) as a string; a number written so is taken as a float
    where the key wants one."""
    wants_float = annotation is float or float in typing.get_args(annotation)
    if wants_float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _describe_bad(value: Any, annotation: Any) -> str:
    want = getattr(annotation, "__name__", str(annotation)).replace("NoneType", "null")
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number (got {value!r})"
    return f"expected {want}, got {type(value).__name__} {value!r}"


def _build_section(cls, key: str, data: Any):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(key, f"must be a mapping (got {type(data).__name__})")
    if cls is ModelConfig and "from" in data:
        data = dict(data)
        data["from_path"] = data.pop("from")
        if not isinstance(data["from_path"], str):
            raise ConfigError("model.from", f"expected a path, got {data['from_path']!r}")
        hf = read_hf_config(data["from_path"])
        clash = sorted(k for k in data if k in hf and data[k] != hf[k])
        if clash:
            raise ConfigError(f"model.{clash[0]}", "is set by model.from's config.json; remove it")
        data = {**hf, **data}
    if cls is ModelConfig and data.get("shape") in SHAPES:
        data = {**SHAPES[data["shape"]], **data}  # explicit keys win over the shape's
    data = _renamed(key, data)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            raise ConfigError(f"{key}.{k}", f"unknown key (known in '{key}': {sorted(names)})")
        v = _as_number(v, hints[k])
        if not _type_ok(v, hints[k]):
            raise ConfigError(f"{key}.{k}", _describe_bad(v, hints[k]))
        if hints[k] is float and isinstance(v, int):
            v = float(v)
        kwargs[k] = v
    return cls(**kwargs)


# Keys renamed in megaray 0.3 (section, old name) -> new name: the old name is still read,
# with a warning, for one release.
RENAMED = {("optim", "placement"): "resident_units", ("worker", "placement"): "node"}


def _renamed(section: str, data: dict) -> dict:
    """``data`` with the keys of RENAMED under their new names (a warning says so each time);
    both names at once is an error naming them."""
    out = dict(data)
    for (sec, old), new in RENAMED.items():
        if sec != section or old not in out:
            continue
        if new in out:
            raise ConfigError(f"{sec}.{old}", f"is the old name of {sec}.{new}, which is set too: keep {sec}.{new}")
        log.warning("%s.%s is called %s.%s from megaray 0.3 on; the old name is read until 0.4", sec, old, sec, new)
        out[new] = out.pop(old)
    return out


def build_config(data: dict) -> RunConfig:
    """Validate a plain dict (as read from YAML) into a RunConfig."""
    if not isinstance(data, dict):
        raise ConfigError("<root>", "a config is a mapping of sections")
    sections = {}
    for name, value in data.items():
        if name not in _SECTIONS:
            raise ConfigError(name, f"unknown section (known: {sorted(_SECTIONS)})")
        cls = typing.get_type_hints(RunConfig)[name]
        sections[name] = _build_section(cls, name, value)
    return RunConfig(**sections)


def apply_override(data: dict, item: str) -> None:
    """Apply one ``section.key=value`` override (value parsed as YAML) to a raw config dict."""
    if "=" not in item:
        raise ConfigError(item, "an override is written key=value, e.g. train.steps=10")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(key, "an override key is section.key, e.g. optim.lr")
    node = data
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(key, f"'{p}' is not a section")
        node = nxt
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None


def shipped_config(name: str) -> Path:
    """Path of a YAML config shipped with megaray (``demo`` -> the package's configs/demo.yaml)."""
    return Path(str(resources.files("megaray.configs").joinpath(f"{name}.yaml")))


def shipped_names() -> list[str]:
    """The shipped configs' names (``demo``, ``debug``, ...)."""
    return sorted(p.name[:-5] for p in resources.files("megaray.configs").iterdir() if p.name.endswith(".yaml"))


def load_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read YAML at ``path`` (or a shipped config's name), apply overrides, validate."""
    p = Path(path)
    # a shipped config's name, unless a file of that name is here (a folder named "demo" is not one)
    if not p.is_file() and not str(path).endswith((".yaml", ".yml")) and shipped_config(str(path)).is_file():
        p = shipped_config(str(path))
    if not p.is_file():
        what = "a folder, not a config file" if p.is_dir() else "no config file there"
        raise ConfigError("<file>", f"{path}: {what} (a YAML file, or a shipped config's name: "
                                    f"{', '.join(shipped_names())})")
    try:
        data = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError("<file>", f"{p} is not valid YAML: {e}") from None
    if data is None:
        raise ConfigError("<file>", f"{p} is empty; a config holds at least one section (run, model, train, ...), "
                                    "or name a shipped config: demo, debug")
    for item in overrides:
        apply_override(data, item)
    return absolute_paths(build_config(data))


# (section, field): the config's paths, resolved against the driver's folder
PATHS = (("run", "dir"), ("model", "from_path"), ("data", "path"), ("cluster", "shm_dir"),
         ("checkpoint", "dir"), ("checkpoint", "resume"))


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """``cfg`` with every path absolute (``~`` expanded), against the folder of the process
    that read the config: a path means what it meant where the user typed the command. The
    actors run elsewhere (a local Ray's workers start in an empty folder of their own:
    ``megaray.driver.cluster.start_local_ray``), and the resolved ``config.yaml`` in the run
    directory says exactly where everything is. ``checkpoint.resume: auto`` is not a path."""
    changed: dict[str, dict[str, str]] = {}
    for section, key in PATHS:
        v = getattr(getattr(cfg, section), key)
        if v is None or (key == "resume" and v == "auto"):
            continue
        changed.setdefault(section, {})[key] = os.path.abspath(os.path.expanduser(v))
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in changed.items()})


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
