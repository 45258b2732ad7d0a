"""Test hooks (``debug`` config section), kept out of the actors' hot paths.

When a run's config asks for a hook, the session starts these subclasses instead of the
plain actors; a run without one never executes a line of this module.

- ``debug.crash_actor`` / ``debug.crash_step``: the worker or an optimizer shard fails with
  ``InjectedFault`` at that step (tests of failure handling and restarts).
- ``debug.nonfinite_steps``: the worker makes those steps' loss and gradients NaN (tests of
  step skipping).
- ``debug.keep_gradients``: the worker keeps a host copy of each step's unclipped gradients
  for ``TrainingSession.gradients()`` (tests and interop checks).
"""
from __future__ import annotations

import numpy as np

from megaray.config import DebugConfig, RunConfig
from megaray.errors import InjectedFault

from .optimizer import OptimizerShard
from .worker import GpuWorker


def wants_worker_hooks(d: DebugConfig) -> bool:
    return d.crash_actor == "worker" or bool(d.nonfinite_steps) or d.keep_gradients


class DebugGpuWorker(GpuWorker):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._last_grads: dict[int, np.ndarray] = {}

    def _run_step(self, step: int, batch, total_tokens):
        d = self.cfg.debug
        if d.crash_actor == "worker" and d.crash_step == step:
            raise InjectedFault(f"injected crash at step {step}")
        return super()._run_step(step, batch, total_tokens)

    def _gradient_done(self, st, u, g):
        if st.step in self.cfg.debug.nonfinite_steps:
            g.fill_(float("nan"))
        super()._gradient_done(st, u, g)
        if self.cfg.debug.keep_gradients:     # summed over the workers, not yet clipped
            self._last_grads[u] = g.cpu().numpy()

    def _decide_and_ship(self, st):
        if st.step in self.cfg.debug.nonfinite_steps:
            st.loss_sum.fill_(float("nan"))
        return super()._decide_and_ship(st)

    def gradients(self) -> dict[int, np.ndarray]:
        """The last step's unclipped fp32 gradients by unit (needs ``debug.keep_gradients``)."""
        if not self.cfg.debug.keep_gradients:
            raise RuntimeError("gradients() needs debug.keep_gradients: true")
        return self._last_grads


class DebugOptimizerShard(OptimizerShard):
    def _apply(self, step: int, lr: float) -> dict:
        d = self.cfg.debug
        if d.crash_actor == "optimizer" and d.crash_step == step:
            raise InjectedFault(f"{self.name}: injected crash at step {step}")
        return super()._apply(step, lr)


def worker_class(cfg: RunConfig) -> type:
    return DebugGpuWorker if wants_worker_hooks(cfg.debug) else GpuWorker


def shard_class(cfg: RunConfig) -> type:
    return DebugOptimizerShard if cfg.debug.crash_actor == "optimizer" else OptimizerShard
