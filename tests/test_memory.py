"""The recomputation policy's choices for given memory budgets, against hand arithmetic."""
from __future__ import annotations

from megaray.config import ModelConfig
from megaray.memory import SAFETY, block_internal_bytes_per_token, keep_blocks


def test_bytes_per_token_hand_computed_for_llama3b():
    cfg = ModelConfig.from_shape("llama3b")
    h, i, q, kv, heads = 3072, 8192, 3072, 1024, 24
    # norm 1 out, norm 2 in and out, two fp32 scales; q, k, v, attention out, lse; o_proj in; MLP
    want = 3 * 2 * h + 8 + 2 * (2 * q + 2 * kv) + 4 * heads + 2 * q + 4 * 2 * i
    assert block_internal_bytes_per_token(cfg, 2) == want == 106600
    assert block_internal_bytes_per_token(cfg, 2, mlp_chunked=True) == want - 4 * 2 * i


def test_keep_blocks_fits_budget():
    cfg = ModelConfig.from_shape("llama3b")
    tokens = 65536
    per_block = SAFETY * 106600 * tokens + cfg.num_params() / 28 * 2
    gib = 2**30
    assert keep_blocks(cfg, tokens, 2, free_bytes=100 * gib, reserve_bytes=0) == int(100 * gib // per_block) == 11
    assert keep_blocks(cfg, tokens, 2, free_bytes=8 * gib, reserve_bytes=0) == 0
    assert keep_blocks(cfg, tokens, 2, free_bytes=5 * gib, reserve_bytes=8 * gib) == 0
    assert keep_blocks(cfg, 1024, 2, free_bytes=100 * gib, reserve_bytes=0) == 28     # everything fits
