"""Activation memory estimates and the recomputation policy.

The worker keeps every block's *input* for each micro-batch of a step. A block whose
internals are also kept is not recomputed in backward; the policy keeps the internals of
the last K blocks (their backward runs first, so they are also freed first), K chosen from
free device memory when not set in the config. The estimate counts what autograd saves in
``megaray.model.block_forward`` (its lean form) per token: one fp32 scale per norm, the
second norm's input (the first's is the block input, held anyway; the norms' outputs are
rebuilt in backward), q, k and v (kv heads as they are where SDPA takes them grouped, else
repeated), attention's output (also o_proj's input) and log-sum-exp, and the MLP's gate and
up projections. When the MLP runs in chunks (``train.mlp_chunk_tokens``) it keeps neither,
but the second norm's output instead. The H200 figures in BENCHMARKS.md compare it with
what one kept block measures.
"""
from __future__ import annotations

from megaray.config import ModelConfig

SAFETY = 1.25


def block_internal_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, mlp_chunked: bool = False) -> int:
    from megaray.model import _SDPA_GQA

    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    s = dtype_bytes
    norms = 2 * 4 + s * h * (2 if mlp_chunked else 1)     # two scales; norm 2's input (and output, chunked)
    kv_saved = kv if _SDPA_GQA or kv == q else q
    attn = s * (2 * q + 2 * kv_saved) + 4 * cfg.num_attention_heads   # q, k, v, output (= o_proj input), lse
    mlp = 0 if mlp_chunked else 2 * s * i       # gate and up
    return norms + attn + mlp


def keep_blocks(cfg: ModelConfig, tokens_per_step: int, dtype_bytes: int, free_bytes: int,
                reserve_bytes: int, mlp_chunked: bool = False) -> int:
    """How many of the last blocks can keep their internals within ``free_bytes - reserve``."""
    per_block = SAFETY * block_internal_bytes_per_token(cfg, dtype_bytes, mlp_chunked) * tokens_per_step
    per_block += cfg.num_params() / max(cfg.num_hidden_layers, 1) * dtype_bytes   # resident weights
    budget = free_bytes - reserve_bytes
    if budget <= 0:
        return 0
    return max(0, min(cfg.num_hidden_layers, int(budget // per_block)))
