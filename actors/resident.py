"""Resident units (``optim.placement`` N): the first N blocks' training state on the worker's device.

A resident unit keeps its fp32 master, its Adam moments and (within a step) its fp32
gradient on the device, and a compute-dtype copy of the master that the forward and the
backward read in place of a weight slot. Nothing of it crosses the link during training and
no shard holds it: the worker updates it itself once the step's verdict is known, with the
same AdamW as the shards (``megaray.adamw``: the same calls, piece by piece, on the CPU, so a
resident unit equals a streamed one bit for bit; ``torch._fused_adamw_`` on CUDA, equal to
fp32 rounding), the same clip coefficient, skipping, weight-decay groups and schedule:

- gradients on the GPU (``optim.grad_placement`` device): the step's gradients were scaled
  by the clip coefficient on the device before any left, resident ones too; an applied step
  updates every resident unit with them;
- gradients in host memory (host): the gradient is rounded to ``optim.grad_dtype`` as the
  streamed ones are on their way out, and the update applies the coefficient; with clipping
  off a unit whose own gradient is not finite is skipped, as a shard skips it.

The master reaches shared memory only when someone reads it there (``flush``: checkpoints,
``state_dict``), and comes back from it after a checkpoint is loaded (``reload``). The
moments are written to a checkpoint in the shards' format, by (unit, start, stop) with each
range's Adam step, so a checkpoint written with one placement resumes with any other.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megaray.adamw import AdamW, hyper, rounding_key
from megaray.buffers import DTYPES, Handles, RunBuffers
from megaray.checkpoint import Checkpoint, PartWriter
from megaray.config import RunConfig
from megaray.layout import cut_pieces
from megaray.schedule import lr_at

from .device import Device


class ResidentUnits:
    def __init__(self, cfg: RunConfig, h: Handles, dev: Device, buf: RunBuffers):
        self.cfg, self.h, self.dev, self.buf = cfg, h, dev, buf
        o = cfg.optim
        self.units = h.resident
        self.dtype = DTYPES[cfg.train.compute_dtype]
        self.master = {u: dev.empty(h.units[u].numel, torch.float32) for u in self.units}
        self.compute = {u: dev.empty(h.units[u].numel, self.dtype) for u in self.units}
        self.m = {u: dev.zeros(h.units[u].numel) for u in self.units}
        self.v = {u: dev.zeros(h.units[u].numel) for u in self.units}
        # the pieces a shard would update, so that the arithmetic is the shards' to the bit
        self.pieces = {u: cut_pieces([h.units[u]], o.slab_numel) for u in self.units}
        self.steps = {(u, p.start): 0 for u in self.units for p in self.pieces[u]}
        self.adam = AdamW(cfg.worker.threads)
        self.reload()

    def __contains__(self, u: int) -> bool:
        return u in self.master

    def __len__(self) -> int:
        return len(self.units)

    def numel(self) -> int:
        return sum(t.numel() for t in self.master.values())

    def close(self) -> None:
        self.adam.close()

    # ------------------------------------------------------------------ the step
    def update(self, step: int, grads: list, applied: bool, coef: float, finite: dict[int, bool]) -> None:
        """Apply step ``step`` to the resident units (their gradients in ``grads``, by unit,
        dropped once used): all of them when the step is applied, or, with the gradients in
        host memory and clipping off, each whose own gradient is finite (``finite``)."""
        o, host = self.cfg.optim, self.h.grad_placement == "host"
        at_once = host and o.clip_grad_norm is None
        if not self.units or not (applied or at_once):
            return
        lr = lr_at(step, o, self.cfg.train.steps)
        scale = coef if host else 1.0           # through the ring the gradients are scaled already
        todo = [u for u in self.units if not at_once or finite[u]]
        for u in todo:
            g = grads[u]
            if host:
                g = g.to(DTYPES[self.h.grad_dtype])  # as the streamed units' gradients leave the device
            if self.dev.cuda:
                self._update_cuda(u, g, lr, scale)
            else:
                self._update_pieces(u, g, lr, scale)
            self.compute[u].copy_(self.master[u])
            grads[u] = None

    def _decay(self, p) -> float:
        o = self.cfg.optim
        return o.weight_decay if p.decay or o.decay_norms_and_biases else 0.0

    def _update_pieces(self, u: int, g: torch.Tensor, lr: float, scale: float) -> None:
        o = self.cfg.optim
        for p in self.pieces[u]:
            key = (u, p.start)
            self.steps[key] += 1
            t = self.steps[key]
            sl = slice(p.start, p.stop)
            self.adam.step(self.master[u][sl], g[sl], self.m[u][sl], self.v[u][sl],
                           hyper(lr, tuple(o.betas), o.eps, self._decay(p), t, grad_scale=scale), None,
                           rounding_key(self.cfg.run.seed, u, t), p.start, t)

    def _update_cuda(self, u: int, g: torch.Tensor, lr: float, scale: float) -> None:
        """The unit's pieces in one multi-tensor fused AdamW call per weight-decay group."""
        o = self.cfg.optim
        g = g.float()
        if scale != 1.0:
            g = g * scale
        groups: dict[float, list] = {}
        for p in self.pieces[u]:
            key = (u, p.start)
            self.steps[key] += 1
            groups.setdefault(self._decay(p), []).append((p, self.steps[key]))
        for decay, items in groups.items():
            sl = [slice(p.start, p.stop) for p, _ in items]
            torch._fused_adamw_([self.master[u][s] for s in sl], [g[s] for s in sl], [self.m[u][s] for s in sl],
                                [self.v[u][s] for s in sl], [],
                                [torch.tensor(float(t), device=self.dev.device) for _, t in items],
                                lr=lr, beta1=o.betas[0], beta2=o.betas[1], weight_decay=decay, eps=o.eps,
                                amsgrad=False, maximize=False)

    # ------------------------------------------------------------------ shared memory, checkpoints
    def flush(self) -> None:
        """The resident masters into their shared-memory regions (for readers there)."""
        for u in self.units:
            self.buf.master(u).copy_(self.master[u])
            if not self.h.aliased:
                self.buf.compute(u).copy_(self.compute[u])

    def reload(self) -> None:
        """The resident masters from shared memory (at start, and after a checkpoint is loaded)."""
        for u in self.units:
            self.master[u].copy_(self.buf.master(u))
            self.compute[u].copy_(self.master[u])

    def save(self, folder: str) -> dict:
        """Write the resident moments as ``resident.bin``, in the shards' format."""
        name = "resident.bin"
        w = PartWriter(Path(folder) / name)
        try:
            entries = []
            for u in self.units:
                for p in self.pieces[u]:
                    at = w.write(self.m[u][p.start:p.stop].cpu())
                    w.write(self.v[u][p.start:p.stop].cpu())
                    entries.append([u, p.start, p.stop, self.steps[(u, p.start)], at])
            return {name: {**w.finish(), "moments": entries}}
        except BaseException:
            w.abort()
            raise

    def load(self, folder: str) -> None:
        """The moments of the resident pieces, from whichever parts hold their ranges (a
        shard's, when the checkpoint was written with them streamed), and the masters from
        shared memory (the store has loaded them)."""
        ck = Checkpoint(folder)
        for u in self.units:
            for p in self.pieces[u]:
                m = torch.empty(p.numel, dtype=torch.float32)
                v = torch.empty(p.numel, dtype=torch.float32)
                self.steps[(u, p.start)] = ck.read_range("moments", u, p.start, p.stop, [m, v])
                self.m[u][p.start:p.stop].copy_(m)
                self.v[u][p.start:p.stop].copy_(v)
        self.reload()

    def optimizer_state(self) -> dict:
        """Adam state by (unit, start) (tests)."""
        return {k: {"step": t, "exp_avg": self.m[k[0]][k[1]:k[1] + p.numel].cpu().clone(),
                    "exp_avg_sq": self.v[k[0]][k[1]:k[1] + p.numel].cpu().clone()}
                for u in self.units for p in self.pieces[u] for k, t in [((u, p.start), self.steps[(u, p.start)])]}
