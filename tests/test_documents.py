"""Packed rows without cross-document attention (``train.attention: document``, issue 20).

A packed row with document masking must give each document exactly what it gets alone:
the block's output and every gradient equal running each document as its own row, in fp64
and fp32, for GQA, qk-norm and bias shapes. Positions restart at each document (checked by hand).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megaray import attention, memory
from megaray.attention import packing
from megaray.config import ModelConfig
from megaray.errors import ConfigError
from megaray.layout import bind, build_layout
from megaray.loader import load_config
from megaray.model import Ropes, block_forward, init_unit, rope_tables

SHAPES = {
    "llama-gqa": dict(shape="debug"),
    "qwen3-qknorm": dict(shape="debug", qk_norm=True, tie_word_embeddings=False),
    "qwen2-bias-mha": dict(shape="debug", attention_bias=True, num_key_value_heads=4),
    # Gemma 3's block 0: a window of 4 tokens (documents of up to 17), its own rotary base,
    # four (1 + w) norms, q/k norms, GELU-tanh, scores scaled by 12^-1/2
    "gemma3-window": dict(shape="debug", norm_placement="sandwich", norm_offset=1.0, qk_norm=True,
                          hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=12.0, sliding_window=4,
                          layer_types=["sliding_attention", "full_attention"], rope_local_theta=1000.0),
}
LENGTHS = [(5, 9, 3), (17,), (1, 6, 6, 4)]          # documents per row; rows of 17 tokens


def _docs(lengths) -> torch.Tensor:
    return torch.cat([torch.full((n,), d, dtype=torch.int64) for d, n in enumerate(lengths)])


def documents_alone(flat, unit, x, dy, lengths, rope, cfg, mlp_chunk=None):
    """The reference: one block run on each document of each row as a row of its own (plain
    causal attention): the output and input gradient laid out as the packed rows, and the
    weights' gradient summed over the documents."""
    w = flat.clone().requires_grad_()
    y, gx, gw = torch.empty_like(x), torch.empty_like(x), torch.zeros_like(flat)
    for r, row in enumerate(lengths):
        at = 0
        for n in row:
            xi = x[r:r + 1, at:at + n].clone().requires_grad_()
            yi = block_forward(bind(w, unit), xi, rope, cfg, mlp_chunk)
            g_w, g_x = torch.autograd.grad(yi, [w, xi], dy[r:r + 1, at:at + n])
            y[r:r + 1, at:at + n], gx[r:r + 1, at:at + n] = yi.detach(), g_x
            gw += g_w
            at += n
    return y, gx, gw


def test_positions_restart_at_each_document():
    doc = torch.stack([_docs(x) for x in LENGTHS])
    pk = packing(doc)
    want = [list(range(5)) + list(range(9)) + list(range(3)), list(range(17)),
            [0] + list(range(6)) + list(range(6)) + list(range(4))]
    assert pk.pos.tolist() == want
    assert not pk.flex and pk.mask.shape == (3, 1, 17, 17)
    # the mask: token 7 of row 0 (document 1, position 2) sees tokens 5-7 and nothing else
    assert pk.mask[0, 0, 7].nonzero().flatten().tolist() == [5, 6, 7]


def test_cumulative_lengths_for_flash_varlen():
    """The rows laid end to end: a document ends at its row's end, even where the next row
    starts with the same id (row 1 continues row 0's document 1 here, as a long document cut
    by the packer would)."""
    doc = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 2, 3, 3]])
    cu, longest = attention.cumulative_lengths(doc)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 7, 8, 10] and longest == 3
    cu, longest = attention.cumulative_lengths(torch.stack([_docs(x) for x in LENGTHS]))
    assert cu.tolist() == [0, 5, 14, 17, 34, 35, 41, 47, 51] and longest == 17


def test_document_work_counts_each_documents_own_pairs():
    """TFLOP/s under document attention: the attention's term counts the documents' squared
    lengths (input tokens: the last column is a target only), a row's end ending its document;
    a causal row is one document of seq tokens, which is the causal formula again."""
    from megaray.model import flops_per_step
    from megaray.step import Batch

    doc = np.array([[[0, 0, 1, 1, 1, 9], [1, 1, 2, 3, 3, 3]]])          # inputs: lengths 2, 3 | 2, 1, 2
    batch = Batch(np.zeros_like(doc), doc=doc)
    assert batch.square_document_lengths() == 4 + 9 + 4 + 1 + 4
    assert Batch(np.zeros((1, 2, 6), np.int64)).square_document_lengths() is None
    whole = Batch(doc, doc=np.zeros_like(doc))
    assert whole.square_document_lengths() == 2 * 5 * 5
    cfg = ModelConfig.from_shape("debug")
    n = cfg.num_params()
    assert flops_per_step(cfg, 10, 5, batch.square_document_lengths()) == 6 * n * 10 + 6 * 2 * 32 * 22
    assert flops_per_step(cfg, 10, 5, whole.square_document_lengths()) == flops_per_step(cfg, 10, 5)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "plain"])
@pytest.mark.parametrize("mlp_chunk", [None, 8], ids=["whole-mlp", "chunked-mlp"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_packed_row_equals_its_documents_alone(shape, dtype, tol, mlp_chunk, lean):
    """Output and every gradient (weights and inputs) of one block over packed rows, against
    the same block run on each document as a row of its own (plain causal attention); also
    with the long-context path's chunked MLP (``train.mlp_chunk_tokens``), and for the lean
    block and plain autograd's (the worker runs both: ``memory.StepShape.recompute_lean``).
    A sliding-window block's packed rows equal each document alone under the same window: the
    documents' and the window's masks combine."""
    cfg = ModelConfig.from_shape(**SHAPES[shape])
    unit = build_layout(cfg)[1]
    flat = init_unit(unit, cfg, seed=3).to(dtype)
    flat += 0.05 * torch.randn(flat.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    rope = Ropes(cfg, 17, dtype=dtype)
    x = torch.randn(len(LENGTHS), 17, cfg.hidden_size, dtype=dtype, generator=torch.Generator().manual_seed(2))
    dy = torch.randn_like(x)

    w = flat.clone().requires_grad_()
    xp = x.clone().requires_grad_()
    y = block_forward(bind(w, unit), xp, rope, cfg, mlp_chunk, lean=lean,
                      pk=packing(torch.stack([_docs(n) for n in LENGTHS]), window=cfg.local_window))
    gw, gx = torch.autograd.grad(y, [w, xp], dy)

    y_ref, gx_ref, gw_ref = documents_alone(flat, unit, x, dy, LENGTHS, rope, cfg, mlp_chunk)
    torch.testing.assert_close(y.detach(), y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(gx, gx_ref, rtol=tol, atol=tol)
    # the norms compute in fp32 whatever the dtype (model._rms_norm_forward), so their scales'
    # gradients, summed over the tokens in another grouping, agree to fp32 rounding. Gemma's
    # norms on attention's and the MLP's small outputs divide by their rms, which magnifies that
    # rounding in every weight's gradient: measured, the packed rows and the documents alone each
    # lie about 4e-7 x the largest gradient from the fp64 computation (whose outputs and input
    # gradients agree to 1e-12), and 1-3e-7 x apart, moving with the threads' cut of the sums
    scale = 2e-6 * float(gw_ref.abs().max()) if cfg.norm_placement != "pre" else 0.0
    torch.testing.assert_close(gw, gw_ref, rtol=max(tol, 1e-5), atol=max(tol, 1e-6, scale))


def test_the_plan_counts_the_masks_and_the_config_names_the_key():
    """Document attention's GPU memory: each micro-batch's FlexAttention block mask (16 bytes
    a pair of 128-token blocks, plus a row) and its positions and document ids (12 bytes a
    token), for every micro-batch of the step; none with causal attention."""
    over = ["model.shape=llama3b", "train.seq_len=4096", "train.micro_batch_size=2", "train.grad_accum=3",
            "data.source=shards", "data.path=/nowhere"]
    doc = memory.gpu_items(load_config("debug", [*over, "train.attention=document"]))
    n = 4096 // 128
    assert doc["document attention (masks, positions)"] == 3 * (16 * 2 * n * (n + 1) + 12 * 2 * 4096)
    assert "document attention (masks, positions)" not in memory.gpu_items(
        load_config("debug", [*over, "train.attention=causal"]))
    with pytest.raises(ConfigError, match="train.attention.*needs data.source: shards"):
        load_config("debug", ["train.attention=document"])
    with pytest.raises(ConfigError, match="train.attention.*must be auto, causal or document"):
        load_config("debug", ["train.attention=sliding"])


def test_the_flex_block_mask_is_create_block_masks_and_attends_by_document():
    """``document_block_mask`` (built from block ranges, never a [s, s] mask) equals
    FlexAttention's own ``create_block_mask`` of the same mask function, block by block and
    full blocks apart, for rows of random documents, a row of one document and a ragged end;
    and FlexAttention through it (eager, on the CPU) gives each document what it gets alone."""
    create_block_mask = pytest.importorskip("torch.nn.attention.flex_attention").create_block_mask
    g = torch.Generator().manual_seed(0)
    for s in (1024, 1000, 300):
        doc = torch.stack([torch.repeat_interleave(torch.arange(60), torch.randint(1, 300, (60,), generator=g))[:s]
                           for _ in range(3)]).int()
        doc[1] = 0

        def same_document_causal(b, h, q, k, doc=doc):
            return (doc[b, q] == doc[b, k]) & (q >= k)

        ours = attention.document_block_mask(doc)
        ref = create_block_mask(same_document_causal, B=3, H=None, Q_LEN=s, KV_LEN=s, device="cpu", BLOCK_SIZE=128)
        assert torch.equal(ours.to_dense(), ref.to_dense())
        assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
        assert ours.full_kv_num_blocks.sum() > 0                     # some blocks skip the element mask

    cfg = ModelConfig.from_shape("debug", hidden_size=64, intermediate_size=128)      # heads of 16
    unit = build_layout(cfg)[1]
    lengths = [[100, 3, 200, 1], [304], [130, 130, 44]]
    doc = torch.stack([_docs(n) for n in lengths])
    pk = attention.packing(doc)
    flex = attention.Packing(pk.doc, pk.pos, attention.document_block_mask(pk.doc))
    assert flex.flex and not pk.flex
    flat = init_unit(unit, cfg, seed=0)
    rope = rope_tables(cfg, 304)
    x = torch.randn(3, 304, cfg.hidden_size, generator=g)
    y = block_forward(bind(flat, unit), x, rope, cfg, pk=flex)
    y_ref, _, _ = documents_alone(flat, unit, x, torch.zeros_like(x), lengths, rope, cfg)
    torch.testing.assert_close(y, y_ref, rtol=2e-5, atol=2e-5)


def test_the_windowed_block_mask_is_create_block_masks_and_keeps_each_window():
    """``document_block_mask`` with a window (a token sees itself and the window - 1 before it,
    in its own document) equals FlexAttention's ``create_block_mask`` of that mask function,
    for windows inside a block, of one block and across blocks, whole and ragged rows; and a
    sliding-window block through it (eager FlexAttention on the CPU), and through the dense
    mask SDPA takes, gives each document what it gets alone under the same window."""
    create_block_mask = pytest.importorskip("torch.nn.attention.flex_attention").create_block_mask
    g = torch.Generator().manual_seed(5)
    for s in (1024, 1000):
        doc = torch.stack([torch.repeat_interleave(torch.arange(40), torch.randint(1, 400, (40,), generator=g))[:s]
                           for _ in range(2)]).int()
        doc[1] = 0
        for window in (1, 100, 128, 300):
            def windowed(b, h, q, k, doc=doc, window=window):
                return (doc[b, q] == doc[b, k]) & (q >= k) & (q - k < window)

            ours = attention.document_block_mask(doc, window)
            ref = create_block_mask(windowed, B=2, H=None, Q_LEN=s, KV_LEN=s, device="cpu", BLOCK_SIZE=128)
            assert torch.equal(ours.to_dense(), ref.to_dense()), (s, window)
            assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks), (s, window)
            dense = attention.dense_mask(doc[:, :s], window)[:, 0]
            assert dense[1, 500].nonzero().flatten().tolist() == list(range(max(0, 501 - window), 501))

    cfg = ModelConfig.from_shape("debug", hidden_size=64, intermediate_size=128, sliding_window=150,
                                 layer_types=["sliding_attention", "full_attention"], rope_local_theta=500.0)
    unit = build_layout(cfg)[1]
    lengths = [[100, 3, 200, 1], [304], [130, 130, 44]]
    doc = torch.stack([_docs(n) for n in lengths])
    pk = attention.packing(doc, window=150)
    flex = attention.Packing(pk.doc, pk.pos, attention.document_block_mask(pk.doc),
                             attention.document_block_mask(pk.doc, 150))
    flat = init_unit(unit, cfg, seed=0)
    rope = Ropes(cfg, 304)
    x = torch.randn(3, 304, cfg.hidden_size, generator=g)
    y_ref, _, _ = documents_alone(flat, unit, x, torch.zeros_like(x), lengths, rope, cfg)
    for p in (flex, pk):
        torch.testing.assert_close(block_forward(bind(flat, unit), x, rope, cfg, pk=p), y_ref, rtol=2e-5, atol=2e-5)
    whole = block_forward(bind(flat, unit), x[1:2], rope, cfg, pk=attention.packing(doc[1:2], window=150))
    torch.testing.assert_close(whole, y_ref[1:2], rtol=2e-5, atol=2e-5)    # one document: the causal window


def test_a_windows_work_counts_only_what_the_window_computes():
    """TFLOP/s with sliding-window blocks: their attention term counts d^2 - (d - W)^2 for a
    document of d > W tokens (the pairs beyond the window dropped), d^2 for a shorter one; the
    full-attention blocks count d^2 as before."""
    from megaray.model import flops_per_step
    from megaray.step import Batch

    cfg = ModelConfig.from_shape("debug", sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    n, h = cfg.num_params(), cfg.hidden_size
    doc = np.array([[[0, 0, 0, 0, 0, 9], [1, 1, 2, 3, 3, 3]]])          # inputs: lengths 5 | 2, 1, 2
    batch = Batch(np.zeros_like(doc), doc=doc)
    assert batch.square_document_lengths(3) == (25 - 4) + 4 + 1 + 4
    got = flops_per_step(cfg, 10, 5, batch.square_document_lengths(), batch.square_document_lengths(3))
    assert got == 6 * n * 10 + 6 * h * ((25 + 4 + 1 + 4) + (21 + 4 + 1 + 4))
    # causal rows of 5 tokens: each row 25 pairs-units in the full block, 25 - 4 in the windowed one
    assert flops_per_step(cfg, 10, 5) == 6 * n * 10 + 6 * h * (2 * 25 + 2 * 21)
