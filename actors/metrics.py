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

TAG_KEYS = ("run", "actor")

STEP_GAUGES = {   # per-step values: metrics.jsonl, TensorBoard train/<name>, ray_megaray_<name>
    "loss": "Training loss of the last step",
    "learning_rate": "Learning rate of the last step",
    "grad_norm": "Global gradient norm of the last step, before clipping (-1 for a skipped step)",
    "tokens_per_second": "Training tokens per second over the last step",
    "step_time_seconds": "Wall time of the last training step",
    "tflops": "Model TFLOP/s of the last step (ARCHITECTURE.md formula; each document's own attention work)",
    "gpu_idle_seconds": "Time in the last step the GPU did no compute",
    "exposed_optimizer_seconds": "Time the worker waited for optimizer updates in the last step",
    "copy_in_gbps": "Host-to-device weight staging rate of the last step, GB/s",
    "copy_out_gbps": "Device-to-host gradient rate of the last step, GB/s",
    "node_memory_used_bytes": "Host memory in use on the run's node (all processes, not only the run's)",
    "gpu_memory_peak_bytes": "Peak device memory of the worker in the last step",
    "skipped_steps": "Steps skipped so far for a non-finite loss or gradient (exported from the first step)",
}
STEP_COUNTERS = {"steps_total": "Training steps completed", "tokens_total": "Training tokens processed"}
SHARD_GAUGES = {
    "optimizer_seconds": "Time this optimizer shard spent updating in its last step",
    "optimizer_params_per_second": "This shard's AdamW update rate in its last step",
}


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
