"""OptimizerShard actor: AdamW over its share of the gradient pieces, in place.

The shard maps the master (and compute-copy) regions and the gradient ring, and keeps the
Adam moments of its pieces (``megaray.layout``: slab-sized slices of a unit's flat
parameters, split at the decay boundary) in its own memory, allocated and touched when it
starts, so the memory the plan counted is taken before training and step 0 runs as fast as
the others. Matrices are decayed; 1-D tensors only with ``optim.decay_norms_and_biases``.
AdamW is elementwise, so updating a unit piece by piece equals updating it whole.

``apply(step, lr)`` is called once per step, before the worker starts it, and runs while
the worker computes: it waits for the worker's verdict on the step, then for each of its
pieces in order takes the piece's gradient, updates master, moments (and the compute copy)
in one pass (``megaray.adamw``), and releases the piece (``megaray.protocol``), so the
worker never reads a half-written layer nor overwrites an unread gradient. Through the ring
(``optim.grad_placement`` device) an fp32 gradient arrives already clipped: the worker scaled
it on the GPU, and the verdict's coefficient is 1; a bf16 one (``optim.grad_dtype``) arrives
as the worker rounded it, and, as from the host gradient buffer (host), the shard applies the
verdict's clip coefficient in the update itself (the same fp32 multiply). With clipping off and the host
buffer, nothing waits for the norm: a piece is updated as soon as it lands, and a unit whose
own gradient is not finite is skipped. A skipped step (non-finite loss or gradient)
advances the versions and touches nothing else.

Checkpoints hold the moments by (unit, start, stop) with each range's Adam step, never by
piece index, so a run resumes with another shard count or slab size bit for bit.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from megaray.adamw import AdamW, update_piece, writes_clipped_gradient
from megaray.buffers import DTYPES, Handles, RunBuffers
from megaray.checkpoint import Checkpoint
from megaray.clipping import applies_at_once
from megaray.config import RunConfig
from megaray.parts import PartWriter

from .calls import actor_guard
from .metrics import SHARD_GAUGES, RunMetrics


class OptimizerShard:
    def __init__(self, cfg: RunConfig, handles: Handles, pieces: list[int], name: str):
        o = cfg.optim
        torch.set_num_threads(o.threads_per_shard)
        self.cfg, self.h, self.pieces, self.name = cfg, handles, list(pieces), name
        self.buf = RunBuffers(handles, kinds=("master", "compute", "ring", "control"))
        self.adam = AdamW(o.threads_per_shard)
        self.moment_dtype = DTYPES[o.moment_dtype]
        self.m: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.steps: dict[int, int] = {}             # Adam steps applied to each piece
        for i in self.pieces:
            piece = handles.pieces[i]
            self.m[i] = torch.zeros(piece.numel, dtype=self.moment_dtype)
            self.v[i] = torch.zeros(piece.numel, dtype=self.moment_dtype)
            self.steps[i] = 0
        if self.pieces and writes_clipped_gradient(o, handles.grad_placement, handles.grad_dtype):
            self.adam.reserve_scaled(max(handles.pieces[i].numel for i in self.pieces))
        self.metrics = RunMetrics(handles.run_id, name.rsplit(":", 1)[-1], SHARD_GAUGES)

    def __repr__(self) -> str:
        """What the Ray dashboard's Actors view shows (Ray reads it once, when the actor starts)."""
        n = sum(self.h.pieces[i].numel for i in self.pieces)
        return (f"OptimizerShard({len(self.pieces)} pieces, {n / 1e6:.2f}M params, "
                f"{self.cfg.optim.threads_per_shard} threads, {self.cfg.optim.moment_dtype} moments)")

    def close(self) -> None:
        """End the update threads (the session calls this before the actor exits)."""
        self.adam.close()

    def kernel(self) -> str:
        """Which AdamW runs here (for the run's log)."""
        o = self.cfg.optim
        return self.adam.describe(self.h.master_dtype, o.moment_dtype, self.h.grad_dtype, not self.h.aliased)

    def apply(self, step: int, lr: float) -> dict:
        """Apply step ``step`` to every piece of this shard as its gradient arrives.

        Returns {"update_s": seconds updating, "wait_s": seconds waiting (for the verdict and
        the gradients), "grad_wait_s": of which for gradients once the verdict was known,
        "span_s": from the verdict to the last piece's release, "params": parameters updated,
        "skipped": bool}."""
        with actor_guard(self.name, step, self.buf.control.abort):
            return self._apply(step, lr)

    def _apply(self, step: int, lr: float) -> dict:
        timeout = self.cfg.worker.wait_timeout_s
        out = {"update_s": 0.0, "wait_s": 0.0, "grad_wait_s": 0.0, "span_s": 0.0, "params": 0, "skipped": False}
        if not self.pieces:
            return out
        control = self.buf.control
        host = self.h.grad_placement == "host"
        at_once = applies_at_once(self.cfg.optim, self.h.grad_placement)    # no norm to wait for
        coef = 1.0
        if not at_once:
            applied, out["wait_s"] = control.wait_verdict(step, timeout)
            if not applied:
                control.skip(self.pieces, step)
                out["skipped"] = True
                return out
            coef = control.clip_coefficient()   # 1.0 for the ring's fp32 gradients: they come clipped
        source = self.buf.host_grads if host else self.buf.ring
        start = time.perf_counter()
        for i in self.pieces:
            piece = self.h.pieces[i]
            what = f" ({self.h.units[piece.unit].name})"
            if host:
                grad, finite, waited = source.take(piece, step, timeout, what)
            else:
                (grad, waited), finite = source.take(piece, step, timeout, what), True
            out["grad_wait_s"] += waited
            t0 = time.perf_counter()
            if finite:                      # clipping off: a unit whose own gradient is not finite is skipped
                self._update(i, grad, lr, coef)
                out["params"] += piece.numel
            source.release(piece, step)
            out["update_s"] += time.perf_counter() - t0
        out["span_s"] = time.perf_counter() - start
        out["wait_s"] += out["grad_wait_s"]
        if out["update_s"] > 0:
            self.metrics.set(optimizer_seconds=out["update_s"],
                             optimizer_params_per_second=out["params"] / out["update_s"])
        return out

    def _update(self, i: int, grad: torch.Tensor, lr: float, coef: float) -> None:
        piece = self.h.pieces[i]
        self.steps[i] += 1
        copy = None if self.h.aliased else self.buf.piece_compute(piece)
        update_piece(self.adam, self.cfg.optim, self.cfg.run.seed, piece, self.buf.piece_master(piece), grad,
                     self.m[i], self.v[i], lr, self.steps[i], coef, copy)

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: str, k: int) -> dict:
        """Write this shard's moments as ``optim-<k>.bin``, each range with its Adam step."""
        name = f"optim-{k}.bin"
        with PartWriter(Path(folder) / name) as w:
            entries = []
            for i in self.pieces:
                p = self.h.pieces[i]
                at = w.write(self.m[i])
                w.write(self.v[i])
                entries.append([p.unit, p.start, p.stop, self.steps[i], at])
            return {name: {**w.finish(), "moments": entries}}

    def load(self, folder: str) -> None:
        """Read the moments of this shard's pieces from whichever parts hold their ranges."""
        ck = Checkpoint(folder)
        for i in self.pieces:
            p = self.h.pieces[i]
            self.steps[i] = ck.read_range("moments", p.unit, p.start, p.stop, [self.m[i], self.v[i]])

    def optimizer_state(self) -> dict:
        """Adam state (moments, step) by piece (tests)."""
        return {i: {"step": self.steps[i], "exp_avg": self.m[i].clone(), "exp_avg_sq": self.v[i].clone()}
                for i in self.pieces}
