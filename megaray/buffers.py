"""Where a run's tensors live in shared memory: the files, their per-unit views, and ``Handles``.

``Handles`` is the small, picklable description that crosses Ray: file names, per-unit byte
offsets, dtypes, the model layout and the gradient pieces. Every actor attaches the files it
needs from it (``RunBuffers``), and orders its access through ``megaray.protocol``.

Files of one run (see ``megaray.shm`` for naming):
- ``master``: master weights (fp32, or bf16 with ``optim.master_dtype``), one page-aligned
  region per layer unit.
- ``compute``: the compute-dtype copy the worker reads (absent when the compute dtype is
  the master's, or with ``optim.compute_copy`` device: then the worker reads the master
  regions themselves and, in the second case, casts them on the device).
- ``ring``: the gradient ring, R slabs of ``optim.grad_slab_mib`` each. A unit's flat fp32
  gradient is cut into pieces of at most one slab (``megaray.layout.cut_pieces``); piece p
  of a step always travels through slab ``p mod R``. Gradients use no other host memory, so
  the ring's size, not the model's, bounds it.
- ``control``: the protocol's int64 control words (``megaray.protocol``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megaray.layout import Piece, UnitLayout, align, cut_pieces, unit_offsets
from megaray.protocol import Control, GradientRing, control_words
from megaray.shm import ShmFile, file_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
             slab_numel: int, ring_slabs: int, master_dtype: str = "float32", host_copy: bool = True) -> Handles:
        units = tuple(units)
        m_off, m_bytes = unit_offsets(units, DTYPES[master_dtype].itemsize)
        if compute_dtype == master_dtype or not host_copy:
            c_off, c_bytes = m_off, 0
        else:
            c_off, c_bytes = unit_offsets(units, DTYPES[compute_dtype].itemsize)
        pieces = cut_pieces(units, slab_numel)
        slab_numel = min(slab_numel, max(p.numel for p in pieces))   # no slab larger than the largest piece
        first: dict[int, int] = {}
        for p in pieces:                      # pieces are cut in unit order: one pass
            first.setdefault(p.unit, p.index)
        ranges = tuple((first[u.index], first.get(u.index + 1, len(pieces))) for u in units)
        return cls(run_id, owner_pid, shm_dir, compute_dtype, master_dtype, units, m_off, m_bytes, c_off, c_bytes,
                   pieces, slab_numel, ring_slabs, ranges)

    @classmethod
    def for_config(cls, cfg, run_id: str, owner_pid: int, units) -> Handles:
        return cls.plan(run_id, owner_pid, cfg.cluster.shm_dir, cfg.train.compute_dtype, units,
                        cfg.optim.slab_numel, cfg.optim.ring_slabs, cfg.optim.master_dtype,
                        cfg.host_compute_copy)

    def unit_pieces(self, u: int) -> range:
        """Indices of unit u's pieces (consecutive, since pieces are cut in unit order)."""
        return range(*self.unit_piece_ranges[u])

    @property
    def slab_bytes(self) -> int:
        return align(self.slab_numel * 4)

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
        return control_words(len(self.pieces), self.ring_slabs)

    @property
    def control_bytes(self) -> int:
        return 8 * self.control_words

    def file_sizes(self) -> dict[str, int]:
        sizes = {"master": self.master_bytes, "ring": self.ring_bytes, "control": self.control_bytes}
        if not self.aliased:
            sizes["compute"] = self.compute_bytes
        return sizes


class RunBuffers:
    """The shared-memory files of a run, mapped in this process, with per-unit views; the
    protocol's ``control`` words and gradient ``ring`` when those files are mapped."""

    def __init__(self, h: Handles, create: bool = False, kinds=("master", "compute", "ring", "control")):
        self.h = h
        self.files: dict[str, ShmFile] = {}
        sizes = h.file_sizes()
        for kind in kinds:
            if kind == "compute" and h.aliased:
                continue
            self.files[kind] = ShmFile(h.path(kind), sizes[kind], create)
        self.control = None
        if "control" in self.files:
            self.control = Control(self.files["control"].view(torch.int64, 0, h.control_words), len(h.pieces),
                                   h.ring_slabs)
        self.ring = GradientRing(self.control, self.slab) if "ring" in self.files and self.control else None

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
