"""The optimizer shards' AdamW (``megaray.adamw``) against torch.optim.AdamW and against AdamW
written out here, for every storage combination: fp32 or bf16 master, gradient and moments,
with and without the host's compute copy, weight decay on and off, clip coefficients below
and at one. The C kernel and its torch fallback must agree bit for bit."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from megaray import adamw
from megaray.loader import load_config

F32, BF16 = torch.float32, torch.bfloat16
N = 50_003          # not a multiple of any vector width


def _state(pdt, gdt, mdt, copy, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(N, generator=g).to(pdt)
    grads = [torch.randn(N, generator=g).to(gdt) for _ in range(3)]
    m = (0.1 * torch.randn(N, generator=g)).to(mdt)
    v = (0.01 * torch.rand(N, generator=g)).to(mdt)
    c = torch.zeros(N, dtype=BF16) if copy else None
    return p, grads, m, v, c


def _run(opt, pdt, gdt, mdt, copy, wd, scale):
    p, grads, m, v, c = _state(pdt, gdt, mdt, copy)
    for t, grad in enumerate(grads, 1):
        h = adamw.hyper(1e-3, (0.9, 0.95), 1e-8, wd, t, grad_scale=scale)
        opt.step(p, grad, m, v, h, copy=c, sr_key=adamw.rounding_key(7, 2, t), offset=1000, adam_step=t)
    return p, m, v, c


def _bits(t):
    return None if t is None else (t.view(torch.int16) if t.dtype == BF16 else t.view(torch.int32))


COMBOS = [c for c in itertools.product((F32, BF16), (F32, BF16), (F32, BF16), (False, True))
          if not (c[0] == BF16 and c[3])]           # a bf16 master is read as it is: no copy


@pytest.mark.parametrize("pdt, gdt, mdt, copy", COMBOS, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("wd, scale", [(0.1, 0.7), (0.0, 1.0)], ids=["decay-clipped", "no-decay-unclipped"])
def test_the_kernel_and_its_fallback_agree_bit_for_bit(pdt, gdt, mdt, copy, wd, scale):
    if adamw.kernel() is None:
        pytest.skip(f"no C kernel here: {adamw.kernel_error()}")
    fused = _run(adamw.AdamW(threads=3), pdt, gdt, mdt, copy, wd, scale)
    fallback = _run(adamw.AdamW(threads=1, use_kernel=False), pdt, gdt, mdt, copy, wd, scale)
    for a, b in zip(fused, fallback):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(_bits(a), _bits(b))


def _written_out(p, g, m, v, t, lr, wd, scale, b1=0.9, b2=0.95, eps=1e-8):
    """AdamW in float64, torch's formula (decoupled decay first)."""
    g = g.double() * scale
    p = p.double() * (1 - lr * wd)
    m = b1 * m.double() + (1 - b1) * g
    v = b2 * v.double() + (1 - b2) * g * g
    p = p - lr / (1 - b1 ** t) * m / ((v / (1 - b2 ** t)).sqrt() + eps)
    return p, m, v


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "fallback"])
@pytest.mark.parametrize("copy", [False, True], ids=["no-copy", "copy"])
def test_fp32_state_matches_adamw_written_out(use_kernel, copy):
    if use_kernel and adamw.kernel() is None:
        pytest.skip("no C kernel here")
    p, grads, m, v, c = _state(F32, F32, F32, copy)
    ref = (p.double(), m.double(), v.double())
    opt = adamw.AdamW(2, use_kernel=use_kernel)
    for t, g in enumerate(grads, 1):
        opt.step(p, g, m, v, adamw.hyper(1e-3, (0.9, 0.95), 1e-8, 0.1, t, grad_scale=0.5), copy=c, adam_step=t)
        ref = _written_out(*ref[:1], g, *ref[1:], t, 1e-3, 0.1, 0.5)
    torch.testing.assert_close(p.double(), ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m.double(), ref[1], rtol=1e-5, atol=5e-8)     # a few fp32 ulps of 0.1
    if copy:
        assert torch.equal(c, p.to(BF16))                          # the copy is the master rounded to nearest


def test_fp32_state_runs_torchs_own_fused_adamw():
    """Without a copy, fp32 state is updated by torch's fused AdamW kernel: torch.optim.AdamW's
    arithmetic (to an ulp), with the clip coefficient applied to the gradient first."""
    p, grads, m, v, _ = _state(F32, F32, F32, False)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    opt.step()                                                       # creates the state (grad None: no-op)
    st = opt.state.setdefault(ref, {})
    st.update(step=torch.tensor(0.0), exp_avg=m.clone(), exp_avg_sq=v.clone())
    ours = adamw.AdamW(1)
    scaled = []
    for t, g in enumerate(grads, 1):
        ref.grad = g * 0.25
        opt.step()
        before = g.clone()
        ours.step(p, g, m, v, adamw.hyper(1e-3, (0.9, 0.95), 1e-8, 0.1, t, grad_scale=0.25), adam_step=t)
        torch.testing.assert_close(g, before, rtol=0, atol=0)       # the shard's gradient is left as it came
        scaled.append(ours._scaled.data_ptr())
    assert len(set(scaled)) == 1                                     # one buffer for the clipped gradient
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, st["exp_avg"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "fallback"])
def test_bf16_moments_and_gradients_match_adamw_with_rounding_each_step(use_kernel):
    if use_kernel and adamw.kernel() is None:
        pytest.skip("no C kernel here")
    p, grads, m, v, _ = _state(F32, BF16, BF16, False)
    rp, rm, rv = p.double(), m.double(), v.double()
    opt = adamw.AdamW(1, use_kernel=use_kernel)
    for t, g in enumerate(grads, 1):
        opt.step(p, g, m, v, adamw.hyper(1e-3, (0.9, 0.95), 1e-8, 0.1, t, grad_scale=0.8), adam_step=t)
        rp, rm, rv = _written_out(rp, g, rm, rv, t, 1e-3, 0.1, 0.8)
        rm, rv = rm.to(BF16).double(), rv.to(BF16).double()             # stored as bf16, to nearest
    torch.testing.assert_close(p.double(), rp, rtol=0, atol=2e-5)
    # the moments are the reference's rounded values, or one bf16 step away where the fp32
    # arithmetic landed on the other side of a rounding boundary
    assert (m.double() != rm).float().mean() < 0.01
    torch.testing.assert_close(m.double(), rm, rtol=1e-2, atol=1e-7)


def test_a_bf16_master_lands_on_a_neighbour_unbiased_and_independent_of_the_cut():
    n = 400_000
    x = torch.full((n,), 1.0 + 2.0 ** -10)            # 1/8 of the way from 1 to the next bf16 (1 + 2^-7)
    out = torch.empty(n, dtype=BF16)
    adamw.stochastic_round(x, out, sr_key=99, first=0)
    vals = out.float()
    assert set(vals.unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    assert abs(float((vals > 1).float().mean()) - 0.125) < 0.005
    # the kernel draws the same noise for the same element of the unit, however the unit is cut
    if adamw.kernel() is None:
        pytest.skip("no C kernel here")
    p, grads, m, v, _ = _state(BF16, F32, F32, False, seed=3)
    whole = [t.clone() for t in (p, m, v)]
    h = adamw.hyper(1e-2, (0.9, 0.95), 1e-8, 0.1, 1)
    adamw.AdamW(1).step(whole[0], grads[0], whole[1], whole[2], h, sr_key=5, offset=0)
    cut = 12_345
    halves = [t.clone() for t in (p, m, v)]
    for a, b in ((0, cut), (cut, N)):
        adamw.AdamW(2).step(halves[0][a:b], grads[0][a:b], halves[1][a:b], halves[2][a:b], h, sr_key=5, offset=a)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(whole, halves))
    fb = [t.clone() for t in (p, m, v)]
    adamw.AdamW(1, use_kernel=False).step(fb[0], grads[0], fb[1], fb[2], h, sr_key=5, offset=0)
    assert torch.equal(_bits(fb[0]), _bits(whole[0]))
    # each weight is one of the two bf16 neighbours of the exact update
    exact = _written_out(p.double(), grads[0], m, v, 1, 1e-2, 0.1, 1.0)[0].float()
    down = exact.to(BF16).float()
    down = torch.where(down > exact, torch.nextafter(down.to(BF16), torch.tensor(-1e30, dtype=BF16)).float(), down)
    up = torch.nextafter(down.to(BF16), torch.tensor(1e30, dtype=BF16)).float()
    got = whole[0].float()
    assert float(((got == down) | (got == up)).float().mean()) > 0.999    # fp32 vs fp64 at a boundary, rarely
    assert int((got == up).sum()) > 1000 and int((got == down).sum()) > 1000


@pytest.mark.parametrize("pdt, mdt, use_kernel", [(F32, F32, True), (F32, BF16, True), (F32, BF16, False)],
                         ids=["torch-fused-fp32", "kernel-bf16-moments", "fallback-bf16-moments"])
def test_any_cut_into_pieces_updates_bit_for_bit_like_the_whole_unit(pdt, mdt, use_kernel):
    """A unit's update does not depend on the slab size, the shard count or the threads: every
    piece starts a whole PIECE_ALIGN after its segment's start, so a vectorised loop's scalar
    tail (torch's fused AdamW rounds it without a fused multiply-add) falls on the same elements
    under any cut. Requests of unaligned slabs (2621 elements: optim.grad_slab_mib=0.01) are
    rounded down. Segments of odd lengths put a tail at each segment's end."""
    from megaray.layout import PIECE_ALIGN, UnitLayout, cut_pieces

    unit = UnitLayout(index=1, name="block.0", kind="block", params=(), numel=8110, decay_numel=7777)
    o = load_config("debug").optim
    g = torch.Generator().manual_seed(11)
    start = (torch.randn(unit.numel, generator=g).to(pdt), (0.1 * torch.randn(unit.numel, generator=g)).to(mdt),
             (0.01 * torch.rand(unit.numel, generator=g)).to(mdt))
    grads = [torch.randn(unit.numel, generator=g) for _ in range(3)]

    def run(slab_numel, threads):
        adam = adamw.AdamW(threads, use_kernel=use_kernel)
        torch.set_num_threads(threads)
        p, m, v = (t.clone() for t in start)
        pieces = cut_pieces([unit], slab_numel)
        for t, grad in enumerate(grads, 1):
            for pc in pieces:
                s = slice(pc.start, pc.stop)
                adamw.update_piece(adam, o, 3, pc, p[s], grad[s], m[s], v[s], 1e-2, t, 0.7)
        return pieces, (p, m, v)

    before = torch.get_num_threads()
    try:
        _, whole = run(1 << 20, 1)
        for slab, threads in ((2621, 1), (1000, 2), (37, 1), (64 * 40, 2)):
            pieces, cut = run(slab, threads)
            assert len(pieces) > 2
            assert all((pc.start - (0 if pc.decay else unit.decay_numel)) % PIECE_ALIGN == 0 for pc in pieces)
            for a, b in zip(whole, cut):
                assert torch.equal(_bits(a), _bits(b)), f"slab {slab}, {threads} threads"
    finally:
        torch.set_num_threads(before)


def test_without_a_compiler_the_fallback_runs_and_says_so_once(tmp_path):
    """A machine with no C compiler on the PATH (and an empty kernel cache): the shard's AdamW
    logs why once and updates with the fallback, equal to the kernel's results."""
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from megaray import adamw\n"
        "p = torch.arange(10, dtype=torch.float32); g = torch.ones(10, dtype=torch.bfloat16)\n"
        "m = torch.zeros(10, dtype=torch.bfloat16); v = torch.zeros(10, dtype=torch.bfloat16)\n"
        "for _ in range(2): a = adamw.AdamW(1)\n"
        "a.step(p, g, m, v, adamw.hyper(1e-2, (0.9, 0.95), 1e-8, 0.1, 1))\n"
        "print('fused', a.fused, 'P', p.tolist())\n")
    env = dict(os.environ, PATH=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "fused False" in r.stdout
    assert r.stderr.count("the fused C AdamW kernel is not available (OSError: no C compiler") == 1
    p = torch.arange(10, dtype=torch.float32)
    adamw.AdamW(1, use_kernel=adamw.kernel() is not None).step(
        p, torch.ones(10, dtype=BF16), torch.zeros(10, dtype=BF16), torch.zeros(10, dtype=BF16),
        adamw.hyper(1e-2, (0.9, 0.95), 1e-8, 0.1, 1))
    assert f"P {p.tolist()}" in r.stdout


def test_the_device_path_is_the_kernels_arithmetic_on_the_cpu():
    """adamw.device_step (resident units with bf16 moments; eagerly off CUDA) against the C
    kernel on the same values, fp32 and bf16 gradients: bit for bit."""
    from megaray.adamw import AdamW, device_step, hyper

    g = torch.Generator().manual_seed(1)
    n = 70_001
    for grad_dtype in (torch.float32, torch.bfloat16):
        master = torch.randn(n, generator=g)
        grad = (torch.randn(n, generator=g) * 1e-2).to(grad_dtype)
        m = (torch.randn(n, generator=g) * 1e-3).bfloat16()
        v = (torch.rand(n, generator=g) * 1e-5).bfloat16()
        h = hyper(1e-3, (0.9, 0.95), 1e-8, 0.1, 5, grad_scale=0.61)
        want = [t.clone() for t in (master, m, v)]
        AdamW(1).step(want[0], grad, want[1], want[2], h)
        assert not torch.equal(want[0], master)
        device_step(master, grad, m, v, h)
        for a, b in zip((master, m, v), want):
            assert torch.equal(a, b)
