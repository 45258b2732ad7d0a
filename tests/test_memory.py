"""The recomputation policy's choices for given memory budgets, against hand arithmetic."""
from __future__ import annotations

from megaray.config import ModelConfig
from megaray.memory import SAFETY, block_internal_bytes_per_token, keep_blocks


def test_bytes_per_token_hand_computed_for_llama3b():
    cfg = ModelConfig.from_shape("llama3b")
    h, i, q, kv = 3072, 8192, 3072, 1024
    want = 2 * (4 * h + 2 * h) + 2 * (2 * q + 2 * kv) + 2 * 4 * q + 2 * q + 4 * 2 * i
    assert block_internal_bytes_per_token(cfg, 2) == want == 149504


def test_keep_blocks_fits_budget():
    cfg = ModelConfig.from_shape("llama3b")
    tokens = 65536
    per_block = SAFETY * 149504 * tokens + cfg.num_params() / 28 * 2
    gib = 2**30
    assert keep_blocks(cfg, tokens, 2, free_bytes=100 * gib, reserve_bytes=0) == int(100 * gib // per_block) == 8
    assert keep_blocks(cfg, tokens, 2, free_bytes=10 * gib, reserve_bytes=0) == 0
    assert keep_blocks(cfg, tokens, 2, free_bytes=5 * gib, reserve_bytes=8 * gib) == 0
    assert keep_blocks(cfg, 1024, 2, free_bytes=100 * gib, reserve_bytes=0) == 28     # everything fits
