"""``megaray bench --block-alone``: one decoder block of a shape alone on the worker's GPU, its
elementwise passes fused (``megaray.fused``, what megaray runs) and eager, against the block's
matrix products and attention alone (what no elementwise work can go below): the forward
without gradients (a recomputed block's first pass, a kept block's rebuilt input), and the
forward and backward of the lean block (kept blocks) and of plain autograd's (recomputed ones).

Weights and inputs are random in bf16, one micro-batch of ``batch`` x ``seq`` tokens; each
case runs ``reps`` times after a warm-up (the compilation), and the time is the median. The
weights' gradients are taken as the worker takes them, at each weight. With ``documents`` (a
mean length) the rows are packed documents under document attention, as ``megaray train``
runs them. A model with sliding windows (Gemma 3) is timed twice: a local block (block 0)
and its first global one, each with its FLOPs (what its window and documents compute), so
the local block's time can be held against its share of the work.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from megaray import fused
from megaray.attention import packing
from megaray.bench.attention import median_seconds
from megaray.config import ModelConfig
from megaray.cost import active_block_params
from megaray.layout import build_layout
from megaray.model import Ropes, block_forward
from megaray.model_config import windowed_square
from megaray.moe import expert_linear
from megaray.step import document_lengths, square_document_lengths


def _weights(cfg: ModelConfig, gen: torch.Generator, device: str) -> dict:
    """The block's views as the layout names them (a mixture's stacked experts and router
    included): matrices random, norm scales ones, all bf16."""
    w = {}
    for v in build_layout(cfg)[1].views:
        t = torch.ones(v.shape, device=device) if len(v.shape) == 1 else torch.randn(v.shape, generator=gen,
                                                                                       device=device) * 0.02
        w[v.key] = t.bfloat16()
    return w


def product_weights(cfg: ModelConfig) -> tuple[str, ...]:
    """The block's matrices: what its products alone read."""
    return tuple(v.key for v in build_layout(cfg)[1].views if len(v.shape) >= 2)


def _products(w: dict, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The block's matrix products and causal attention, with nothing between them; a
    mixture's router and its experts' grouped products over a balanced routing (each expert
    the same number of the N x k rows)."""
    b, s, hd_model = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v = (F.linear(x, w[f"self_attn.{n}_proj.weight"]) for n in "qkv")
    a = F.scaled_dot_product_attention(q.view(b, s, nh, hd).transpose(1, 2), k.view(b, s, nkv, hd).transpose(1, 2),
                                       v.view(b, s, nkv, hd).transpose(1, 2), is_causal=True, enable_gqa=nkv != nh)
    o = F.linear(a.transpose(1, 2).reshape(b, s, nh * hd), w["self_attn.o_proj.weight"])
    if not cfg.moe:
        return F.linear(F.linear(o, w["mlp.gate_proj.weight"]) + F.linear(o, w["mlp.up_proj.weight"]),
                        w["mlp.down_proj.weight"])
    e, top = cfg.num_experts, cfg.num_experts_per_tok
    rows = o.reshape(-1, hd_model)
    n = rows.shape[0] * top
    offs = torch.linspace(n / e, n, e, device=x.device).round().to(torch.int32)
    xs = rows.repeat(top, 1)
    g = expert_linear(xs, w["mlp.experts.gate_proj"], offs)
    u = expert_linear(xs, w["mlp.experts.up_proj"], offs)
    y = expert_linear(g + u, w["mlp.experts.down_proj"], offs)
    return y.view(top, -1, hd_model).sum(0).view(b, s, hd_model) + F.linear(rows, w["mlp.gate.weight"]).sum()


def block_flops(cfg: ModelConfig, seq: int, batch: int, layer: int = 0, doc: np.ndarray | None = None) -> float:
    """Block ``layer``'s forward FLOPs over ``batch`` x ``seq`` tokens, as the TFLOP/s figure
    counts them (``cost.block_forward_seconds``' terms): 2 x active parameters x tokens and
    attention's 2 x hidden x (squared lengths): the rows', or with ``doc`` (each token's
    document, [batch, seq]) each document's, less what the block's window drops
    (``model_config.windowed_square``); a forward and backward is three times it."""
    window = cfg.window(layer)
    if doc is None:
        pairs = batch * (seq * seq if window is None else windowed_square(seq, window))
    else:
        pairs = square_document_lengths(doc, window)
    return 2.0 * (batch * seq * active_block_params(cfg) + cfg.hidden_size * pairs)


def timed_layers(cfg: ModelConfig) -> list[int]:
    """The blocks the bench times: block 0, and a model's first global block where block 0
    attends through a sliding window."""
    if cfg.window(0) is None:
        return [0]
    return [0] + [i for i in range(cfg.num_hidden_layers) if cfg.window(i) is None][:1]


def _case(cfg: ModelConfig, seq: int, batch: int, reps: int, device: str = "cuda", layer: int = 0,
          doc: np.ndarray | None = None) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    w = _weights(cfg, gen, device)
    rope = Ropes(cfg, seq, device=device)
    pk = None if doc is None else packing(torch.from_numpy(doc).to(device), cfg.head_dim, cfg.window(layer))
    x = torch.randn(batch, seq, cfg.hidden_size, generator=gen, device=device).bfloat16()
    dy = torch.randn(batch, seq, cfg.hidden_size, generator=gen, device=device).bfloat16()

    def backward(forward, names=tuple(w)):
        """The input's gradient and those of the weights ``names`` (the ones ``forward`` uses)."""
        def go():
            leaves = {k: v.detach().requires_grad_() if k in names else v for k, v in w.items()}
            xl = x.detach().requires_grad_()
            torch.autograd.grad(forward(leaves, xl), [xl, *(leaves[k] for k in names)], dy)
        return go

    def no_grad(forward):
        def go():
            with torch.no_grad():
                forward(w, x)
        return go

    def block(lean: bool):
        return lambda ws, xi: block_forward(ws, xi, rope, cfg, lean=lean, pk=pk, layer=layer)

    cases = {"forward_s": no_grad(block(True)), "lean_s": backward(block(True)), "plain_s": backward(block(False))}
    row = {"seq": seq, "batch": batch, "layer": layer, "window": cfg.window(layer),
           "mean_doc_len": None if doc is None else float(doc.size / len(document_lengths(doc))),
           "forward_flops": block_flops(cfg, seq, batch, layer, doc)}
    for mode in ("eager", "fused"):
        fused.configure(enabled=mode == "fused")
        row[mode] = {k: median_seconds(fn, reps) for k, fn in cases.items()}
        if mode == "fused" and not fused.active():
            row["fused_error"] = fused.failure()
    fused.configure()
    products = lambda ws, xi: _products(ws, xi, cfg)      # noqa: E731
    row["products"] = {"forward_s": median_seconds(no_grad(products), reps),
                       "backward_s": median_seconds(backward(products, product_weights(cfg)), reps)}
    return row


def run(shape: str, cases: list[tuple[int, int]], reps: int = 10, device: str = "cuda",
        documents: int | None = None, seed: int = 0) -> list[dict]:
    """For each (seq, batch) and each of ``timed_layers``: one block's seconds, fused and
    eager, and its products alone (``device`` other than the GPU for tests: the passes then
    run eagerly both ways). ``documents``: rows of packed documents of this mean length
    (``bench.document_ids``), the same ones for every block of a case."""
    from megaray.bench.run import document_ids

    cfg = ModelConfig.from_shape(shape)
    rng = np.random.default_rng(seed)
    rows = []
    for seq, batch in cases:
        doc = None if documents is None else document_ids(rng, (batch, seq), documents)
        for layer in timed_layers(cfg):
            rows.append({"shape": shape, **_case(cfg, seq, batch, reps, device, layer, doc)})
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_rows(rows: list[dict]) -> None:
    print("one block alone (bf16, median ms; lean and plain: forward and backward):")
    for r in rows:
        e, f, p = r["eager"], r["fused"], r["products"]
        where = (f" block {r['layer']}" + (f" (window {r['window']})" if r["window"] else "")
                 + (f", documents of mean {r['mean_doc_len']:.0f}" if r["mean_doc_len"] else ""))
        print(f"  {r['shape']}{where} seq {r['seq']} x {r['batch']}: forward {1e3 * e['forward_s']:.2f} eager, "
              f"{1e3 * f['forward_s']:.2f} fused, {1e3 * p['forward_s']:.2f} products alone; lean "
              f"{1e3 * e['lean_s']:.2f} / {1e3 * f['lean_s']:.2f}; plain {1e3 * e['plain_s']:.2f} / "
              f"{1e3 * f['plain_s']:.2f}; products alone {1e3 * p['backward_s']:.2f}; TFLOP/s forward and "
              f"backward: plain fused {3e-12 * r['forward_flops'] / f['plain_s']:.0f}, products alone "
              f"{3e-12 * r['forward_flops'] / p['backward_s']:.0f}"
              + (f"; fusing failed: {r['fused_error']}" if "fused_error" in r else ""))
    for local, full in zip(rows, rows[1:]):
        if local["window"] and not full["window"] and (local["seq"], local["batch"]) == (full["seq"], full["batch"]):
            time = local["fused"]["plain_s"] / full["fused"]["plain_s"]
            print(f"    the window's block against the global one: {time:.3f} of its time for "
                  f"{local['forward_flops'] / full['forward_flops']:.3f} of its work")
