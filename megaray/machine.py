"""What a machine has for a run, read off it (``Machine.here``): host memory, free space in the
shared-memory folder, free GPU memory; ``megaray.plan`` checks a run's plan against it.

Host memory is what the kernel calls available, and never more than Ray's memory monitor
allows: Ray kills a worker once the node's memory in use (its
cgroup's, less inactive file pages, else total less available) passes
``RAY_memory_usage_threshold`` of the total (0.95 by default; ``megaray`` starts its own
local Ray at 0.98, ``megaray.driver.cluster.start_local_ray``). On the H200 machine a qwen14b plan
of 118.8 GiB against 119.8 available was killed at Ray's 95% (122.3 GiB in use by Ray's
measure, the CUDA libraries' file pages included).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megaray.errors import ConfigError

RAY_KILL_THRESHOLD = 0.95        # Ray's default RAY_memory_usage_threshold


def ray_kill_fraction() -> float | None:
    """The share of the node's memory at which Ray's memory monitor kills workers, as this
    process's environment sets it (Ray's default otherwise); None when the monitor is off."""
    if os.environ.get("RAY_memory_monitor_refresh_ms", "").strip() == "0":
        return None
    return float(os.environ.get("RAY_memory_usage_threshold", RAY_KILL_THRESHOLD))


def on_cores(fn, items, threads: int | None = None, size=None, done=None) -> None:
    """``fn(item)`` for every item, on ``threads`` threads (every core this process may use by
    default): for torch work, which releases the GIL. With ``size(item)``, the largest items
    start first, so the threads end together; ``done(item)``, when given, is called on the
    item's thread once ``fn`` has returned. The first error is raised once all end."""
    items = sorted(items, key=lambda i: -size(i)) if size else list(items)

    def one(item) -> None:
        fn(item)
        if done is not None:
            done(item)

    with ThreadPoolExecutor(max(1, min(threads or len(os.sched_getaffinity(0)), len(items)))) as pool:
        for _ in pool.map(one, items):
            pass


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    return info


def available(info: dict[str, int]) -> int:
    """What the kernel calls available (free memory on kernels too old to say)."""
    return info.get("MemAvailable", info["MemFree"])


def in_use(info: dict[str, int]) -> int:
    """Memory in use by every process: total less available."""
    return info["MemTotal"] - available(info)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def ray_memory_view(info: dict, cgroup: str = "/sys/fs/cgroup") -> tuple[int, int]:
    """(used, total) bytes as Ray's memory monitor counts them: a cgroup v2's memory.current
    less its inactive file pages, else total less available; the total is the cgroup's limit
    where it sets one below the machine's memory."""
    total = info["MemTotal"]
    limit = _read_int(f"{cgroup}/memory.max")
    if limit:
        total = min(total, limit)
    used = in_use(info)
    current = _read_int(f"{cgroup}/memory.current")
    if current is not None:
        try:
            with open(f"{cgroup}/memory.stat") as f:
                stat = dict(line.split()[:2] for line in f if line.strip())
            used = current - int(stat["inactive_file"])
        except (OSError, KeyError, ValueError):
            pass
    return max(0, used), total


@dataclass
class Machine:
    host_bytes: int          # memory available to the run
    shm_bytes: int           # free space in cluster.shm_dir
    gpu_bytes: int | None    # free device memory, None when no GPU is visible here

    @classmethod
    def here(cls, shm_dir: str, gpu_bytes: int | None = None, probe_gpu: bool = False) -> Machine:
        info = meminfo()
        host = available(info)
        fraction = ray_kill_fraction()
        if fraction is not None:        # what Ray's memory monitor lets the run add
            used, total = ray_memory_view(info)
            host = max(0, min(host, int(fraction * total) - used))
        try:
            st = os.statvfs(shm_dir)
        except OSError as e:
            raise ConfigError("cluster.shm_dir", f"cannot use {shm_dir} for the run's shared memory: "
                                                 f"{e.strerror or e}") from None
        gpu = gpu_bytes
        if gpu is None and probe_gpu:
            import torch

            if torch.cuda.is_available():
                gpu = torch.cuda.mem_get_info()[0]
        return cls(host, st.f_bavail * st.f_frsize, gpu)
