"""OptimizerShard actor: AdamW over a contiguous range of layer units, in place.

The shard maps the master (and compute-copy) regions of its units and keeps their fp32 Adam
moments in its own memory. For each unit it runs torch's AdamW (fused where torch has it)
over two views of the master region: the matrices, decayed, and the 1-D tensors, decayed
only when ``optim.decay_norms_and_biases`` is set. The gradient is read in place from the
unit's shared gradient region. After an update it refreshes the compute copy, then bumps
``version[u]`` and releases the gradient region, in that order, so the worker never reads
a half-written layer.

Two modes, chosen by the scheduler:
- clipping on: ``on_grad`` only queues the unit; ``apply`` runs after the whole backward
  with the exact global clip coefficient (from the norms the worker took on the GPU), in
  forward order, overlapping the next step's forward. The coefficient is applied inside
  the fused AdamW kernel (its ``grad_scale`` input, as torch's GradScaler uses it), so
  clipping costs no extra pass over the gradient.
- clipping off: ``on_grad`` updates the unit at once, overlapping the rest of the backward.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from megaray.buffers import Handles, RunBuffers
from megaray.config import RunConfig
from megaray.checkpoint import crc32_file, verify_file
from megaray.errors import ActorFailure, CheckpointError, InjectedFault

from .metrics import RunMetrics


class OptimizerShard:
    def __init__(self, cfg: RunConfig, handles: Handles, units: list[int], name: str):
        torch.set_num_threads(cfg.optim.threads_per_shard)
        self.cfg, self.h, self.units, self.name = cfg, handles, list(units), name
        self.buf = RunBuffers(handles, kinds=("master", "compute", "grad", "control"))
        o = cfg.optim
        self.opts: dict[int, torch.optim.AdamW] = {}
        self.segments: dict[int, list[tuple[torch.Tensor, slice]]] = {}
        for u in self.units:
            lay = handles.units[u]
            master = self.buf.master(u)
            segs = [(master[:lay.decay_numel], slice(0, lay.decay_numel), o.weight_decay)]
            if lay.decay_numel < lay.numel:
                wd = o.weight_decay if o.decay_norms_and_biases else 0.0
                segs.append((master[lay.decay_numel:], slice(lay.decay_numel, lay.numel), wd))
            segs = [s for s in segs if s[0].numel() > 0]
            self.segments[u] = [(p, sl) for p, sl, _ in segs]
            groups = [{"params": [p], "weight_decay": wd} for p, _, wd in segs]
            self.opts[u] = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=True)
        self.pending: list[int] = []
        self._step, self._step_s, self._step_params = -1, 0.0, 0
        self.metrics = RunMetrics(handles.run_id, name.rsplit(":", 1)[-1], {
            "optimizer_seconds": "Time this optimizer shard spent updating in its last step",
            "optimizer_params_per_second": "This shard's AdamW update rate in its last step"})

    def _fault(self, step: int) -> None:
        d = self.cfg.debug
        if d.crash_actor == "optimizer" and d.crash_step == step:
            raise InjectedFault(f"{self.name}: injected crash at step {step}")

    def on_grad(self, step: int, u: int, lr: float, apply_now: bool) -> None:
        """A unit's gradient has landed: update it now, or queue it for ``apply``."""
        try:
            self._fault(step)
            if apply_now:
                self._update(step, u, 1.0, lr, skip=False)
            else:
                self.pending.append(u)
        except Exception as e:
            raise ActorFailure(self.name, f"{type(e).__name__}: {e}", step) from e

    def apply(self, step: int, coef: float, lr: float, skip: bool) -> float:
        """Update every pending unit in forward order; returns seconds spent."""
        t0 = time.perf_counter()
        try:
            self._fault(step)
            for u in sorted(self.pending):
                self._update(step, u, coef, lr, skip)
            self.pending.clear()
            return time.perf_counter() - t0
        except Exception as e:
            raise ActorFailure(self.name, f"{type(e).__name__}: {e}", step) from e

    def _account(self, step: int, seconds: float, params: int) -> None:
        """Per-step busy time, published to the metrics when the next step begins."""
        if step != self._step:
            if self._step >= 0 and self._step_s > 0:
                self.metrics.set(optimizer_seconds=self._step_s,
                                 optimizer_params_per_second=self._step_params / self._step_s)
            self._step, self._step_s, self._step_params = step, 0.0, 0
        self._step_s += seconds
        self._step_params += params

    def _update(self, step: int, u: int, coef: float, lr: float, skip: bool) -> None:
        t0 = time.perf_counter()
        if not skip:
            grad = self.buf.grad(u)
            opt = self.opts[u]
            # Fused AdamW divides the gradient by grad_scale in its own pass.
            opt.grad_scale = None if coef == 1.0 else torch.tensor(1.0 / coef)
            opt.found_inf = None if coef == 1.0 else torch.zeros(())
            for group, (p, sl) in zip(opt.param_groups, self.segments[u]):
                group["lr"] = lr
                p.grad = grad[sl]
            opt.step()
            for p, _ in self.segments[u]:
                p.grad = None
            if not self.h.aliased:
                self.buf.compute(u).copy_(self.buf.master(u))
        self.buf.set_version(u, step + 1)
        self.buf.set_grad_state(u, 0)
        self._account(step, time.perf_counter() - t0, 0 if skip else self.h.units[u].numel)

    def save(self, folder: str, k: int) -> dict:
        """Write this shard's AdamW states (moments, step counts) by unit as ``optim-<k>.pt``."""
        name = f"optim-{k}.pt"
        path = Path(folder) / name
        torch.save({"units": {u: self.opts[u].state_dict() for u in self.units}}, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        crc, n = crc32_file(path)
        return {name: {"bytes": n, "crc32": crc, "units": list(self.units)}}

    def load(self, folder: str, parts: dict) -> None:
        """Load the states of this shard's units from whichever parts hold them."""
        need = set(self.units)
        for name, part in parts.items():
            mine = need & set(part.get("units", []))
            if not name.startswith("optim-") or not mine:
                continue
            path = Path(folder) / name
            verify_file(path, part)
            try:
                states = torch.load(path, map_location="cpu", weights_only=True)["units"]
            except Exception as e:
                raise CheckpointError(f"checkpoint part {path} cannot be read: {e}") from None
            for u in mine:
                self.opts[u].load_state_dict(states[u])
            need -= mine
        if need:
            raise CheckpointError(f"{folder}: no optimizer state for units {sorted(need)}")
        self.pending.clear()

    def optimizer_state(self) -> dict:
        """Adam moments by unit (tests and checkpoints)."""
        return {u: [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                    for g in opt.param_groups for p in g["params"]] for u, opt in self.opts.items()}
