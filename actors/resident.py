"""Resident units (``optim.resident_units`` N): the training state of the first N units in forward
order (the embedding, then the first blocks) on the worker's device.

A resident unit keeps its fp32 master, its Adam moments (``optim.moment_dtype``: fp32, or
bf16 as the shards keep them) and (within a step) its gradient on the device, and a
compute-dtype copy of the master that the forward and the backward read in place of a weight
slot. Nothing of it crosses the link during training and no shard holds it: the worker updates
it itself once the step's verdict is known, with the same AdamW as the shards
(``megaray.adamw``: the same calls, piece by piece, on the CPU, so a resident unit equals a
streamed one bit for bit; on CUDA ``torch._fused_adamw_`` for fp32 moments and the C kernel's
arithmetic compiled, ``adamw.device_step``, for bf16 ones, equal to fp32 rounding), the same
clip coefficient, skipping, weight-decay groups and schedule:

- gradients on the GPU (``optim.grad_placement`` device): the step's fp32 gradients were
  scaled by the clip coefficient on the device before any left, resident ones too; bf16 ones
  (``optim.grad_dtype``, rounded as each backward ended) were not, and the update applies the
  coefficient, as the shards do; an applied step updates every resident unit with them;
- gradients in host memory (host): the gradient is rounded to ``optim.grad_dtype`` as the
  streamed ones are on their way out, and the update applies the coefficient; with clipping
  off a unit whose own gradient is not finite is skipped, as a shard skips it.

A resident unit has no state in host memory at all: its regions of the shared files are never
written (the files stay sparse there), the worker initializes its master from the same
source as the store would (the seed's generator for the unit, or the Hugging Face files),
and writes it and the moments to a checkpoint itself, in the store's and the shards' format
(by unit and range, each moment range with its Adam step), so a checkpoint written with one
placement resumes with any other.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megaray.adamw import AdamW, device_step, hyper, piece_decay, update_piece
from megaray.buffers import DTYPES, Handles
from megaray.checkpoint import Checkpoint
from megaray.clipping import applies_at_once
from megaray.config import RunConfig
from megaray.hf.read import load_into
from megaray.layout import cut_pieces
from megaray.lr_schedule import lr_at
from megaray.model import init_params
from megaray.parts import PartWriter

from .device import Device

RESIDENT_INIT_THREADS = 4     # parameters initialised at once, each through a host temporary


class ResidentUnits:
    def __init__(self, cfg: RunConfig, h: Handles, dev: Device):
        self.cfg, self.h, self.dev = cfg, h, dev
        o = cfg.optim
        self.units = h.resident
        self.dtype = DTYPES[cfg.train.compute_dtype]
        self.master = {u: dev.empty(h.units[u].numel, torch.float32) for u in self.units}
        self.compute = {u: dev.empty(h.units[u].numel, self.dtype) for u in self.units}
        moments = DTYPES[o.moment_dtype]       # fp32, or bf16 rounded to nearest as the shards keep them
        self.m = {u: dev.zeros(h.units[u].numel, moments) for u in self.units}
        self.v = {u: dev.zeros(h.units[u].numel, moments) for u in self.units}
        # the pieces a shard would update, so that the arithmetic is the shards' to the bit
        self.pieces = {u: cut_pieces([h.units[u]], o.slab_numel) for u in self.units}
        self.steps = {(u, p.start): 0 for u in self.units for p in self.pieces[u]}
        # on CUDA the fused AdamW reads each piece's step from the device: counted there too,
        # so that no update waits for a host-to-device copy
        self.device_steps = ({k: torch.zeros((), dtype=torch.float32, device=dev.device) for k in self.steps}
                             if dev.cuda else {})
        self.adam = AdamW(cfg.worker.threads)
        self._initialize()

    def __contains__(self, u: int) -> bool:
        return u in self.master

    def close(self) -> None:
        self.adam.close()

    # ------------------------------------------------------------------ the step
    def update(self, step: int, grads: list, applied: bool, coef: float, finite: dict[int, bool]) -> None:
        """Apply step ``step`` to the resident units (their gradients in ``grads``, by unit,
        dropped once used): all of them when the step is applied, or, with the gradients in
        host memory and clipping off, each whose own gradient is finite (``finite``). ``coef``:
        the clip coefficient to apply, as the shards do (``GradientShipper.readers_coef``: 1.0
        where the gradients come scaled)."""
        o, host = self.cfg.optim, self.h.grad_placement == "host"
        at_once = applies_at_once(o, self.h.grad_placement)
        if not self.units or not (applied or at_once):
            return
        lr = lr_at(step, o, self.cfg.train.steps)
        todo = [u for u in self.units if not at_once or finite[u]]
        for u in todo:
            g = grads[u]
            if host:
                g = g.to(DTYPES[self.h.grad_dtype])  # as the streamed units' gradients leave the device
            if self.dev.cuda and self.m[u].dtype == torch.float32:
                self._update_cuda(u, g, lr, coef)
            elif self.dev.cuda:
                self._update_device(u, g, lr, coef)
            else:
                self._update_pieces(u, g, lr, coef)
            self.compute[u].copy_(self.master[u])
            grads[u] = None

    def _update_pieces(self, u: int, g: torch.Tensor, lr: float, scale: float) -> None:
        for p in self.pieces[u]:
            self.steps[(u, p.start)] += 1
            sl = slice(p.start, p.stop)
            update_piece(self.adam, self.cfg.optim, self.cfg.run.seed, p, self.master[u][sl], g[sl],
                         self.m[u][sl], self.v[u][sl], lr, self.steps[(u, p.start)], scale)

    def _update_device(self, u: int, g: torch.Tensor, lr: float, scale: float) -> None:
        """bf16 moments on CUDA: the shards' arithmetic piece by piece in one compiled pass each
        (``adamw.device_step``; torch's fused AdamW takes no bf16 moments beside an fp32 master)."""
        o = self.cfg.optim
        for p in self.pieces[u]:
            self.steps[(u, p.start)] += 1
            sl = slice(p.start, p.stop)
            device_step(self.master[u][sl], g[sl], self.m[u][sl], self.v[u][sl],
                        hyper(lr, tuple(o.betas), o.eps, piece_decay(o, p), self.steps[(u, p.start)], scale))

    def _update_cuda(self, u: int, g: torch.Tensor, lr: float, scale: float) -> None:
        """The unit's pieces in one multi-tensor fused AdamW call per weight-decay group."""
        o = self.cfg.optim
        g = g.float()
        if scale != 1.0:        # in place: the step's gradient of this unit has no other reader left
            g.mul_(scale)
        groups: dict[float, list] = {}
        for p in self.pieces[u]:
            self.steps[(u, p.start)] += 1
            groups.setdefault(piece_decay(o, p), []).append(p)
        for decay, ps in groups.items():
            sl = [slice(p.start, p.stop) for p in ps]
            steps = [self.device_steps[(u, p.start)] for p in ps]
            torch._foreach_add_(steps, 1.0)
            torch._fused_adamw_([self.master[u][s] for s in sl], [g[s] for s in sl], [self.m[u][s] for s in sl],
                                [self.v[u][s] for s in sl], [], steps, lr=lr, beta1=o.betas[0], beta2=o.betas[1],
                                weight_decay=decay, eps=o.eps, amsgrad=False, maximize=False)

    # ------------------------------------------------------------------ weights, checkpoints
    def _initialize(self) -> None:
        """The resident masters as the store would have made them: from the Hugging Face
        directory (``model.from``), else each parameter from its own seeded generator. Only
        parameters pass through host memory, never a whole unit's or every resident unit's: the
        worker starts before the shards take their moments (``session``), and the seeded
        path's RESIDENT_INIT_THREADS parameters at a time (qwen14b: the embedding's 2.9 GiB
        and three blocks' largest, 0.3 GiB each) are a small part of what the moments leave."""
        units, m = self.h.units, self.cfg.model
        if m.from_path:
            load_into(units, self.master.__getitem__, m.from_path, only=set(self.units),
                      threads=RESIDENT_INIT_THREADS)
        else:
            init_params([(s, self.master[u][s.offset:s.offset + s.numel]) for u in self.units
                         for s in units[u].params], m, self.cfg.run.seed, threads=RESIDENT_INIT_THREADS)
        for u in self.units:
            self.compute[u].copy_(self.master[u])

    def masters(self) -> dict[int, torch.Tensor]:
        """The resident masters, on the CPU (``state_dict``)."""
        return {u: self.master[u].cpu().clone() for u in self.units}

    def save(self, folder: str) -> dict:
        """Write the resident masters and moments as ``resident.bin``, in the store's and the
        shards' formats."""
        name = "resident.bin"
        with PartWriter(Path(folder) / name) as w:
            masters, moments = [], []
            for u in self.units:          # piece by piece: one piece at a time in host memory
                for p in self.pieces[u]:
                    sl = slice(p.start, p.stop)
                    masters.append([u, p.start, p.stop, w.write(self.master[u][sl].cpu())])
                    at = w.write(self.m[u][sl].cpu())
                    w.write(self.v[u][sl].cpu())
                    moments.append([u, p.start, p.stop, self.steps[(u, p.start)], at])
            return {name: {**w.finish(), "master": masters, "moments": moments}}

    def load(self, folder: str) -> None:
        """The resident masters and moments from whichever parts hold their ranges (the
        store's and a shard's, when the checkpoint was written with them streamed)."""
        ck = Checkpoint(folder)
        for u in self.units:              # piece by piece, as written
            for p in self.pieces[u]:
                master = torch.empty(p.numel, dtype=torch.float32)
                m, v = (torch.empty(p.numel, dtype=self.m[u].dtype) for _ in range(2))
                ck.read_range("master", u, p.start, p.stop, [master])
                key = (u, p.start)
                self.steps[key] = ck.read_range("moments", u, p.start, p.stop, [m, v])
                if key in self.device_steps:
                    self.device_steps[key].fill_(float(self.steps[key]))
                self.master[u][p.start:p.stop].copy_(master)
                self.m[u][p.start:p.stop].copy_(m)
                self.v[u][p.start:p.stop].copy_(v)
            self.compute[u].copy_(self.master[u])

    def optimizer_state(self) -> dict:
        """Adam state by (unit, start) (tests)."""
        out = {}
        for u in self.units:
            for p in self.pieces[u]:
                out[(u, p.start)] = {"step": self.steps[(u, p.start)],
                                     "exp_avg": self.m[u][p.start:p.stop].cpu().clone(),
                                     "exp_avg_sq": self.v[u][p.start:p.stop].cpu().clone()}
        return out
