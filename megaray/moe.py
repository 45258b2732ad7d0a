"""Mixtures of experts: a block's MLP as a router and its experts (Qwen3-MoE, Mixtral, OLMoE).

A mixture differs from the dense block in its MLP alone. A router (softmax over the experts
in fp32, the top k, renormalised where ``norm_topk_prob`` says), and every token's k experts,
dropless, run as grouped matrix products over the tokens sorted by expert
(``torch._grouped_mm`` where the device has it, else a loop over the experts); their outputs
are weighted (on the down projection's input), go back to token order, and each token's k
are summed. What the router did
(its assignments and its probabilities, ``Routed``) is handed out for the step's
load-balancing loss, which spans all of the step's tokens and layers (``aux_loss_grad``).

Like ``megaray.model``, this module imports neither Ray nor CUDA streams: the experts are a
pure function of (the block's views, activations).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megaray.config import ModelConfig
from megaray.fused import fused


@fused
def _swiglu(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The experts' product silu(gate) x up, each row scaled by its router weight ([rows, 1]),
    in one compiled kernel on the GPU. The down projection is linear, so scaling its input
    is scaling its output: the weighting costs a pass over [rows, intermediate] here in
    place of two over [rows, hidden] after it, and its output need not be saved."""
    return F.silu(g) * u * weight


@dataclass
class Routed:
    """What one mixture-of-experts layer's router did over one call's tokens."""
    counts: torch.Tensor
    """[experts] fp32: the tokens each expert received (top-k assignments); no gradient."""
    prob_sum: torch.Tensor
    """[experts] fp32: the router's softmax probabilities summed over the tokens; part of the
    autograd graph when the forward ran under it (the load-balancing loss's gradient enters here)."""
    rows: int
    """Tokens routed."""


def route(x: torch.Tensor, router: torch.Tensor, cfg: ModelConfig):
    """The router of ``x`` [N, H]: each token's k experts and their weights (in x's dtype), and
    the fp32 softmax over all experts. transformers' arithmetic: softmax in fp32, top k, the k
    probabilities renormalised with ``norm_topk_prob`` (Mixtral's softmax over its top-k logits
    is these weights)."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(x.dtype), idx, probs


_GROUPED: dict = {}      # (device type, dtype) -> whether torch._grouped_mm runs there


def _grouped_runs(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs on x's device and dtype (tried once, on tiny inputs:
    it needs a recent torch, and on CUDA a Hopper GPU and bf16)."""
    key = (x.device.type, x.dtype)
    if key not in _GROUPED:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.zeros(16, 16, dtype=x.dtype, device=x.device)
                torch._grouped_mm(a, torch.zeros(2, 16, 16, dtype=x.dtype, device=x.device),
                                  offs=torch.tensor([8, 16], dtype=torch.int32, device=x.device))
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED[key] = ok
    return _GROUPED[key]


def expert_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: list[int] | None = None):
    """``x`` [M, in], its rows sorted by expert (expert e's end at ``offs[e]``), through each
    row's expert of ``w`` [experts, out, in]: [M, out]. One grouped product where the device
    runs one; else a loop over the experts (``counts``, the rows each, read on the host).
    Under autocast (the bench's GPU-resident baseline, fp32 weights) both go to its dtype
    first: ``torch._grouped_mm`` is not an op autocast casts, and the baseline must run the
    experts through the same kernel as megaray."""
    if torch.is_autocast_enabled(x.device.type):
        dt = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dt), w.to(dt)
    if _grouped_runs(x):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    counts = counts if counts is not None else torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    parts, a = [], 0
    for e, n in enumerate(counts):
        parts.append(F.linear(x[a:a + n], w[e]))
        a += n
    return torch.cat(parts)


class _Rows(torch.autograd.Function):
    """``x[rows]`` whose backward is a gather too: ``rows`` [N x k] lists every token k times
    (each row of ``x`` reaches k experts), ``back`` [N x k] is where token n's j-th copy went,
    so the input's gradient is ``g[back]`` summed over each token's k copies. Autograd's own
    backward of ``x[rows]`` is an accumulating scatter (a sort and atomics on CUDA)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor, back: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(back)
        ctx.k = k
        return x[rows]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (back,) = ctx.saved_tensors
        return g[back].view(-1, ctx.k, g.shape[-1]).sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """``x[perm]`` for a permutation, its backward the gather by the inverse ``inv``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inv)
        return x[perm]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (inv,) = ctx.saved_tensors
        return g[inv], None, None


def moe_mlp(h: torch.Tensor, w: dict, cfg: ModelConfig, routed: list | None = None) -> torch.Tensor:
    """The experts' SwiGLU of ``h`` [B, S, H]: each token through its k experts, weighted by its
    router, summed. Dropless: an expert takes every token routed to it. Appends a ``Routed``
    to ``routed`` when given.

    The N x k (token, expert) pairs are sorted by expert (stable: within an expert, by token)
    for the grouped products, each pair's router weight scales its down projection's input
    (``_swiglu``), and the outputs are put back in token order and each token's k summed (a
    reduction in fp32, rounded once). Every move of activation rows, forward and backward, is a
    gather by a permutation (``_Rows``, ``_Permute``): no accumulating scatter, no atomics."""
    b, s, hd = h.shape
    k = cfg.num_experts_per_tok
    x = h.reshape(-1, hd)
    weights, idx, probs = route(x, w["mlp.gate.weight"], cfg)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)           # pairs by expert; within one, by token
    back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    # counted by scatter, not bincount: on CUDA bincount reads its input's maximum on the host
    counts = torch.zeros(cfg.num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat,
                                                                                          torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    host = None if _grouped_runs(x) else counts.tolist()
    xs = _Rows.apply(x, order // k, back, k)
    g = expert_linear(xs, w["mlp.experts.gate_proj"], offs, host)
    u = expert_linear(xs, w["mlp.experts.up_proj"], offs, host)
    a = _swiglu(g, u, weights.reshape(-1)[order].unsqueeze(-1))
    y = expert_linear(a, w["mlp.experts.down_proj"], offs, host)
    out = _Permute.apply(y, back, order).view(-1, k, hd).sum(1)    # token order: [N, k, H], summed
    if routed is not None:
        routed.append(Routed(counts.float(), probs.sum(0), x.shape[0]))
    return out.view(b, s, hd)


def aux_loss_grad(cfg: ModelConfig, counts: torch.Tensor, rows: int) -> torch.Tensor:
    """The load-balancing loss's gradient with respect to each layer's summed router
    probabilities (``Routed.prob_sum``), the same for every layer and token.

    The loss (transformers' ``load_balancing_loss_func``, over the step's tokens and every
    layer): coef x experts x sum_e f_e P_e, with f_e = (assignments to e) / R and
    P_e = (probabilities of e, summed) / R over R = layers x tokens rows; f carries no
    gradient, so d loss / d (prob sum of e) = coef x experts x f_e / R. ``counts`` are the
    assignments summed over the layers; ``rows`` is R."""
    return cfg.router_aux_loss_coef * cfg.num_experts * counts / (rows * rows)


def balance_loss(cfg: ModelConfig, counts: torch.Tensor, prob_sum: torch.Tensor, rows: float) -> float:
    """The load-balancing loss's value before its coefficient, experts x sum_e f_e P_e
    (``aux_loss_grad``; transformers' ``aux_loss``): 1.0 when the routing is balanced."""
    return float(cfg.num_experts * (counts * prob_sum).sum() / (rows * rows))
