"""Reading a Hugging Face model directory: config.json into model keys, safetensors into masters.

Loading is a copy per tensor, upcast to the master's dtype, a tensor a thread on every core:
safetensors files are memory-mapped and read tensor by tensor, never whole. Anything the
templates do not implement (another architecture, an MLP bias, a window over every block
shorter than the sequence, another rope type, Gemma's soft-capping) is refused with the key
named.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megaray.errors import ConfigError, ModelFileError
from megaray.hf import ARCHITECTURES, MOE
from megaray.machine import on_cores

IGNORED_TENSORS = ("rotary_emb.inv_freq",)
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' Gemma3TextConfig defaults, which the Hub's Gemma 3 config.json files rely on
GEMMA3_DEFAULTS = dict(vocab_size=262208, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
                       pad_token_id=0, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                       model_type="gemma3_text")
# a multimodal checkpoint's text model under these prefixes (transformers 4's files, and 5's),
# its other towers left out
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")


def read_hf_config(path: str | os.PathLike) -> dict:
    """ModelConfig keyword arguments from ``<path>/config.json``; refuses what megaray lacks."""
    p = Path(path) / "config.json"
    c, arch = _read_json(p)
    kind = ARCHITECTURES[arch]

    def refuse(key: str, why: str):
        raise ConfigError("model.from", f"{p}: {key}={c.get(key)!r} is not supported: {why}")

    if kind == "gemma3_text":
        _check_gemma3(c, refuse)
    elif c.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the MLP is SwiGLU with silu")
    if c.get("mlp_bias", False):
        refuse("mlp_bias", "MLP projections have no bias")
    if c.get("use_sliding_window", False):
        refuse("use_sliding_window", "attention is full causal attention")
    if c.get("pretraining_tp", 1) not in (1, None):
        refuse("pretraining_tp", "only 1")
    if kind == "olmo2" and c.get("attention_bias"):
        refuse("attention_bias", "OLMo 2's projections have no biases")
    heads = c["num_attention_heads"]
    out = dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=True if kind == "qwen2" else bool(c.get("attention_bias", False)),
        qk_norm=kind in ("qwen3", "olmo2"), initializer_range=float(c.get("initializer_range", 0.02)),
        sliding_window=(c.get("sliding_window") if (kind in ("mistral", "mixtral", "phi3")
                                                    or c.get("use_sliding_window")) else None),
        architecture=arch, pad_token_id=_token(c.get("pad_token_id"), c["vocab_size"]),
        **_rope_keys(c, kind, refuse),
    )
    if kind == "olmo2":     # q/k norms over the whole projections, the block's norms on its outputs
        out.update(qk_norm_scope="projection", norm_placement="post")
    if kind == "gemma3_text":
        layers, pattern = c["num_hidden_layers"], c.get("sliding_window_pattern", 6)
        types = c.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                         for i in range(layers)]
        out.update(qk_norm=True, norm_placement="sandwich", norm_offset=1.0, scale_embeddings=True,
                   hidden_act="gelu_pytorch_tanh", tie_word_embeddings=bool(c["tie_word_embeddings"]),
                   query_pre_attn_scalar=float(c["query_pre_attn_scalar"]), layer_types=list(types),
                   sliding_window=c["sliding_window"], max_position_embeddings=c["max_position_embeddings"],
                   pad_token_id=_token(c["pad_token_id"], c["vocab_size"]))
    if kind in MOE:
        out.update(_experts(c, kind, refuse))
    return out


def _read_json(p: Path) -> tuple[dict, str]:
    """config.json's keys (a multimodal Gemma 3's text model's, with transformers' defaults
    where the Hub's files leave them out) and the architecture; refuses a file that is not a
    supported model's config."""
    if not p.is_file():
        raise ConfigError("model.from", f"{p.parent} has no config.json")
    try:
        c = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("model.from", f"{p} is not valid JSON: {e}") from None
    if not isinstance(c, dict):
        raise ConfigError("model.from", f"{p} holds a JSON {type(c).__name__}, not an object of config keys")
    archs = c.get("architectures") or []
    if archs[:1] == ["Gemma3ForConditionalGeneration"] or c.get("model_type") == "gemma3":
        # the Hub's Gemma 3 (4B and up) is multimodal: its text model's keys are text_config's
        c = {**(c.get("text_config") or {}), "architectures": ["Gemma3ForCausalLM"]}
        archs = c["architectures"]
    if archs[:1] == ["Gemma3ForCausalLM"] or c.get("model_type") == "gemma3_text":
        c = {**GEMMA3_DEFAULTS, **c}        # the Hub's Gemma 3 configs leave transformers' defaults out
    arch = archs[0] if archs else {v: k for k, v in ARCHITECTURES.items()}.get(c.get("model_type"))
    if arch not in ARCHITECTURES:
        raise ConfigError("model.from", f"{p}: architecture {archs or c.get('model_type')} is not supported "
                                        f"(supported: {sorted(ARCHITECTURES)})")
    missing = [k for k in _REQUIRED if k not in c]
    if missing:
        raise ConfigError("model.from", f"{p} lacks the required key(s) {missing}")
    bad = [k for k in _REQUIRED if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] <= 0]
    if bad:
        raise ConfigError("model.from", f"{p}: {', '.join(f'{k}={c[k]!r}' for k in bad)} must be positive integers")
    return c, arch


def _rope_keys(c: dict, kind: str, refuse) -> dict:
    """The rotary keys: base, partial rotary, scaling (llama3, LongRoPE with Phi-3's old names,
    linear), and Gemma 3's local base. transformers 5 writes ``rope_parameters`` (Gemma's keyed
    by layer type); the Hub's files ``rope_theta``, ``rope_scaling`` and
    ``rope_local_base_freq``."""
    rope = dict(c.get("rope_parameters") or {})
    local_rope = None
    if kind == "gemma3_text":
        local_rope = rope.get("sliding_attention") or {}
        rope = {"rope_theta": 1000000.0, **(rope.get("full_attention") or {})}
        if local_rope.get("rope_type", "default") != "default":
            refuse("rope_parameters", "the sliding-window blocks' rotary is unscaled (default)")
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    partial = float(c.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
    scaling = c.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind_of = (lambda r: r.get("rope_type", r.get("type")))
    if scaling is not None and kind_of(scaling) in ("default", None):
        scaling = None
    if scaling is not None and kind == "phi3" and kind_of(scaling) in ("su", "yarn"):   # Phi-3's old names
        scaling = {**scaling, "rope_type": "longrope"}
    if scaling is not None and kind_of(scaling) == "longrope":
        scaling = {k: v for k, v in scaling.items() if k not in ("type", "partial_rotary_factor")}
        scaling = {**scaling, "rope_type": "longrope", "original_max_position_embeddings": scaling.get(
            "original_max_position_embeddings", c.get("original_max_position_embeddings"))}
    if scaling is not None and kind_of(scaling) == "linear":
        scaling = {"rope_type": "linear", "factor": float(scaling["factor"])}
    if scaling is not None and kind_of(scaling) not in ("llama3", "longrope", "linear"):
        refuse("rope_scaling", f"rope type {kind_of(scaling)!r}; llama3, longrope or linear scaling")
    out = dict(rope_theta=float(theta), rope_scaling=scaling, partial_rotary_factor=partial)
    if local_rope is not None:
        out["rope_local_theta"] = float(c.get("rope_local_base_freq", local_rope.get("rope_theta", 10000.0)))
    return out


def _check_gemma3(c: dict, refuse) -> None:
    """Gemma 3's text model as the templates run it: GELU-tanh, no soft-capping, causal."""
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        key = "hidden_activation" if "hidden_activation" in c else "hidden_act"
        refuse(key, "Gemma 3's MLP is gated by GELU with the tanh approximation (gelu_pytorch_tanh)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            refuse(key, "Gemma 3 caps neither the logits nor the attention scores (null)")
    if c.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention", "attention is causal")


def _token(t, vocab: int) -> int | None:
    """A token id of config.json, or None where it is unset or outside the vocabulary (some
    configs name an id their vocabulary lacks, which transformers then does not use either)."""
    return t if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab else None


def _experts(c: dict, kind: str, refuse) -> dict:
    """A mixture of experts' keys: its experts, router and load-balancing loss, and OLMoE's and
    Qwen3-MoE's q/k norms; refuses the variants the templates do not implement."""
    if kind == "qwen3_moe":
        if c.get("decoder_sparse_step", 1) != 1:
            refuse("decoder_sparse_step", "every block is a mixture of experts (1)")
        if c.get("mlp_only_layers"):
            refuse("mlp_only_layers", "every block is a mixture of experts (none dense)")
    if kind == "mixtral" and c.get("router_jitter_noise"):
        refuse("router_jitter_noise", "the router adds no noise (0)")
    if kind == "olmoe" and c.get("clip_qkv") is not None:
        refuse("clip_qkv", "q, k and v are not clipped (null)")
    experts = c.get("num_experts") or c.get("num_local_experts")
    if not isinstance(experts, int) or experts <= 0:
        refuse("num_experts", "a mixture of experts needs a positive number of experts")
    return dict(
        num_experts=experts, num_experts_per_tok=int(c.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(c.get("moe_intermediate_size") or c["intermediate_size"]),
        norm_topk_prob=True if kind == "mixtral" else bool(c.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(c.get("output_router_logits", False)),
        qk_norm=kind in ("qwen3_moe", "olmoe"), qk_norm_scope="projection" if kind == "olmoe" else "head",
    )


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
        # a multimodal checkpoint (the Hub's Gemma 3): its text model's tensors by the text
        # model's names, the vision tower and projector left out
        self.stored = {k: k for k in self.where}
        if any(k.startswith(TEXT_PREFIXES) for k in self.where):
            self.stored = {}
            for k in self.where:
                if k.startswith(TEXT_PREFIXES):
                    self.stored["model." + k.split(".", 2)[2]] = k
            self.where = {name: self.where[k] for name, k in self.stored.items()}
        if weight_map:
            missing = sorted(k for k, f in weight_map.items() if self.where.get(k) != f)
            if missing:
                raise ModelFileError(f"tensors listed in {index} are not in their shard: {missing[:5]}")

    def names(self) -> list[str]:
        return sorted(self.where)

    def get(self, name: str) -> torch.Tensor:
        f = self.where[name]
        try:
            return self.handles[f].get_tensor(self.stored[name])
        except Exception as e:
            raise ModelFileError(f"{self.path / f}: tensor {name} cannot be read (truncated or corrupt?): "
                                 f"{e}") from None


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
        shape = tuple(src.handles[f].get_slice(src.stored[name]).get_shape())
        if shape != spec.shape:
            raise ModelFileError(f"{src.path / f}: tensor {name} has shape {shape}, config.json implies {spec.shape}")
    return src


def load_into(units, master_view, path: str | os.PathLike, only=None, threads: int | None = None,
              progress=None) -> dict:
    """Copy every tensor of a model directory into the master regions, upcasting (only the
    units whose indices are in ``only``, when given; the whole directory is checked);
    ``progress(values)`` is called as each tensor is in.

    ``master_view(u)`` returns unit u's flat master tensor. A tensor a thread on ``threads``
    threads (every core by default): safetensors hands out views of its memory map, so a
    thread's copy is where the file is read and upcast and the master's pages first touched,
    all outside the GIL. Returns a small report.
    """
    src = verify_source(units, path)
    jobs = [(u, s) for u in units for s in u.params if only is None or u.index in only]
    read = []                                          # (dtype, bytes) per tensor; append is atomic

    def one(job) -> None:
        u, s = job
        t = src.get(s.name)                            # its shape checked by verify_source
        master_view(u.index)[s.offset:s.offset + s.numel].copy_(t.reshape(-1))
        read.append((str(t.dtype).replace("torch.", ""), t.numel() * t.element_size()))

    on_cores(one, jobs, threads, size=lambda j: j[1].numel,
             done=None if progress is None else lambda j: progress(j[1].numel))
    if jobs and master_view(jobs[0][0].index).is_cuda:
        torch.cuda.synchronize()                       # the threads' copies to resident masters
    return {"tensors": len(jobs), "source_bytes": sum(b for _, b in read),
            "source_dtypes": sorted({d for d, _ in read})}
