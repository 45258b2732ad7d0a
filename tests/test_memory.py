"""The one GPU memory model: its per-token estimate against what autograd saves, and the
worker's choices (kept blocks, offloaded inputs, the correction by measurement) for given
budgets, against hand arithmetic."""
from __future__ import annotations

import pytest

from megaray import memory
from megaray.config import ModelConfig
from megaray.loader import load_config
from megaray.memory import block_internal_bytes_per_token


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

    from megaray.layout import bind, build_layout
    from megaray.model import block_forward, init_unit, rope_tables

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
    plain = _saved_bytes_per_token(cfg, lean=False) - rope
    assert plain == block_internal_bytes_per_token(cfg, 2) + 2 * (2 * h + 2 * i)
    assert plain == block_internal_bytes_per_token(cfg, 2, lean=False)


def test_estimate_matches_what_the_compiled_plain_block_saves():
    """With the elementwise passes compiled (torch.compile's CPU code generation here, Triton on
    the GPU: the same graphs, cut for the backward by the same partitioner), plain autograd's
    SwiGLU saves the gate and the up projection and rebuilds silu(gate) in its backward: one
    [tokens, intermediate] tensor fewer than eagerly. The lean block saves what it says either
    way."""
    from megaray import fused

    cfg = ModelConfig.from_shape("debug")
    rope = 4 * cfg.head_dim * 2 / 2
    eager = _saved_bytes_per_token(cfg, lean=False)
    try:
        fused.configure(devices=("cpu",))
        compiled = _saved_bytes_per_token(cfg, lean=False)
        lean = _saved_bytes_per_token(cfg, lean=True)
        if not fused.active():
            pytest.skip(f"torch.compile does not work on this machine: {fused.failure()}")
    finally:
        fused.configure()
    assert eager - compiled == 2 * cfg.intermediate_size
    assert compiled - rope == block_internal_bytes_per_token(cfg, 2, lean=False, fused=True)
    assert lean - rope == block_internal_bytes_per_token(cfg, 2, fused=True) == block_internal_bytes_per_token(cfg, 2)


def test_kept_blocks_and_offload_for_a_budget_by_hand():
    cfg = load_config("debug", ["model.shape=llama3b", "train.seq_len=2048", "train.micro_batch_size=4",
                                "train.grad_accum=8", "train.compute_dtype=bfloat16"])
    block = 2 * 3072 + 3072 * 3072 + 2 * 3072 * 1024 + 3072 * 3072 + 3 * 3072 * 8192
    kept_one = 55400 * 65536 + 2 * block          # one kept block: its internals over 64k tokens and its weights
    base = memory.gpu_total(cfg)
    # while the peak stays at the head (every input saved), each kept block adds exactly its cost
    assert memory.gpu_total(cfg, keep=5) - base == 5 * kept_one
    assert memory.keep_count(cfg, base + 5 * kept_one) == 5
    assert memory.keep_count(cfg, base + 5 * kept_one - 1) == 4
    assert memory.keep_count(cfg, base - 1) == 0
    assert memory.keep_count(cfg, 10**15) == 28
    # the fewest offloaded inputs; here one offloaded block moves the peak from the head to the
    # backward's end (every block's fp32 gradient), so more offloading saves nothing: all of them
    one = memory.gpu_total(cfg, offload=1)
    assert base - one < 2 * 65536 * 3072 and one == memory.gpu_total(cfg, offload=2)
    assert memory.offload_count(cfg, base) == 0
    assert memory.offload_count(cfg, base - 1) == 1
    assert memory.offload_count(cfg, one) == 1
    assert memory.offload_count(cfg, one - 1) == 28
    # the worker's budget: free memory less 6% and 2 GiB
    assert memory.budget(100 * 2**30) == int(94 * 2**30) - 2 * 2**30


def test_adapt_keep_by_measurement():
    gib = 2**30
    # 3.5 blocks of headroom under the budget: 3 more; 0.5 block over it: one fewer
    budget = 96 * gib
    peak = budget - 7 * gib // 2
    assert memory.adapt_keep(10, 28, measured_peak=peak, kept_block_bytes=gib, budget_bytes=budget) == 13
    assert memory.adapt_keep(10, 28, measured_peak=budget + gib // 2, kept_block_bytes=gib, budget_bytes=budget) == 9
    assert memory.adapt_keep(27, 28, measured_peak=0, kept_block_bytes=gib, budget_bytes=96 * gib) == 28
    assert memory.adapt_keep(1, 28, measured_peak=200 * gib, kept_block_bytes=gib, budget_bytes=96 * gib) == 0


def test_blocks_keep_plain_activations_only_when_all_fit():
    """llama3b at 64k tokens a step: kept plain blocks cost 2 x (2h + i) bytes a token more
    than lean ones with the compiled passes (2 x (2h + 2i) eagerly: silu(gate) too); the worker
    keeps plain blocks only when all 28 fit, nothing offloaded and the MLP unchunked."""
    cfg = load_config("debug", ["model.shape=llama3b", "train.seq_len=2048", "train.micro_batch_size=4",
                                "train.grad_accum=8", "train.compute_dtype=bfloat16"])
    extra = 65536 * 2 * (2 * 3072 + 8192)           # per kept block
    eager = load_config("debug", ["model.shape=llama3b", "train.seq_len=2048", "train.micro_batch_size=4",
                                  "train.grad_accum=8", "train.compute_dtype=bfloat16",
                                  "worker.fuse_elementwise=false"])
    lean_all = memory.gpu_total(cfg, keep=28)
    plain_all = memory.gpu_total(cfg, keep=28, lean=False)
    assert plain_all - lean_all == 28 * extra
    assert memory.gpu_items(cfg, keep=28, lean=False)["kept blocks (plain autograd's internals + weights, at the "
                                                       "peak)"] == 28 * ((55400 + 28672) * 65536 + 2 * 100_669_440)
    assert memory.gpu_items(eager, keep=28, lean=False)["kept blocks (plain autograd's internals + weights, at "
                                                        "the peak)"] == 28 * ((55400 + 45056) * 65536 + 2 * 100_669_440)
    # lean blocks save the same either way; the plain recomputation's workspace of one
    # micro-batch (8192 tokens) holds silu(gate) too eagerly
    assert memory.gpu_total(eager, keep=28) - lean_all == 8192 * 2 * 8192
    # they are chosen only where they fit as the eager passes save them (a compile may fail and
    # run the passes eagerly): silu(gate) of 28 blocks over 64k tokens and of the workspace's
    # micro-batch more
    eager_all = memory.gpu_total(eager, keep=28, lean=False)
    assert eager_all - plain_all == 28 * 65536 * 2 * 8192 + 8192 * 2 * 8192
    assert memory.kept_plain(cfg, eager_all) and not memory.kept_plain(cfg, eager_all - 1)
    assert not memory.kept_plain(cfg, plain_all)
    assert memory.keep_choice(cfg, eager_all) == (28, False) and memory.keep_choice(cfg, plain_all) == (28, True)
    assert not memory.kept_plain(cfg, eager_all, offload=1)
    chunked = load_config("debug", ["model.shape=llama3b", "train.seq_len=2048", "train.micro_batch_size=4",
                                    "train.grad_accum=8", "train.compute_dtype=bfloat16",
                                    "train.mlp_chunk_tokens=4096"])
    assert not memory.kept_plain(chunked, 10**15)
    # recomputed blocks run plain unless the MLP is chunked
    assert not memory.StepShape.of(cfg).recompute_lean and memory.StepShape.of(chunked).recompute_lean


def test_input_stride_saves_every_sth_input_by_hand():
    """``worker.input_stride``: the saved inputs at the step's peak, counted by hand, and the
    backward's order of passes."""
    base = ["model.num_hidden_layers=6", "optim.grad_placement=host"]
    one = memory.StepShape.of(load_config("debug", base)).one_input
    saved = "saved block inputs (at the peak)"

    def inputs(stride, keep=0, offload=0):
        cfg = load_config("debug", base + [f"worker.input_stride={stride}"])
        return memory.gpu_items(cfg, keep, offload)[saved] // one

    # every input and the last output at the head: 7; stride 2 saves blocks 0, 2, 4's, and
    # block 5's input lives beside its output while it computes: 5; stride 3 saves 0 and 3's: 4
    assert (inputs(1), inputs(2), inputs(3)) == (7, 5, 4)
    # two kept blocks (4, 5): recomputed 0-3, anchors 0 and 2, plus the kept ones' inputs and the output
    assert inputs(2, keep=2) == 2 + 2 + 1
    # the first 3 blocks' inputs offloaded: of anchors 0, 2, 4 only 4's stays. At the head:
    # 4's, block 5's input and its output, 3; at block 3's backward, 4's gone, 2's back (with
    # 0's on its way) and 3's rebuilt, 3 too
    assert inputs(2, offload=3) == 3
    assert memory.recompute_order(5, 2) == [(4, True, True), (2, False, True), (3, True, False), (2, True, False),
                                            (0, False, True), (1, True, False), (0, True, False)]
    assert memory.recompute_order(3, 1) == [(2, True, True), (1, True, True), (0, True, True)]


@pytest.mark.parametrize("shape, kw", [
    ("debug", dict(qk_norm=True)),
    ("debug_moe", {}),
    ("debug_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40)),
    ("debug_moe", dict(qk_norm_scope="projection", architecture="OlmoeForCausalLM", norm_topk_prob=False)),
], ids=["qk-norms", "moe", "moe-top3-wide", "olmoe-norms"])
def test_estimate_of_qk_norms_and_experts_against_what_autograd_saves(shape, kw):
    """q/k norms save their inputs and scales (exactly counted); a mixture's MLP saves the
    router's softmax and top k, and per routed row the gathered input, gate, up, silu, product,
    the experts' output in token order and two permutations: counted to within 2% (a little over: the top-k
    values and the renormalised weights share storage where norm_topk_prob is off)."""
    cfg = ModelConfig.from_shape(shape, **kw)
    rope = 4 * cfg.head_dim * 2 / 2
    for lean in (True, False):
        got = _saved_bytes_per_token(cfg, lean=lean) - rope
        want = block_internal_bytes_per_token(cfg, 2, lean=lean)
        if cfg.moe:
            assert got <= want <= 1.02 * got, (lean, got, want)
        else:
            assert got == want, (lean, got, want)
