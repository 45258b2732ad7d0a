"""Hugging Face model directories: read config.json and safetensors, write them back.

Supported architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM. Parameter names are the same on both sides (megaray's layout uses Hugging
Face's names), so loading is a copy per tensor, upcast to fp32, one tensor in memory at a
time: safetensors files are memory-mapped and read tensor by tensor, never whole.
Anything the templates do not implement (another architecture, an MLP bias, a sliding
window shorter than the sequence, another rope type) is refused with the key named.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from megaray.errors import ConfigError, ModelFileError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "generation_config.json", "chat_template.jinja")
IGNORED_TENSORS = ("rotary_emb.inv_freq",)


def read_hf_config(path: str | os.PathLike) -> dict:
    """ModelConfig keyword arguments from ``<path>/config.json``; refuses what megaray lacks."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise ConfigError("model.from", f"{path} has no config.json")
    try:
        c = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError("model.from", f"{p} is not valid JSON: {e}") from None
    archs = c.get("architectures") or []
    arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                   "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(c.get("model_type"))
    if arch not in ARCHITECTURES:
        raise ConfigError("model.from", f"{p}: architecture {archs or c.get('model_type')} is not supported "
                                        f"(supported: {sorted(ARCHITECTURES)})")
    kind = ARCHITECTURES[arch]

    def refuse(key: str, why: str):
        raise ConfigError("model.from", f"{p}: {key}={c.get(key)!r} is not supported: {why}")

    if c.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the MLP is SwiGLU with silu")
    if c.get("mlp_bias", False):
        refuse("mlp_bias", "MLP projections have no bias")
    if c.get("use_sliding_window", False):
        refuse("use_sliding_window", "attention is full causal attention")
    if c.get("pretraining_tp", 1) not in (1, None):
        refuse("pretraining_tp", "only 1")
    rope = dict(c.get("rope_parameters") or {})
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("default", None):
        scaling = None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "llama3":
        refuse("rope_scaling", f"rope type {scaling.get('rope_type', scaling.get('type'))!r}; only llama3 scaling")
    heads = c["num_attention_heads"]
    out = dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=float(theta), rope_scaling=scaling,
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=True if kind == "qwen2" else bool(c.get("attention_bias", False)),
        qk_norm=kind == "qwen3", initializer_range=float(c.get("initializer_range", 0.02)),
        sliding_window=c.get("sliding_window") if (kind == "mistral" or c.get("use_sliding_window")) else None,
        architecture=arch,
    )
    return out


class SafetensorsSource:
    """The weight files of a model directory: one model.safetensors, or shards with an index."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelFileError(f"{index} is not a valid safetensors index: {e}") from None
        elif single.is_file():
            weight_map = None
        else:
            raise ModelFileError(f"{self.path} has neither model.safetensors nor model.safetensors.index.json")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self.handles, self.where = {}, {}
        for f in files:
            fp = self.path / f
            if not fp.is_file():
                raise ModelFileError(f"shard {fp} listed in {index.name} is missing")
            try:
                h = safe_open(str(fp), framework="pt")
                keys = list(h.keys())
            except Exception as e:
                raise ModelFileError(f"{fp} is not a readable safetensors file (truncated or corrupt?): {e}") from None
            self.handles[f] = h
            for k in keys:
                self.where[k] = f
        if weight_map:
            missing = sorted(k for k, f in weight_map.items() if self.where.get(k) != f)
            if missing:
                raise ModelFileError(f"tensors listed in {index} are not in their shard: {missing[:5]}")

    def names(self) -> list[str]:
        return sorted(self.where)

    def get(self, name: str) -> torch.Tensor:
        f = self.where[name]
        try:
            return self.handles[f].get_tensor(name)
        except Exception as e:
            raise ModelFileError(f"{self.path / f}: tensor {name} cannot be read (truncated or corrupt?): {e}") from None


def verify_source(units, path: str | os.PathLike) -> SafetensorsSource:
    """Check names and shapes against the layout from the files' headers alone (no data read)."""
    src = SafetensorsSource(path)
    wanted = {s.name: s for u in units for s in u.params}
    unknown = [n for n in src.names() if n not in wanted and not n.endswith(IGNORED_TENSORS)]
    if unknown:
        raise ModelFileError(f"{path}: tensors megaray's model does not have: {unknown[:5]}")
    missing = [n for n in wanted if n not in src.where]
    if missing:
        raise ModelFileError(f"{path}: tensors missing from the safetensors files: {missing[:5]}")
    for name, spec in wanted.items():
        f = src.where[name]
        shape = tuple(src.handles[f].get_slice(name).get_shape())
        if shape != spec.shape:
            raise ModelFileError(f"{src.path / f}: tensor {name} has shape {shape}, config.json implies {spec.shape}")
    return src


def load_into(units, master_view, path: str | os.PathLike) -> dict:
    """Copy every tensor of a model directory into the fp32 master regions, upcasting.

    ``master_view(u)`` returns unit u's flat fp32 tensor. Returns a small report.
    """
    src = verify_source(units, path)
    wanted = {s.name: (u, s) for u in units for s in u.params}
    dtypes, nbytes = set(), 0
    for name, (u, s) in wanted.items():
        t = src.get(name)
        if tuple(t.shape) != s.shape:
            raise ModelFileError(f"{path}: tensor {name} has shape {tuple(t.shape)}, config.json implies {s.shape}")
        dtypes.add(str(t.dtype).replace("torch.", ""))
        nbytes += t.numel() * t.element_size()
        master_view(u.index)[s.offset:s.offset + s.numel].copy_(t.reshape(-1))
        del t
    return {"tensors": len(wanted), "source_bytes": nbytes, "source_dtypes": sorted(dtypes)}


def hf_config_dict(model, architecture: str | None, source: dict | None = None) -> dict:
    """A transformers config.json for ``model`` (a ModelConfig)."""
    arch = architecture or ("Qwen3ForCausalLM" if model.qk_norm else
                            "Qwen2ForCausalLM" if model.attention_bias else "LlamaForCausalLM")
    out = dict(source or {})
    out.update({
        "architectures": [arch], "model_type": ARCHITECTURES[arch],
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size, "num_hidden_layers": model.num_hidden_layers,
        "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_key_value_heads,
        "head_dim": model.head_dim, "rms_norm_eps": model.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings, "torch_dtype": "float32",
        "rope_theta": model.rope_theta, "rope_scaling": model.rope_scaling,
    })
    out.pop("rope_parameters", None)
    out.pop("dtype", None)
    if ARCHITECTURES[arch] in ("llama", "qwen3"):
        out["attention_bias"] = model.attention_bias
    if ARCHITECTURES[arch] == "mistral":
        out["sliding_window"] = model.sliding_window
    return out


def write_hf_dir(out_dir: str | os.PathLike, model, specs: list[tuple[str, int]], get,
                 source_dir: str | None = None, dtype: torch.dtype = torch.float32,
                 shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write config.json, sharded safetensors with their index, and the source's side files.

    ``specs`` lists (name, numel) in layout order and ``get(name)`` returns a tensor; shards
    are planned first and written one at a time, so at most one shard is in memory.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source_cfg = None
    if source_dir and (Path(source_dir) / "config.json").is_file():
        source_cfg = json.loads((Path(source_dir) / "config.json").read_text())
    cfg = hf_config_dict(model, getattr(model, "architecture", None), source_cfg)
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    plan, size = [[]], 0
    for name, numel in specs:
        if size and size + numel * itemsize > shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(name)
        size += numel * itemsize
    n, written, weight_map = len(plan), [], {}
    for i, names in enumerate(plan):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: get(k).to(dtype).contiguous() for k in names}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in names})
        written.append(fname)
    if n > 1:
        total = sum(numel for _, numel in specs) * itemsize
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    if source_dir:
        for f in SIDE_FILES:
            if (Path(source_dir) / f).is_file():
                shutil.copy2(Path(source_dir) / f, out / f)
                written.append(f)
    return written


def find_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder, or the newest complete checkpoint of a run directory."""
    from megaray.checkpoint import complete_checkpoints
    from megaray.config import load_config
    from megaray.errors import CheckpointError

    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    if (p / "config.yaml").is_file():
        found = complete_checkpoints(load_config(p / "config.yaml").checkpoint_dir)
        if found:
            return found[0]
        raise CheckpointError(f"run {p} has no complete checkpoint")
    found = complete_checkpoints(p)
    if found:
        return found[0]
    raise CheckpointError(f"{p} is neither a checkpoint, a folder of checkpoints, nor a run directory")


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32",
                      shard_bytes: int = 5 * 2**30) -> tuple[Path, list[str]]:
    """Write a checkpoint's weights as a Hugging Face model directory."""
    import numpy as np

    from megaray.checkpoint import read_manifest, verify_file
    from megaray.config import ModelConfig
    from megaray.model import build_layout

    ck = find_checkpoint(path)
    m = read_manifest(ck)
    verify_file(ck / "master.bin", m["parts"]["master.bin"])
    model = ModelConfig(**m["model"])
    units = build_layout(model)
    from megaray.buffers import unit_offsets

    stored = m["parts"]["master.bin"].get("dtype", "float32")
    size = {"float32": 4, "bfloat16": 2}[stored]
    offsets, _ = unit_offsets(units, size)   # master.bin is the master file, byte for byte
    master = np.memmap(ck / "master.bin", dtype=np.uint8, mode="r")
    where = {}
    for u in units:
        base = offsets[u.index]
        for s in u.params:
            where[s.name] = (base + size * s.offset, s.numel, s.shape)

    def get(name):
        off, n, shape = where[name]
        if size == 2:   # bf16: numpy has no such dtype, so read the raw 16 bits
            raw = np.frombuffer(master, dtype=np.int16, count=n, offset=off).copy()
            return torch.from_numpy(raw).view(torch.bfloat16).float().view(shape)
        return torch.from_numpy(np.frombuffer(master, dtype=np.float32, count=n, offset=off).copy()).view(shape)

    specs = [(s.name, s.numel) for u in units for s in u.params]
    written = write_hf_dir(out_dir, model, specs, get, model.from_path,
                           {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype], shard_bytes)
    return ck, written
