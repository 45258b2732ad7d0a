"""Mixtures of experts against transformers' own classes (Qwen3-MoE, Mixtral, OLMoE): the
templates' logits, the load-balancing loss and every parameter's gradient, from a random small
model transformers made and saved as the Hub stores it (each expert's matrices apart).

No Ray here: the templates are pure functions of (weights as views of one flat buffer per
unit, activations); the weights come in through megaray's own Hugging Face reader.
"""
from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hub import (  # noqa: E402
    assert_adam_close,
    megaray_units,
    reference_adamw,
    save_checkpoint,
    train_cfg,
    warnings_of,
)

from megaray.config import ModelConfig  # noqa: E402
from megaray.layout import bind, build_layout  # noqa: E402
from megaray.model import IGNORE_INDEX, block_forward, embed_forward, head_loss_sum, rms_norm, rope_tables  # noqa: E402
from megaray.moe import aux_loss_grad, balance_loss, expert_linear  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
FAMILIES = {   # transformers' config and model classes, and what the family sets
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, norm_topk_prob=True, head_dim=8)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, norm_topk_prob=False, pad_token_id=0,
                                                       eos_token_id=1)),
}


def hf_model(family: str, folder, seed: int = 0, experts: int = 4):
    """A random small fp32 transformers model of ``family``, saved in ``folder`` as the Hub
    stores it. Norm scales and the router are randomised too (transformers starts them at one
    and at zero or a small normal)."""
    conf_name, cls_name, kw = FAMILIES[family]
    kw = {**kw, ("num_local_experts" if family == "mixtral" else "num_experts"): experts}
    cfg = getattr(transformers, conf_name)(**SMALL, **kw)
    torch.manual_seed(seed)
    m = getattr(transformers, cls_name)(cfg).float()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
    m.save_pretrained(folder)
    return m


def hub_view(tensors: dict, name: str, width: int) -> torch.Tensor:
    """What transformers holds (``tensors``: its parameters' values or gradients, by its own
    names) for the Hub's tensor ``name``: the parameter itself, or the slice of the stacked
    experts (``gate_up_proj`` [E, 2 x width, H], gate rows first; ``down_proj`` [E, H, width])
    that the Hub's per-expert tensor is."""
    m = re.fullmatch(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name)
    if m:
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj in ("down_proj", "w2"):
            return tensors[f"{prefix}.mlp.experts.down_proj"][e]
        both = tensors[f"{prefix}.mlp.experts.gate_up_proj"][e]
        return both[:width] if proj in ("gate_proj", "w1") else both[width:]
    return tensors[name.replace("block_sparse_moe.gate", "mlp.gate")]


def hub_state(ref, cfg: ModelConfig, grads: bool = False) -> dict[str, torch.Tensor]:
    """transformers' weights (or their gradients) under the Hub's names, megaray's layout's."""
    tensors = {k: (p.grad if grads else p.detach()) for k, p in ref.named_parameters()}
    return {s.name: hub_view(tensors, s.name, cfg.moe_intermediate_size).clone()
            for u in build_layout(cfg) for s in u.params}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_router_loss_and_gradients_equal_transformers(family, tmp_path):
    ref = hf_model(family, tmp_path)
    cfg, units, flats = megaray_units(tmp_path)
    assert cfg.moe and cfg.num_experts == 4 and cfg.architecture == FAMILIES[family][1]
    assert sum(u.numel for u in units) == cfg.num_params() == sum(p.numel() for p in ref.parameters())
    torch.manual_seed(1)
    inp = torch.randint(0, cfg.vocab_size, (2, 10))
    tgt = torch.cat([inp[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)   # transformers' shift of labels=inp

    out = ref(input_ids=inp, labels=inp, output_router_logits=True)
    w = [bind(f, u) for u, f in zip(units, flats)]
    x, routed = embed_forward(w[0], inp, cfg), []
    rope = rope_tables(cfg, inp.shape[1])
    for i in range(cfg.num_hidden_layers):
        x = block_forward(w[i + 1], x, rope, cfg, routed=routed)
    logits = torch.nn.functional.linear(rms_norm(x, w[-1]["model.norm.weight"], cfg.rms_norm_eps),
                                        w[-1]["lm_head.weight"])
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)

    # the load-balancing loss over every layer's tokens, as transformers computes it
    counts, probs = sum(r.counts for r in routed), sum(r.prob_sum for r in routed)
    rows = sum(r.rows for r in routed)
    assert rows == cfg.num_hidden_layers * inp.numel() and counts.sum() == rows * cfg.num_experts_per_tok
    aux = cfg.router_aux_loss_coef * balance_loss(cfg, counts, probs.detach(), rows)
    assert aux == pytest.approx(cfg.router_aux_loss_coef * float(out.aux_loss), rel=1e-5)

    # every gradient of (mean cross-entropy + coef x aux); the aux term enters through each
    # layer's probability sums, as the worker feeds it (aux_loss_grad)
    ce_sum, n = head_loss_sum(w[-1], w[0], x.reshape(-1, cfg.hidden_size), tgt.reshape(-1), cfg)
    torch.testing.assert_close(ce_sum / n + aux, out.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    g_aux = aux_loss_grad(cfg, counts, rows)
    grads = torch.autograd.grad([ce_sum / n] + [r.prob_sum for r in routed], flats,
                                [torch.ones(())] + [g_aux] * len(routed))
    want = hub_state(ref, cfg, grads=True)
    for u, g in zip(units, grads):
        for s in u.params:
            torch.testing.assert_close(g[s.offset:s.offset + s.numel].view(s.shape), want[s.name], rtol=1e-4,
                                       atol=1e-6, msg=lambda m, name=s.name: f"{family} {name}: {m}")


def test_an_expert_without_tokens_gets_a_zero_gradient():
    """Dropless routing sorts the tokens by expert; an expert no token chose is an empty group:
    its matrices get exactly zero gradient (the grouped product and the loop alike)."""
    torch.manual_seed(0)
    x = torch.randn(7, 16, requires_grad=True)
    w = torch.randn(3, 8, 16, requires_grad=True)
    counts = [4, 0, 3]
    offs = torch.tensor([4, 4, 7], dtype=torch.int32)
    y = expert_linear(x, w, offs, counts)
    ref = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    torch.testing.assert_close(y, ref)
    gx, gw = torch.autograd.grad(y, [x, w], torch.ones_like(y))
    assert torch.equal(gw[1], torch.zeros_like(gw[1])) and gw[0].abs().sum() > 0 and gw[2].abs().sum() > 0


def test_moe_shapes_count_total_and_active_parameters():
    """The registry's mixtures by hand: OLMoE-1B-7B 6.92B (1.28B active), Qwen3-30B-A3B 30.5B
    (3.35B active), Mixtral-8x7B 46.7B (12.9B active)."""
    for shape, total, active in (("olmoe7b", 6_919_161_856, 1_282_017_280),
                                 ("qwen3moe30b", 30_532_122_624, 3_353_032_704),
                                 ("mixtral8x7b", 46_702_792_704, 12_879_925_248)):
        cfg = ModelConfig.from_shape(shape)
        assert (cfg.num_params(), cfg.active_params()) == (total, active)
        assert sum(u.numel for u in build_layout(cfg)) == total
    h, i, e, k = 2048, 1024, 64, 8          # OLMoE by hand: attention, q/k norms over the projections, experts
    attn = 4 * h * h + 2 * h
    block = attn + e * h + e * 3 * h * i + 2 * h
    assert ModelConfig.from_shape("olmoe7b").num_params() == 50304 * h * 2 + h + 16 * block
    assert ModelConfig.from_shape("olmoe7b").active_params() == 50304 * h * 2 + h + 16 * (block - (e - k) * 3 * h * i)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_through_the_actors_equals_transformers_and_adamw(ray_cluster, tmp_path, family):
    """load -> train -> export for each family, against transformers with torch's AdamW:
    three steps of megaray (two micro-batches of one row a step: accumulation) equal three
    steps of transformers on the whole two-row batch (mean cross-entropy plus the weighted
    load-balancing loss over all of the step's tokens); the export reloads in transformers
    with no warning, every tensor as megaray holds it, with megaray's logits."""
    import importlib

    import numpy as np

    from megaray.driver.session import TrainingSession
    from megaray.hf.export import export_checkpoint

    ref = hf_model(family, tmp_path / "hf", seed=3)
    lr, wd, steps = 3e-3, 0.1, 3
    cfg = train_cfg(tmp_path / "hf", lr, wd, steps, keep_gradients=True)
    rng = np.random.default_rng(4)
    batches = [rng.integers(0, cfg.model.vocab_size, (2, 1, 13)) for _ in range(steps)]

    opt = reference_adamw(ref, cfg, lr, wd)
    lb = importlib.import_module(type(ref).__module__).load_balancing_loss_func   # transformers' own
    with TrainingSession(cfg) as s:
        for step, b in enumerate(batches):
            m = s.train_step(step, b)
            tok = torch.from_numpy(b.reshape(2, 13))
            out = ref(input_ids=tok[:, :-1], output_router_logits=True)
            ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.model.vocab_size), tok[:, 1:].reshape(-1))
            aux = lb(out.router_logits, cfg.model.num_experts, cfg.model.num_experts_per_tok)
            loss = ce + cfg.model.router_aux_loss_coef * aux
            assert m["loss"] == pytest.approx(float(ce), rel=1e-5)
            assert m["router_loss"] == pytest.approx(float(aux), rel=1e-5)
            assert m["expert_load_max"] >= m["expert_load_mean"] >= 1.0
            opt.zero_grad()
            loss.backward()
            opt.step()
        weights = s.state_dict()
        logits = s.logits(batches[0].reshape(2, 13)[:, :-1])
        folder = save_checkpoint(s, cfg, tmp_path / "ckpt", steps)
    assert_adam_close(weights, hub_state(ref, cfg.model), lr)
    export_checkpoint(folder, tmp_path / "export")
    with warnings_of("transformers") as said:
        back = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert not said, said
    for name, t in hub_state(back, cfg.model).items():
        assert torch.equal(t, torch.from_numpy(weights[name])), name
    torch.testing.assert_close(back(torch.from_numpy(batches[0].reshape(2, 13)[:, :-1])).logits,
                               torch.from_numpy(logits), rtol=1e-5, atol=1e-5)


def test_an_expert_no_token_reaches_gets_no_gradient_and_still_decays(ray_cluster, tmp_path):
    """Block 0's router sees the normed input's first coordinate alone, h0: experts 0 and 2 lead
    where h0 > 0, experts 1 and 3 where h0 < 0, and expert 4 (logit 0) is never in a token's
    top two. Its matrices get exactly zero gradient every step, and the optimizer shards decay
    them as AdamW decays a parameter without gradient: p x (1 - lr x wd) a step, nothing else."""
    from megaray.driver.session import TrainingSession

    ref = hf_model("qwen3_moe", tmp_path / "hf", seed=5, experts=5)
    with torch.no_grad():
        block = ref.model.layers[0]
        block.post_attention_layernorm.weight.zero_()[0] = 1.0
        block.mlp.gate.weight.zero_()[:4, 0] = torch.tensor([5.0, -5.0, 4.0, -4.0])
    ref.save_pretrained(tmp_path / "hf")
    lr, wd = 1e-2, 0.1
    cfg = train_cfg(tmp_path / "hf", lr, wd, 2, keep_gradients=True)
    unused = [f"model.layers.0.mlp.experts.4.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    before = hub_state(ref, cfg.model)
    rng = torch.Generator().manual_seed(0)
    with TrainingSession(cfg) as s:
        for step in range(2):
            m = s.train_step(step, torch.randint(0, cfg.model.vocab_size, (2, 1, 13), generator=rng).numpy())
            grads = s.gradients()
            assert all(not grads[n].any() for n in unused), step
            assert m["expert_load_max"] > 1.5                 # four experts share block 0's tokens
        weights = s.state_dict()
    for n in unused:
        expect = before[n] * (1 - lr * wd) * (1 - lr * wd)    # in fp32, as the shards multiply
        torch.testing.assert_close(torch.from_numpy(weights[n]), expect, rtol=1e-6, atol=0)
        assert not torch.equal(torch.from_numpy(weights[n]), before[n])
