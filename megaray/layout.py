"""Where every parameter lives: layer units, their flat layout, and the pieces they are cut into.

- The model is cut into *layer units* in forward order: the embedding (0), each decoder block
  (1..L), and the head (L + 1: the final norm, plus the output matrix when embeddings are
  untied). Each unit's parameters live in one flat buffer; ``UnitLayout`` says where each
  named tensor sits in it. Names are Hugging Face's, so checkpoints and exports map one to one.
- Within a unit, matrices come first and 1-D tensors (norm scales, biases) last, so the
  optimizer sees two contiguous segments: decayed ``[0, decay_numel)`` and not decayed.
- A *piece* is a slab-sized slice of a unit (``optim.grad_slab_mib``), never crossing the
  decay boundary: the unit of transport through the gradient ring and of one optimizer
  update. Pieces are a transport detail: nothing that is saved depends on how units were cut.
- Every piece starts a whole number of ``PIECE_ALIGN`` elements after its segment's start, so
  under any cut an element takes the same code path in a vectorised update: torch's fused
  AdamW computes a call's last ``numel % vector width`` elements in a scalar loop that rounds
  differently (no fused multiply-add), and a cut at an arbitrary element moved that tail with
  it (1 ulp apart on an AVX2 machine). Aligned, the only tails are at the segments' ends, the
  same elements whatever the slab size, shard count or thread count.

Invariant: a layout is a pure function of the model config, so every actor derives the same
one, and a checkpoint keyed by (unit, offset) or by parameter name reads back in any run of
the same model.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import torch

from megaray.config import ModelConfig

ALIGN = 4096        # bytes: every unit's region in a shared file starts on a page
PIECE_ALIGN = 64    # elements: a piece's start within its segment (a multiple of any CPU vector width)
# The one table from a config's dtype name (train.compute_dtype, optim.*_dtype, a checkpoint's
# manifest, export's --dtype) to torch's dtype.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ParamSpec:
    name: str          # Hugging Face name
    shape: tuple
    offset: int        # elements into the unit's flat buffer
    decay: bool        # a matrix (weight decay applies) or a 1-D tensor
    key: str = ""      # the templates' name for its view: short_name(name), or its experts' stack's

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class View:
    """One tensor a template reads: a parameter, or a stack of experts' matrices [E, out, in]
    (their per-expert parameters, adjacent in the flat buffer)."""
    key: str
    offset: int
    shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class UnitLayout:
    index: int         # position in forward order: 0 = embedding, 1..L = blocks, L+1 = head
    name: str          # "embed", "block.3", "head"
    kind: str          # "embed" | "block" | "head"
    params: tuple      # ParamSpec, matrices first
    numel: int
    decay_numel: int   # params[...] with decay occupy [0, decay_numel)
    views: tuple = ()  # View: what ``bind`` hands the templates, in flat-buffer order


EXPERTS = "mlp.experts."      # the templates' names of the experts' stacks begin so


def _unit(index: int, name: str, kind: str, entries: list[tuple]) -> UnitLayout:
    """Entries are (name, shape), or (name, shape, the templates' key) where Hugging Face's
    name is not the templates' (a router of another family; an expert's matrix, keyed by its
    stack: the consecutive entries of one key form one stacked view), or (name, shape, splits)
    for a matrix the Hub stores fused (Phi-3's qkv_proj): ``splits`` is ((key, rows), ...),
    a view a block of its rows, which lie one after another in the flat buffer."""
    entries = sorted(entries, key=lambda e: len(e[1]) < 2)  # stable: matrices first
    specs, views, off, decay_numel = [], [], 0, 0
    for pname, shape, *given in entries:
        splits = given[0] if given and isinstance(given[0], tuple) else None
        key = given[0] if given and splits is None else short_name(pname)
        spec = ParamSpec(pname, tuple(shape), off, len(shape) >= 2, key)
        stacked = key.startswith(EXPERTS)
        if splits is not None:
            assert sum(rows for _, rows in splits) == shape[0], pname
            row = off
            for k, rows in splits:
                views.append(View(k, row, (rows, *shape[1:])))
                row += rows * math.prod(shape[1:])
        elif stacked and views and views[-1].key == key:      # the next expert of the stack
            last = views[-1]
            views[-1] = View(key, last.offset, (last.shape[0] + 1, *shape))
        else:
            views.append(View(key, off, (1, *shape) if stacked else tuple(shape)))
        specs.append(spec)
        off += spec.numel
        if spec.decay:
            decay_numel = off
    return UnitLayout(index, name, kind, tuple(specs), off, decay_numel, tuple(views))


# Hugging Face's names of a mixture-of-experts block's router and experts, by family:
# (router, the experts' prefix, the gate, up and down projections' names)
_MOE_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts", ("w1", "w3", "w2")),
}
_MOE_DEFAULT = ("mlp.gate.weight", "mlp.experts", ("gate_proj", "up_proj", "down_proj"))      # Qwen3-MoE, OLMoE


def _mlp_entries(cfg: ModelConfig, p: str) -> list[tuple]:
    """A block's MLP: the dense SwiGLU, or a router and its experts' stacks (every expert's
    gate projection, then every up projection, then every down projection)."""
    h = cfg.hidden_size
    if not cfg.moe:
        i = cfg.intermediate_size
        if cfg.architecture in FUSED:        # Phi-3: gate and up in one matrix, gate's rows first
            return [(p + "mlp.gate_up_proj.weight", (2 * i, h), (("mlp.gate_proj.weight", i),
                                                                 ("mlp.up_proj.weight", i))),
                    (p + "mlp.down_proj.weight", (h, i))]
        return [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    router, experts, projections = _MOE_NAMES.get(cfg.architecture, _MOE_DEFAULT)
    i, n = cfg.moe_intermediate_size, cfg.num_experts
    out = [(p + router, (n, h), "mlp.gate.weight")]
    for proj, stack, shape in zip(projections, ("gate_proj", "up_proj", "down_proj"), ((i, h), (i, h), (h, i))):
        out += [(f"{p}{experts}.{e}.{proj}.weight", shape, EXPERTS + stack) for e in range(n)]
    return out


# families whose Hub files fuse q, k and v into one matrix, and the MLP's gate and up into
# another: the same values in the same order as Llama's apart, so one flat layout serves both
FUSED = ("Phi3ForCausalLM",)

# a block's RMSNorm scales by model.norm_placement: before attention and the MLP (Llama), on
# their outputs (OLMo 2), or both (Gemma 3), in Hugging Face's names
BLOCK_NORMS = {"pre": ("input_layernorm.weight", "post_attention_layernorm.weight"),
               "post": ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
               "sandwich": ("input_layernorm.weight", "post_attention_layernorm.weight",
                            "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")}


def build_layout(cfg: ModelConfig) -> list[UnitLayout]:
    """Every unit's layout, in forward order (memoized: the planner asks for it often)."""
    key = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= 4:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = _layout(cfg)
    return list(_LAYOUTS[key])


_LAYOUTS: dict[str, tuple[UnitLayout, ...]] = {}


def _layout(cfg: ModelConfig) -> tuple[UnitLayout, ...]:
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    units = [_unit(0, "embed", "embed", [("model.embed_tokens.weight", (cfg.vocab_size, h))])]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if cfg.architecture in FUSED:        # Phi-3: q, k and v in one matrix, in that order
            qkv = [(p + "self_attn.qkv_proj.weight", (q + 2 * kv, h), (("self_attn.q_proj.weight", q),
                                                                      ("self_attn.k_proj.weight", kv),
                                                                      ("self_attn.v_proj.weight", kv)))]
        else:
            qkv = [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h))]
        e = [
            *qkv,
            (p + "self_attn.o_proj.weight", (h, q)),
            *_mlp_entries(cfg, p),
            *[(p + name, (h,)) for name in BLOCK_NORMS[cfg.norm_placement]],
        ]
        if cfg.attention_bias:
            e += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                  (p + "self_attn.v_proj.bias", (kv,))]
        if cfg.qk_norm:
            wide = cfg.qk_norm_scope == "projection"
            e += [(p + "self_attn.q_norm.weight", (q if wide else hd,)),
                  (p + "self_attn.k_norm.weight", (kv if wide else hd,))]
        units.append(_unit(i + 1, f"block.{i}", "block", e))
    head = [("model.norm.weight", (h,))]
    if not cfg.tie_word_embeddings:
        head.insert(0, ("lm_head.weight", (cfg.vocab_size, h)))
    units.append(_unit(cfg.num_hidden_layers + 1, "head", "head", head))
    return tuple(units)


def short_name(spec_name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``self_attn.q_proj.weight``."""
    if spec_name.startswith("model.layers."):
        return spec_name.split(".", 3)[3]
    return spec_name


def bind(flat: torch.Tensor, unit: UnitLayout) -> dict[str, torch.Tensor]:
    """Views into ``flat`` for each of ``unit``'s views (``View``), keyed by the templates' names:
    each parameter by its short name, a mixture's experts by their stacks
    (``mlp.experts.gate_proj`` [experts, out, in]), in flat-buffer order."""
    return {v.key: flat[v.offset:v.offset + v.numel].view(v.shape) for v in unit.views}


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def unit_offsets(units, elem_size: int) -> tuple[tuple[int, ...], int]:
    """Byte offset of each unit's page-aligned region in a shared file, and the file's size."""
    out, off = [], 0
    for u in units:
        out.append(off)
        off = align(off + u.numel * elem_size)
    return tuple(out), off


@dataclass(frozen=True)
class Piece:
    """One slab's worth of a unit's flat parameters: [start, stop) of unit ``unit``."""
    index: int
    unit: int
    start: int
    stop: int
    decay: bool     # inside the unit's decayed (matrix) range

    @property
    def numel(self) -> int:
        return self.stop - self.start


def cut_pieces(units, slab_numel: int) -> tuple[Piece, ...]:
    """Every unit's [0, decay_numel) and [decay_numel, numel), in pieces of at most ``slab_numel``
    elements (rounded down to whole ``PIECE_ALIGN``s, at least one), in forward order."""
    step = max(PIECE_ALIGN, slab_numel // PIECE_ALIGN * PIECE_ALIGN)
    out: list[Piece] = []
    for u in units:
        for a, b, decay in ((0, u.decay_numel, True), (u.decay_numel, u.numel, False)):
            for start in range(a, b, step):
                out.append(Piece(len(out), u.index, start, min(b, start + step), decay))
    return tuple(out)


def assign_pieces(num_pieces: int, num_shards: int, layout: str = "interleaved",
                  sizes: list[int] | None = None) -> list[list[int]]:
    """Split piece indices among shards. Interleaved: in the order the gradients arrive, each
    piece to the shard with the fewest parameters so far (``sizes``, the pieces' numel; the
    lower index on a tie), so every shard updates about as much, its pieces spread along the
    step (equal pieces: piece p to shard p mod N). Contiguous: as-even-as-possible ranges."""
    if layout == "interleaved":
        sizes = [1] * num_pieces if sizes is None else list(sizes)
        out, load = [[] for _ in range(num_shards)], [0] * num_shards
        for p in range(num_pieces):
            k = min(range(num_shards), key=lambda k: (load[k], len(out[k]), k))
            out[k].append(p)
            load[k] += sizes[p]
        return out
    base, extra = divmod(num_pieces, num_shards)
    out, start = [], 0
    for k in range(num_shards):
        n = base + (1 if k < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out
