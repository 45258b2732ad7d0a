"""The long-context pieces on the CPU: chunked MLP and chunked loss equal the unchunked
result, the lean RMSNorm's gradients equal autograd's through the plain formula, and block
inputs offloaded to host memory come back so the step is bit-identical to one without."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import shm_files

from megaray.driver.runner import train
from megaray.layout import bind, build_layout
from megaray.loader import load_config
from megaray.model import block_forward, init_unit, mlp, rms_norm, rope_tables


def _plain_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _grads(fn, *inputs, dy):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, dy)


def test_rms_norm_forward_is_the_formula_and_its_gradients_are_autograds():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 7, 64, generator=g, dtype=torch.float64), torch.randn(64, generator=g, dtype=torch.float64)
    dy = torch.randn(3, 7, 64, generator=g, dtype=torch.float64)
    # float64 here: the custom backward's formula against autograd, free of rounding
    x32, w32 = x.float(), w.float()
    out, (gx, gw) = _grads(lambda a, b: rms_norm(a, b, 1e-5), x32, w32, dy=dy.float())
    ref, (rx, rw) = _grads(lambda a, b: _plain_rms_norm(a, b, 1e-5), x32, w32, dy=dy.float())
    assert torch.equal(out, ref)                                            # the same forward, bit for bit
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-5)
    xb, wb, dyb = x.bfloat16(), w.bfloat16(), dy.bfloat16()               # bf16: within bf16 rounding
    out, (gx, gw) = _grads(lambda a, b: rms_norm(a, b, 1e-5), xb, wb, dy=dyb)
    ref, (rx, rw) = _grads(lambda a, b: _plain_rms_norm(a, b, 1e-5), xb, wb, dy=dyb)
    assert torch.equal(out, ref)
    torch.testing.assert_close(gx.float(), rx.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw.float(), rw.float(), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_chunked_mlp_equals_the_whole_sequence(dtype, tol):
    g = torch.Generator().manual_seed(1)
    w = {"mlp.gate_proj.weight": torch.randn(48, 16, generator=g) * 0.3,
         "mlp.up_proj.weight": torch.randn(48, 16, generator=g) * 0.3,
         "mlp.down_proj.weight": torch.randn(16, 48, generator=g) * 0.3}
    h, dy = torch.randn(2, 37, 16, generator=g), torch.randn(2, 37, 16, generator=g)
    names = list(w)

    def run(chunk):
        def fn(x, *ws):
            return mlp(x, dict(zip(names, ws)), chunk)
        return _grads(fn, h.to(dtype), *(t.to(dtype) for t in w.values()), dy=dy.to(dtype))

    whole, gw = run(None)
    chunked, gc = run(10)                                   # 74 tokens: 8 chunks, the last one short
    torch.testing.assert_close(chunked.float(), whole.float(), rtol=tol, atol=tol)
    for a, b in zip(gc, gw):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * 10)


def test_block_with_chunked_mlp_equals_plain_block():
    cfg = load_config("debug").model
    unit = build_layout(cfg)[1]
    flat = init_unit(unit, cfg, 0).double()
    x = torch.randn(2, 24, cfg.hidden_size, dtype=torch.float64)
    rope = rope_tables(cfg, 64, dtype=torch.float64)
    dy = torch.randn_like(x)
    outs = []
    for chunk in (None, 7):
        f = flat.clone().requires_grad_()
        xi = x.clone().requires_grad_()
        y = block_forward(bind(f, unit), xi, rope, cfg, mlp_chunk=chunk)
        outs.append((y, *torch.autograd.grad(y, [f, xi], dy)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _losses(s):
    rows = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def test_offloaded_block_inputs_come_back_bit_for_bit(ray_cluster, tmp_path):
    """Block inputs through host memory and back (the CPU's round trip of the GPU's pinned
    offload): the same losses and weights as keeping them, bit for bit; and a run with the MLP
    and the loss in small chunks agrees with both to fp32 rounding."""
    base = ["train.steps=3", "data.max_bytes=50000", "checkpoint.resume=null", "train.eval_batches=1"]
    ref = train(load_config("debug", base + [f"run.dir={tmp_path}/a"]))
    off = train(load_config("debug", base + [f"run.dir={tmp_path}/b", "worker.offload_inputs=2"]))
    assert _losses(off) == _losses(ref)
    rows = [json.loads(x) for x in (Path(off["run_dir"]) / "worker.jsonl").read_text().splitlines()]
    assert rows[0]["offloaded_inputs"] == 2
    # 2 blocks x 2 micro-batches x [2, 32, 32] fp32
    assert rows[0]["offload_bytes"] == 2 * 2 * 2 * 32 * 32 * 4
    master = lambda s: (Path(s["checkpoint"]) / "master.bin").read_bytes()  # noqa: E731
    assert master(off) == master(ref)
    chunked = train(load_config("debug", base + [f"run.dir={tmp_path}/c", "worker.offload_inputs=1",
                                                 "train.mlp_chunk_tokens=16", "train.loss_chunk_tokens=24"]))
    assert _losses(chunked) == pytest.approx(_losses(ref), rel=1e-5)
    assert shm_files() == []


def test_input_stride_rebuilds_the_unsaved_inputs_bit_for_bit(ray_cluster, tmp_path):
    """``worker.input_stride``: saving every 2nd block's input (with the last block kept and
    the first three blocks' saved inputs offloaded) or every 3rd, the backward rebuilds the
    others' by running forward again: the same losses and weights as saving every input with
    the same kept and offloaded blocks, bit for bit."""
    base = ["train.steps=3", "data.max_bytes=50000", "checkpoint.resume=null", "train.eval_batches=1",
            "model.num_hidden_layers=5"]
    kept = ["worker.keep_activations=1", "worker.offload_inputs=3"]   # a kept block runs lean: its own rounding
    runs = {name: train(load_config("debug", base + [f"run.dir={tmp_path}/{name}"] + extra))
            for name, extra in (("ref", []), ("three", ["worker.input_stride=3"]), ("kept", kept),
                                ("two", kept + ["worker.input_stride=2"]))}
    master = lambda s: (Path(s["checkpoint"]) / "master.bin").read_bytes()  # noqa: E731
    for s, ref in ((runs["three"], runs["ref"]), (runs["two"], runs["kept"])):
        assert _losses(s) == _losses(ref)
        assert master(s) == master(ref)
    rows = [json.loads(x) for x in (Path(runs["two"]["run_dir"]) / "worker.jsonl").read_text().splitlines()]
    assert rows[0]["input_stride"] == 2 and rows[0]["kept_blocks"] == 1
    assert "one recomputed block's input in 2 saved" in (Path(runs["two"]["run_dir"]) / "train.log").read_text()
    # of blocks 0-2, the anchors 0 and 2 go to host memory: 2 x 2 micro-batches x [2, 32, 32] fp32
    assert rows[0]["offload_bytes"] == 2 * 2 * 2 * 32 * 32 * 4
    assert shm_files() == []
