"""The worker's weight slots: layer units brought onto the device, double buffered.

Block units share two device buffers (``block0``, ``block1``); the embedding and the head
have one each. ``stage(u, step)`` starts bringing unit u's compute weights as of step
``step`` into a slot on a copy thread, while the unit before it computes; the compute stream
waits for the copy's event (``ready``) before it reads the slot, and the copy stream waits
for the slot's last reader (``release``) before it overwrites it. A block goes to a free
block slot (staged units are busy until released): in a plain pass the two alternate, and a
block staged again while its slot still holds it for the same step is not copied again (the
backward's first block, left there by the forward; an anchor block run forward again and
then backward, ``worker.input_stride``).

Where the weights come from:
- ``SharedSource``: the run's shared memory on this node. A unit crosses piece by piece, each
  piece as soon as its update is in (``Control.wait_version``): a unit updated by several
  shards at once starts crossing the link before its last piece is done. The files are
  pinned once, so copies run at the link's pinned rate. With ``optim.compute_copy`` device
  there is no bf16 copy on the host: the fp32 master crosses the link one slab at a time
  into a staging buffer and is cast into the slot on the copy stream.
- ``RelaySource``: a worker on another node asks the relay actor (``actors.relay``) for the
  unit through Ray's object store, then pins and copies it.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megaray.buffers import Handles, RunBuffers
from megaray.config import RunConfig
from megaray.layout import DTYPES, bind
from megaray.step import WorkerTimes

from .calls import get_or_raise
from .device import Device, StepClock


class SharedSource:
    """Unit weights from the run's shared memory (pinned once, on CUDA)."""

    def __init__(self, cfg: RunConfig, h: Handles, buf: RunBuffers, dev: Device):
        self.cfg, self.h, self.buf = cfg, h, buf
        for region in buf.streamed_regions("master" if h.aliased else "compute"):
            dev.pin(region, "the weights")

    def parts(self, u: int, step: int):
        """(source tensor, [(piece, start, stop), ...], seconds waited so far)."""
        return self.buf.compute(u), [(i, self.h.pieces[i].start, self.h.pieces[i].stop)
                                     for i in self.h.unit_pieces(u)], 0.0

    def wait_piece(self, piece: int, u: int, step: int) -> float:
        return self.buf.control.wait_version(piece, step, f"optimizer update of {self.h.units[u].name} for step "
                                                          f"{step}", self.cfg.worker.wait_timeout_s)

    def version(self) -> int:
        return self.buf.streamed_version()


class RelaySource:
    """Unit weights from the store's node through Ray's object store (a worker on another node)."""

    def __init__(self, relay, dev: Device):
        self.relay, self.dev = relay, dev

    def parts(self, u: int, step: int):
        t0 = time.perf_counter()
        src = get_or_raise(self.relay.unit.remote(u, step), "relay")   # waits for the unit's update
        waited = time.perf_counter() - t0
        if self.dev.cuda:
            src = src.pin_memory()
        return src, [(None, 0, src.numel())], waited

    def wait_piece(self, piece, u: int, step: int) -> float:
        return 0.0

    def version(self) -> int:
        return get_or_raise(self.relay.version.remote(), "relay")


_BLOCKS = ("block0", "block1")


def _done() -> Future:
    fut: Future = Future()
    fut.set_result(None)
    return fut


class WeightSlots:
    """Device slots for the embedding (unless it is resident), the head and two block buffers
    (each block into whichever is free)."""

    def __init__(self, cfg: RunConfig, h: Handles, dev: Device, source, resident=None):
        self.cfg, self.h, self.dev, self.source = cfg, h, dev, source
        self.resident = resident           # resident units' compute copies stand in for slots
        self.resident_units = frozenset(resident.units if resident is not None else ())
        self.units = h.units
        self.dtype = DTYPES[cfg.train.compute_dtype]
        block_numel = self.units[1].numel if len(self.units) > 2 else 0
        self.slots = {"head": dev.empty(self.units[-1].numel, self.dtype),
                      "block0": dev.empty(block_numel, self.dtype), "block1": dev.empty(block_numel, self.dtype)}
        if 0 not in self.resident_units:           # a resident embedding is read where it lives
            self.slots["embed"] = dev.empty(self.units[0].numel, self.dtype)
        # slot -> (unit, step, the copy that fills it) it holds or is receiving
        self.holds: dict[str, tuple[int, int, Future]] = {}
        self.free_event: dict[str, object] = {}              # slot -> event after its last reader
        self.busy: set[str] = set()                          # block slots staged and not yet released
        self._staging: torch.Tensor | None = None            # fp32 slab for the on-device cast
        self.copy_in = ThreadPoolExecutor(1, thread_name_prefix="copy-in")

    def slot_name(self, u: int) -> str:
        """The slot that holds (or receives) unit u."""
        kind = self.units[u].kind
        if kind != "block":
            return kind
        # both slots may hold u, one of them from an earlier step: the newer is u's
        held = [(self.holds[name][1], name) for name in _BLOCKS if self.holds.get(name, (None,))[0] == u]
        if not held:
            raise KeyError(f"{self.units[u].name} is in no block slot")
        return max(held)[1]

    def _block_slot(self, u: int, step: int) -> str:
        """The block slot unit u is staged into: its own, if it holds it for this step still;
        else a free one."""
        for name in _BLOCKS:
            if self.holds.get(name, (None, None))[:2] == (u, step):
                return name
        for name in _BLOCKS:
            if name not in self.busy:
                return name
        raise RuntimeError(f"no free block slot for {self.units[u].name}: both hold units not yet released")

    def begin(self) -> None:
        """A pass over the units starts: every block slot is free to take a new unit (after a
        failed step too). What the slots hold stays, for a block staged again."""
        self.busy.clear()

    def flat(self, u: int) -> torch.Tensor:
        if u in self.resident_units:
            return self.resident.compute[u]
        return self.slots[self.slot_name(u)][: self.units[u].numel]

    def weights(self, u: int, grad: bool):
        """The flat slot of unit u (a leaf that requires grad when ``grad``) and views into it."""
        flat = self.flat(u)
        if grad:
            flat = flat.detach().requires_grad_()
        return flat, bind(flat, self.units[u])

    def stage(self, u: int, step: int, times: WorkerTimes, clock: StepClock) -> Future:
        """Start bringing unit u's compute weights (as of step ``step``) into its slot (a
        resident unit's are on the device already: updated in order on the compute stream)."""
        if u in self.resident_units:
            return _done()
        block = self.units[u].kind == "block"
        slot = self._block_slot(u, step) if block else self.units[u].kind
        if block:
            self.busy.add(slot)
        held = self.holds.get(slot)
        if held is not None and held[:2] == (u, step):
            return held[2]                              # its copy, done or still in flight
        free_ev = self.free_event.get(slot)
        dst = self.slots[slot][: self.units[u].numel]

        def work():
            src, parts, waited = self.source.parts(u, step)
            times.copy_in_bytes += src.numel() * src.element_size()
            if self.dev.cuda and free_ev is not None:
                self.dev.copy_stream.wait_event(free_ev)
            ev = None
            for piece, a, b in parts:
                if piece is not None:
                    waited += self.source.wait_piece(piece, u, step)
                ev = self.copy_in_range(dst[a:b], src[a:b], times, clock)
            times.wait_optimizer_s += waited
            clock.waited_for_optimizer(u, waited)
            return ev

        fut = self.copy_in.submit(work)
        self.holds[slot] = (u, step, fut)
        return fut

    def ready(self, fut: Future, times: WorkerTimes) -> None:
        """The compute stream waits for a staged unit."""
        t0 = time.perf_counter()
        self.dev.compute_waits(fut.result())
        times.wait_copy_in_s += time.perf_counter() - t0

    def release(self, u: int) -> None:
        """Compute issued so far has finished reading unit u's slot before it is refilled."""
        if u in self.resident_units:
            return
        slot = self.slot_name(u)
        ev = self.dev.event_after_compute()
        if ev is not None:
            self.free_event[slot] = ev
        self.busy.discard(slot)

    def forget(self, slot: str) -> None:
        """The slot's contents were overwritten outside staging (the link measurement)."""
        self.holds.pop(slot, None)

    def copy_in_range(self, dst: torch.Tensor, src: torch.Tensor, times: WorkerTimes, clock: StepClock | None):
        """Copy host ``src`` into device ``dst``; on CUDA on the copy stream, returning the
        event after it. A source in another dtype (the fp32 master, ``optim.compute_copy``
        device) crosses the link as it is, one slab at a time into an fp32 staging buffer,
        and is cast into ``dst`` there, on the same stream."""
        dev = self.dev
        if not dev.cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.copy_in_s += time.perf_counter() - t0
            return None
        with torch.cuda.stream(dev.copy_stream):
            start, ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(dev.copy_stream)
            if src.dtype == dst.dtype:
                dst.copy_(src, non_blocking=True)
            else:
                if self._staging is None or self._staging.dtype != src.dtype:
                    self._staging = dev.empty(self.h.slab_numel, src.dtype)
                n = self._staging.numel()
                for a in range(0, src.numel(), n):
                    part = self._staging[: min(n, src.numel() - a)]
                    part.copy_(src[a:a + n], non_blocking=True)
                    dst[a:a + n].copy_(part)
            ev.record(dev.copy_stream)
        if clock is not None:
            clock.copy_events.append((start, ev))
        return ev
