"""The optimizer shards' AdamW rate on this machine, measured before the placement is chosen.

The cost model's update rate is the reference machine's (``megaray.cost.ADAMW_PER_CORE``),
but hosts differ, and so do leases of the same kind: on one H200 host the shards updated a
third slower than on another (BENCHMARKS.md), and with the reference rate the
placement left the GPU waiting 11-13% of every step for updates that more resident units
would have taken off the CPU. So a run that chooses its placement on a GPU first measures:
one short-lived actor per shard, with the shard's threads, all on one node (they share its
memory bandwidth, as the shards will), each updating its own buffer of the run's state dtypes
with the shards' AdamW over one window that starts for all of them at once, after every one is
built and warm; the rates are summed. ``Speeds.update_scale`` is the
sum against the reference rate for the same cores. A measurement that cannot run (no free
CPUs on the node, an actor that fails) leaves the reference rate, and the log says so.
"""
from __future__ import annotations

import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from megaray.config import RunConfig
from megaray.cost import reference_update_rate

log = logging.getLogger("megaray")

WINDOW_S = 0.5          # each shard's timed window, all of them at once
START_AFTER_S = 0.25    # from the driver's call to the window's start: every call has arrived


@ray.remote
class _ShardTimer:
    """One shard's AdamW, with the shard's threads, over its own buffer of the run's state
    dtypes; built and warmed (pages touched, kernel loaded) before any timer is asked to time."""

    def __init__(self, master_dtype: str, moment_dtype: str, grad_dtype: str, copy: bool, numel: int,
                 threads: int):
        import torch

        from megaray import adamw
        from megaray.bench.adamw import random_state

        torch.set_num_threads(threads)
        self.numel = numel
        self.state = random_state(numel, master_dtype, grad_dtype, moment_dtype, copy)
        self.opt = adamw.AdamW(threads)
        self.hyper = adamw.hyper(1e-4, (0.9, 0.95), 1e-8, 0.1, 1)
        self._step()

    def _step(self) -> None:
        p, g, m, v, c = self.state
        self.opt.step(p, g, m, v, self.hyper, copy=c, sr_key=1)

    def ready(self) -> bool:
        return True

    def measure(self, start_at: float, window_s: float) -> tuple[float, float, float]:
        """Parameters a second, counted over the window from ``start_at`` (or from the call's
        arrival, if later); and the window's wall-clock start and end."""
        time.sleep(max(0.0, start_at - time.time()))
        wall0, t0 = time.time(), time.perf_counter()
        done = 0
        while True:
            self._step()
            done += self.numel
            elapsed = time.perf_counter() - t0
            if elapsed >= window_s:
                self.opt.close()
                return done / elapsed, wall0, time.time()


def update_rate(cfg: RunConfig, numel: int = 4 * 2**20, window_s: float = WINDOW_S,
                start_after_s: float = START_AFTER_S, timeout_s: float = 60.0) -> float:
    """The shards' summed AdamW rate (parameters a second) measured on the driver's node, for
    the run's shard count, threads and state dtypes; ``numel`` parameters a shard (4 Mi: 112
    MB of fp32 state, well beyond the caches). Two phases, the driver the barrier between
    them: every timer built and warm, then every one timed over the same window. (A fixed
    start time is not enough: seven processes importing torch at once on a fresh node took
    longer than any fixed lead, and each then timed a window of its own.)"""
    o = cfg.optim
    node = ray.get_runtime_context().get_node_id()
    timer = _ShardTimer.options(num_cpus=o.threads_per_shard,
                                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    timers = [timer.remote(o.master_dtype, o.moment_dtype, o.grad_dtype, cfg.host_compute_copy, numel,
                           o.threads_per_shard) for _ in range(o.num_shards)]
    try:
        deadline = time.monotonic() + timeout_s
        ray.get([t.ready.remote() for t in timers], timeout=timeout_s)
        start_at = time.time() + start_after_s
        results = ray.get([t.measure.remote(start_at, window_s) for t in timers],
                          timeout=max(deadline - time.monotonic(), start_after_s + 2 * window_s + 5.0))
    finally:
        for t in timers:                     # none left holding the node's CPUs (a pending one is cancelled)
            ray.kill(t)
    together = min(end for _, _, end in results) - max(start for _, start, _ in results)
    if together < window_s / 2:              # a timer started late: the others had the memory to themselves
        log.warning("the optimizer shards' timed updates overlapped for %.2f s of %.2f: the measured rate is "
                    "on the high side", max(together, 0.0), window_s)
    return float(sum(rate for rate, _, _ in results))


def update_scale(cfg: RunConfig, **kw) -> float:
    """The measured rate against the reference machine's for the same cores and state (1.0,
    said in the log, where the measurement cannot run)."""
    try:
        rate = update_rate(cfg, **kw)
    except ray.exceptions.RayError as e:          # a timeout too (GetTimeoutError is one)
        log.warning("could not measure the optimizer shards' update rate (%s); planning with the reference "
                    "machine's", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return 1.0
    ref = reference_update_rate(cfg)
    log.info("optimizer shards measured alone: %.2f G params/s summed (%d x %d threads), %.2f of the reference "
             "machine's %.2f", rate / 1e9, cfg.optim.num_shards, cfg.optim.threads_per_shard, rate / ref, ref / 1e9)
    return rate / ref
