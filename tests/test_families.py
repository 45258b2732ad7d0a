"""The dense families beyond Llama's (issue 46) against transformers' own classes: OLMo 2
(norms on attention's and the MLP's outputs, q/k norms over the whole projections), Phi-3
(fused matrices, partial rotary, LongRoPE) and Gemma 3 (sliding windows, four (1 + w) norms). A random
small model transformers made and saved as the Hub stores it is read by megaray's reader; the
templates' logits and every parameter's gradient equal transformers' to fp32 rounding, and a
few steps through the actors equal transformers with torch's AdamW, then export and reload.
"""
from __future__ import annotations

import numpy as np
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

from megaray.layout import bind  # noqa: E402
from megaray.model import (  # noqa: E402
    IGNORE_INDEX,
    Ropes,
    block_forward,
    embed_forward,
    head_loss_sum,
    norm,
)

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5, short_factor=[1.0, 1.3],
                long_factor=[2.0, 3.5])
FAMILIES = {   # transformers' config and model classes, what the family sets, what megaray reads from it
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=1, eos_token_id=2, rope_theta=50000.0),
              dict(norm_placement="post", qk_norm=True, qk_norm_scope="projection")),
    # Phi-3's fused q/k/v and gate/up, a partial rotary (half of each head) with LongRoPE: rows
    # longer than the original 8 positions take the long factors, and cos and sin are scaled
    # by sqrt(1 + ln(32 / 8) / ln 8)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=1, eos_token_id=2, max_position_embeddings=32,
                                                   original_max_position_embeddings=8, rope_parameters=LONGROPE),
             dict(partial_rotary_factor=0.5, rotary_dim=4)),
    # Gemma 3: a window of 4 tokens on block 0 (rows of 6 and 10 are longer), full attention on
    # block 1 with linear RoPE scaling, each kind its own base; four (1 + w) norms a block, q/k
    # norms, GELU-tanh, the embedding times sqrt(32), scores scaled by 12^-1/2, tied
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=8, query_pre_attn_scalar=12, sliding_window=4, pad_token_id=0, eos_token_id=1,
                    bos_token_id=2, max_position_embeddings=32, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
               dict(norm_placement="sandwich", norm_offset=1.0, scale_embeddings=True, hidden_act="gelu_pytorch_tanh",
                    query_pre_attn_scalar=12.0, sliding_window=4, rope_local_theta=1000.0, rope_theta=100000.0,
                    rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True,
                    layer_types=["sliding_attention", "full_attention"])),
}


def megaray_logits(w: list, tokens: torch.Tensor, cfg) -> torch.Tensor:
    """The templates' logits of ``tokens`` [b, s]: every block with its own rotary tables and
    window, the final norm, the head (the embedding where tied)."""
    x = embed_forward(w[0], tokens, cfg)
    ropes = Ropes(cfg, tokens.shape[1])
    for i in range(cfg.num_hidden_layers):
        x = block_forward(w[i + 1], x, ropes, cfg, layer=i)
    out = w[0]["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w[-1]["lm_head.weight"]
    return x, torch.nn.functional.linear(norm(x, w[-1]["model.norm.weight"], cfg), out)


def hf_model(family: str, folder, seed: int = 0):
    """A random small fp32 transformers model of ``family`` saved in ``folder``; its norm scales
    randomised too (transformers starts them at one)."""
    conf_name, cls_name, kw, _ = FAMILIES[family]
    cfg = getattr(transformers, conf_name)(**SMALL, **kw)
    torch.manual_seed(seed)
    m = getattr(transformers, cls_name)(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    m.save_pretrained(folder)
    return m


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_gradients_equal_transformers(family, tmp_path):
    ref = hf_model(family, tmp_path)
    cfg, units, flats = megaray_units(tmp_path)
    assert cfg.architecture == FAMILIES[family][1]
    assert {k: getattr(cfg, k) for k in FAMILIES[family][3]} == FAMILIES[family][3]
    assert sum(u.numel for u in units) == cfg.num_params() == sum(p.numel() for p in ref.parameters())
    torch.manual_seed(1)
    w = [bind(f, u) for u, f in zip(units, flats)]
    with torch.no_grad():                    # a row within the original length too (LongRoPE's short factors)
        short = torch.randint(0, cfg.vocab_size, (2, 6))
        torch.testing.assert_close(megaray_logits(w, short, cfg)[1], ref(input_ids=short).logits,
                                   rtol=1e-5, atol=1e-5)
    inp = torch.randint(0, cfg.vocab_size, (2, 10))
    tgt = torch.cat([inp[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)   # transformers' shift of labels=inp
    out = ref(input_ids=inp, labels=inp)
    x, logits = megaray_logits(w, inp, cfg)
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    ce_sum, n = head_loss_sum(w[-1], w[0], x.reshape(-1, cfg.hidden_size), tgt.reshape(-1), cfg)
    torch.testing.assert_close(ce_sum / n, out.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    grads = torch.autograd.grad(ce_sum / n, flats)
    want = {name: p.grad for name, p in ref.named_parameters()}
    for u, g in zip(units, grads):
        for s in u.params:
            torch.testing.assert_close(g[s.offset:s.offset + s.numel].view(s.shape), want[s.name], rtol=1e-4,
                                       atol=1e-6, msg=lambda m, name=s.name: f"{family} {name}: {m}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_through_the_actors_equals_transformers_and_adamw(ray_cluster, tmp_path, family):
    """load -> train -> export: three steps of megaray (two micro-batches of one row a step)
    equal three of transformers with torch's AdamW on the whole two-row batch; the export
    reloads in transformers with no warning, every tensor as megaray holds it, with megaray's
    logits."""
    from megaray.driver.session import TrainingSession
    from megaray.hf.export import export_checkpoint

    ref = hf_model(family, tmp_path / "hf", seed=3)
    lr, wd, steps = 3e-3, 0.1, 3
    cfg = train_cfg(tmp_path / "hf", lr, wd, steps)
    rng = np.random.default_rng(4)
    batches = [rng.integers(0, cfg.model.vocab_size, (2, 1, 13)) for _ in range(steps)]
    opt = reference_adamw(ref, cfg, lr, wd)
    with TrainingSession(cfg) as s:
        for step, b in enumerate(batches):
            m = s.train_step(step, b)
            tok = torch.from_numpy(b.reshape(2, 13))
            logits = ref(input_ids=tok[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.model.vocab_size), tok[:, 1:].reshape(-1))
            assert m["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
            opt.zero_grad()
            loss.backward()
            opt.step()
        weights = s.state_dict()
        ours = s.logits(batches[0].reshape(2, 13)[:, :-1])
        folder = save_checkpoint(s, cfg, tmp_path / "ckpt", steps)
    assert_adam_close(weights, ref.state_dict(), lr)
    export_checkpoint(folder, tmp_path / "export")
    with warnings_of("transformers") as said:
        back = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert not said, said
    for name, t in back.state_dict().items():
        held = "model.embed_tokens.weight" if name == "lm_head.weight" and cfg.model.tie_word_embeddings else name
        assert torch.equal(t, torch.from_numpy(weights[held])), name
    torch.testing.assert_close(back(torch.from_numpy(batches[0].reshape(2, 13)[:, :-1])).logits,
                               torch.from_numpy(ours.copy()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["olmo2", "gemma3"])
def test_the_memory_model_counts_what_a_post_norm_block_saves(tmp_path, family):
    """OLMo 2's and Gemma 3's blocks run as plain autograd whether or not the worker asks for a
    lean one: the plan counts them so, within 10% of what autograd holds for a block's backward
    (measured here with saved-tensor hooks, storage by storage, the block's input and weights
    apart; Gemma's full-attention block, whose attention on the CPU saves what flash attention
    saves on the GPU)."""
    from megaray.memory import block_internal_bytes_per_token

    hf_model(family, tmp_path)
    cfg, units, flats = megaray_units(tmp_path)
    layer = 1
    w = bind(flats[1 + layer].detach().requires_grad_(), units[1 + layer])
    x = torch.randn(1, 64, cfg.hidden_size, requires_grad=True)
    rope = Ropes(cfg, 64)
    skip = {x.untyped_storage().data_ptr()} | {t.untyped_storage().data_ptr() for t in w.values()}
    seen: dict[int, int] = {}

    def pack(t):
        p = t.untyped_storage().data_ptr()
        if p not in skip:
            seen[p] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block_forward(w, x, rope, cfg, lean=True, layer=layer)
    per_token = sum(seen.values()) / 64
    counted = block_internal_bytes_per_token(cfg, 4, lean=True)
    assert counted == block_internal_bytes_per_token(cfg, 4, lean=False)
    assert abs(counted - per_token) <= 0.1 * per_token, (counted, per_token)


def test_the_hubs_multimodal_gemma3_folder_is_read_for_its_text_model(tmp_path):
    """The Hub's Gemma 3 4B-27B folders are Gemma3ForConditionalGeneration: a sparse text_config
    (transformers' defaults left out) and the text model's tensors under language_model.model.
    (transformers 4's files) or model.language_model. (5's), beside a vision tower. megaray
    reads the text model: the same config and weights, so the same logits, as the text-only
    folder; the vision tower's tensors are left out."""
    import json

    from safetensors.torch import load_file, save_file

    ref = hf_model("gemma3", tmp_path / "text")
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    tensors = load_file(tmp_path / "text" / "model.safetensors")
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar",
            "max_position_embeddings", "rms_norm_eps")
    for prefix in ("language_model.model.", "model.language_model."):
        folder = tmp_path / prefix.replace(".", "_")
        folder.mkdir()
        vision = "vision_tower.vision_model.embeddings.patch_embedding.weight"
        save_file({**{prefix + k.split(".", 1)[1]: v for k, v in tensors.items()},
                   ("model." if prefix.startswith("model.") else "") + vision: torch.zeros(4, 3, 2, 2)},
                  folder / "model.safetensors")
        text_config = {"model_type": "gemma3_text", **{k: text[k] for k in keep}}
        if prefix.startswith("language_model"):       # transformers 4's keys, as the Hub's files have them
            for k in ("layer_types", "rope_parameters"):
                del text_config[k]
            text_config.update(sliding_window_pattern=2, rope_theta=100000.0, rope_local_base_freq=1000.0,
                               rope_scaling={"factor": 2.0, "rope_type": "linear"})
        (folder / "config.json").write_text(json.dumps({
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text_config,
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}}))
        cfg, units, flats = megaray_units(folder)
        assert cfg.architecture == "Gemma3ForCausalLM" and cfg.norm_offset == 1.0 and cfg.scale_embeddings
        w = [bind(f, u) for u, f in zip(units, flats)]
        tok = torch.randint(0, cfg.vocab_size, (1, 9))
        with torch.no_grad():
            torch.testing.assert_close(megaray_logits(w, tok, cfg)[1], ref(input_ids=tok).logits, rtol=1e-5, atol=1e-5)
