"""Scheduler actor: drives steps, routes gradients to optimizer shards, keeps counters.

It is an async actor: while it awaits a step's ``GpuWorker.run_step``, the worker's
``grad_ready`` notifications run concurrently and are forwarded at once to the shard that
owns the unit, so a shard starts on a gradient while the GPU computes the layers below.

Per step, the scheduler moves through explicit states (``Phase``):
IDLE -> COMPUTE (worker running; gradients flowing to shards) -> REDUCE (global norm from
the per-unit squared norms the worker took on the GPU) -> APPLY (shards update, in forward order, overlapping the next
step's COMPUTE) -> IDLE. With clipping off there is no REDUCE wait: shards update each unit
as its gradient lands.

The ordering guarantee — no layer is read for step t+1 before its step-t update finished — is
kept by ``version[u]`` in shared memory, written by the shard after the update and checked by
the worker before staging; the scheduler's part is to hand every gradient over exactly once
and to abort the run (the shared ``abort`` word) as soon as any actor fails, so nothing
waits forever on a dead peer.
"""
from __future__ import annotations

import asyncio
import enum
import math
import time

import ray

from megaray.buffers import Handles, RunBuffers
from megaray.config import RunConfig
from megaray.errors import ActorFailure
from megaray.model import flops_per_step
from megaray.schedule import lr_at

from .metrics import STEP_GAUGES, RunMetrics, host_memory_used_bytes


class Phase(enum.Enum):
    IDLE = "idle"
    COMPUTE = "compute"
    REDUCE = "reduce"
    APPLY = "apply"
    FAILED = "failed"


def shard_ranges(num_units: int, num_shards: int, layout: str = "contiguous") -> list[list[int]]:
    """Split unit indices among shards: contiguous, as-even-as-possible ranges, or interleaved."""
    if layout == "interleaved":
        return [list(range(k, num_units, num_shards)) for k in range(num_shards)]
    base, extra = divmod(num_units, num_shards)
    out, start = [], 0
    for k in range(num_shards):
        n = base + (1 if k < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


class Scheduler:
    def __init__(self, cfg: RunConfig, handles: Handles, name: str):
        self.cfg, self.h, self.name = cfg, handles, name
        self.buf = RunBuffers(handles, kinds=("control",))
        self.phase = Phase.IDLE
        self.worker = None
        self.shards: list = []
        self.shard_names: list[str] = []
        self.owner: dict[int, int] = {}
        self.apply_now = cfg.optim.clip_grad_norm is None
        self._pending: list[tuple[str, ray.ObjectRef]] = []   # previous step's apply calls
        self._grads: dict[int, list[tuple[str, ray.ObjectRef]]] = {}
        self._arrived: dict[int, asyncio.Event] = {}
        self._expected: dict[int, int] = {}
        self._lr: dict[int, float] = {}
        self.counters = {"steps": 0, "tokens": 0, "skipped_steps": 0, "grads_routed": 0}
        self.metrics = RunMetrics(handles.run_id, "scheduler", STEP_GAUGES, {
            "steps_total": "Training steps completed", "tokens_total": "Training tokens processed",
            "skipped_steps_total": "Steps skipped for a non-finite loss or gradient"})

    def attach(self, worker, shards, shard_names: list[str]) -> None:
        self.worker, self.shards, self.shard_names = worker, list(shards), list(shard_names)
        for k, units in enumerate(shard_ranges(self.h.num_units, len(shards), self.cfg.optim.shard_layout)):
            for u in units:
                self.owner[u] = k

    # ---------------------------------------------------------------- gradient routing
    async def grad_ready(self, step: int, u: int) -> None:
        k = self.owner[u]
        ref = self.shards[k].on_grad.remote(step, u, self._lr[step], self.apply_now)
        self._grads.setdefault(step, []).append((self.shard_names[k], ref))
        self.counters["grads_routed"] += 1
        ev = self._arrived.setdefault(step, asyncio.Event())
        if len(self._grads[step]) == self._expected.get(step, -1):
            ev.set()

    # ---------------------------------------------------------------- steps
    async def _await_all(self, main: tuple[str, ray.ObjectRef], side) -> object:
        """Await ``main``; fail fast if it or any call in ``side()`` fails."""
        main_fut = asyncio.wrap_future(main[1].future())
        seen: dict = {}
        while True:
            for label, ref in side():
                if ref not in seen:
                    seen[ref] = (label, asyncio.wrap_future(ref.future()))
            waiting = [main_fut] + [f for _, f in seen.values() if not f.done()]
            # Wake as soon as anything finishes; the timeout picks up calls side() adds later.
            await asyncio.wait(waiting, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            failed = [(label, f) for label, f in seen.values() if f.done() and f.exception() is not None]
            if main_fut.done() and main_fut.exception() is not None:
                failed.append((main[0], main_fut))             # a peer's failure, if any, comes first
            if failed:
                self._fail()
                label, f = failed[0]
                raise _as_failure(label, f.exception())
            if main_fut.done():
                return main_fut.result()

    def _fail(self) -> None:
        self.phase = Phase.FAILED
        self.buf.abort()

    async def train_step(self, step: int, tokens) -> dict:
        t0 = time.perf_counter()
        lr = lr_at(step, self.cfg.optim, self.cfg.train.steps)
        self._lr[step] = lr
        self._arrived.setdefault(step, asyncio.Event())
        self.phase = Phase.COMPUTE
        prev = self._pending
        ref = self.worker.run_step.remote(step, tokens)
        res = await self._await_all(("worker", ref), lambda: prev + self._grads.get(step, []))
        # The previous step's updates have all finished (the worker waited for their
        # versions); collect them, so a failure among them is reported, never dropped.
        for label, r in prev:
            try:
                await r
            except Exception as e:
                self._fail()
                raise _as_failure(label, e) from None
        # Every gradient of the step has been announced; wait until all reached the shards.
        self._expected[step] = res["grads_sent"]
        if len(self._grads.get(step, [])) == res["grads_sent"]:
            self._arrived[step].set()
        await asyncio.wait_for(self._arrived[step].wait(), timeout=self.cfg.worker.wait_timeout_s)
        self.phase = Phase.REDUCE
        # on_grad calls are watched for failure during the next step, with the applies.
        self._pending = self._grads.pop(step)
        norm = math.sqrt(sum(res["grad_sqnorms"]))
        finite = math.isfinite(norm) and math.isfinite(res["loss_sum"])
        coef = clip_coefficient(norm, self.cfg.optim.clip_grad_norm)
        if not self.apply_now:
            self.phase = Phase.APPLY
            self._pending += [(n, s.apply.remote(step, coef, lr, not finite))
                              for n, s in zip(self.shard_names, self.shards)]
        for d in (self._lr, self._arrived, self._expected):
            d.pop(step, None)
        self.counters["steps"] += 1
        self.counters["tokens"] += res["tokens"]
        self.counters["skipped_steps"] += 0 if finite else 1
        dt = time.perf_counter() - t0
        tokens_per_step = self.cfg.train.tokens_per_step
        metrics = {
            "step": step, "loss": res["loss_sum"] / max(res["tokens"], 1), "lr": lr, "grad_norm": norm,
            "clip_coef": coef, "skipped": not finite, "tokens": res["tokens"], "step_time_s": dt,
            "tokens_per_s": res["tokens"] / dt,
            "tflops": flops_per_step(self.cfg.model, tokens_per_step, self.cfg.train.seq_len) / dt / 1e12,
        }
        metrics.update({f"worker/{k}": v for k, v in res.items()
                        if k not in ("loss_sum", "tokens", "grad_sqnorms")})
        metrics.update({
            "copy_in_gbps": res.get("copy_in_bytes", 0) / max(res.get("copy_in_s", 0), 1e-9) / 1e9,
            "copy_out_gbps": res.get("copy_out_bytes", 0) / max(res.get("copy_out_s", 0), 1e-9) / 1e9,
            "exposed_optimizer_s": res.get("wait_optimizer_s", 0.0),
            "host_memory_used_bytes": host_memory_used_bytes(),
            "gpu_memory_peak_bytes": res.get("gpu_peak_bytes", 0),
        })
        self.metrics.set(step_time_seconds=dt, tokens_per_second=metrics["tokens_per_s"], tflops=metrics["tflops"],
                         loss=metrics["loss"], grad_norm=norm if finite else -1.0, learning_rate=lr,
                         copy_in_gbps=metrics["copy_in_gbps"], copy_out_gbps=metrics["copy_out_gbps"],
                         exposed_optimizer_seconds=metrics["exposed_optimizer_s"],
                         host_memory_used_bytes=metrics["host_memory_used_bytes"],
                         gpu_memory_peak_bytes=metrics["gpu_memory_peak_bytes"])
        self.metrics.inc(steps_total=1, tokens_total=res["tokens"], skipped_steps_total=0 if finite else 1)
        self.phase = Phase.APPLY if self._pending else Phase.IDLE
        return metrics

    async def evaluate(self, step: int, tokens) -> float:
        ref = self.worker.evaluate.remote(step, tokens)
        res = await self._await_all(("worker", ref), lambda: self._pending)
        return res["loss_sum"] / max(res["tokens"], 1)

    async def drain(self) -> None:
        """Wait for every outstanding optimizer update."""
        for label, r in self._pending:
            await self._await_all((label, r), lambda: [])
        self._pending = []
        self.phase = Phase.IDLE

    def state(self) -> dict:
        return {"phase": self.phase.value, **self.counters}

    def set_counters(self, counters: dict) -> None:
        """Restore the counters of a resumed run."""
        self.counters.update({k: counters[k] for k in self.counters if k in counters})


def _as_failure(label: str, exc: BaseException) -> ActorFailure:
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, ActorFailure):
        return cause
    return ActorFailure(label, f"{type(cause).__name__}: {cause}")
