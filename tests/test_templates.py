"""Layer templates against independent reference modules: outputs and every gradient.

No Ray here: the templates are pure functions of (weights as views of one flat buffer,
activations), and the reference is tests/reference.py.
"""
from __future__ import annotations

import math

import pytest
import torch
from reference import RefBlock, RefLlama

from megaray import model
from megaray.config import ModelConfig
from megaray.layout import bind, build_layout, short_name
from megaray.model import block_forward, embed_forward, flops_per_step, head_loss_sum, init_unit, rope_tables

CASES = {
    "llama-gqa": dict(shape="debug"),
    "qwen2-bias": dict(shape="debug", attention_bias=True, num_key_value_heads=4),
    "qwen3-qknorm-untied": dict(shape="debug", qk_norm=True, tie_word_embeddings=False),
}


def _cfg(shape: str, **kw) -> ModelConfig:
    return ModelConfig.from_shape(shape, **kw)


def _ref_cfg(c: ModelConfig) -> dict:
    return {k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                       "rope_theta", "tie_word_embeddings", "attention_bias", "qk_norm")}


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "plain"])
@pytest.mark.parametrize("case", list(CASES))
def test_block_template_matches_reference(case, lean):
    torch.manual_seed(0)
    cfg = _cfg(**CASES[case])
    unit = build_layout(cfg)[1]
    ref = RefBlock(_ref_cfg(cfg)).double()
    for p in ref.parameters():                     # non-trivial norm scales and biases too
        p.data.normal_(0.0, 0.3 if p.ndim == 1 else 0.1)
        if p.ndim == 1:
            p.data += 1.0
    flat = torch.zeros(unit.numel, dtype=torch.float64)
    sd = ref.state_dict()
    for s in unit.params:
        flat[s.offset:s.offset + s.numel] = sd[short_name(s.name)].reshape(-1)
    flat.requires_grad_()
    x = torch.randn(3, 11, cfg.hidden_size, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    rope = rope_tables(cfg, 11, dtype=torch.float64)
    y = block_forward(bind(flat, unit), x1, rope, cfg, lean=lean)
    y_ref = ref(x2)
    # both sides build rotary angles in fp32 (as HF does), so agreement is to fp32 rounding
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    dy = torch.randn_like(y)
    g_flat, g_x = torch.autograd.grad(y, [flat, x1], dy)
    y_ref.backward(dy)
    torch.testing.assert_close(g_x, x2.grad, rtol=1e-5, atol=1e-6)
    grads = dict(ref.named_parameters())
    for s in unit.params:
        torch.testing.assert_close(g_flat[s.offset:s.offset + s.numel].view(s.shape),
                                   grads[short_name(s.name)].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=s.name: f"{n}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_lean_block_in_bf16_equals_plain_autograd(case):
    """The lean block (norms fused with their projections, SwiGLU rebuilt in backward) runs
    the same forward arithmetic as plain autograd and the same backward formulas: in bf16 the
    output is identical and the gradients agree to bf16 rounding of the sums' order."""
    torch.manual_seed(1)
    cfg = _cfg(**CASES[case])
    unit = build_layout(cfg)[1]
    flat = (init_unit(unit, cfg, seed=5) + 0.05 * torch.randn(unit.numel)).to(torch.bfloat16)
    rope = rope_tables(cfg, 16)
    x = torch.randn(2, 16, cfg.hidden_size).to(torch.bfloat16)
    dy = torch.randn(2, 16, cfg.hidden_size).to(torch.bfloat16)
    out = {}
    for lean in (True, False):
        f, xi = flat.clone().requires_grad_(), x.clone().requires_grad_()
        y = block_forward(bind(f, unit), xi, rope, cfg, lean=lean)
        out[lean] = (y,) + torch.autograd.grad(y, [f, xi], dy)
    assert torch.equal(out[True][0], out[False][0])
    for a, b in zip(out[True][1:], out[False][1:]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        assert (a.float() - b.float()).abs().mean() < 2e-3 * b.float().abs().mean() + 1e-6


@pytest.mark.parametrize("case", list(CASES))
def test_whole_model_chunked_loss_matches_reference(case):
    """Embedding -> blocks -> chunked head loss equals the reference's full-logit loss."""
    cfg = _cfg(**CASES[case])
    units = build_layout(cfg)
    flats = [init_unit(u, cfg, seed=3).double().requires_grad_() for u in units]
    ref = RefLlama(_ref_cfg(cfg)).double()
    state = {}
    for u, f in zip(units, flats):
        for s in u.params:
            state[s.name] = f.detach()[s.offset:s.offset + s.numel].view(s.shape)
    ref.load_state_dict(state, strict=True)
    tok = torch.randint(0, cfg.vocab_size, (2, 13))
    inp, tgt = tok[:, :-1], tok[:, 1:]
    rope = rope_tables(cfg, 12, dtype=torch.float64)
    w = [bind(f, u) for u, f in zip(units, flats)]
    x = embed_forward(w[0], inp, cfg)
    for i in range(cfg.num_hidden_layers):
        x = block_forward(w[i + 1], x, rope, cfg)
    xf, tf = x.reshape(-1, cfg.hidden_size), tgt.reshape(-1)
    total, count = 0.0, 0
    for c in range(0, xf.shape[0], 5):             # chunks of 5 tokens, uneven last chunk
        ls, n = head_loss_sum(w[-1], w[0], xf[c:c + 5], tf[c:c + 5], cfg)
        total, count = total + ls, count + int(n)
    loss = total / count
    logits = ref(inp)
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(), tf)
    torch.testing.assert_close(loss.float(), ref_loss, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref_loss.backward()
    named = dict(ref.named_parameters())
    for u, f in zip(units, flats):
        for s in u.params:
            torch.testing.assert_close(f.grad[s.offset:s.offset + s.numel].view(s.shape).float(),
                                       named[s.name].grad.float(), rtol=1e-5, atol=1e-7)


def test_layout_puts_matrices_first_and_counts_params():
    cfg = _cfg(shape="debug", attention_bias=True, qk_norm=True, tie_word_embeddings=False)
    units = build_layout(cfg)
    assert [u.name for u in units] == ["embed", "block.0", "block.1", "head"]
    for u in units:
        kinds = [s.decay for s in u.params]
        assert kinds == sorted(kinds, reverse=True)
        assert sum(s.numel for s in u.params if s.decay) == u.decay_numel
    assert sum(u.numel for u in units) == cfg.num_params()
    # hand count for the debug shape, untied, with biases and qk norms
    h, i, hd = 32, 64, 8
    block = 2 * h + h * 32 + 2 * h * 16 + 32 * h + 3 * h * i + (32 + 16 + 16) + 2 * hd
    assert cfg.num_params() == 256 * h + 2 * block + h + 256 * h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_initialising_on_threads_gives_the_one_thread_values(dtype):
    """The store initialises a parameter a thread: the values must not depend on the threads,
    the order or the buffer's dtype (a bf16 master holds the fp32 values rounded)."""
    cfg = _cfg(shape="debug", attention_bias=True, qk_norm=True, tie_word_embeddings=False)
    units = build_layout(cfg)
    expect = torch.cat([init_unit(u, cfg, seed=11) for u in units]).to(dtype)
    for threads in (1, 5):
        out = torch.full((sum(u.numel for u in units),), float("nan"), dtype=dtype)
        at, jobs = 0, []
        for u in units:
            jobs += [(s, out[at + s.offset:at + s.offset + s.numel]) for s in u.params]
            at += u.numel
        model.init_params(jobs, cfg, seed=11, threads=threads)
        assert torch.equal(out, expect)
    # what the values are: N(0, initializer_range) for matrices, ones for norms, zeros for biases
    for u in units:
        flat = init_unit(u, cfg, seed=11)
        for s in u.params:
            v = flat[s.offset:s.offset + s.numel]
            if s.decay:
                assert abs(v.std().item() - cfg.initializer_range) < 0.1 * cfg.initializer_range, s.name
            else:
                assert torch.equal(v, torch.zeros_like(v) if s.name.endswith("bias") else torch.ones_like(v)), s.name


def test_llama3_rope_scaling_matches_hand_computed_frequencies():
    cfg = _cfg(shape="llama1b")
    cos, sin = rope_tables(cfg, 2)
    hd = cfg.head_dim
    inv = [1.0 / 500000.0 ** (2 * j / hd) for j in range(hd // 2)]
    for j, f in enumerate(inv):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want = f
        elif wavelen > 8192 / 1.0:
            want = f / 32.0
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * f / 32.0 + smooth * f
        assert math.isclose(math.atan2(float(sin[1, j]), float(cos[1, j])), want, rel_tol=1e-5, abs_tol=1e-9)


def test_flops_formula_matches_design_md():
    cfg = _cfg(shape="debug")
    n = cfg.num_params()
    assert flops_per_step(cfg, 1000, 100) == 6 * n * 1000 + 6 * 2 * 32 * 100 * 1000


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["llama-gqa", "qwen3-qknorm-untied"])
def test_the_loss_gradient_formed_directly_equals_autograds(case, dtype, monkeypatch):
    """head_loss_and_grads (the worker's head) against autograd through head_loss_sum's
    cross-entropy: loss and every input's gradient, with ignored targets, several row blocks
    and an uneven last one."""
    monkeypatch.setattr(model, "LOSS_ROWS", 4)
    torch.manual_seed(0)
    cfg = _cfg(**CASES[case])
    units = build_layout(cfg)
    head, emb = (init_unit(u, cfg, seed=5).to(dtype).requires_grad_() for u in (units[-1], units[0]))
    x = torch.randn(11, cfg.hidden_size, dtype=dtype).requires_grad_()
    t = torch.randint(0, cfg.vocab_size, (11,))
    t[[2, 7]] = model.IGNORE_INDEX
    wh, we = bind(head, units[-1]), bind(emb, units[0])
    ins = [head, x] + ([emb] if cfg.tie_word_embeddings else [])
    loss, got = model.head_loss_and_grads(wh, we, x, t, cfg, 0.3, ins)
    # autograd's cross-entropy on logits in fp32 (fp64 for fp64 weights), as head_loss_sum
    h = model.rms_norm(x, wh["model.norm.weight"], cfg.rms_norm_eps)
    out = we["model.embed_tokens.weight"] if cfg.tie_word_embeddings else wh["lm_head.weight"]
    logits = torch.nn.functional.linear(h, out).to(torch.promote_types(dtype, torch.float32))
    ref = torch.nn.functional.cross_entropy(logits, t, ignore_index=model.IGNORE_INDEX, reduction="sum")
    want = torch.autograd.grad(ref * 0.3, ins)
    rtol, atol = {torch.float64: (1e-12, 1e-14), torch.float32: (1e-5, 1e-7), torch.bfloat16: (2e-2, 1e-3)}[dtype]
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.double(), w.double(), rtol=rtol, atol=atol * float(w.abs().max()))
