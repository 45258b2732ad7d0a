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
- ``grads`` (``optim.grad_placement`` host, instead of the ring): every unit's gradient as it
  left the GPU, in ``optim.grad_dtype``, waiting for the step's norm; one region a unit.
- ``control``: the protocol's int64 control words (``megaray.protocol``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megaray.layout import DTYPES, Piece, UnitLayout, align, cut_pieces, unit_offsets
from megaray.protocol import Control, GradientRing, HostGradients, control_words
from megaray.shm import ShmFile, file_name


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
    grad_placement: str = "device"                     # where gradients wait for the norm
    grad_dtype: str = "float32"                        # what crosses the link and waits in host memory
    grad_offsets: tuple[int, ...] = ()
    grad_bytes: int = 0
    resident: tuple[int, ...] = ()                     # units whose state stays on the worker's device

    @classmethod
    def plan(cls, run_id: str, owner_pid: int, shm_dir: str, compute_dtype: str, units,
             slab_numel: int, ring_slabs: int, master_dtype: str = "float32", host_copy: bool = True,
             grad_placement: str = "device", grad_dtype: str = "float32", resident: tuple[int, ...] = ()) -> Handles:
        """Resident units have master regions (written for checkpoints) but no gradient
        pieces: nothing of theirs crosses the ring or reaches a shard."""
        units = tuple(units)
        m_off, m_bytes = unit_offsets(units, DTYPES[master_dtype].itemsize)
        if compute_dtype == master_dtype or not host_copy:
            c_off, c_bytes = m_off, 0
        else:
            c_off, c_bytes = unit_offsets(units, DTYPES[compute_dtype].itemsize)
        pieces = cut_pieces([u for u in units if u.index not in resident], slab_numel)
        slab_numel = max(p.numel for p in pieces)    # a slab holds the largest piece, no more
        ring_slabs = min(ring_slabs, len(pieces))                     # nor more slabs than pieces
        count = {u.index: 0 for u in units}
        for p in pieces:
            count[p.unit] += 1
        ranges, first = [], 0
        for u in units:                       # pieces are cut in unit order
            ranges.append((first, first + count[u.index]))
            first += count[u.index]
        g_off, g_bytes = unit_offsets(units, DTYPES[grad_dtype].itemsize) if grad_placement == "host" else ((), 0)
        if grad_placement == "host":
            ring_slabs = 0                    # gradients wait in their own regions, not in a ring
        return cls(run_id, owner_pid, shm_dir, compute_dtype, master_dtype, units, m_off, m_bytes, c_off, c_bytes,
                   pieces, slab_numel, ring_slabs, tuple(ranges), grad_placement, grad_dtype, g_off, g_bytes,
                   tuple(resident))

    @classmethod
    def for_config(cls, cfg, run_id: str, owner_pid: int, units) -> Handles:
        o = cfg.optim
        return cls.plan(run_id, owner_pid, cfg.cluster.shm_dir, cfg.train.compute_dtype, units,
                        o.slab_numel, o.ring_slabs, o.master_dtype, cfg.host_compute_copy,
                        "host" if o.grad_placement == "host" else "device", o.grad_dtype,
                        tuple(range(o.resident_count)))

    @property
    def streamed(self) -> tuple[int, ...]:
        """Units whose state lives in host memory (every unit but the resident ones)."""
        return tuple(u.index for u in self.units if u.index not in self.resident)

    def unit_regions(self, kind: str) -> list[tuple[int, int]]:
        """(byte offset, bytes) of each streamed unit's region of a per-unit file ('master',
        'compute', 'grads'). A resident unit's region is never written, so the file stays
        sparse there and takes no memory."""
        offsets, dtype = {"master": (self.master_offsets, self.master_dtype),
                          "compute": (self.compute_offsets, self.compute_dtype),
                          "grads": (self.grad_offsets, self.grad_dtype)}[kind]
        return [(offsets[u], align(self.units[u].numel * DTYPES[dtype].itemsize)) for u in self.streamed]

    def held_bytes(self, kind: str) -> int:
        """Bytes of a per-unit file that hold data: the streamed units' regions."""
        return sum(n for _, n in self.unit_regions(kind))

    def unit_pieces(self, u: int) -> range:
        """Indices of unit u's pieces (consecutive, since pieces are cut in unit order)."""
        return range(*self.unit_piece_ranges[u])

    @property
    def slab_bytes(self) -> int:
        return align(self.slab_numel * DTYPES[self.grad_dtype].itemsize)

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
        sizes = {"master": self.master_bytes, "control": self.control_bytes}
        if self.grad_placement == "host":
            sizes["grads"] = self.grad_bytes
        else:
            sizes["ring"] = self.ring_bytes
        if not self.aliased:
            sizes["compute"] = self.compute_bytes
        return sizes


class RunBuffers:
    """The shared-memory files of a run, mapped in this process, with per-unit views; the
    protocol's ``control`` words and gradient ``ring`` when those files are mapped."""

    def __init__(self, h: Handles, create: bool = False, kinds=("master", "compute", "ring", "control")):
        """Map the files of ``kinds`` that this run has ('ring' stands for the gradients'
        home: the ring, or the host gradient buffer)."""
        self.h = h
        self.files: dict[str, ShmFile] = {}
        sizes = h.file_sizes()
        kinds = [("grads" if k == "ring" and h.grad_placement == "host" else k) for k in kinds]
        for kind in kinds:
            if kind in sizes:
                self.files[kind] = ShmFile(h.path(kind), sizes[kind], create)
        self.control = None
        if "control" in self.files:
            self.control = Control(self.files["control"].view(torch.int64, 0, h.control_words), len(h.pieces),
                                   h.ring_slabs)
        self.ring = GradientRing(self.control, self.slab) if "ring" in self.files and self.control else None
        self.host_grads = (HostGradients(self.control, self.piece_grad) if "grads" in self.files and self.control
                           else None)

    def master(self, u: int) -> torch.Tensor:
        return self.files["master"].view(DTYPES[self.h.master_dtype], self.h.master_offsets[u], self.h.units[u].numel)

    def compute(self, u: int) -> torch.Tensor:
        """What the worker streams for unit u: the compute copy, or the master itself when
        there is none (``Handles.cast_on_device``: then in the master's dtype)."""
        if self.h.aliased:
            return self.master(u)
        return self.files["compute"].view(DTYPES[self.h.compute_dtype], self.h.compute_offsets[u],
                                          self.h.units[u].numel)

    def streamed_regions(self, kind: str) -> list[torch.Tensor]:
        """The byte ranges of a per-unit file that streamed units use (what the worker pins:
        pinning a resident unit's never-written region would make the kernel allocate it)."""
        if not self.h.resident:
            return [self.files[kind].bytes]
        return [self.files[kind].bytes[at:at + n] for at, n in self.h.unit_regions(kind)]

    def streamed_version(self) -> int:
        """The step every streamed unit's weights are at, at least (the oldest piece's version)."""
        return min(self.control.versions(self.h.unit_pieces(u)) for u in self.h.streamed)

    def piece_master(self, p: Piece) -> torch.Tensor:
        return self.master(p.unit)[p.start:p.stop]

    def piece_compute(self, p: Piece) -> torch.Tensor:
        return self.compute(p.unit)[p.start:p.stop]

    def slab(self, s: int, numel: int | None = None) -> torch.Tensor:
        """Slab s of the ring (in ``optim.grad_dtype``)."""
        return self.files["ring"].view(DTYPES[self.h.grad_dtype], s * self.h.slab_bytes,
                                       self.h.slab_numel if numel is None else numel)

    def grad(self, u: int) -> torch.Tensor:
        """Unit u's region of the host gradient buffer (``optim.grad_placement`` host)."""
        return self.files["grads"].view(DTYPES[self.h.grad_dtype], self.h.grad_offsets[u], self.h.units[u].numel)

    def piece_grad(self, p: Piece) -> torch.Tensor:
        return self.grad(p.unit)[p.start:p.stop]
