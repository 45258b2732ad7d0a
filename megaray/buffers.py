"""Where a run's tensors live in shared memory, and the control words that order access.

``Handles`` is the small, picklable description that crosses Ray: file names, per-unit byte
offsets, dtypes, the model layout and the gradient pieces. Every actor attaches the files it
needs from it.

Files of one run (see ``megaray.shm`` for naming):
- ``master``: master weights (fp32, or bf16 with ``optim.master_dtype``), one flat region
  per layer unit.
- ``compute``: the compute-dtype copy the worker reads (absent when the compute dtype is
  the master's, or with ``optim.compute_copy`` device: then the worker reads the master
  regions themselves and, in the second case, casts them on the device).
- ``ring``: the gradient ring, R slabs of ``optim.grad_slab_mib`` each. A unit's flat fp32
  gradient is cut into pieces of at most one slab (split at the unit's decay boundary too);
  piece p of a step always travels through slab ``p mod R``. Gradients use no other host
  memory, so the ring's size, not the model's, bounds it.
- ``control``: int64 words: [abort, decided, verdict, version[P], slab_piece[R], slab_step[R]].

Invariants the control words keep:
- ``version[p]`` is the number of optimizer steps applied to piece p. The worker stages unit u
  for step t only once every piece of u has ``version == t``; so a layer's compute copy is
  never read while its update runs, and never read stale.
- ``slab_piece[s]`` is p + 1 from the moment the worker has written piece p into slab s (with
  ``slab_step[s]`` its step) until the piece's optimizer shard has applied it, and 0 when
  the slab is free; the worker writes a slab only when it is 0, and only the owner of the
  piece frees it.
- ``decided`` = t + 1 once the worker knows step t's global gradient norm; ``verdict`` says
  whether step t is applied (1) or skipped for a non-finite loss or gradient (0). The verdict
  is written before ``decided``, and the worker decides step t + 1 only after every piece
  of step t has its new version, so a shard never reads a later step's verdict.
- ``abort`` set to 1 makes every wait raise ``RunAborted``, so no actor hangs on a dead peer.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from megaray.errors import RunAborted
from megaray.model import UnitLayout
from megaray.shm import ShmFile, file_name

ALIGN = 4096
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def unit_offsets(units, elem_size: int) -> tuple[tuple[int, ...], int]:
    out, off = [], 0
    for u in units:
        out.append(off)
        off = _align(off + u.numel * elem_size)
    return tuple(out), off


@dataclass(frozen=True)
class Piece:
    """One slab's worth of a unit's flat parameters: [start, stop) of unit ``unit``."""
    index: int
    unit: int
    start: int
    stop: int
    decay: bool     # inside the unit's decayed (matrix) range

    @property
    def numel(self) -> int:
        return self.stop - self.start


def cut_pieces(units, slab_numel: int) -> tuple[Piece, ...]:
    """Every unit's [0, decay_numel) and [decay_numel, numel), in slab-sized pieces, in forward order."""
    out: list[Piece] = []
    for u in units:
        for a, b, decay in ((0, u.decay_numel, True), (u.decay_numel, u.numel, False)):
            for start in range(a, b, slab_numel):
                out.append(Piece(len(out), u.index, start, min(b, start + slab_numel), decay))
    return tuple(out)


def assign_pieces(num_pieces: int, num_shards: int, layout: str = "interleaved") -> list[list[int]]:
    """Split piece indices among shards: piece p to shard p mod N, or contiguous, as-even-as-possible ranges."""
    if layout == "interleaved":
        return [list(range(k, num_pieces, num_shards)) for k in range(num_shards)]
    base, extra = divmod(num_pieces, num_shards)
    out, start = [], 0
    for k in range(num_shards):
        n = base + (1 if k < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


@dataclass(frozen=True)
class Handles:
    run_id: str
    owner_pid: int
    shm_dir: str
    compute_dtype: str
    master_dtype: str
    units: tuple[UnitLayout, ...]
    master_offsets: tuple[int, ...]
    master_bytes: int
    compute_offsets: tuple[int, ...]
    compute_bytes: int
    pieces: tuple[Piece, ...]
    slab_numel: int
    ring_slabs: int
    unit_piece_ranges: tuple[tuple[int, int], ...]     # unit -> [first piece, last piece + 1)

    @classmethod
    def plan(cls, run_id: str, owner_pid: int, shm_dir: str, compute_dtype: str, units,
             slab_numel: int, ring_slabs: int, master_dtype: str = "float32", host_copy: bool = True) -> "Handles":
        units = tuple(units)
        m_off, m_bytes = unit_offsets(units, DTYPES[master_dtype].itemsize)
        if compute_dtype == master_dtype or not host_copy:
            c_off, c_bytes = m_off, 0
        else:
            c_off, c_bytes = unit_offsets(units, DTYPES[compute_dtype].itemsize)
        pieces = cut_pieces(units, slab_numel)
        slab_numel = min(slab_numel, max(p.numel for p in pieces))   # no slab larger than the largest piece
        ranges = tuple((min(p.index for p in pieces if p.unit == u.index),
                        max(p.index for p in pieces if p.unit == u.index) + 1) for u in units)
        return cls(run_id, owner_pid, shm_dir, compute_dtype, master_dtype, units, m_off, m_bytes, c_off, c_bytes,
                   pieces, slab_numel, ring_slabs, ranges)

    @classmethod
    def for_config(cls, cfg, run_id: str, owner_pid: int, units) -> "Handles":
        return cls.plan(run_id, owner_pid, cfg.cluster.shm_dir, cfg.train.compute_dtype, units,
                        cfg.optim.slab_numel, cfg.optim.ring_slabs, cfg.optim.master_dtype,
                        cfg.host_compute_copy)

    def unit_pieces(self, u: int) -> range:
        """Indices of unit u's pieces (consecutive, since pieces are cut in unit order)."""
        return range(*self.unit_piece_ranges[u])

    @property
    def slab_bytes(self) -> int:
        return _align(self.slab_numel * 4)

    @property
    def ring_bytes(self) -> int:
        return self.ring_slabs * self.slab_bytes

    @property
    def aliased(self) -> bool:
        """The worker reads the master itself (no separate compute copy)."""
        return self.compute_bytes == 0

    @property
    def cast_on_device(self) -> bool:
        """The worker reads the master and casts it to the compute dtype itself."""
        return self.aliased and self.compute_dtype != self.master_dtype

    @property
    def num_units(self) -> int:
        return len(self.units)

    def path(self, kind: str) -> str:
        return os.path.join(self.shm_dir, file_name(self.owner_pid, self.run_id, kind))

    @property
    def control_words(self) -> int:
        return 3 + len(self.pieces) + 2 * self.ring_slabs

    @property
    def control_bytes(self) -> int:
        return 8 * self.control_words

    def file_sizes(self) -> dict[str, int]:
        sizes = {"master": self.master_bytes, "ring": self.ring_bytes, "control": self.control_bytes}
        if not self.aliased:
            sizes["compute"] = self.compute_bytes
        return sizes


class RunBuffers:
    """The shared-memory files of a run, mapped in this process, with per-unit views."""

    def __init__(self, h: Handles, create: bool = False, kinds=("master", "compute", "ring", "control")):
        self.h = h
        self.files: dict[str, ShmFile] = {}
        sizes = h.file_sizes()
        for kind in kinds:
            if kind == "compute" and h.aliased:
                continue
            self.files[kind] = ShmFile(h.path(kind), sizes[kind], create)
        self.control = self.files["control"].view(torch.int64, 0, h.control_words) if "control" in self.files else None
        P, R = len(h.pieces), h.ring_slabs
        self._ver, self._slab, self._slab_step = 3, 3 + P, 3 + P + R

    def master(self, u: int) -> torch.Tensor:
        return self.files["master"].view(DTYPES[self.h.master_dtype], self.h.master_offsets[u], self.h.units[u].numel)

    def compute(self, u: int) -> torch.Tensor:
        """What the worker streams for unit u: the compute copy, or the master itself when
        there is none (``Handles.cast_on_device``: then in the master's dtype)."""
        if self.h.aliased:
            return self.master(u)
        return self.files["compute"].view(DTYPES[self.h.compute_dtype], self.h.compute_offsets[u],
                                          self.h.units[u].numel)

    def piece_master(self, p: Piece) -> torch.Tensor:
        return self.master(p.unit)[p.start:p.stop]

    def piece_compute(self, p: Piece) -> torch.Tensor:
        return self.compute(p.unit)[p.start:p.stop]

    def slab(self, s: int, numel: int | None = None) -> torch.Tensor:
        return self.files["ring"].view(torch.float32, s * self.h.slab_bytes,
                                       self.h.slab_numel if numel is None else numel)

    # -- control words
    def abort(self) -> None:
        self.control[0] = 1

    @property
    def aborted(self) -> bool:
        return bool(self.control[0])

    def version(self, p: int) -> int:
        return int(self.control[self._ver + p])

    def set_version(self, p: int, v: int) -> None:
        self.control[self._ver + p] = v

    def unit_version(self, u: int) -> int:
        """Optimizer steps applied to every piece of unit u (the least over its pieces)."""
        r = self.h.unit_pieces(u)
        return int(self.control[self._ver + r.start: self._ver + r.stop].min())

    def slab_piece(self, s: int) -> int:
        """p + 1 when slab s holds piece p, 0 when it is free."""
        return int(self.control[self._slab + s])

    def slab_step(self, s: int) -> int:
        return int(self.control[self._slab_step + s])

    def fill_slab(self, s: int, piece: int, step: int) -> None:
        self.control[self._slab_step + s] = step
        self.control[self._slab + s] = piece + 1

    def put_piece(self, piece: Piece, step: int, copy, timeout_s: float) -> float:
        """The writer's side of the ring for one piece: wait until its slab (``piece mod R``)
        is free, ``copy(slab view)`` the gradient in, hand the slab to the piece's shard.
        Returns the seconds spent waiting for the slab."""
        s = piece.index % self.h.ring_slabs
        waited = self.wait(lambda: self.slab_piece(s) == 0,
                           f"gradient slab {s} (for piece {piece.index} of step {step})", timeout_s)
        copy(self.slab(s, piece.numel))
        self.fill_slab(s, piece.index, step)
        return waited

    def free_slab(self, s: int) -> None:
        self.control[self._slab + s] = 0

    def reset(self, step: int) -> None:
        """State of a run whose weights are those after ``step`` steps: every piece at that
        version, the ring empty, nothing decided beyond it."""
        self.control[self._ver: self._ver + len(self.h.pieces)] = step
        self.control[self._slab: self._slab + self.h.ring_slabs] = 0
        self.control[1] = step

    def decide(self, step: int, apply: bool) -> None:
        """Publish step ``step``'s verdict: its gradients are applied, or the step is skipped."""
        self.control[2] = 1 if apply else 0
        self.control[1] = step + 1

    def decided(self, step: int) -> bool:
        return int(self.control[1]) >= step + 1

    @property
    def verdict(self) -> bool:
        return bool(self.control[2])

    def wait(self, ready, what: str, timeout_s: float) -> float:
        """Wait until ``ready()``; returns seconds waited. Raises on abort or timeout."""
        if ready():
            return 0.0
        t0 = time.perf_counter()
        spins = 0
        while not ready():
            if self.aborted:
                raise RunAborted(f"run aborted while waiting for {what}")
            waited = time.perf_counter() - t0
            if waited > timeout_s:
                raise TimeoutError(f"waited {waited:.0f} s for {what} (worker.wait_timeout_s={timeout_s})")
            spins += 1
            # Spin briefly, then poll every 0.2 ms; a long wait (a shard waiting for the
            # worker's whole backward) backs off to 5 ms so it leaves the cores to the others.
            time.sleep(0 if spins < 100 else 0.0002 if waited < 0.05 else 0.001 if waited < 1.0 else 0.005)
        return time.perf_counter() - t0
