"""Where a run's tensors live in shared memory, and the control words that order access.

``Handles`` is the small, picklable description that crosses Ray: file names, per-unit byte
offsets, dtypes and the model layout. Every actor attaches the files it needs from it.

Files of one run (see ``megaray.shm`` for naming):
- ``master``: fp32 master weights, one flat region per layer unit.
- ``compute``: the compute-dtype copy the worker reads (absent when compute is fp32: then
  the worker reads the master regions themselves).
- ``grad``: one fp32 gradient region per layer unit, written by the worker, read and
  released by the unit's optimizer shard.
- ``control``: int64 words: [abort, version[U], grad_state[U]].

Invariants the control words keep:
- ``version[u]`` is the number of optimizer steps applied to unit u. The worker stages unit u
  for step t only once ``version[u] == t``; so a layer's compute copy is never read while
  its update runs, and never read stale.
- ``grad_state[u]`` is 1 from the moment the worker has written unit u's gradient until its
  optimizer shard has consumed it; the worker writes a gradient region only when it is 0.
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


def _offsets(units, elem_size: int) -> tuple[tuple[int, ...], int]:
    out, off = [], 0
    for u in units:
        out.append(off)
        off = _align(off + u.numel * elem_size)
    return tuple(out), off


@dataclass(frozen=True)
class Handles:
    run_id: str
    owner_pid: int
    shm_dir: str
    compute_dtype: str
    units: tuple[UnitLayout, ...]
    master_offsets: tuple[int, ...]
    master_bytes: int
    compute_offsets: tuple[int, ...]
    compute_bytes: int

    @classmethod
    def plan(cls, run_id: str, owner_pid: int, shm_dir: str, compute_dtype: str, units) -> "Handles":
        units = tuple(units)
        m_off, m_bytes = _offsets(units, 4)
        if compute_dtype == "float32":
            c_off, c_bytes = m_off, 0
        else:
            c_off, c_bytes = _offsets(units, DTYPES[compute_dtype].itemsize)
        return cls(run_id, owner_pid, shm_dir, compute_dtype, units, m_off, m_bytes, c_off, c_bytes)

    @property
    def aliased(self) -> bool:
        """The worker reads the fp32 master itself (no separate compute copy)."""
        return self.compute_bytes == 0

    @property
    def num_units(self) -> int:
        return len(self.units)

    def path(self, kind: str) -> str:
        return os.path.join(self.shm_dir, file_name(self.owner_pid, self.run_id, kind))

    @property
    def control_bytes(self) -> int:
        return 8 * (1 + 2 * self.num_units)

    def file_sizes(self) -> dict[str, int]:
        sizes = {"master": self.master_bytes, "grad": self.master_bytes, "control": self.control_bytes}
        if not self.aliased:
            sizes["compute"] = self.compute_bytes
        return sizes


class RunBuffers:
    """The shared-memory files of a run, mapped in this process, with per-unit views."""

    def __init__(self, h: Handles, create: bool = False, kinds=("master", "compute", "grad", "control")):
        self.h = h
        self.files: dict[str, ShmFile] = {}
        sizes = h.file_sizes()
        for kind in kinds:
            if kind == "compute" and h.aliased:
                continue
            self.files[kind] = ShmFile(h.path(kind), sizes[kind], create)
        self.control = self.files["control"].view(torch.int64, 0, 1 + 2 * h.num_units) if "control" in self.files else None

    def master(self, u: int) -> torch.Tensor:
        return self.files["master"].view(torch.float32, self.h.master_offsets[u], self.h.units[u].numel)

    def compute(self, u: int) -> torch.Tensor:
        if self.h.aliased:
            return self.master(u)
        return self.files["compute"].view(DTYPES[self.h.compute_dtype], self.h.compute_offsets[u],
                                          self.h.units[u].numel)

    def grad(self, u: int) -> torch.Tensor:
        return self.files["grad"].view(torch.float32, self.h.master_offsets[u], self.h.units[u].numel)

    # -- control words
    def abort(self) -> None:
        self.control[0] = 1

    @property
    def aborted(self) -> bool:
        return bool(self.control[0])

    def version(self, u: int) -> int:
        return int(self.control[1 + u])

    def set_version(self, u: int, v: int) -> None:
        self.control[1 + u] = v

    def grad_state(self, u: int) -> int:
        return int(self.control[1 + self.h.num_units + u])

    def set_grad_state(self, u: int, v: int) -> None:
        self.control[1 + self.h.num_units + u] = v

    def wait(self, ready, what: str, timeout_s: float) -> float:
        """Spin-wait until ``ready()``; returns seconds waited. Raises on abort or timeout."""
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
            time.sleep(0 if spins < 100 else 0.0002)
        return time.perf_counter() - t0
