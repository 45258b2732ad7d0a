"""The worker's gradients on their way out: the step's verdict, then copy-out to the shards.

When the backward has ended the global norm is known. ``ship`` scales every unit's fp32
gradient by the exact clip coefficient on the device, publishes the verdict (applied), and
returns; a copy-out thread then streams the gradients, in forward order and in slab-sized
pieces, through the pinned gradient ring (``GradientRing.put``) while the next step's forward
begins (its first layers wait only for their own pieces' updates). Each unit's device memory
goes back as soon as its last piece has landed. ``skip`` publishes a skipped step instead:
no piece leaves the device.

A worker on another node hands the (scaled) gradients to the relay actor, which publishes
the verdict and fills the ring on the store's node.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megaray.buffers import Handles, RunBuffers
from megaray.config import RunConfig
from megaray.errors import RunAborted

from .calls import get_or_raise
from .device import Device, StepClock


class GradientShipper:
    def __init__(self, cfg: RunConfig, h: Handles, dev: Device, buf: RunBuffers | None, relay=None):
        self.cfg, self.h, self.dev, self.buf, self.relay = cfg, h, dev, buf, relay
        if buf is not None:
            dev.pin(buf.files["ring"].bytes, "the gradient ring")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="copy-out")
        self._future: Future | None = None          # the previous step's gradients leaving
        self._stats: list[dict] = []                # copy-out statistics of finished steps

    def check_previous(self) -> None:
        """Raise the previous step's copy-out failure, if it has failed."""
        if self._future is not None and self._future.done():
            self._future.result()

    def error(self) -> str | None:
        """Why the copy-out failed, when that is what aborted the run."""
        f = self._future
        if f is not None and f.done() and f.exception() is not None and not isinstance(f.exception(), RunAborted):
            return f"gradient copy-out failed: {type(f.exception()).__name__}: {f.exception()}"
        return None

    def finished_stats(self) -> dict:
        """Copy-out statistics of the steps whose gradients have left since the last call."""
        out: dict = {}
        while self._stats:
            for k, v in self._stats.pop(0).items():
                out[k] = out.get(k, 0.0) + v
        return out

    def ship(self, step: int, grads: list, coef: float, clock: StepClock) -> None:
        """Step ``step`` is applied: scale by ``coef``, publish the verdict, start the copy-out."""
        if coef != 1.0:
            with clock.span(-1):
                for g in grads:
                    g.mul_(coef)
        if self.relay is not None:
            self._future = self._thread.submit(self._ship_remote, step, [g.cpu() for g in grads])
            return
        ready = self.dev.event_after_compute()
        if ready is not None:
            for g in grads:
                g.record_stream(self.dev.out_stream)
        self.buf.control.decide(step, True)
        self._future = self._thread.submit(self._ship_local, step, grads, ready)

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
        st = {"wait_slab_s": 0.0, "copy_out_s": 0.0, "copy_out_bytes": 0}
        cuda, out = self.dev.cuda, self.dev.out_stream if self.dev.cuda else None
        try:
            if ready is not None:
                out.wait_event(ready)
            last = {p.unit: p.index for p in self.h.pieces}
            for piece in self.h.pieces:
                src = grads[piece.unit][piece.start:piece.stop]

                def copy(dst, src=src):
                    t0 = time.perf_counter()
                    if cuda:
                        with torch.cuda.stream(out):
                            dst.copy_(src, non_blocking=True)
                        out.synchronize()       # landed before the shard may read it
                    else:
                        dst.copy_(src)
                    st["copy_out_s"] += time.perf_counter() - t0

                st["wait_slab_s"] += self.buf.ring.put(piece, step, copy, self.cfg.worker.wait_timeout_s)
                st["copy_out_bytes"] += 4 * piece.numel
                if last[piece.unit] == piece.index:
                    grads[piece.unit] = None                # its device memory goes back now
            self._stats.append(st)
        except RunAborted:
            raise
        except BaseException:
            self.abort()
            raise

    def _ship_remote(self, step: int, grads: list) -> None:
        """Copy-out thread of a worker on another node: the step's gradients to the relay."""
        t0 = time.perf_counter()
        st = get_or_raise(self.relay.ship.remote(step, grads), "relay")
        st["copy_out_s"] = time.perf_counter() - t0
        self._stats.append(st)
