"""Data-parallel workers on the CPU: two real GpuWorker actors (computing on the CPU) joined
by a gloo process group share one parameter store and must give what one worker gives with
the whole batch: the same losses, gradients and weights, to fp32 rounding."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import shm_files

from megaray.driver.session import TrainingSession
from megaray.errors import ConfigError
from megaray.loader import load_config
from megaray.step import Batch


def _train(workers: int, steps: int = 3, masked: bool = False, extra: tuple = ()):
    cfg = load_config("debug", [f"worker.count={workers}", "worker.device=cpu", "train.grad_accum=4",
                                "train.micro_batch_size=2", "optim.num_shards=1", "debug.keep_gradients=true",
                                "optim.grad_slab_mib=0.015625", *extra])
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        toks = rng.integers(0, 256, (4, 2, 33))
        if masked:      # uneven loss masks: the workers' shares hold different numbers of targets
            mask = (rng.random((4, 2, 33)) < 0.3 + 0.6 * (np.arange(4) >= 2)[:, None, None]).astype(np.uint8)
            toks = Batch(toks, loss_mask=mask)
        batches.append(toks)
    with TrainingSession(cfg) as s:
        out = [s.train_step(i, b) for i, b in enumerate(batches)]
        grads = s.gradients()
        names = sorted(s.actors)
        run_id = s.run_id
        weights = s.state_dict()
    assert shm_files(run_id) == []
    return out, grads, weights, names


@pytest.mark.parametrize("masked", [False, True])
def test_two_workers_equal_one_with_the_whole_batch(ray_cluster, masked):
    one, g1, w1, _ = _train(1, masked=masked)
    two, g2, w2, names = _train(2, masked=masked)
    assert "worker" in names and "worker-1" in names
    for a, b in zip(one, two):
        assert a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    for k in g1:
        np.testing.assert_allclose(g2[k], g1[k], rtol=1e-5, atol=1e-7, err_msg=k)
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert any(not np.array_equal(w1[k], _init(k)) for k in w1)     # it trained


def test_two_workers_of_a_mixture_of_experts_equal_one(ray_cluster):
    """debug_moe with its load-balancing loss trained: the loss spans the whole step's tokens,
    so two workers (each routing half the micro-batches) sum their routers' tallies before
    either's backward, and give one worker's gradients and router loss."""
    one, g1, _, _ = _train(1, steps=2, extra=("model.shape=debug_moe",))
    two, g2, _, _ = _train(2, steps=2, extra=("model.shape=debug_moe",))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["router_loss"] == pytest.approx(a["router_loss"], rel=1e-6)
        assert b["expert_load_max"] == pytest.approx(a["expert_load_max"], rel=1e-6)
    for k in g1:
        np.testing.assert_allclose(g2[k], g1[k], rtol=1e-5, atol=1e-7, err_msg=k)


def _init(name):
    from megaray.layout import build_layout
    from megaray.model import init_unit

    cfg = load_config("debug")
    for u in build_layout(cfg.model):
        for s in u.params:
            if s.name == name:
                return init_unit(u, cfg.model, cfg.run.seed)[s.offset:s.offset + s.numel].reshape(s.shape).numpy()


def test_workers_must_share_the_micro_batches_evenly():
    with pytest.raises(ConfigError, match="worker.count"):
        load_config("debug", ["worker.count=3", "train.grad_accum=4"])
