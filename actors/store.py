"""ParameterStore actor: owns a run's shared-memory files and initializes the weights.

It creates the master, compute-copy, gradient-ring and control files, fills the master weights
from a Hugging Face directory (``model.from``) or deterministically from the seed (each unit from its own generator, so the result does not
depend on sharding), casts the compute copy, and publishes ``Handles``. It is the only
writer of weights outside the optimizer shards, and only before training starts.
"""
from __future__ import annotations

import torch

import resource
import time
from pathlib import Path

from megaray.buffers import Handles, RunBuffers
from megaray.checkpoint import read_into, write_bytes
from megaray.errors import CheckpointError
from megaray.hf import load_into
from megaray.config import RunConfig
from megaray.model import build_layout, init_unit
from megaray.shm import remove_run


class ParameterStore:
    def __init__(self, cfg: RunConfig, run_id: str, owner_pid: int):
        torch.set_num_threads(1)
        self.cfg = cfg
        units = build_layout(cfg.model)
        self.h = Handles.for_config(cfg, run_id, owner_pid, units)
        self.buf = RunBuffers(self.h, create=True)
        t0 = time.perf_counter()
        if cfg.model.from_path:
            # Tensor by tensor from memory-mapped safetensors: never the whole model twice.
            self.load_report = load_into(units, self.buf.master, cfg.model.from_path)
        else:
            for u in units:
                self.buf.master(u.index).copy_(init_unit(u, cfg.model, cfg.run.seed))
            self.load_report = {"initialized_from_seed": cfg.run.seed}
        for u in units:
            self._sync_compute(u.index)
        self.load_report.update(seconds=time.perf_counter() - t0,
                                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                                master_bytes=self.h.master_bytes)

    def report(self) -> dict:
        """How the weights were created: source, seconds, this process's peak RSS."""
        return self.load_report

    def _sync_compute(self, u: int) -> None:
        if not self.h.aliased:
            self.buf.compute(u).copy_(self.buf.master(u))

    def handles(self) -> Handles:
        return self.h

    def save(self, folder: str) -> dict:
        """Write the master weights of every unit as ``master.bin``; returns its part entry
        (which names the master's dtype)."""
        data = memoryview(self.buf.files["master"].bytes.numpy())[: self.h.master_bytes]
        return {"master.bin": {**write_bytes(Path(folder) / "master.bin", data), "dtype": self.h.master_dtype}}

    def load(self, folder: str, parts: dict, step: int) -> None:
        """Read ``master.bin`` (verifying its checksum), refresh the compute copy, and mark
        every piece as updated through ``step`` steps so the worker may read it for ``step``."""
        if "master.bin" not in parts:
            raise CheckpointError(f"{folder}: the manifest lists no master.bin")
        dtype = parts["master.bin"].get("dtype", "float32")
        if dtype != self.h.master_dtype:
            raise CheckpointError(f"{folder}: master.bin holds {dtype} weights, this run keeps {self.h.master_dtype} "
                                  "(optim.master_dtype must match the checkpoint's)")
        out = memoryview(self.buf.files["master"].bytes.numpy())[: self.h.master_bytes]
        read_into(Path(folder) / "master.bin", out, parts["master.bin"])
        for u in self.h.units:
            self._sync_compute(u.index)
        self.buf.reset(step)

    def ping(self) -> bool:
        return True

    def close(self) -> list[str]:
        return remove_run(self.h.shm_dir, self.h.run_id)
