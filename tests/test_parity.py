"""megaray against an independent plain-PyTorch reference, trained step by step.

Both start from the same weights and see the same data; the reference is an ordinary
nn.Module (tests/reference.py) trained with torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_ on the whole step's batch at once, while megaray streams
layers through its worker, accumulates over 3 micro-batches and updates with 2 optimizer
shards. Every step's loss and the final weights must agree to fp32 rounding.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference import RefLlama

from megaray.driver.session import TrainingSession
from megaray.loader import build_config

STEPS = 6
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 2


def ref_lr(step: int) -> float:
    # Hand-written: linear warmup to LR over WARMUP steps, then cosine to MIN_LR at the last step.
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    p = (step - WARMUP) / (STEPS - 1 - WARMUP)
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * p))


def run_pair(model_overrides: dict, clip: float, keep: int, optim: dict):
    model = {"shape": "debug", **model_overrides}
    cfg = build_config({
        "model": model,
        "train": {"steps": STEPS, "micro_batch_size": 2, "grad_accum": 3, "seq_len": 16,
                  "compute_dtype": "float32", "loss_chunk_tokens": 10},
        "optim": {"lr": LR, "min_lr": MIN_LR, "warmup_steps": WARMUP, "schedule": "cosine",
                  "weight_decay": 0.1, "clip_grad_norm": clip, "num_shards": 2, "betas": [0.9, 0.95], **optim},
        "data": {"max_bytes": 20000},
        "worker": {"keep_activations": keep},
    })
    c = {k: getattr(cfg.model, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                             "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "rms_norm_eps", "rope_theta",
                                             "tie_word_embeddings", "attention_bias", "qk_norm")}
    rng = np.random.default_rng(7)
    batches = [rng.integers(0, c["vocab_size"], size=(3, 2, 17)) for _ in range(STEPS)]

    ours_losses, coefs, kept = [], [], set()
    with TrainingSession(cfg) as s:
        init = s.state_dict()
        for step in range(STEPS):
            m = s.train_step(step, batches[step])
            ours_losses.append(m["loss"])
            coefs.append(m["clip_coefficient"])
            kept.add(m["worker/kept_blocks"])
        final = s.state_dict()

    ref = RefLlama(c)
    ref.load_state_dict({k: torch.tensor(v) for k, v in init.items()}, strict=True)
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    no_decay = [p for p in ref.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95), eps=1e-8)
    ref_losses = []
    for step in range(STEPS):
        tok = torch.from_numpy(batches[step]).reshape(6, 17)
        logits = ref(tok[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c["vocab_size"]), tok[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        for g in opt.param_groups:
            g["lr"] = ref_lr(step)
        opt.step()
        ref_losses.append(loss.item())
    ref_final = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    assert kept == {keep}, kept
    return ours_losses, ref_losses, coefs, init, final, ref_final


# Gradient slabs of 4096 fp32 cut the embedding and every block into several pieces; a ring
# of one slab makes every piece wait for the one before it to be applied.
SMALL_RING = {"grad_slab_mib": 4096 * 4 / 2**20, "grad_ring_slabs": 1, "num_shards": 3, "shard_layout": "contiguous"}


@pytest.mark.parametrize("overrides, keep, optim", [
    ({}, 0, SMALL_RING),                                            # Llama, tied, all recomputed
    ({}, 1, {}),                                                    # the last block kept resident
    ({"tie_word_embeddings": False, "attention_bias": True, "qk_norm": True}, 2,
     {"grad_slab_mib": 4096 * 4 / 2**20, "grad_ring_slabs": 3}),   # Qwen2/3 features
], ids=["llama-tied-recompute-ring1", "llama-tied-keep1", "untied-bias-qknorm-keepall-ring3"])
def test_training_matches_reference(ray_cluster, overrides, keep, optim):
    ours, ref, coefs, init, final, ref_final = run_pair(overrides, clip=0.5, keep=keep, optim=optim)
    assert min(coefs) < 0.9, f"clipping never clipped: {coefs}"
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(ours, ref))
    assert loss_err < 1e-5, (ours, ref)
    assert set(final) == set(ref_final)
    weight_err, elem_err = 0.0, 0.0
    for k in ref_final:
        moved = np.abs(ref_final[k] - init[k]).max()
        assert moved > 1e-4, f"{k} did not train"
        diff = (final[k] - ref_final[k]).astype(np.float64)
        weight_err = max(weight_err, np.linalg.norm(diff) / np.linalg.norm(ref_final[k]))
        elem_err = max(elem_err, np.abs(diff).max())
    print(f"parity {overrides} keep={keep}: max loss rel err {loss_err:.2e}, max weight rel err (per-tensor norm) "
          f"{weight_err:.2e}, largest element difference {elem_err:.2e} (lr {LR})")
    assert weight_err < 1e-5
    # Adam turns rounding-level gradients into lr-sized steps; no element may be off by
    # more than a small fraction of one step.
    assert elem_err < 0.05 * LR


def test_cast_on_the_device_equals_the_host_copy(ray_cluster):
    """bf16 compute with the compute copy made by the optimizer shards in shared memory, and
    with none (``optim.compute_copy=device``: the worker streams the fp32 master and casts
    it itself): both casts round to nearest, so the runs are the same bit for bit. The
    second run's store holds no compute-copy file."""
    from conftest import shm_files

    rng = np.random.default_rng(2)
    batches = [rng.integers(0, 256, (3, 2, 17)) for _ in range(3)]
    out = {}
    for where in ("host", "device"):
        cfg = build_config({"model": {"shape": "debug"},
                            "train": {"steps": 3, "grad_accum": 3, "micro_batch_size": 2, "seq_len": 16,
                                      "compute_dtype": "bfloat16"},
                            "optim": {"compute_copy": where, "grad_slab_mib": 4096 * 4 / 2**20, "num_shards": 2},
                            "worker": {"device": "cpu"}, "cluster": {"num_cpus": 6}})
        assert cfg.host_compute_copy == (where == "host")
        with TrainingSession(cfg) as s:
            files = shm_files(s.handles.run_id)
            assert any(f.endswith("_compute") for f in files) == (where == "host"), files
            losses = [s.train_step(i, b)["loss"] for i, b in enumerate(batches)]
            out[where] = (losses, s.state_dict())
    assert out["host"][0] == out["device"][0]
    for k, v in out["host"][1].items():
        np.testing.assert_array_equal(out["device"][1][k], v, err_msg=k)


def test_compute_copy_auto_by_tokens_per_worker():
    def cfg(tokens, count=1, node="local", dtype="bfloat16"):
        return build_config({"train": {"micro_batch_size": 1, "seq_len": 1024, "grad_accum": tokens // 1024,
                                        "compute_dtype": dtype},
                             "worker": {"count": count, "node": node}})
    assert cfg(32768).host_compute_copy is False        # 32k tokens a worker or more: cast on the device
    assert cfg(16384).host_compute_copy is True
    assert cfg(65536).host_compute_copy is False
    assert cfg(65536, count=4).host_compute_copy is True          # 16k tokens each
    assert cfg(65536, node="remote").host_compute_copy is True
    assert cfg(65536, dtype="float32").host_compute_copy is False  # the master is the compute copy
