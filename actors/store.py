"""ParameterStore actor: owns a run's shared-memory files and initializes the weights.

It creates the master, compute-copy, gradient-ring and control files, fills the master weights
from a Hugging Face directory (``model.from``) or deterministically from the seed (each unit
from its own generator, so the result does not depend on sharding), casts the compute copy,
and publishes ``Handles``. It is the only writer of weights outside the optimizer shards, and
only before training starts (or when a checkpoint is loaded, between steps).
"""
from __future__ import annotations

import os
import resource
import struct
import threading
import time
from pathlib import Path

import torch

from megaray.buffers import Handles, RunBuffers
from megaray.checkpoint import Checkpoint
from megaray.config import RunConfig
from megaray.errors import CheckpointError
from megaray.hf.read import load_into
from megaray.layout import build_layout
from megaray.machine import on_cores
from megaray.model import init_params
from megaray.parts import PartWriter
from megaray.shm import ShmFile, file_name, remove_run


def startup_path(shm_dir: str, owner_pid: int, run_id: str) -> str:
    """The store's start-up counter: two int64, values written so far and values in all."""
    return os.path.join(shm_dir, file_name(owner_pid, run_id, "startup"))


def read_startup(path: str) -> tuple[int, int] | None:
    """(values written, values in all) of a store starting, or None before it has begun."""
    try:
        with open(path, "rb") as f:
            data = f.read(16)
    except FileNotFoundError:
        return None
    return struct.unpack("=qq", data) if len(data) == 16 else None


class ParameterStore:
    def __init__(self, cfg: RunConfig, run_id: str, owner_pid: int):
        torch.set_num_threads(1)
        self.cfg = cfg
        units = build_layout(cfg.model)
        self.h = Handles.for_config(cfg, run_id, owner_pid, units)
        # what the driver reads to show the initialisation's progress (it goes with the run's files)
        self._startup = ShmFile(startup_path(cfg.cluster.shm_dir, owner_pid, run_id), 16, create=True)
        counts, lock = self._startup.view(torch.int64, 0, 2), threading.Lock()
        counts[1] = sum(units[u].numel for u in self.h.streamed)

        def progress(values: int) -> None:
            with lock:
                counts[0] += values

        self.buf = RunBuffers(self.h, create=True)
        t0 = time.perf_counter()
        # streamed units only: a resident unit's state is the worker's, from the same source
        if cfg.model.from_path:
            # A tensor a thread from memory-mapped safetensors: never the whole model twice.
            self.load_report = load_into(units, self.buf.master, cfg.model.from_path, only=set(self.h.streamed),
                                         progress=progress)
        else:
            # A parameter a thread, every core: nothing else runs before the store is ready,
            # and one thread takes minutes for a 14B model (about 200 M values/s).
            init_params([(s, self.buf.master(u)[s.offset:s.offset + s.numel]) for u in self.h.streamed
                         for s in units[u].params], cfg.model, cfg.run.seed, progress=progress)
            self.load_report = {"initialized_from_seed": cfg.run.seed}
        self._sync_compute()
        self.load_report.update(seconds=time.perf_counter() - t0,
                                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                                master_bytes=self.h.master_bytes)

    def __repr__(self) -> str:
        """What the Ray dashboard's Actors view shows (Ray reads it once, when the actor starts)."""
        held = sum(self.h.file_sizes().values())
        return f"ParameterStore({held / 2**30:.2f} GiB in {self.h.shm_dir}, {self.h.num_units} units)"

    def report(self) -> dict:
        """How the weights were created: source, seconds, this process's peak RSS."""
        return self.load_report

    def _sync_compute(self) -> None:
        if not self.h.aliased:      # a unit a thread, the largest (embedding, head) first
            on_cores(lambda u: self.buf.compute(u).copy_(self.buf.master(u)), self.h.streamed,
                     size=lambda u: self.h.units[u].numel)

    def handles(self) -> Handles:
        return self.h

    def save(self, folder: str) -> dict:
        """Write every streamed unit's master weights, unit after unit, as ``master.bin`` (the
        worker writes the resident units')."""
        with PartWriter(Path(folder) / "master.bin") as w:
            entries = [[u, 0, self.h.units[u].numel, w.write(self.buf.master(u))] for u in self.h.streamed]
            return {"master.bin": {**w.finish(), "master": entries}}

    def load(self, folder: str) -> None:
        """Read every streamed unit's master weights (verifying each block), refresh the
        compute copy, and mark every piece as updated through the checkpoint's step."""
        ck = Checkpoint(folder)
        stored = ck.manifest.get("master_dtype")
        if stored != self.h.master_dtype:
            raise CheckpointError(f"{folder}: the checkpoint holds {stored} master weights, this run keeps "
                                  f"{self.h.master_dtype} (optim.master_dtype must match the checkpoint's)")
        for u in self.h.streamed:
            ck.read_range("master", u, 0, self.h.units[u].numel, [self.buf.master(u)])
        self._sync_compute()
        self.buf.control.reset(ck.step)

    def ping(self) -> bool:
        return True

    def close(self) -> list[str]:
        return remove_run(self.h.shm_dir, self.h.run_id)
