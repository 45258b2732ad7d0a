"""A run's metrics: one table of names for metrics.jsonl, TensorBoard and Prometheus.

Each per-step quantity has one name everywhere: the key in ``metrics.jsonl``, the
TensorBoard tag ``train/<name>``, and the Prometheus series ``ray_megaray_<name>`` (Ray adds
the ``ray_`` prefix), exported by the scheduler. Steps are counted from 1: the value recorded
for step n is the one of the n-th completed step, the step the log line and the checkpoint of
that state (``step-0000000n``) carry too. Every series carries the tags ``run`` (the run id)
and ``actor`` (the role: scheduler, optimizer-3), so the dashboard and any Prometheus query
can tell runs and actors apart. Declared once per actor with fixed tag keys.
"""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge

from megaray.machine import in_use, meminfo
from megaray.step import MOE_GAUGES, SHARD_GAUGES, STEP_COUNTERS, STEP_GAUGES  # noqa: F401  (the actors' names)

TAG_KEYS = ("run", "actor")


class RunMetrics:
    """One actor's metric objects; ``set`` records values under this actor's tags."""

    def __init__(self, run_id: str, actor: str, gauges: dict[str, str], counters: dict[str, str] | None = None):
        self.tags = {"run": run_id, "actor": actor}
        self.gauges = {k: Gauge(f"megaray_{k}", description=d, tag_keys=TAG_KEYS) for k, d in gauges.items()}
        self.counters = {k: Counter(f"megaray_{k}", description=d, tag_keys=TAG_KEYS)
                         for k, d in (counters or {}).items()}

    def set(self, **values: float) -> None:
        for k, v in values.items():
            self.gauges[k].set(float(v), tags=self.tags)

    def inc(self, **values: float) -> None:
        for k, v in values.items():
            if v > 0:   # Counter.inc refuses 0
                self.counters[k].inc(float(v), tags=self.tags)


def node_memory_used_bytes() -> int:
    """Memory in use on this node (MemTotal - MemAvailable): every process's, not the run's."""
    return in_use(meminfo())
