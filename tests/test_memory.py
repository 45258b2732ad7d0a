"""The recomputation policy's choices for given memory budgets, against hand arithmetic."""
from __future__ import annotations

from megaray.config import ModelConfig
from megaray.memory import SAFETY, block_internal_bytes_per_token, keep_blocks


def test_bytes_per_token_hand_computed_for_llama3b():
    cfg = ModelConfig.from_shape("llama3b")
    h, i, q, kv, heads = 3072, 8192, 3072, 1024, 24
    # two fp32 scales, norm 2's input; q, k, v, attention out (o_proj's input too), lse; gate, up
    want = 8 + 2 * h + 2 * (2 * q + 2 * kv) + 4 * heads + 2 * 2 * i
    assert block_internal_bytes_per_token(cfg, 2) == want == 55400
    # chunked: no gate and up kept, norm 2's output instead
    assert block_internal_bytes_per_token(cfg, 2, mlp_chunked=True) == want - 2 * 2 * i + 2 * h


def _saved_bytes_per_token(cfg, lean: bool, tokens=(2, 64)) -> float:
    """Bytes autograd saves for one block, by distinct storage, read with saved-tensor hooks
    (the block's input and its weights excluded: they are held anyway)."""
    import torch

    from megaray.model import bind, block_forward, build_layout, init_unit, rope_tables

    unit = build_layout(cfg)[1]
    flat = init_unit(unit, cfg, 0).to(torch.bfloat16).requires_grad_()
    x = torch.randn(*tokens, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    rope = rope_tables(cfg, tokens[1])
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block_forward(bind(flat, unit), x, rope, cfg, lean=lean)
    for held in (x, flat):
        seen.pop(held.untyped_storage().data_ptr(), None)
    return sum(seen.values()) / (tokens[0] * tokens[1])


def test_estimate_matches_what_autograd_saves():
    """The per-token estimate against the saved tensors of a real block (bf16, on the CPU),
    less the rotary tables' bf16 casts (per position, not per token: 4 x head_dim x 2 bytes
    over the batch here), which vanish at real sizes."""
    cfg = ModelConfig.from_shape("debug")
    rope = 4 * cfg.head_dim * 2 / 2
    assert _saved_bytes_per_token(cfg, lean=True) - rope == block_internal_bytes_per_token(cfg, 2)
    # plain autograd keeps the norms' outputs, silu(gate) and the product too: about twice as much
    h, i = cfg.hidden_size, cfg.intermediate_size
    assert _saved_bytes_per_token(cfg, lean=False) - rope == block_internal_bytes_per_token(cfg, 2) + 2 * (2 * h + 2 * i)


def test_keep_blocks_fits_budget():
    cfg = ModelConfig.from_shape("llama3b")
    tokens = 65536
    per_block = SAFETY * 55400 * tokens + cfg.num_params() / 28 * 2
    gib = 2**30
    assert keep_blocks(cfg, tokens, 2, free_bytes=100 * gib, reserve_bytes=0) == int(100 * gib // per_block) == 22
    assert keep_blocks(cfg, tokens, 2, free_bytes=4 * gib, reserve_bytes=0) == 0     # under one block
    assert keep_blocks(cfg, tokens, 2, free_bytes=5 * gib, reserve_bytes=8 * gib) == 0
    assert keep_blocks(cfg, 1024, 2, free_bytes=100 * gib, reserve_bytes=0) == 28     # everything fits
