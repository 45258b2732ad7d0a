"""megaray.fused: the blocks' elementwise passes compiled by torch.compile where configured (the
GPU by default), eager elsewhere; SwiGLU's gradients by autograd's formulas; a compile that
fails is said once, and the passes run eagerly from then on."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from megaray import fused
from megaray.layout import bind, build_layout
from megaray.loader import load_config
from megaray.model import _swiglu, _swiglu_grads, block_forward, init_unit, rope_tables


@pytest.fixture(autouse=True)
def default_configuration():
    fused.configure()
    yield
    fused.configure()


def test_swiglu_gradients_are_autograds():
    """Both forms (the one the compiler traces, the eager one that reuses the product's
    gradient) against autograd through silu(g) * u, in float64: the same formulas, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    g, u, dp = (torch.randn(5, 3, 40, generator=gen, dtype=torch.float64) for _ in range(3))
    gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
    ref_dg, ref_du = torch.autograd.grad(F.silu(gl) * ul, [gl, ul], dp)
    du, dg = _swiglu_grads.__wrapped__(g, u, dp.clone())
    assert torch.equal(du, ref_du) and torch.equal(dg, ref_dg)
    spent = dp.clone()
    du, dg = _swiglu_grads(g, u, spent)                  # on the CPU: the eager form
    assert torch.equal(du, ref_du) and torch.equal(dg, ref_dg)
    assert not torch.equal(spent, dp)                    # which took the product's gradient's memory
    assert torch.equal(_swiglu(g, u), F.silu(g) * u)


def _block_grads(lean: bool, dtype):
    cfg = load_config("debug").model
    unit = build_layout(cfg)[1]
    gen = torch.Generator().manual_seed(1)
    flat = init_unit(unit, cfg, 0).to(dtype).requires_grad_()
    x = torch.randn(2, 24, cfg.hidden_size, generator=gen, dtype=dtype).requires_grad_()
    dy = torch.randn(2, 24, cfg.hidden_size, generator=gen, dtype=dtype)
    y = block_forward(bind(flat, unit), x, rope_tables(cfg, 64), cfg, lean=lean)
    return (y, *torch.autograd.grad(y, [flat, x], dy))


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "plain"])
def test_a_block_with_compiled_passes_equals_the_eager_block(lean):
    """The compiler here is torch.compile's CPU code generation (the GPU's is Triton; the
    kernels are the same passes): forward, the weights' and the input's gradients to fp32
    rounding."""
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def inductor(gm, example_inputs):             # torch.compile's default backend, counting its graphs
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    eager = _block_grads(lean, torch.float32)
    fused.configure(devices=("cpu",), backend=inductor)
    compiled = _block_grads(lean, torch.float32)
    if not fused.active():
        pytest.skip(f"torch.compile does not work on this machine: {fused.failure()}")
    assert len(graphs) >= 4                       # the norm's forward and backward, RoPE, SwiGLU at least
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_failed_compile_is_said_once_and_the_passes_run_eagerly(caplog):
    def no_triton(gm, example_inputs):
        raise RuntimeError("Cannot find a working triton installation")

    cfg = load_config("debug").model
    unit = build_layout(cfg)[1]
    w = bind(init_unit(unit, cfg, 0), unit)
    fused.configure(devices=("cpu",), backend=no_triton)
    gen = torch.Generator().manual_seed(2)
    g, u, dp = (torch.randn(4, 16, generator=gen) for _ in range(3))
    x = torch.randn(1, 8, cfg.hidden_size, generator=gen)
    with caplog.at_level(logging.WARNING, logger="megaray"):
        out = _swiglu(g, u)
        du, dg = _swiglu_grads(g, u, dp.clone())
        y = block_forward(w, x, rope_tables(cfg, 8), cfg)
    failed, why = not fused.active(), fused.failure()
    fused.configure(enabled=False)
    assert torch.equal(y, block_forward(w, x, rope_tables(cfg, 8), cfg))
    assert torch.equal(out, F.silu(g) * u)
    ref = _swiglu_grads.__wrapped__(g, u, dp)
    assert torch.equal(du, ref[0]) and torch.equal(dg, ref[1])
    said = [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(said) == 1 and "working triton" in said[0]
    assert failed and "working triton" in why
    fused.configure(devices=("cpu",), backend=no_triton)      # a new configuration tries again
    assert fused.active()
