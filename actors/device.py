"""The worker's device: its CUDA streams (or the CPU), pinning, events, and the step's clock.

On CUDA the worker runs four streams: compute (the current stream), copy-in (weights
staged into the next slot), copy-out (gradients into the ring) and offload (block inputs to
and from pinned host memory); ordering between them is by events only, never by
synchronising the host. On the CPU the same calls run in order with plain copies, so CI
exercises the same schedule.

``StepClock`` brackets every compute region (a unit's forward, the head, a unit's backward)
with events on the compute stream (wall time on the CPU), so ``compute_s`` is the GPU's busy
time; the gaps between regions are the GPU idle inside a step. A gap before a unit whose
weights had to wait for the optimizer counts as optimizer wait (up to that wait), the rest
as waiting for copy-in or for kernel launches.
"""
from __future__ import annotations

import math
import mmap
import time
from contextlib import contextmanager

import torch

from megaray.step import WorkerTimes


class Device:
    def __init__(self, device: str, cap_bytes: int | None = None):
        """``cap_bytes`` (``worker.gpu_memory_gib``): the most this process may allocate on
        the GPU; the caching allocator enforces it (an allocation past it is out of memory)."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.cap_bytes = cap_bytes
        if self.cuda and cap_bytes is not None:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), index)
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(self.device)
            self.copy_stream = torch.cuda.Stream(self.device)
            self.out_stream = torch.cuda.Stream(self.device)
            self.offload_stream = torch.cuda.Stream(self.device)

    def pin(self, t: torch.Tensor, what: str) -> None:
        """Register host memory (a shared file's mapping) with CUDA once, for the whole run:
        copies from pageable memory run at a seventh of the pinned rate."""
        if not self.cuda:
            return
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {what} ({t.numel() * t.element_size()} bytes) failed: {err}")

    def unpin(self, t: torch.Tensor) -> None:
        if self.cuda:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def pinned_empty(self, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
        """Page-locked host memory of exactly this size (plain memory on the CPU), and the
        mapping that holds it: drop both after ``unpin``. Not torch's ``pin_memory``: its
        caching allocator rounds every block up to a power of two, so 10 GiB of offloaded
        inputs would hold 16 GiB of host memory that the planner never counted."""
        if not self.cuda:
            return torch.empty(shape, dtype=dtype), None
        nbytes = math.prod(shape) * dtype.itemsize
        mapping = mmap.mmap(-1, max(nbytes, 1))
        t = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        self.pin(t, f"{nbytes} bytes of offloaded block inputs")
        return t.view(dtype).view(shape), mapping

    def event_after_compute(self):
        """An event after the compute issued so far (None on the CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.compute_stream)
        return ev

    def compute_waits(self, ev) -> None:
        if ev is not None:
            self.compute_stream.wait_event(ev)

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=self.device)

    def zeros(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def free_bytes(self) -> int:
        """Device memory free to this process: free plus what it holds already (its cap,
        ``worker.gpu_memory_gib``, is applied by ``memory.gpu_budget``)."""
        return torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def wait_compute_and_copy_in(self) -> None:
        """The host waits for the compute and copy-in streams (never for copy-out, which
        waits on the optimizer shards)."""
        if self.cuda:
            self.copy_stream.synchronize()
            self.compute_stream.synchronize()


class StepClock:
    """The compute regions of one step and the optimizer waits of the units they used."""

    def __init__(self, dev: Device):
        self.dev = dev
        self.spans: list = []
        self.copy_events: list = []
        self.opt_wait: dict[int, float] = {}        # unit -> optimizer wait before its copy-in

    @contextmanager
    def span(self, u: int):
        """Bracket unit u's compute region (u = -1: the step's reductions)."""
        if self.dev.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(self.dev.compute_stream)
            yield
            b.record(self.dev.compute_stream)
        else:
            a = time.perf_counter()
            yield
            b = time.perf_counter()
        self.spans.append((u, a, b))

    def waited_for_optimizer(self, u: int, seconds: float) -> None:
        self.opt_wait[u] = self.opt_wait.get(u, 0.0) + seconds

    def add_gpu_time(self, times: WorkerTimes) -> None:
        """Add the busy time of the step's compute regions and the idle gaps between them to
        ``times`` (call after the compute stream has finished the step)."""
        el = (lambda a, b: a.elapsed_time(b) / 1e3) if self.dev.cuda else (lambda a, b: b - a)
        busy = opt = other = first = 0.0
        for k, (u, a, b) in enumerate(self.spans):
            busy += el(a, b)
            waited = self.opt_wait.pop(u, 0.0)         # only a unit's first region waited
            if k:
                gap = max(0.0, el(self.spans[k - 1][2], a))
                w = min(gap, waited)
                opt, other = opt + w, other + gap - w
            else:                                       # before the first region: outside the GPU
                first = waited                          # work, of which this long waiting for updates
        times.compute_s += busy
        times.gap_optimizer_s += opt
        times.gap_other_s += other
        times.first_unit_optimizer_s += first
        if self.dev.cuda:
            times.copy_in_s += sum(a.elapsed_time(b) for a, b in self.copy_events) / 1e3
