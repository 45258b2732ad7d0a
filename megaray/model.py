"""Llama-family decoder as stateless layer templates.

Design choices:
- The model is cut into *layer units* (``megaray.layout``): the embedding, each decoder
  block, and the head, each unit's parameters in one flat buffer.
- A template is a pure function of (weights bound as views into a flat buffer,
  activations). No nn.Module owns weights; backward through views of one flat leaf tensor
  yields one flat gradient for the whole unit.
- The loss is a *sum* over target tokens, computed in chunks so the logits of a whole
  batch never exist at once; the caller divides by the step's token count, which makes
  gradient accumulation exact.
- Packed rows may keep each document's attention to itself (``megaray.attention.Packing``,
  ``train.attention`` document): positions restart at every document start, and the mask
  allows a token only its own document's earlier tokens, as a row of one document would see.
- A mixture of experts differs from the dense block in its MLP alone: ``megaray.moe``.

This module imports neither Ray nor CUDA streams.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megaray.attention import Packing, block_attention
from megaray.config import ModelConfig
from megaray.fused import fused
from megaray.init_weights import init_param, init_params, init_unit  # noqa: F401 - model's API too
from megaray.model_config import windowed_square
from megaray.moe import moe_mlp
from megaray.rope import Ropes, apply_rope, rope_tables  # noqa: F401 - rope_tables: model's API too

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------- templates

@fused
def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """weight * (x / rms(x)) computed in fp32 and cast back; also the fp32 1/rms per token."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd


@fused
def _norm_again(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The norm's output rebuilt from its input and saved scale: the forward's arithmetic exactly."""
    return weight * (x.float() * rstd).to(x.dtype)


@fused
def _norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                   need_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the input and the scale weight of ``weight * x * rstd``, in fp32."""
    n = x.float() * rstd
    dw = None
    if need_dw:
        dw = (dy.float() * n.to(x.dtype).float()).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
    dn = dy.float() * weight.float()
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw


class _RMSNorm(torch.autograd.Function):
    """RMSNorm that saves its input as it came (bf16 on the GPU) and one fp32 scale per token,
    not the fp32 upcast autograd would keep: 2 bytes an element instead of 6. The forward's
    arithmetic is exactly ``rms_norm``'s; the backward computes in fp32."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = _rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _norm_backward(dy, x, weight, rstd, ctx.needs_input_grad[1])
        return dx, dw, None


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _NormLinears(torch.autograd.Function):
    """``linear(rms_norm(x), W_k, b_k)`` for several k (q, k and v) that saves the norm's input
    and per-token scale but not its output: the backward rebuilds that in one elementwise
    pass. Same forward arithmetic as the separate ops; ``wb`` is W_1, b_1, W_2, b_2, ...
    (a bias may be None)."""

    @staticmethod
    def forward(ctx, x, wn, eps, *wb):
        h, rstd = _rms_norm_forward(x, wn, eps)
        ctx.save_for_backward(x, wn, rstd, *wb)
        return tuple(F.linear(h, wb[k], wb[k + 1]) for k in range(0, len(wb), 2))

    @staticmethod
    def backward(ctx, *dys):
        x, wn, rstd, *wb = ctx.saved_tensors
        need = ctx.needs_input_grad
        h = _flat(_norm_again(x, wn, rstd))
        dh, grads = None, []
        for j, dy in enumerate(dys):
            w, b = wb[2 * j], wb[2 * j + 1]
            d = _flat(dy)
            grads.append(d.t().mm(h) if need[3 + 2 * j] else None)
            grads.append(d.sum(0) if b is not None and need[4 + 2 * j] else None)
            part = d.mm(w)
            dh = part if dh is None else dh + part
        dx, dwn = _norm_backward(dh.view(x.shape), x, wn, rstd, need[1])
        return (dx, dwn, None, *grads)


@fused
def _swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


@fused
def _geglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP product: GELU (tanh approximation) of the gate, times up."""
    return F.gelu(g, approximate="tanh") * u


# model.hidden_act: the gated product, the activation alone, and its backward (autograd's own)
GATED = {"silu": (_swiglu, F.silu, torch.ops.aten.silu_backward),
         "gelu_pytorch_tanh": (_geglu, lambda g: F.gelu(g, approximate="tanh"),
                               lambda d, g: torch.ops.aten.gelu_backward(d, g, approximate="tanh"))}


def _swiglu_grads_inplace(g: torch.Tensor, u: torch.Tensor, dp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sg = F.silu(g)
    du = sg.mul_(dp)        # silu(gate) becomes the up projection's gradient
    dp.mul_(u)              # and the product's gradient silu(gate)'s
    del sg
    return du, torch.ops.aten.silu_backward(dp, g)


@fused(eager=_swiglu_grads_inplace)
def _swiglu_grads(g: torch.Tensor, u: torch.Tensor, dp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The up projection's and the gate's gradients of ``silu(g) * u`` from the product's
    gradient ``dp``, by autograd's formulas (``silu_backward``). Three [tokens, intermediate]
    tensors at most (``dp`` and the two gradients): eagerly ``dp`` is overwritten (the caller's
    temporary)."""
    return F.silu(g) * dp, torch.ops.aten.silu_backward(dp * u, g)


class _NormSwiGLU(torch.autograd.Function):
    """``down(silu(gate(h)) * up(h))`` with ``h = rms_norm(x)``, saving the norm's input and
    scale and the gate and up projections only: the norm's output, ``silu(gate)`` and the
    product (half of what autograd would keep) are rebuilt in the backward by elementwise
    passes, which cost far less than recomputing the block. Forward arithmetic and backward
    formulas are autograd's own (``silu_backward``): the same gradients, eagerly bit for bit
    (fused on the GPU, to the compute dtype's rounding: ``megaray.fused``)."""

    @staticmethod
    def forward(ctx, x, wn, wg, wu, wd, eps):
        h, rstd = _rms_norm_forward(x, wn, eps)
        g, u = F.linear(h, wg), F.linear(h, wu)
        ctx.save_for_backward(x, wn, rstd, g, u, wg, wu, wd)
        return F.linear(_swiglu(g, u), wd)

    @staticmethod
    def backward(ctx, dy):
        x, wn, rstd, g, u, wg, wu, wd = ctx.saved_tensors
        need = ctx.needs_input_grad
        g, u, d = _flat(g), _flat(u), _flat(dy)
        dwd = d.t().mm(_swiglu(g, u)) if need[4] else None
        du, dg = _swiglu_grads(g, u, d.mm(wd))
        h = _flat(_norm_again(x, wn, rstd))
        dwg = dg.t().mm(h) if need[2] else None
        dwu = du.t().mm(h) if need[3] else None
        del h
        dh = dg.mm(wg)
        dh += du.mm(wu)
        dx, dwn = _norm_backward(dh.view(x.shape), x, wn, rstd, need[1])
        return dx, dwn, dwg, dwu, dwd, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return _rms_norm_forward(x, weight, eps)[0]


@fused
def _offset_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                         offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm: (x / rms(x)) x (offset + weight) in fp32, cast back last; also 1/rms."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * (offset + weight.float())).to(x.dtype), rstd


@fused
def _offset_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                          offset: float, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the input and the weight of ``_offset_norm_forward``, in fp32."""
    n = x.float() * rstd
    dyf = dy.float()
    dw = (dyf * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype) if need_dw else None
    dn = dyf * (offset + weight.float())
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw


class _OffsetRMSNorm(torch.autograd.Function):
    """Gemma's RMSNorm saving its input as it came and one fp32 scale per token (as ``_RMSNorm``)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        out, rstd = _offset_norm_forward(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _offset_norm_backward(dy, x, weight, rstd, ctx.offset, ctx.needs_input_grad[1])
        return dx, dw, None, None


def norm(x: torch.Tensor, weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The model's RMSNorm: Llama's (``rms_norm``: the normalised input cast, then scaled), or
    with ``model.norm_offset`` Gemma's (scaled by offset + weight in fp32, then cast)."""
    if not cfg.norm_offset:
        return rms_norm(x, weight, cfg.rms_norm_eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _OffsetRMSNorm.apply(x, weight, cfg.rms_norm_eps, cfg.norm_offset)
    return _offset_norm_forward(x, weight, cfg.rms_norm_eps, cfg.norm_offset)[0]


class _ChunkedMLP(torch.autograd.Function):
    """SwiGLU MLP over the sequence in chunks of ``chunk`` tokens, each recomputed in the
    backward: what stays alive is the MLP's input and one chunk's intermediates, never the
    four [tokens, intermediate] tensors of a whole long sequence."""

    @staticmethod
    def forward(ctx, h, wg, wu, wd, chunk, act="silu"):
        ctx.save_for_backward(h, wg, wu, wd)
        ctx.chunk, ctx.act = chunk, act
        gated = GATED[act][0]
        flat = h.reshape(-1, h.shape[-1])
        out = torch.empty(flat.shape[0], wd.shape[0], dtype=h.dtype, device=h.device)
        for a in range(0, flat.shape[0], chunk):
            c = flat[a:a + chunk]
            out[a:a + chunk] = F.linear(gated(F.linear(c, wg), F.linear(c, wu)), wd)
        return out.view(*h.shape[:-1], wd.shape[0])

    @staticmethod
    def backward(ctx, dy):
        """Each chunk's gradients by autograd's own formulas (``silu_backward``, in the compute
        dtype, as ``_NormSwiGLU``), the weights' summed over chunks in fp32. In-place steps keep
        four [chunk, intermediate] tensors alive at most (``memory.MLP_CHUNK_LIVE``): the gate,
        the up projection, silu(gate) and, in turn, their product, the gate's gradient or the
        up projection's."""
        h, wg, wu, wd = ctx.saved_tensors
        _, act, act_backward = GATED[ctx.act]
        acc = torch.promote_types(h.dtype, torch.float32)     # fp32 sums for bf16, fp64 stays fp64
        flat, dflat = h.reshape(-1, h.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dh = torch.empty_like(flat)
        dwg, dwu, dwd = (torch.zeros(w.shape, dtype=acc, device=w.device) for w in (wg, wu, wd))
        for a in range(0, flat.shape[0], ctx.chunk):
            c, d = flat[a:a + ctx.chunk], dflat[a:a + ctx.chunk]
            g, u = F.linear(c, wg), F.linear(c, wu)
            sg = act(g)
            dwd += d.t().mm(sg * u).to(acc)
            dp = d.mm(wd)                       # the product's gradient
            du = sg.mul_(dp)                    # silu(gate) becomes the up projection's gradient
            dp.mul_(u)                          # and the product's gradient silu(gate)'s
            del sg, u
            dg = act_backward(dp, g)
            del dp, g
            dwg += dg.t().mm(c).to(acc)
            dwu += du.t().mm(c).to(acc)
            dh[a:a + ctx.chunk] = dg.mm(wg) + du.mm(wu)
        return dh.view(h.shape), dwg.to(wg.dtype), dwu.to(wu.dtype), dwd.to(wd.dtype), None, None


def mlp(h: torch.Tensor, w: dict, chunk: int | None = None, act: str = "silu") -> torch.Tensor:
    """The gated MLP (SwiGLU, or with ``act`` gelu_pytorch_tanh Gemma's); along the sequence in
    chunks (recomputed in backward) when the input holds more than ``chunk`` tokens."""
    wg, wu, wd = w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"]
    if chunk and h.numel() // h.shape[-1] > chunk:
        return _ChunkedMLP.apply(h, wg, wu, wd, chunk, act)
    return F.linear(GATED[act][0](F.linear(h, wg), F.linear(h, wu)), wd)


def embed_forward(w: dict, tokens: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The embedding lookup; the ``model.pad_token_id`` row gets no gradient from it, as
    transformers' nn.Embedding gives it none; with ``model.scale_embeddings`` (Gemma 3) times
    sqrt(hidden_size), the factor rounded to the weights' dtype as transformers rounds it."""
    weight = w["model.embed_tokens.weight"]
    out = F.embedding(tokens, weight, padding_idx=cfg.pad_token_id)
    if cfg.scale_embeddings:
        out = out * torch.tensor(cfg.hidden_size ** 0.5, dtype=weight.dtype, device=weight.device)
    return out


def block_forward(w: dict, x: torch.Tensor, rope, cfg: ModelConfig, mlp_chunk: int | None = None,
                  lean: bool = True, pk: Packing | None = None, routed: list | None = None,
                  layer: int = 0) -> torch.Tensor:
    """Decoder block ``layer``: x + attn(norm(x)), then + mlp(norm(.)); with
    ``model.norm_placement`` post (OLMo 2) x + norm(attn(x)), then + norm(mlp(.)); sandwich
    (Gemma 3) x + norm(attn(norm(x))), then + norm(mlp(norm(.))). x: [B, S, H]. ``rope``:
    ``Ropes`` (block ``layer``'s tables taken from it) or one (cos, sin) for every block. With
    ``pk`` (document attention) RoPE takes each token's position in its document and attention
    stays inside each document; a sliding-window block (``model.layer_types``) also keeps each
    token to the window before it. A mixture of experts' MLP is ``moe_mlp`` (``routed``
    collects what its router did; ``mlp_chunk`` and ``lean`` concern the dense MLP only).

    Grouped-query attention hands the kv heads to SDPA as they are where torch supports it
    (``enable_gqa``), never materializing the repeated keys and values; ``mlp_chunk`` see ``mlp``.
    ``lean`` (under autograd): each norm is fused with the projections that read it
    (``_NormLinears``, ``_NormSwiGLU``), so the saved activations are about half of plain
    autograd's for the same forward arithmetic; the bench's baseline runs ``lean=False``.
    OLMo 2's and Gemma 3's blocks run as plain autograd (their norms stand on outputs)."""
    b, s, _ = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = rope[layer] if isinstance(rope, Ropes) else rope
    if pk is None:
        cos, sin = cos[:s], sin[:s]
    else:
        cos, sin = cos[pk.pos].unsqueeze(1), sin[pk.pos].unsqueeze(1)
    eps = cfg.rms_norm_eps
    lean = lean and torch.is_grad_enabled()
    post = cfg.norm_placement == "post"           # OLMo 2: the norms on attention's and the MLP's outputs
    sandwich = cfg.norm_placement == "sandwich"   # Gemma 3: on the inputs and the outputs
    wqkv = [w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"), w["self_attn.k_proj.weight"],
            w.get("self_attn.k_proj.bias"), w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias")]
    if post:
        q, k, v = (F.linear(x, wqkv[j], wqkv[j + 1]) for j in (0, 2, 4))
    elif lean and not sandwich:
        q, k, v = _NormLinears.apply(x, w["input_layernorm.weight"], eps, *wqkv)
    else:
        h = norm(x, w["input_layernorm.weight"], cfg)
        q, k, v = (F.linear(h, wqkv[j], wqkv[j + 1]) for j in (0, 2, 4))
    if cfg.qk_norm and cfg.qk_norm_scope == "projection":     # over the whole projections (OLMoE)
        q = norm(q, w["self_attn.q_norm.weight"], cfg)
        k = norm(k, w["self_attn.k_norm.weight"], cfg)
    q = q.view(b, s, nh, hd)
    k = k.view(b, s, nkv, hd)
    if cfg.qk_norm and cfg.qk_norm_scope == "head":
        q = norm(q, w["self_attn.q_norm.weight"], cfg)
        k = norm(k, w["self_attn.k_norm.weight"], cfg)
    q = apply_rope(q.transpose(1, 2), cos.to(q.dtype), sin.to(q.dtype))
    k = apply_rope(k.transpose(1, 2), cos.to(k.dtype), sin.to(k.dtype))
    v = v.view(b, s, nkv, hd).transpose(1, 2)
    scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
    a = block_attention(q, k, v, cfg.window(layer), pk, scale)
    a = a.transpose(1, 2).reshape(b, s, nh * hd)
    o = F.linear(a, w["self_attn.o_proj.weight"])
    if sandwich:
        x = x + norm(o, w["post_attention_layernorm.weight"], cfg)
        m = mlp(norm(x, w["pre_feedforward_layernorm.weight"], cfg), w, mlp_chunk, cfg.hidden_act)
        return x + norm(m, w["post_feedforward_layernorm.weight"], cfg)
    if post:
        x = x + rms_norm(o, w["post_attention_layernorm.weight"], eps)
        return x + rms_norm(mlp(x, w, mlp_chunk), w["post_feedforward_layernorm.weight"], eps)
    x = x + o
    wn = w["post_attention_layernorm.weight"]
    if cfg.moe:
        return x + moe_mlp(rms_norm(x, wn, eps), w, cfg, routed)
    if lean and not (mlp_chunk and b * s > mlp_chunk):
        return x + _NormSwiGLU.apply(x, wn, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"],
                                     w["mlp.down_proj.weight"], eps)
    return x + mlp(rms_norm(x, wn, eps), w, mlp_chunk)


def head_loss_sum(w_head: dict, w_embed: dict | None, x: torch.Tensor, targets: torch.Tensor,
                  cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies of one chunk, and the count of counted targets.

    x: [N, H] final hidden states of N tokens; targets: [N] (IGNORE_INDEX is skipped).
    The logits of the chunk are computed in fp32.
    """
    h = norm(x, w_head["model.norm.weight"], cfg)
    out = w_embed["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w_head["lm_head.weight"]
    logits = F.linear(h, out).float()
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (targets != IGNORE_INDEX).sum()


LOSS_ROWS = 1024     # rows of a loss chunk turned into fp32 at once by head_loss_and_grads


def head_loss_and_grads(w_head: dict, w_embed: dict | None, x: torch.Tensor, targets: torch.Tensor,
                        cfg: ModelConfig, scale: float, inputs: list[torch.Tensor]):
    """Sum of token cross-entropies of one chunk, and the gradients of ``scale`` x that sum
    with respect to ``inputs`` (leaves the chunk's graph was built from).

    The logits' gradient, ``scale`` x (softmax - one-hot target), zero for IGNORE_INDEX, is
    formed directly, ``LOSS_ROWS`` rows at a time, into a tensor of the logits' dtype;
    autograd takes it from there (the projection and the norm). Per block of rows: one fused
    log-softmax that reads the logits as they are and writes fp32 (fp64 for fp64 logits), the
    loss gathered from it, then exp, the one-hot subtracted and the row's factor (``scale``,
    zero for IGNORE_INDEX) applied while writing the logits' dtype: four passes over the
    block where an upcast copy, logsumexp and separate scalings made eleven (llama1b's head,
    8192 tokens on the H200: 31.5 ms, autograd's 31.0, the eleven passes' 39.5). Autograd's own
    log-softmax would hold three fp32 [N, V] tensors at its peak; this holds the logits, their
    gradient and one fp32 [LOSS_ROWS, V] block (``megaray.memory.loss_chunk_bytes`` counts
    two). Same math as ``head_loss_sum`` + backward, to fp32 rounding.
    """
    h = norm(x, w_head["model.norm.weight"], cfg)
    out = w_embed["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w_head["lm_head.weight"]
    logits = F.linear(h, out)
    grad = torch.empty_like(logits)
    acc = torch.promote_types(logits.dtype, torch.float32)          # fp32, or fp64 for fp64 logits
    loss = torch.zeros((), dtype=acc, device=x.device)
    with torch.no_grad():
        for r in range(0, logits.shape[0], LOSS_ROWS):
            t = targets[r:r + LOSS_ROWS]
            valid = t != IGNORE_INDEX
            t = torch.where(valid, t, 0).unsqueeze(1)
            lp = torch.log_softmax(logits[r:r + LOSS_ROWS], dim=1, dtype=acc)
            loss -= (lp.gather(1, t).squeeze(1) * valid).sum()
            lp.exp_()                                               # softmax
            lp.scatter_add_(1, t, torch.full_like(t, -1.0, dtype=acc))
            torch.mul(lp, (valid.to(acc) * scale).unsqueeze(1), out=grad[r:r + LOSS_ROWS])
    grads = torch.autograd.grad(logits, inputs, grad_outputs=grad)
    return loss, grads


def flops_per_step(cfg: ModelConfig, tokens: int, seq_len: int, square_lengths: int | None = None,
                   window_square_lengths: int | None = None) -> float:
    """ARCHITECTURE.md's formula: 6 x params x tokens + 6 x layers x hidden x seq x tokens, with
    a mixture of experts' *active* parameters (``ModelConfig.active_params``: k experts a token,
    the whole router). Under document attention the attention's term counts each document's
    own work: ``square_lengths``, the sum of the step's documents' squared lengths
    (``Batch.square_document_lengths``), in place of seq x tokens (a causal row is one
    document of seq tokens: rows x seq^2 = seq x tokens). A sliding-window block (Gemma 3's
    local blocks) counts only what its window computes: a document of d tokens under a window
    of W, d^2 - (d - W)^2 where d > W (``window_square_lengths``; rows of seq tokens where not
    given)."""
    pairs = seq_len * tokens if square_lengths is None else square_lengths
    L, window = cfg.num_hidden_layers, cfg.local_window
    local = cfg.local_blocks if window is not None else 0
    if local:
        if window_square_lengths is None:
            window_square_lengths = tokens // seq_len * windowed_square(seq_len, window)
        attention = (L - local) * pairs + local * window_square_lengths
    else:
        attention = L * pairs
    return 6.0 * cfg.active_params() * tokens + 6.0 * cfg.hidden_size * attention
