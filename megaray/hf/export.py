"""Writing a Hugging Face model directory from a megaray checkpoint (``megaray export``).

config.json, sharded safetensors with their index (one shard in memory at a time), and the
tokenizer and generation files of the model the run started from; transformers'
``AutoModelForCausalLM.from_pretrained`` loads the result and gives megaray's logits.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from megaray.checkpoint import Checkpoint, complete_checkpoints
from megaray.config import ModelConfig
from megaray.errors import CheckpointError, ExportError
from megaray.hf import ARCHITECTURES, MOE, SIDE_FILES
from megaray.layout import DTYPES, build_layout
from megaray.leftovers import remove_dead_tmp


def hf_config_dict(model, architecture: str | None, source: dict | None = None) -> dict:
    """A transformers config.json for ``model`` (a ModelConfig)."""
    arch = architecture or ("Olmo2ForCausalLM" if model.norm_placement == "post" else
                            "Gemma3ForCausalLM" if model.norm_placement == "sandwich" else
                            "Qwen3ForCausalLM" if model.qk_norm else
                            "Qwen2ForCausalLM" if model.attention_bias else "LlamaForCausalLM")
    out = dict(source or {})
    out.update({
        "architectures": [arch], "model_type": ARCHITECTURES[arch],
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size, "num_hidden_layers": model.num_hidden_layers,
        "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_key_value_heads,
        "head_dim": model.head_dim, "rms_norm_eps": model.rms_norm_eps, "hidden_act": model.hidden_act,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings, "torch_dtype": "float32",
        "rope_theta": model.rope_theta, "rope_scaling": model.rope_scaling,
    })
    if model.pad_token_id is not None:
        out["pad_token_id"] = model.pad_token_id
    out.pop("rope_parameters", None)
    out.pop("dtype", None)
    kind = ARCHITECTURES[arch]
    if kind in ("llama", "qwen3", "qwen3_moe", "olmoe", "olmo2"):
        out["attention_bias"] = model.attention_bias
    if kind in ("mistral", "mixtral", "phi3"):
        out["sliding_window"] = model.sliding_window
    if kind == "gemma3_text":
        scalar = model.query_pre_attn_scalar      # transformers' field is an int (168, 256)
        out.update(hidden_activation=model.hidden_act,
                   query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                   sliding_window=model.sliding_window, layer_types=list(model.layer_types),
                   rope_local_base_freq=model.rope_local_theta, attention_bias=False,
                   final_logit_softcapping=None, attn_logit_softcapping=None)
        out.pop("sliding_window_pattern", None)
    if kind == "phi3":
        out["partial_rotary_factor"] = model.partial_rotary_factor
        rs = model.rope_scaling
        if rs is not None:
            out["original_max_position_embeddings"] = rs["original_max_position_embeddings"]
    elif model.partial_rotary_factor != 1.0:
        raise ExportError(f"{arch} turns every dimension of a head (model.partial_rotary_factor "
                          f"{model.partial_rotary_factor} is Phi-3's)")
    if kind in MOE:
        out.update({"num_local_experts" if kind == "mixtral" else "num_experts": model.num_experts,
                    "num_experts_per_tok": model.num_experts_per_tok,
                    "router_aux_loss_coef": model.router_aux_loss_coef,
                    "output_router_logits": model.output_router_logits})
        if kind == "qwen3_moe":
            out.update(moe_intermediate_size=model.moe_intermediate_size, norm_topk_prob=model.norm_topk_prob,
                       decoder_sparse_step=1, mlp_only_layers=[])
        elif kind == "olmoe":
            out.update(norm_topk_prob=model.norm_topk_prob, clip_qkv=None)
        else:
            out["router_jitter_noise"] = 0.0
    return out


def write_hf_dir(out_dir: str | os.PathLike, model, specs: list[tuple[str, int]], get,
                 source_dir: str | None = None, dtype: torch.dtype = torch.float32,
                 shard_bytes: int = 5 * 2**30, on_shard=None) -> list[str]:
    """Write config.json, sharded safetensors with their index, and the source's side files.

    ``specs`` lists (name, numel) in layout order and ``get(name)`` returns a tensor; shards
    are planned first and written one at a time, so at most one shard is in memory.
    ``on_shard(i, n, file name, bytes)`` is called after each shard is written.
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
        if on_shard is not None:
            on_shard(i + 1, n, fname, (out / fname).stat().st_size)
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
    """A checkpoint folder, or the newest complete checkpoint of a folder of checkpoints or
    of a run directory (whose summary.json names its checkpoint folder)."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    folders = [p]
    summary = p / "summary.json"
    if summary.is_file():
        try:
            folder = json.loads(summary.read_text()).get("checkpoint_dir")
        except json.JSONDecodeError:
            folder = None
        if folder:
            folders.insert(0, Path(folder))
    for folder in folders:
        found = complete_checkpoints(folder)
        if found:
            return found[0]
    raise CheckpointError(f"{p} is neither a checkpoint, a folder of checkpoints, nor a run directory with one")


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32",
                      shard_bytes: int = 5 * 2**30, on_shard=None) -> tuple[Path, list[str]]:
    """Write a checkpoint's weights as a Hugging Face model directory, ``out_dir``: a new
    folder, or an empty one. Anything else there (another model, an earlier export) is
    refused and left as it is. The files are written into ``<out_dir>.tmp-<pid>`` and the
    folder renamed into place last, so a failed export leaves no half model that loads."""
    out = Path(out_dir).absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(f"{out_dir} already exists and is not an empty folder; export writes a new folder "
                          "and leaves that one as it is")
    ck = Checkpoint(find_checkpoint(path))
    remove_dead_tmp(out)                                    # what a killed export left
    model = ModelConfig(**ck.manifest["model"])
    where = {s.name: (u, s) for u in build_layout(model) for s in u.params}

    def get(name):
        u, s = where[name]
        out = torch.empty(s.numel, dtype=ck.master_dtype)
        ck.read_range("master", u.index, s.offset, s.offset + s.numel, [out])
        return out.float().view(s.shape)

    specs = [(name, s.numel) for name, (_, s) in where.items()]
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        written = write_hf_dir(tmp, model, specs, get, model.from_path,
                               DTYPES[dtype], shard_bytes, on_shard)
        os.rename(tmp, out)                 # onto a missing or an empty folder
    except OSError as e:
        raise ExportError(f"writing {out_dir} failed ({e.strerror or e}); nothing was left there") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ck.path, written
