"""Activation memory estimates and the recomputation policy.

The worker keeps every block's *input* for each micro-batch of a step. A block whose
internals are also kept is not recomputed in backward; the policy keeps the internals of
the last K blocks (their backward runs first, so they are also freed first), K chosen from
free device memory when not set in the config. The estimate counts what autograd saves in
``megaray.model.block_forward`` per token: each RMSNorm's fp32 upcast of its input (kept
for both the square and the scaling) and its compute-dtype output, q/k/v and their rotated
forms, the repeated k/v and output of attention, and the four MLP tensors. On the H200 this
is within 2% of the device memory one kept block measures (BENCHMARKS.md).
"""
from __future__ import annotations

from megaray.config import ModelConfig

SAFETY = 1.25


def block_internal_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    s = dtype_bytes
    norms = 2 * (4 * h + s * h)                 # fp32 upcast of x, and the cast output; two norms
    attn = s * (2 * q + 2 * kv) + s * 4 * q + s * q   # rope in/out, sdpa q/k/v/out, o_proj input
    mlp = 4 * s * i                             # gate, silu(gate), up, product
    return norms + attn + mlp


def keep_blocks(cfg: ModelConfig, tokens_per_step: int, dtype_bytes: int, free_bytes: int,
                reserve_bytes: int) -> int:
    """How many of the last blocks can keep their internals within ``free_bytes - reserve``."""
    per_block = SAFETY * block_internal_bytes_per_token(cfg, dtype_bytes) * tokens_per_step
    per_block += cfg.num_params() / max(cfg.num_hidden_layers, 1) * dtype_bytes   # resident weights
    budget = free_bytes - reserve_bytes
    if budget <= 0:
        return 0
    return max(0, min(cfg.num_hidden_layers, int(budget // per_block)))
