"""Ray metrics of a run (``ray.util.metrics``), declared once per actor with fixed tag keys.

Every series carries the tags ``run`` (the run id) and ``actor`` (the role: scheduler,
worker, optimizer-3), so the dashboard's Metrics view and any Prometheus query can tell
runs and actors apart. Names are exported with Ray's ``ray_`` prefix, e.g.
``ray_megaray_step_time_seconds``.
"""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge

TAG_KEYS = ("run", "actor")

STEP_GAUGES = {
    "step_time_seconds": "Wall time of the last training step",
    "tokens_per_second": "Training tokens per second over the last step",
    "tflops": "Model TFLOP/s of the last step (ARCHITECTURE.md formula)",
    "loss": "Training loss of the last step",
    "grad_norm": "Global gradient norm of the last step, before clipping",
    "learning_rate": "Learning rate of the last step",
    "copy_in_gbps": "Host-to-device weight staging rate of the last step, GB/s",
    "copy_out_gbps": "Device-to-host gradient rate of the last step, GB/s",
    "exposed_optimizer_seconds": "Time the worker waited for optimizer updates in the last step",
    "host_memory_used_bytes": "Host memory in use on the run's node",
    "gpu_memory_peak_bytes": "Peak device memory of the worker in the last step",
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


def host_memory_used_bytes() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info.get("MemAvailable", info["MemFree"])
