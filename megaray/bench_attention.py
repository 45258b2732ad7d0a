"""``megaray bench --attention-alone``: one attention layer's forward and backward alone, by
kernel, on the worker's GPU: causal SDPA (flash), document attention through FlexAttention's
block mask (what megaray runs) and through SDPA with a dense boolean mask (the other fused
option that needs no new dependency; its [s, s] mask makes it impossible on long rows).

Rows are packed documents of exponentially distributed lengths (``bench.document_ids``), the
heads llama3b's (24 query heads, 8 kv heads, 128 wide), bf16. Each kernel runs ``reps`` times
after a warm-up (FlexAttention's compilation); the time is the median.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from megaray.attention import document_block_mask, flex_attention

HEADS, KV_HEADS, HEAD_DIM = 24, 8, 128


def _time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _case(doc: torch.Tensor, flex, reps: int) -> dict:
    """One row of packed documents (``doc`` [batch, seq] on the GPU), every kernel."""
    batch, seq = doc.shape
    q = torch.randn(batch, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, KV_HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dy = torch.randn_like(q)

    def step(attend):
        def go():
            torch.autograd.grad(attend(), [q, k, v], dy)
        return go

    block_mask = document_block_mask(doc)
    out = {"causal_s": _time(step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
                             reps),
           "flex_document_s": _time(step(lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)), reps)}
    if batch * seq * seq <= 2**31:       # the dense mask fits
        causal = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
        dense = ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)
        out["sdpa_dense_mask_s"] = _time(step(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, enable_gqa=True)), reps)
    return out


def run(cases: list[tuple[int, int]], mean_len: int, reps: int = 5, seed: int = 0) -> list[dict]:
    """For each (seq, batch): seconds of one forward and backward with each kernel, and the
    share of query-key pairs the document mask keeps against causal's."""
    from megaray.bench import document_ids

    rng = np.random.default_rng(seed)
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for seq, batch in cases:
        doc = torch.from_numpy(document_ids(rng, (batch, seq), mean_len)).cuda()
        lengths = torch.cat([torch.unique_consecutive(r, return_counts=True)[1] for r in doc.cpu()]).double()
        rows.append({"seq": seq, "batch": batch, "mean_doc_len": mean_len, **_case(doc, flex, reps),
                     "pairs_kept": float((lengths * (lengths + 1) / 2).sum() / (batch * seq * (seq + 1) / 2))})
        torch.cuda.empty_cache()
    return rows


def print_rows(rows: list[dict]) -> None:
    print("attention alone (llama3b heads, bf16, forward + backward, median s):")
    for r in rows:
        dense = f"{r['sdpa_dense_mask_s']:.4f}" if "sdpa_dense_mask_s" in r else "does not fit"
        print(f"  seq {r['seq']:>7} x {r['batch']}: causal SDPA {r['causal_s']:.4f}, document FlexAttention "
              f"{r['flex_document_s']:.4f}, document SDPA + dense mask {dense}; documents of mean "
              f"{r['mean_doc_len']} keep {100 * r['pairs_kept']:.1f}% of causal's pairs")
