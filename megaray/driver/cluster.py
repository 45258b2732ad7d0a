"""The driver's Ray: attach to a cluster (``cluster.address`` or ``RAY_ADDRESS``) or start a
local one from a folder of megaray's own, and the dashboard's address for the log."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import ray

from megaray.config import RunConfig
from megaray.errors import ClusterError


def connect_ray(cfg: RunConfig) -> bool:
    """Attach to the configured or RAY_ADDRESS cluster, else start a local one.

    Returns True when this call started Ray (so the caller shuts it down).
    """
    if ray.is_initialized():
        return False
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    where = (f"the Ray cluster at {address} (cluster.address)" if cfg.cluster.address else
             f"the Ray cluster at RAY_ADDRESS={address}" if address else "a local Ray")
    if address:
        attach(address, f"cannot start or reach {where}", namespace="megaray", log_to_driver=True)
        return True
    try:
        needed = cfg.optim.num_shards * cfg.optim.threads_per_shard + cfg.worker.count * cfg.worker.threads
        start_local_ray(num_cpus=cfg.cluster.num_cpus or max(needed, os.cpu_count() or 1),
                        object_store_memory=cfg.cluster.object_store_mb * 2**20, namespace="megaray")
        return True
    except Exception as e:          # ray.init raises bare Exception, ConnectionError, RuntimeError...
        raise _failed(f"cannot start or reach {where}", e) from None


def attach(address: str, what: str | None = None, **init) -> None:
    """``ray.init(address=address, **init)``; its failure a one-line ClusterError: ``what``
    (by default: cannot reach the Ray cluster at ``address``), then what Ray answered."""
    try:
        ray.init(address=address, **init)
    except Exception as e:          # ray.init raises bare Exception, ConnectionError, ValueError...
        raise _failed(what or f"cannot reach the Ray cluster at {address}", e) from None


def _failed(what: str, e: Exception) -> ClusterError:
    """Ray shut down again, and ``what`` with the first line of Ray's answer."""
    with contextlib.suppress(Exception):
        ray.shutdown()
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ClusterError(f"{what}: {first}")


LOCAL_RAY_KILL_THRESHOLD = "0.98"


def start_local_ray(**kwargs) -> None:
    """``ray.init(address="local", **kwargs)`` from an empty folder of megaray's own.

    A local Ray starts its workers in the driver's folder and puts that folder first on their
    import path. Launched from a source checkout's root, the workers would import the
    checkout's ``megaray/`` (which has no ``actors/``: setup maps it there from the top-level
    folder) in place of the installed package, and every actor would fail to import. The
    config's paths are absolute by then (``megaray.loader.absolute_paths``), so the workers'
    folder means nothing to a run.

    Ray's memory monitor kills a worker at ``RAY_memory_usage_threshold`` of the node's
    memory (0.95 by default: 6.3 GiB of a 125 GiB host held back). megaray plans host memory
    itself and refuses a run that does not fit (``megaray.fitting.check``, against what the
    monitor allows), so its own cluster starts at 0.98 unless the environment sets it."""
    os.environ.setdefault("RAY_memory_usage_threshold", LOCAL_RAY_KILL_THRESHOLD)
    here = os.getcwd()
    folder = Path(tempfile.gettempdir()) / f"megaray-{os.getuid()}" / "ray-workers"
    folder.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)
    try:
        ray.init(address="local", **kwargs)
    finally:
        os.chdir(here)


def dashboard_url() -> str:
    try:
        from ray._private.worker import get_dashboard_url

        url = get_dashboard_url()
        return f"http://{url}" if url and not url.startswith("http") else (url or "not running")
    except Exception:
        return "not available"


def run_bundle(cfg: RunConfig, device: str) -> dict:
    """What a run reserves on one node (its placement group's one bundle): a CPU per optimizer
    thread, and the local workers' threads and GPUs."""
    o, remote = cfg.optim, cfg.worker.node == "remote"
    cpus = o.num_shards * o.threads_per_shard + (0 if remote else cfg.worker.count * cfg.worker.threads)
    bundle = {"CPU": max(cpus, 1)}
    if device == "cuda" and not remote:
        bundle["GPU"] = cfg.worker.count
    return bundle


def bundle_shortfall(bundle: dict, have: dict) -> str | None:
    """Why a cluster offering ``have`` cannot hold ``bundle``, with the fixes; None if it can."""
    short = {k: (have.get(k, 0), v) for k, v in bundle.items() if have.get(k, 0) < v}
    if not short:
        return None
    said = ", ".join(f"{v} {k} (it offers {h:g})" for k, (h, v) in short.items())
    fixes = []
    if "CPU" in short:
        fixes.append(f"start it with more (ray start --head --num-cpus={bundle['CPU']}: CPUs may outnumber cores)")
        fixes.append("or ask for fewer (optim.num_shards x optim.threads_per_shard + worker.count x worker.threads "
                     "CPUs: e.g. optim.num_shards=1 worker.threads=1)")
    if "GPU" in short:
        fixes.append("GPUs: worker.count GPUs on one node, or worker.device=cpu")
    return f"the Ray cluster cannot hold the run on one node: it needs {said}; " + " ".join(fixes)
