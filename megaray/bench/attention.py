"""``megaray bench --attention-alone``: one attention layer's forward and backward alone, by
kernel, on the worker's GPU: causal SDPA (flash), document attention through FlexAttention's
block mask (what megaray runs), through flash attention's variable-length kernel over the
documents' cumulative lengths (``torch.nn.attention.varlen``, torch >= 2.10: the rows laid end
to end, each document its own sequence) and through SDPA with a dense boolean mask (its
[s, s] mask makes it impossible on long rows). The candidates the choice of kernel rests on.

Rows are packed documents of exponentially distributed lengths (``bench.document_ids``), the
heads a shape's (llama3b's by default: 24 query heads, 8 kv heads, 128 wide), bf16. A shape
with sliding windows (Gemma 3) is also timed under its window, causal rows and documents,
through FlexAttention's windowed block mask and flash varlen's own window (``window_size``: the
kernel megaray's windowed blocks run on CUDA, ``attention.window_attention``, there with the kv
heads grouped). Each kernel runs ``reps`` times after a warm-up (FlexAttention's compilation);
the time is the median.
"""
from __future__ import annotations

import inspect
import time

import numpy as np
import torch
import torch.nn.functional as F

from megaray.attention import cumulative_lengths, document_block_mask, flex_attention, varlen_kernel
from megaray.config import ModelConfig


def median_seconds(fn, reps: int) -> float:
    """Median wall seconds of ``fn`` on the GPU (or the CPU, where there is none) over ``reps``
    runs after one warm-up."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _case(doc: torch.Tensor, flex, reps: int, cfg: ModelConfig) -> dict:
    """One row of packed documents (``doc`` [batch, seq] on the GPU), every kernel."""
    batch, seq = doc.shape
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dy = torch.randn_like(q)

    def step(attend):
        def go():
            torch.autograd.grad(attend(), [q, k, v], dy)
        return go

    block_mask = document_block_mask(doc)
    causal_sdpa = step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    out = {"causal_s": median_seconds(causal_sdpa, reps),
           "flex_document_s": median_seconds(step(lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)), reps)}
    varlen_attn = varlen_kernel()
    if varlen_attn is not None:
        try:
            out.update(_varlen(varlen_attn, q, k, v, dy, doc, reps))
        except Exception as e:          # an API that changed between torch versions: say so, time the rest
            out["varlen_document_error"] = f"{type(e).__name__}: {e}"
    window = cfg.sliding_window if cfg.local_blocks else None
    if window:
        rows = torch.arange(batch, device=doc.device, dtype=doc.dtype)[:, None].expand(batch, seq).contiguous()
        for name, ids in (("window", rows), ("document_window", doc)):
            mask = document_block_mask(ids, window)
            out[f"flex_{name}_s"] = median_seconds(step(lambda m=mask: flex(q, k, v, block_mask=m, enable_gqa=True)),
                                                   reps)
            if varlen_attn is not None:
                try:
                    timed = _varlen(varlen_attn, q, k, v, dy, ids, reps, window)
                    out.update({key.replace("document", name): t for key, t in timed.items()})
                except Exception as e:
                    out[f"varlen_{name}_error"] = f"{type(e).__name__}: {e}"
    if batch * seq * seq <= 2**31:       # the dense mask fits
        causal = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
        dense = ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)
        out["sdpa_dense_mask_s"] = median_seconds(step(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, enable_gqa=True)), reps)
    return out


def _varlen(varlen_attn, q, k, v, dy, doc: torch.Tensor, reps: int, window: int | None = None) -> dict:
    """Flash varlen on the same tensors, laid out as it takes them ([tokens, heads, dim], as the
    blocks' projections make them), with grouped kv heads as they are where its signature
    takes them (``enable_gqa``), else repeated per query head (timed, and said); with
    ``window``, each token keeps the ``window`` tokens up to itself (flash's
    ``window_size`` (window - 1, 0))."""
    batch, heads, seq, dim = q.shape
    cu, longest = cumulative_lengths(doc)

    def flat(t):
        return t.detach().transpose(1, 2).reshape(batch * seq, t.shape[1], dim).clone().requires_grad_()

    qf, kf, vf, dyf = flat(q), flat(k), flat(v), dy.transpose(1, 2).reshape(batch * seq, heads, dim)
    params = inspect.signature(varlen_attn).parameters
    if window:
        kw = {"window_size": (window - 1, 0)}
    else:
        kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    native = "enable_gqa" in params
    if native:
        kw["enable_gqa"] = True

    def go():
        kk, vv = (kf, vf) if native else (kf.repeat_interleave(heads // kf.shape[1], 1),
                                          vf.repeat_interleave(heads // vf.shape[1], 1))
        torch.autograd.grad(varlen_attn(qf, kk, vv, cu, cu, longest, longest, **kw), [qf, kf, vf], dyf)

    return {"varlen_document_s": median_seconds(go, reps), "varlen_kv_heads": "grouped" if native else "repeated"}


def run(cases: list[tuple[int, int]], mean_len: int, reps: int = 5, seed: int = 0,
        shape: str = "llama3b") -> list[dict]:
    """For each (seq, batch): seconds of one forward and backward with each kernel, with
    ``shape``'s heads (and its window), and the share of query-key pairs the document mask
    keeps against causal's."""
    from megaray.bench.run import document_ids

    cfg = ModelConfig.from_shape(shape)
    rng = np.random.default_rng(seed)
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for seq, batch in cases:
        doc = torch.from_numpy(document_ids(rng, (batch, seq), mean_len)).cuda()
        lengths = torch.cat([torch.unique_consecutive(r, return_counts=True)[1] for r in doc.cpu()]).double()
        rows.append({"shape": shape, "seq": seq, "batch": batch, "mean_doc_len": mean_len,
                     **_case(doc, flex, reps, cfg),
                     "pairs_kept": float((lengths * (lengths + 1) / 2).sum() / (batch * seq * (seq + 1) / 2))})
        torch.cuda.empty_cache()
    return rows


def print_rows(rows: list[dict]) -> None:
    if rows:
        print(f"attention alone ({rows[0].get('shape', 'llama3b')} heads, bf16, forward + backward, median s):")
    for r in rows:
        dense = f"{r['sdpa_dense_mask_s']:.4f}" if "sdpa_dense_mask_s" in r else "does not fit"
        varlen = (f"{r['varlen_document_s']:.4f} (kv heads {r['varlen_kv_heads']})" if "varlen_document_s" in r
                  else r.get("varlen_document_error", "not in this torch"))
        print(f"  seq {r['seq']:>7} x {r['batch']}: causal SDPA {r['causal_s']:.4f}, document FlexAttention "
              f"{r['flex_document_s']:.4f}, document flash varlen {varlen}, document SDPA + dense mask "
              f"{dense}; documents of mean {r['mean_doc_len']} keep {100 * r['pairs_kept']:.1f}% of causal's pairs")
        for name in ("window", "document_window"):
            if f"flex_{name}_s" in r:
                varlen = (f"{r[f'varlen_{name}_s']:.4f}" if f"varlen_{name}_s" in r
                          else r.get(f"varlen_{name}_error", "not in this torch"))
                flex = r[f"flex_{name}_s"]
                print(f"    {name.replace('_', ' and ')}: FlexAttention {flex:.4f}, flash varlen {varlen}")
