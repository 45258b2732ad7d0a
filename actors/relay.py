"""WeightRelay actor: the parameter store's side for GPU workers on other nodes.

A worker on another node cannot map the run's shared memory, so weights and gradients
cross through Ray's object store instead, one layer unit at a time, and this actor (on the
store's node, attached to the shared files) keeps the same ordering guarantees a local worker
keeps, through the same protocol (``megaray.protocol``):

- ``unit(u, step)`` returns unit u's compute-dtype weights once every piece of it has
  ``version == step`` (never stale, never half-updated);
- ``ship(step, grads, coef)`` publishes the step's verdict and writes the (already summed,
  and clipped unless rounded: ``coef``) gradients piece by piece into the ring, each only
  into a free slab;
- ``decide(step, False)`` skips a step; ``abort()`` releases every waiter of the run.

It is a threaded actor: a worker asks for the next units while the previous step's
gradients are still going into the ring.
"""
from __future__ import annotations

import torch

from megaray.buffers import Handles, RunBuffers
from megaray.config import RunConfig
from megaray.step import CopyOut

from .calls import actor_guard
from .shipping import put_pieces


class WeightRelay:
    def __init__(self, cfg: RunConfig, handles: Handles, name: str):
        torch.set_num_threads(1)
        self.cfg, self.h, self.name = cfg, handles, name
        self.buf = RunBuffers(handles, kinds=("master", "compute", "ring", "control"))

    def _guard(self, fn, step):
        with actor_guard(self.name, step, self.buf.control.abort):
            return fn()

    def unit(self, u: int, step: int) -> torch.Tensor:
        """Unit u's compute weights as of ``step`` steps (a copy: it leaves through the object store)."""
        def get():
            self.buf.control.wait_versions(self.h.unit_pieces(u), step,
                                           f"optimizer update of {self.h.units[u].name} for step {step}",
                                           self.cfg.worker.wait_timeout_s)
            return self.buf.compute(u).clone()
        return self._guard(get, step)

    def ship(self, step: int, grads: list, coef: float = 1.0) -> CopyOut:
        """Step ``step`` is applied (``coef``: the clip coefficient the shards apply, 1.0 where
        the gradients come clipped): every piece of ``grads`` (one flat tensor a unit) into its slab."""
        def put():
            self.buf.control.decide(step, True, coef)
            return put_pieces(self.buf, step, grads, self.cfg.worker.wait_timeout_s)
        return self._guard(put, step)

    def decide(self, step: int, apply: bool) -> None:
        self.buf.control.decide(step, apply)

    def version(self) -> int:
        """The step every unit's weights are at, at least."""
        return self.buf.streamed_version()

    def abort(self) -> None:
        self.buf.control.abort()
