"""Shared fixtures: one Ray cluster per test module, with CPUs set explicitly."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=6, num_gpus=0, object_store_memory=128 * 2**20, include_dashboard=False,
             log_to_driver=False)
    yield ray
    ray.shutdown()


def shm_files(run_id: str | None = None, pid: int | None = None) -> list[str]:
    """megaray's shared-memory files of a run, or of runs driven by ``pid`` (default: this process)."""
    if run_id is not None:
        return [f for f in os.listdir("/dev/shm") if f.startswith("megaray_") and f"_{run_id}_" in f]
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"megaray_{pid or os.getpid()}_")]
