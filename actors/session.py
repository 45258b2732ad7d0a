"""TrainingSession: starts a run's actors, steps them, and always tears them down.

The session runs in the driver (``megaray train``, a ``ray job submit`` entrypoint, or a
test). It removes shared-memory files of dead runs, reserves one placement group so the
actors that share memory land on one node, creates the actors with readable names
(``megaray:<run>:optimizer-1``), and on ``close()`` — called however the run ends — aborts
waits, kills every actor and deletes the run's shared-memory files.

With ``worker.count`` > 1 it starts that many workers (``worker``, ``worker-1``, ...) and
joins them in one process group; with ``worker.placement=remote`` the placement group holds
only the store, scheduler, shards and the relay, and each worker is pinned to another node
(round robin over the nodes with room for one).
"""
from __future__ import annotations

import logging
import os
import re
import uuid

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from megaray.buffers import RunBuffers, assign_pieces
from megaray.config import RunConfig
from megaray.errors import ActorFailure, MegarayError
from megaray.shm import remove_run, remove_stale

from .calls import get_or_raise  # noqa: F401  (also megaray.actors.session.get_or_raise)
from .optimizer import OptimizerShard
from .relay import WeightRelay
from .scheduler import Scheduler
from .store import ParameterStore
from .worker import GpuWorker

log = logging.getLogger("megaray")
NAMESPACE = "megaray"


def new_run_id(name: str) -> str:
    return f"{re.sub(r'[^A-Za-z0-9-]', '-', name)[:32]}-{uuid.uuid4().hex[:8]}"


def resolve_device(cfg: RunConfig) -> str:
    if cfg.worker.device != "auto":
        return cfg.worker.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


@ray.remote(num_gpus=1, num_cpus=0, max_calls=1)   # its CUDA context leaves with it
def _gpu_free() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]


class TrainingSession:
    def __init__(self, cfg: RunConfig, run_id: str | None = None):
        self.cfg = cfg
        self.run_id = run_id or new_run_id(cfg.run.name)
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.pg = None
        self.buf: RunBuffers | None = None
        self.device = None

    def actor_name(self, role: str) -> str:
        return f"megaray:{self.run_id}:{role}"

    def start(self) -> "TrainingSession":
        cfg = self.cfg
        stale = remove_stale(cfg.cluster.shm_dir)
        if stale:
            log.info("removed %d shared-memory files of dead runs", len(stale))
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        cfg = self.cfg
        if cfg.model.from_path:   # headers, names and shapes, before any actor or allocation
            from megaray.hf import verify_source
            from megaray.model import build_layout

            verify_source(build_layout(cfg.model), cfg.model.from_path)
        self.device = resolve_device(cfg)
        # The memory plan, before anything is allocated (host and /dev/shm here, the GPU
        # through a probe task on a GPU of the cluster).
        from megaray.plan import Machine, check

        gpu_free = ray.get(_gpu_free.remote()) if self.device == "cuda" else None
        self.plan = check(cfg, Machine.here(cfg.cluster.shm_dir, gpu_bytes=gpu_free))
        o = cfg.optim
        n_workers = cfg.worker.count
        remote = cfg.worker.placement == "remote"
        cpus = o.num_shards * o.threads_per_shard + (0 if remote else n_workers * cfg.worker.threads)
        bundle = {"CPU": max(cpus, 1)}
        if self.device == "cuda" and not remote:
            bundle["GPU"] = n_workers
        have = ray.cluster_resources()
        if any(have.get(k, 0) < v for k, v in bundle.items()):
            raise MegarayError(
                f"the Ray cluster has {dict((k, have.get(k, 0)) for k in bundle)} but the run needs {bundle} "
                f"on one node (optim.num_shards x optim.threads_per_shard + worker.count x worker.threads CPUs, "
                f"worker.count GPUs)")
        self.pg = placement_group([bundle], strategy="STRICT_PACK", name=self.actor_name("group"))
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise MegarayError(
                f"the Ray cluster cannot place the run's actors on one node: it needs {bundle} "
                f"(optim.num_shards x optim.threads_per_shard + worker.threads CPUs); it has "
                f"{ray.available_resources()}") from None
        where = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0)

        def spawn(cls, role, num_cpus=0, num_gpus=0, **kw):
            return ray.remote(cls).options(
                name=self.actor_name(role), namespace=NAMESPACE, num_cpus=num_cpus, num_gpus=num_gpus,
                scheduling_strategy=where, max_restarts=0, **kw)

        store = spawn(ParameterStore, "store").remote(cfg, self.run_id, os.getpid())
        self.actors["store"] = store
        try:
            handles = ray.get(store.handles.remote())
        except ray.exceptions.RayActorError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, MegarayError):   # e.g. a broken model file: say so plainly
                raise cause from None
            raise
        self.weights_report = ray.get(store.report.remote())
        if self.cfg.model.from_path:
            r = self.weights_report
            log.info("loaded %s: %d tensors, %.2f GB (%s) in %.1f s; store peak RSS %.2f GB for %.2f GB of "
                     "masters", self.cfg.model.from_path, r["tensors"], r["source_bytes"] / 1e9,
                     ",".join(r["source_dtypes"]), r["seconds"], r["peak_rss_bytes"] / 1e9, r["master_bytes"] / 1e9)
        self.handles = handles
        self.buf = RunBuffers(handles, kinds=("control",))
        sched = spawn(Scheduler, "scheduler").remote(cfg, handles, self.actor_name("scheduler"))
        self.actors["scheduler"] = sched
        relay, nodes = None, []
        if remote:
            relay = spawn(WeightRelay, "relay", max_concurrency=8).remote(cfg, handles, self.actor_name("relay"))
            self.actors["relay"] = relay
            nodes = self._worker_nodes(n_workers)
        workers = []
        for rank in range(n_workers):          # rank 0 is "worker": it decides steps and ships gradients
            role = "worker" if rank == 0 else f"worker-{rank}"
            opts = dict(num_cpus=cfg.worker.threads, num_gpus=1 if self.device == "cuda" else 0)
            if remote:
                cls = ray.remote(GpuWorker).options(
                    name=self.actor_name(role), namespace=NAMESPACE, max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[rank], soft=False), **opts)
            else:
                cls = spawn(GpuWorker, role, **opts)
            workers.append(cls.remote(cfg, handles, self.device, self.actor_name(role), rank, n_workers, relay))
            self.actors[role] = workers[-1]
        shards, names = [], []
        for k, pieces in enumerate(assign_pieces(len(handles.pieces), o.num_shards, o.shard_layout)):
            name = self.actor_name(f"optimizer-{k}")
            shard = spawn(OptimizerShard, f"optimizer-{k}", num_cpus=o.threads_per_shard).remote(
                cfg, handles, pieces, name)
            self.actors[f"optimizer-{k}"] = shard
            shards.append(shard)
            names.append(name)
        # Surface constructor errors now, naming the actor.
        for role, a in self.actors.items():
            try:
                ray.get(a.__ray_ready__.remote())
            except ray.exceptions.RayError as e:
                raise ActorFailure(self.actor_name(role), f"failed to start: {e}") from None
        if n_workers > 1:
            addr, port = ray.get(workers[0].rendezvous.remote())
            self._call([w.join_group.remote(addr, port) for w in workers], "worker")
        ray.get(sched.attach.remote(workers, shards, names))
        log.info("run %s: %d layer units in %d gradient pieces, %d optimizer shards, a ring of %d x %g MiB "
                 "gradient slabs, %d worker(s) on %s", self.run_id, handles.num_units, len(handles.pieces),
                 len(shards), handles.ring_slabs, handles.slab_bytes / 2**20, n_workers, self.device)

    def _worker_nodes(self, n: int) -> list[str]:
        """Nodes other than the store's with room for a worker each (round robin over them)."""
        store_node = ray.util.placement_group_table(self.pg)["bundles_to_node_id"][0]
        need = {"CPU": self.cfg.worker.threads, **({"GPU": 1} if self.device == "cuda" else {})}
        others = [nd["NodeID"] for nd in ray.nodes() if nd["Alive"] and nd["NodeID"] != store_node
                  and all(nd["Resources"].get(k, 0) >= v for k, v in need.items())]
        if not others:
            raise MegarayError(f"worker.placement=remote needs a node other than the store's ({store_node[:12]}) "
                               f"with {need}; the cluster has none")
        return [others[r % len(others)] for r in range(n)]

    # ------------------------------------------------------------------ driving
    def _call(self, ref, who: str = "scheduler"):
        return get_or_raise(ref, self.actor_name(who))

    def train_step(self, step: int, tokens: np.ndarray) -> dict:
        return self._call(self.actors["scheduler"].train_step.remote(step, tokens))

    def evaluate(self, step: int, tokens: np.ndarray) -> float:
        return self._call(self.actors["scheduler"].evaluate.remote(step, tokens))

    def drain(self) -> None:
        self._call(self.actors["scheduler"].drain.remote())

    def state_dict(self) -> dict[str, np.ndarray]:
        """Master weights (as fp32) by Hugging Face name, after all pending updates.

        Read straight from the shared master file (no copy through Ray's object store).
        """
        self.drain()
        master = RunBuffers(self.handles, kinds=("master",))
        out = {}
        for u in self.handles.units:
            flat = master.master(u.index)
            for s in u.params:
                out[s.name] = flat[s.offset:s.offset + s.numel].view(s.shape).float().numpy().copy()
        return out

    def gradients(self) -> dict[str, np.ndarray]:
        """The last step's unclipped fp32 gradients by name (needs ``debug.keep_gradients``)."""
        by_unit = self._call(self.actors["worker"].gradients.remote(), "worker")
        return {s.name: by_unit[u.index][s.offset:s.offset + s.numel].reshape(s.shape)
                for u in self.handles.units for s in u.params}

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """fp32 logits [batch, seq, vocab] for tokens [batch, seq] with the current weights."""
        self.drain()
        return self._call(self.actors["worker"].logits.remote(tokens))

    def check_alive(self) -> None:
        """Raise ActorFailure if the store died (the others fail inside the step that needs them)."""
        try:
            ray.get(self.actors["store"].ping.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise ActorFailure(self.actor_name("store"), f"actor died: {type(e).__name__}") from None

    # ------------------------------------------------------------------ checkpoints
    def _shards(self):
        return [(int(k.split("-")[1]), a) for k, a in self.actors.items() if k.startswith("optimizer-")]

    def save_parts(self, folder: str) -> dict:
        """Every store and shard writes its own part of a checkpoint, in parallel."""
        self.drain()
        refs = [self.actors["store"].save.remote(folder)] + [a.save.remote(folder, k) for k, a in self._shards()]
        parts: dict = {}
        for p in self._call(refs, "checkpoint"):
            parts.update(p)
        return parts

    def load_parts(self, folder: str, parts: dict, step: int, counters: dict) -> None:
        refs = [self.actors["store"].load.remote(folder, parts, step)] + \
            [a.load.remote(folder, parts) for _, a in self._shards()]
        self._call(refs, "checkpoint")
        ray.get(self.actors["scheduler"].set_counters.remote(counters))

    def counters(self) -> dict:
        return ray.get(self.actors["scheduler"].state.remote())

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Abort waits, kill every actor, free the placement group and the shared memory."""
        if self.buf is not None:
            try:
                self.buf.abort()
            except Exception:  # the control file may already be gone
                pass
        for a in self.actors.values():
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.actors.clear()
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        self.buf = None
        remove_run(self.cfg.cluster.shm_dir, self.run_id)

    def __enter__(self) -> "TrainingSession":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
