"""Scheduler actor: drives steps, watches every actor's calls, keeps counters and metrics.

It is an async actor and stays off the per-layer path: a step is one ``run_step`` call to
each worker (with several data-parallel workers, each gets an even, contiguous share of the
step's micro-batches and the whole step's token count) plus one ``apply`` call to each
optimizer shard, all issued at the step's start;
the worker and the shards then order themselves through the shared control words
(``megaray.protocol``).

Per step, the scheduler moves through explicit states (``Phase``):
IDLE -> COMPUTE (the worker runs the step's forward and backward; the shards finish the
previous step's updates, which the forward's first layers wait for, then wait for this
step's gradients) -> APPLY (the worker has decided the step: the shards update from the
gradient ring while the next step's COMPUTE begins) -> IDLE once drained.

The ordering guarantees:
- no layer is read for step t+1 before its step-t update finished: ``version[p]``, written
  by the shard after the update and checked by the worker before staging;
- clipping and skipping are exact: the worker publishes a step's verdict only after the
  whole backward, when the global norm is known, and gradients leave the GPU already scaled;
- a gradient slab is overwritten only after its piece was applied: ``slab_piece[s]``;
- every call of a step is collected during the next one (or by ``drain``), so a failure is
  reported, never dropped, and any failure aborts the run (the shared ``abort`` word), so
  nothing waits forever on a dead peer.
"""
from __future__ import annotations

import asyncio
import enum
import time

import ray

from megaray.buffers import Handles, RunBuffers
from megaray.config import RunConfig
from megaray.errors import RunAborted
from megaray.lr_schedule import lr_at
from megaray.model import flops_per_step
from megaray.step import Batch, EvalResult, StepResult

from .calls import failure_of
from .metrics import MOE_GAUGES, STEP_COUNTERS, STEP_GAUGES, RunMetrics, node_memory_used_bytes

# How long a failed step waits for the failure that aborted it, when only the calls it
# released have answered: an actor that neither answers nor dies in this long is hung.
ABORT_REPORT_S = 300.0


class Phase(enum.Enum):
    IDLE = "idle"
    COMPUTE = "compute"
    APPLY = "apply"
    FAILED = "failed"


class Scheduler:
    def __init__(self, cfg: RunConfig, handles: Handles, name: str):
        self.cfg, self.h, self.name = cfg, handles, name
        self.buf = RunBuffers(handles, kinds=("control",))
        self.phase = Phase.IDLE
        self.worker = None
        self.workers: list = []
        self.shards: list = []
        self.shard_names: list[str] = []
        self._pending: list[tuple[str, ray.ObjectRef]] = []   # the previous step's apply calls
        self._current: list[tuple[str, ray.ObjectRef]] = []   # the calls of the step (or evaluation) running
        self.counters = {"steps": 0, "tokens": 0, "skipped_steps": 0}
        self.gauges = {**STEP_GAUGES, **(MOE_GAUGES if cfg.model.moe else {})}
        self.metrics = RunMetrics(handles.run_id, "scheduler", self.gauges, STEP_COUNTERS)

    def attach(self, workers, shards, shard_names: list[str]) -> None:
        """Workers (rank 0 first: it decides each step), the shards and their names."""
        self.workers = list(workers) if isinstance(workers, (list, tuple)) else [workers]
        self.worker, self.shards, self.shard_names = self.workers[0], list(shards), list(shard_names)

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
                # Report the first cause, not an actor that only stopped because the run was
                # aborted: the actor that aborted it raises its own failure just after.
                raise min(await self._first_causes((main[0], main_fut), seen), key=_aborted)
            if main_fut.done():
                return main_fut.result()

    async def _first_causes(self, main: tuple, seen: dict) -> list:
        """The failures among ``main`` and ``seen`` (label and future each), once one is a
        first cause (not ``aborted``) or every call has ended. The aborting actor's own reply can come after
        the calls it released, late on a loaded machine: wait for it by condition, with a
        deadline (ABORT_REPORT_S) only for an actor that hangs."""
        everything = [main] + list(seen.values())
        deadline = time.monotonic() + ABORT_REPORT_S
        while True:
            failures = [failure_of(label, f.exception()) for label, f in everything
                        if f.done() and f.exception() is not None]
            rest = [f for _, f in everything if not f.done()]
            left = deadline - time.monotonic()
            if not rest or left <= 0 or not all(_aborted(e) for e in failures):
                return failures
            await asyncio.wait(rest, timeout=left, return_when=asyncio.FIRST_COMPLETED)

    def _fail(self) -> None:
        self.phase = Phase.FAILED
        self.buf.control.abort()

    async def _collect(self, calls) -> list:
        out = []
        for label, r in calls:
            try:
                out.append(await r)
            except Exception as e:
                self._fail()
                raise failure_of(label, e) from None
        return out

    async def train_step(self, step: int, batch: Batch) -> dict:
        """Step ``step`` on ``batch``: its metrics row (the previous step's updates collected)."""
        t0 = time.perf_counter()
        lr = lr_at(step, self.cfg.optim, self.cfg.train.steps)
        self.phase = Phase.COMPUTE
        prev = self._pending
        applies = [(n, s.apply.remote(step, lr)) for n, s in zip(self.shard_names, self.shards)]
        if len(self.workers) == 1:
            ref, others = self.worker.run_step.remote(step, batch), []
        else:
            shares = batch.shares(len(self.workers))
            total = batch.target_tokens()
            ref = self.worker.run_step.remote(step, shares[0], total)
            others = [(f"worker-{r}", w.run_step.remote(step, shares[r], total))
                      for r, w in enumerate(self.workers[1:], 1)]
        self._current = [("worker", ref)] + others + applies
        res: StepResult = await self._await_all(("worker", ref), lambda: prev + applies + others)
        await self._collect(others)
        # The previous step's updates have all finished (the worker waited for their
        # versions); collect them, so a failure among them is reported, never dropped.
        done = await self._collect(prev)
        self._pending = applies
        self.phase = Phase.APPLY
        norm, finite, coef = res.grad_norm, res.applied, res.clip_coef
        self.counters["steps"] += 1
        self.counters["tokens"] += res.tokens
        self.counters["skipped_steps"] += 0 if finite else 1
        dt = time.perf_counter() - t0
        tokens_per_step = self.cfg.train.tokens_per_step
        metrics = {
            "step": step + 1, "loss": res.loss, "learning_rate": lr,
            "grad_norm": norm if finite else -1.0, "clip_coefficient": coef, "skipped": not finite,
            "tokens": res.tokens, "step_time_seconds": dt, "tokens_per_second": res.tokens / dt,
            "tflops": flops_per_step(self.cfg.model, tokens_per_step, self.cfg.train.seq_len,
                                     batch.square_document_lengths(),
                                     batch.square_document_lengths(self.cfg.model.local_window)) / dt / 1e12,
            "gpu_idle_seconds": max(0.0, dt - res.times.compute_s),
            "exposed_optimizer_seconds": res.times.wait_optimizer_s,
            "copy_in_gbps": res.times.copy_in_bytes / max(res.times.copy_in_s, 1e-9) / 1e9,
            "copy_out_gbps": res.times.copy_out_bytes / max(res.times.copy_out_s, 1e-9) / 1e9,
            "node_memory_used_bytes": node_memory_used_bytes(),
            "gpu_memory_peak_bytes": res.gpu_peak_bytes,
            "skipped_steps": self.counters["skipped_steps"],
        }
        metrics.update(res.moe_metrics())
        self.metrics.set(**{k: metrics[k] for k in self.gauges})
        self.metrics.inc(steps_total=1, tokens_total=res.tokens)
        worked = [d for d in done if d["update_s"] > 0]
        if worked:   # the previous step's updates, summed over the shards (each shard exports its own)
            metrics["optimizer_params_per_second_all_shards"] = sum(d["params"] / d["update_s"] for d in worked)
            metrics["optimizer_update_seconds_slowest_shard"] = max(d["update_s"] for d in worked)
            # after the verdict: the last shard's finish, and the shards' waits for gradient pieces
            metrics["optimizer_span_seconds_slowest_shard"] = max(d["span_s"] for d in worked)
            metrics["optimizer_gradient_wait_seconds_mean_shard"] = sum(d["grad_wait_s"] for d in worked) / len(worked)
            metrics["optimizer_gradient_wait_seconds_most_shard"] = max(d["grad_wait_s"] for d in worked)
        metrics.update(res.metrics())
        return metrics

    async def evaluate(self, step: int, batch: Batch) -> float:
        ref = self.worker.evaluate.remote(step, batch)
        self._current = [("worker", ref)]
        res: EvalResult = await self._await_all(("worker", ref), lambda: self._pending)
        return res.loss

    async def drain(self) -> None:
        """Wait for every outstanding optimizer update."""
        pending, self._pending = self._pending, []
        for label, r in pending:
            await self._await_all((label, r), lambda: pending)
        await self._collect(pending)
        self.phase = Phase.IDLE

    async def settle(self, timeout_s: float = 20.0) -> None:
        """Wait (at most ``timeout_s``) for every call this scheduler issued to end, however it
        ends: the session calls it after aborting the run, so no call is still running when its
        actor is killed (a clean run then shows no failed tasks)."""
        refs = [r for _, r in self._pending + self._current]
        if refs:
            await asyncio.wait([asyncio.wrap_future(r.future()) for r in refs], timeout=timeout_s)

    def __repr__(self) -> str:
        return f"Scheduler({self.cfg.worker.count} worker(s), {self.cfg.optim.num_shards} optimizer shards)"

    def state(self) -> dict:
        return {"phase": self.phase.value, **self.counters}

    def set_counters(self, counters: dict) -> None:
        """Restore the counters of a resumed run."""
        self.counters.update({k: counters[k] for k in self.counters if k in counters})


def _aborted(e) -> bool:
    """Whether a failure only followed another's abort of the run (a first cause sorts first):
    an actor's ``aborted`` failure, or a bare RunAborted from a caller without actor_guard."""
    return isinstance(e, RunAborted) or getattr(e, "aborted", False)
