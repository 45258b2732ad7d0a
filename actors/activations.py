"""What the worker keeps of a step's activations between its forward and its backward.

Every block's *input* is saved for each micro-batch. Beyond that:
- the last K blocks keep their internals (and a private device copy of their weights, since
  their slot is refilled) so their backward needs no recomputation: K is
  ``worker.keep_activations``, or, when unset, what ``megaray.memory``'s model says fits the
  device's budget, corrected after every step by the measured peak and one kept block's
  measured cost (``memory.adapt_keep``). They keep what the lean block saves, or, when every
  block fits that way (``memory.kept_plain``), plain autograd's activations, which run faster;
- the first N blocks' inputs wait in pinned host memory (``worker.offload_inputs``: when the
  user leaves it unset, the plan's number, ``plan.resolve``, which its host memory counts; the
  worker never offloads on its own), going out on the offload stream after the compute that
  wrote them and coming back one block ahead of their backward;
- with ``worker.input_stride`` S > 1 only every S-th recomputed block's input is saved at all
  (and, among the first N, offloaded); the backward rebuilds the others from it
  (``memory.recompute_order``).
"""
from __future__ import annotations

import torch

from megaray import memory
from megaray.config import RunConfig
from megaray.step import WorkerTimes

from .device import Device


class ActivationPolicy:
    def __init__(self, cfg: RunConfig, dev: Device, block_numel: int, dtype: torch.dtype, cast_slab_bytes: int):
        self.cfg, self.dev = cfg, dev
        self.L = cfg.model.num_hidden_layers
        self.block_numel, self.dtype, self.cast_slab_bytes = block_numel, dtype, cast_slab_bytes
        self.stride = cfg.worker.stride             # every stride-th block's input is saved
        self._keep: int | None = None
        self.lean = True                            # kept blocks save the lean block's internals
        self.kept_block_bytes = 0                   # measured device memory of one kept block
        self._kept_bufs: list[torch.Tensor] = []
        self.host_inputs: torch.Tensor | None = None
        self._host_mapping = None

    # ------------------------------------------------------------------ choices
    def _budget(self) -> int:
        return memory.gpu_budget(self.dev.free_bytes(), self.cfg.worker.gpu_memory_gib)

    def keep_count(self) -> int:
        """Blocks (the last ones) whose activations stay resident this step."""
        k = self.cfg.worker.keep_activations
        if k is not None:
            return min(k, self.L)
        if not self.dev.cuda:
            return 0
        if self._keep is None:
            self._keep, self.lean = memory.keep_choice(self.cfg, self._budget(), self._planned_offload(),
                                                       self.cast_slab_bytes)
        return self._keep

    def _planned_offload(self) -> int:
        """The config's number (resolved by the plan; None, an unresolved config: none). A
        count of the worker's own, from the free memory it sees once its CUDA libraries are
        loaded, once offloaded every block's input on a run the plan had fit with none: 12 GiB
        of pinned host memory it had not counted, and the host's OOM killer ended the run
        (BENCHMARKS.md run 68)."""
        return self.cfg.worker.offload_inputs or 0

    def offload_count(self, keep_from: int) -> int:
        """Blocks (the first ones) whose inputs wait in host memory: the config's number, never
        a kept block's."""
        return min(self._planned_offload(), keep_from, self.L)

    def measure_kept_block(self, allocated_before: int, buf: torch.Tensor) -> None:
        """The first kept block's cost, as the allocator saw it: internals and its weights."""
        if self.dev.cuda and not self.kept_block_bytes:
            self.kept_block_bytes = self.dev.memory_allocated() - allocated_before + buf.numel() * buf.element_size()

    def adapt(self, peak_bytes: int) -> None:
        """Re-choose the kept blocks from this step's measured peak."""
        if self.cfg.worker.keep_activations is not None or not self.dev.cuda or not self.kept_block_bytes:
            return
        keep = memory.adapt_keep(self._keep or 0, self.L, peak_bytes, self.kept_block_bytes, self._budget())
        if not self.lean and keep < self.L:     # plain blocks no longer all fit: lean ones, measured afresh
            self.lean, self.kept_block_bytes = True, 0
            keep = memory.keep_count(self.cfg, self._budget(), self._planned_offload(), self.cast_slab_bytes)
        self._keep = keep

    # ------------------------------------------------------------------ buffers
    def kept_buffer(self, k: int) -> torch.Tensor:
        while len(self._kept_bufs) <= k:
            self._kept_bufs.append(self.dev.empty(self.block_numel, self.dtype))
        return self._kept_bufs[k]

    def host_buffer(self, n: int, like: torch.Tensor, M: int) -> torch.Tensor:
        """Host memory for the saved inputs among the first n blocks, of M micro-batches,
        allocated (and pinned) once."""
        shape = (memory.anchors(n, self.stride), M) + tuple(like.shape)
        if self.host_inputs is None or tuple(self.host_inputs.shape) != shape:
            self.free_host_buffer()
            self.host_inputs, self._host_mapping = self.dev.pinned_empty(shape, like.dtype)
        return self.host_inputs

    def free_host_buffer(self) -> None:
        if self.host_inputs is not None:
            self.dev.synchronize()                  # no copy still reads or writes it
            if self._host_mapping is not None:
                self.dev.unpin(self.host_inputs)
            self.host_inputs = self._host_mapping = None    # the mapping goes with its last reference

    def offload(self, j: int, acts: list, times: WorkerTimes) -> None:
        """Send block j's saved inputs to host memory (after the compute that wrote them)."""
        host = self.host_inputs[j // self.stride]
        if self.dev.cuda:
            ev = self.dev.event_after_compute()
            with torch.cuda.stream(self.dev.offload_stream):
                self.dev.offload_stream.wait_event(ev)
                for m, x in enumerate(acts[j]):
                    host[m].copy_(x, non_blocking=True)
                    x.record_stream(self.dev.offload_stream)   # its memory is reused only after the copy
        else:
            for m, x in enumerate(acts[j]):
                host[m].copy_(x)
        times.offload_bytes += sum(x.numel() * x.element_size() for x in acts[j])
        acts[j] = [None] * len(acts[j])

    def fetch(self, j: int, acts: list):
        """Bring block j's inputs back to the device; returns the event compute waits on."""
        host = self.host_inputs[j // self.stride]
        if not self.dev.cuda:
            acts[j] = [x.clone() for x in host]
            return None
        with torch.cuda.stream(self.dev.offload_stream):
            back = [x.to(self.dev.device, non_blocking=True) for x in host]
            ev = torch.cuda.Event()
            ev.record(self.dev.offload_stream)
        for x in back:
            x.record_stream(self.dev.compute_stream)
        acts[j] = back
        return ev
