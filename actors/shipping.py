"""The worker's gradients on their way out: the step's verdict, then copy-out to the shards.

When the backward has ended the global norm is known. ``ship`` scales every unit's fp32
gradient by the exact clip coefficient on the device, publishes the verdict (applied), and
returns; a copy-out thread then streams the gradients, in forward order and in slab-sized
pieces, through the pinned gradient ring (``GradientRing.put``) while the next step's forward
begins (its first layers wait only for their own pieces' updates). Each unit's device memory
goes back as soon as its last piece has landed. ``skip`` publishes a skipped step instead:
no piece leaves the device. With ``optim.grad_dtype`` bfloat16 the streamed units' gradients
wait on the device rounded already (half the memory: the worker rounds each as its backward
ends); they are not scaled there (a second rounding) but cross as they are, and the verdict
carries the coefficient, which the shards apply in fp32 as they do to gradients from host
memory: the same numbers as ``optim.grad_placement`` host gives.

With ``optim.grad_placement`` host the gradients do not wait on the device: ``ship_unit``
sends each unit's gradient to its region of the host gradient buffer as soon as its backward
is done (on the copy-out stream, rounded to ``optim.grad_dtype`` there), and the copy-out
thread publishes each piece once its bytes have landed, with whether the unit's gradient is
finite; ``decide`` then publishes the verdict and the clip coefficient, which the shards
apply. The device frees each unit's gradient as soon as it has left.

A worker on another node hands the (scaled) gradients to the relay actor, which publishes
the verdict and fills the ring on the store's node.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megaray.buffers import DTYPES, Handles, RunBuffers
from megaray.config import RunConfig
from megaray.errors import RunAborted
from megaray.step import CopyOut

from .calls import get_or_raise
from .device import Device, StepClock


def put_pieces(buf: RunBuffers, step: int, grads: list, timeout: float, copy=None) -> CopyOut:
    """Every piece of ``grads`` (one flat tensor a unit) into its ring slab, in forward order,
    each handed to its shard as soon as ``copy(dst, src)`` (default: a plain copy) returns;
    a unit's gradient is dropped from ``grads`` once its last piece has left (on the GPU its
    memory goes back then). The worker's copy-out thread and the relay both ship this way."""
    h, st = buf.h, CopyOut()
    last = {p.unit: p.index for p in h.pieces}
    for piece in h.pieces:
        src = grads[piece.unit][piece.start:piece.stop]

        def timed(dst, src=src):
            t0 = time.perf_counter()
            if copy is None:
                dst.copy_(src)
            else:
                copy(dst, src)
            st.copy_out_s += time.perf_counter() - t0

        st.wait_slab_s += buf.ring.put(piece, step, timed, timeout)
        st.copy_out_bytes += DTYPES[h.grad_dtype].itemsize * piece.numel
        if last[piece.unit] == piece.index:
            grads[piece.unit] = None
    return st


class GradientShipper:
    def __init__(self, cfg: RunConfig, h: Handles, dev: Device, buf: RunBuffers | None, relay=None):
        self.cfg, self.h, self.dev, self.buf, self.relay = cfg, h, dev, buf, relay
        self.host = h.grad_placement == "host"
        self.grad_dtype = DTYPES[h.grad_dtype]
        # gradients waiting on the device rounded to grad_dtype (unscaled: the shards apply the coefficient)
        self.rounds = not self.host and self.grad_dtype != torch.float32
        if buf is not None:
            regions = buf.streamed_regions("grads") if self.host else [buf.files["ring"].bytes]
            for region in regions:
                dev.pin(region, "the host gradient buffer" if self.host else "the gradient ring")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="copy-out")
        self._futures: list[Future] = []            # gradients leaving (the previous step's, or this one's units)
        self._stats: list[CopyOut] = []             # copy-out statistics of finished steps

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def check_previous(self) -> None:
        """Raise an earlier copy-out failure, if one has failed; forget the finished ones."""
        for f in [f for f in self._futures if f.done()]:
            f.result()
            self._futures.remove(f)

    def error(self) -> str | None:
        """Why the copy-out failed, when that is what aborted the run."""
        for f in self._futures:
            if f.done() and f.exception() is not None and not isinstance(f.exception(), RunAborted):
                return f"gradient copy-out failed: {type(f.exception()).__name__}: {f.exception()}"
        return None

    # ------------------------------------------------------------------ gradients in host memory
    def ship_unit(self, step: int, u: int, g: torch.Tensor, sq: torch.Tensor) -> None:
        """Unit u's gradient of step ``step`` (final) to its host region, now; ``sq`` is its
        squared norm on the device (whether it is finite is published with it)."""
        dst = self.buf.grad(u)
        ev = None
        if self.dev.cuda:
            ready = self.dev.event_after_compute()
            out = self.dev.out_stream
            with torch.cuda.stream(out):
                out.wait_event(ready)
                dst.copy_(g, non_blocking=True)          # rounded to grad_dtype on the device
                host_sq = torch.empty((), dtype=torch.float64, pin_memory=True)
                host_sq.copy_(sq, non_blocking=True)      # read on the host: no wait behind later compute
                g.record_stream(out)
                ev = torch.cuda.Event()
                ev.record(out)
            g, sq = None, host_sq
        self._futures.append(self._thread.submit(self._land_unit, step, u, g, sq, ev))

    def _land_unit(self, step: int, u: int, g, sq: torch.Tensor, ev) -> None:
        """Copy-out thread: once unit u's bytes (and its squared norm) are in host memory,
        publish its pieces."""
        try:
            t0 = time.perf_counter()
            if ev is not None:
                ev.synchronize()
            else:
                self.buf.grad(u).copy_(g)
            finite = math.isfinite(float(sq))
            st = CopyOut(copy_out_s=time.perf_counter() - t0,
                         copy_out_bytes=self.buf.grad(u).numel() * self.buf.grad(u).element_size())
            for p in self.h.unit_pieces(u):
                self.buf.host_grads.publish(self.h.pieces[p], step, finite)
            self._stats.append(st)
        except BaseException:
            self.abort()
            raise

    def decide(self, step: int, applied: bool, coef: float) -> None:
        """Publish the verdict of a step whose gradients went to host memory (the shards apply ``coef``)."""
        self.buf.control.decide(step, applied, coef)

    def finished_stats(self) -> CopyOut:
        """Copy-out statistics of the steps whose gradients have left since the last call."""
        out = CopyOut()
        while self._stats:
            out += self._stats.pop(0)
        return out

    def readers_coef(self, coef: float) -> float:
        """The clip coefficient the gradients' readers (the shards, the resident units) apply
        in their update: ``coef`` where the gradients wait unscaled (in host memory, or rounded
        on the device), 1.0 where ``ship`` scaled them on the device (fp32 through the ring)."""
        return coef if self.host or self.rounds else 1.0

    def ship(self, step: int, grads: list, coef: float, clock: StepClock) -> None:
        """Step ``step`` is applied: scale the fp32 gradients by ``coef`` (rounded ones go
        unscaled: ``readers_coef``), publish the verdict, start the copy-out."""
        if coef != 1.0 and not self.rounds:
            with clock.span(-1):
                for g in grads:
                    g.mul_(coef)
        coef = self.readers_coef(coef)
        if self.relay is not None:
            self._futures.append(self._thread.submit(self._ship_remote, step, [g.cpu() for g in grads], coef))
            return
        ready = self.dev.event_after_compute()
        if ready is not None:
            for g in grads:
                g.record_stream(self.dev.out_stream)
        self.buf.control.decide(step, True, coef)
        self._futures.append(self._thread.submit(self._ship_local, step, grads, ready))

    def skip(self, step: int) -> None:
        """Step ``step`` is skipped (a non-finite loss or gradient): nothing leaves the device."""
        if self.relay is not None:
            get_or_raise(self.relay.decide.remote(step, False), "relay")
        else:
            self.buf.control.decide(step, False)

    def abort(self) -> None:
        """Release every waiter of the run (through the relay when the shared files are elsewhere)."""
        if self.relay is not None:
            self.relay.abort.remote()
        else:
            self.buf.control.abort()

    def _ship_local(self, step: int, grads: list, ready) -> None:
        """Copy-out thread: every piece into its ring slab, in forward order; each slab is
        handed to its shard as soon as its copy has landed."""
        try:
            if ready is not None:
                self.dev.out_stream.wait_event(ready)
            copy = self._copy_landed if self.dev.cuda else None
            self._stats.append(put_pieces(self.buf, step, grads, self.cfg.worker.wait_timeout_s, copy))
        except RunAborted:
            raise
        except BaseException:
            self.abort()
            raise

    def _copy_landed(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One piece to its slab on the copy-out stream, landed before the shard may read it."""
        out = self.dev.out_stream
        with torch.cuda.stream(out):
            dst.copy_(src, non_blocking=True)
        out.synchronize()

    def _ship_remote(self, step: int, grads: list, coef: float) -> None:
        """Copy-out thread of a worker on another node: the step's gradients to the relay."""
        t0 = time.perf_counter()
        st: CopyOut = get_or_raise(self.relay.ship.remote(step, grads, coef), "relay")
        st.copy_out_s = time.perf_counter() - t0
        self._stats.append(st)
