"""The Scheduler stepped one step at a time against small fake actors.

The fakes are real Ray actors that record what the scheduler asks of them, so routing,
clipping, skipping, the order of calls and failure handling are checked without a model.
"""
from __future__ import annotations

import math

import pytest
import ray

from megaray.actors.scheduler import Scheduler, clip_coefficient, shard_ranges
from megaray.buffers import Handles, RunBuffers
from megaray.config import load_config
from megaray.errors import ActorFailure
from megaray.model import build_layout
from megaray.schedule import lr_at


@ray.remote
class FakeWorker:
    def __init__(self, scheduler_name: str, units: int):
        self.name, self.units, self.sq = scheduler_name, units, [1.0] * units

    def set_sqnorms(self, sq):
        self.sq = sq

    def run_step(self, step, tokens):
        sched = ray.get_actor(self.name, namespace="megaray-test")
        for u in reversed(range(self.units)):             # backward order, as the real worker
            sched.grad_ready.remote(step, u)
        return {"loss_sum": 10.0, "tokens": 5, "grads_sent": self.units, "grad_sqnorms": self.sq}


@ray.remote
class FakeShard:
    def __init__(self, fail_apply_at=None):
        self.log, self.fail = [], fail_apply_at

    def on_grad(self, step, u, lr, apply_now):
        self.log.append(("on_grad", step, u, apply_now))

    def apply(self, step, coef, lr, skip):
        if step == self.fail:
            raise RuntimeError("disk on fire")
        self.log.append(("apply", step, round(coef, 12), lr, skip))
        return 0.0

    def calls(self):
        return self.log


def _setup(tmp_path, overrides=(), fail_apply_at=None):
    cfg = load_config("debug", [f"cluster.shm_dir={tmp_path}", *overrides])
    h = Handles.plan("sched-test", 1, str(tmp_path), "float32", build_layout(cfg.model))
    ctl = RunBuffers(h, create=True, kinds=("control",))
    name = f"sched-{len(list(tmp_path.iterdir()))}-{id(cfg)}"
    sched = ray.remote(Scheduler).options(name=name, namespace="megaray-test").remote(cfg, h, name)
    worker = FakeWorker.remote(name, h.num_units)
    shards = [FakeShard.remote(fail_apply_at if k == 1 else None) for k in range(cfg.optim.num_shards)]
    ray.get(sched.attach.remote(worker, shards, [f"optimizer-{k}" for k in range(len(shards))]))
    return cfg, h, ctl, sched, worker, shards


def test_clipped_step_routes_every_gradient_then_applies_once(ray_cluster, tmp_path):
    cfg, h, _, sched, _, shards = _setup(tmp_path)
    m = ray.get(sched.train_step.remote(0, None))
    U = h.num_units
    assert m["grad_norm"] == pytest.approx(math.sqrt(U))
    assert m["clip_coef"] == pytest.approx(clip_coefficient(math.sqrt(U), cfg.optim.clip_grad_norm))
    assert m["loss"] == 2.0 and not m["skipped"]
    assert ray.get(sched.state.remote())["phase"] == "apply"      # updates overlap the next step
    ray.get(sched.drain.remote())
    assert ray.get(sched.state.remote())["phase"] == "idle"
    for units, shard in zip(shard_ranges(U, 2), shards):
        calls = ray.get(shard.calls.remote())
        grads = [c for c in calls if c[0] == "on_grad"]
        assert sorted(c[2] for c in grads) == units and all(not c[3] for c in grads)
        assert calls[-1] == ("apply", 0, round(m["clip_coef"], 12), lr_at(0, cfg.optim, cfg.train.steps), False)
        assert [c[0] for c in calls].count("apply") == 1           # after all of its gradients


def test_nonfinite_norm_skips_and_counts(ray_cluster, tmp_path):
    _, h, _, sched, worker, shards = _setup(tmp_path)
    ray.get(worker.set_sqnorms.remote([float("nan")] + [1.0] * (h.num_units - 1)))
    m = ray.get(sched.train_step.remote(0, None))
    ray.get(sched.drain.remote())
    assert m["skipped"]
    assert ray.get(sched.state.remote())["skipped_steps"] == 1
    assert all(ray.get(s.calls.remote())[-1][-1] is True for s in shards)


def test_clipping_off_updates_on_arrival(ray_cluster, tmp_path):
    _, _, _, sched, _, shards = _setup(tmp_path, ["optim.clip_grad_norm=null"])
    m = ray.get(sched.train_step.remote(0, None))
    ray.get(sched.drain.remote())
    assert m["clip_coef"] == 1.0
    for s in shards:
        calls = ray.get(s.calls.remote())
        assert calls and all(c[0] == "on_grad" and c[3] for c in calls)


def test_a_failed_update_aborts_the_next_step(ray_cluster, tmp_path):
    _, _, ctl, sched, _, _ = _setup(tmp_path, fail_apply_at=0)
    ray.get(sched.train_step.remote(0, None))
    with pytest.raises(ActorFailure) as e:
        ray.get(sched.train_step.remote(1, None))
    assert "optimizer-1" in str(e.value) and "disk on fire" in str(e.value)
    assert ctl.aborted                                              # waiting actors are released
    assert ray.get(sched.state.remote())["phase"] == "failed"
