"""TrainingSession: starts every actor of a run, drives it, and always tears it down.

The session runs in the driver (``megaray train``, a ``ray job submit`` entrypoint, a bench
or a test). ``start()`` removes shared-memory files of dead runs, checks the memory plan,
reserves one placement group so the actors that share memory land on one node, and spawns
every actor of the run with a readable name (``megaray:<run>:optimizer-1``): the store, the
scheduler, the workers, the optimizer shards and the data feeder (and, for workers on other
nodes, the relay). ``close()`` — called however the run ends — lets the run's calls end,
aborts waits, kills every actor, removes the placement group and deletes the run's
shared-memory files.

With ``worker.count`` > 1 it starts that many workers (``worker``, ``worker-1``, ...) and
joins them in one process group; with ``worker.node=remote`` the placement group holds
only the store, scheduler, shards, feeder and the relay, and each worker is pinned to another
node (round robin over the nodes with room for one).

Data: batches are addressed by stream position (rows consumed so far), which checkpoints
store; the session asks the feeder for the next ``data.prefetch`` steps' batches ahead of
the step that trains. The feeder holds nothing but its files, so ``replace_data_actor``
starts a new one that continues at the same positions.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
import uuid
from collections.abc import Callable

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from megaray.actors.calibrate import update_scale
from megaray.actors.calls import get_or_raise
from megaray.actors.data import DataFeeder
from megaray.actors.debug import shard_class, worker_class
from megaray.actors.relay import WeightRelay
from megaray.actors.scheduler import Scheduler
from megaray.actors.store import ParameterStore, read_startup, startup_path
from megaray.buffers import RunBuffers
from megaray.config import RunConfig
from megaray.driver.cluster import bundle_shortfall, run_bundle
from megaray.errors import ActorFailure, ConfigError, MegarayError
from megaray.fitting import check
from megaray.hf.read import verify_source
from megaray.layout import assign_pieces, build_layout
from megaray.machine import Machine
from megaray.plan import count, describe_input_stride, describe_placement, resolve, shard_speeds, size
from megaray.shm import remove_run, remove_stale
from megaray.step import Batch

log = logging.getLogger("megaray")
NAMESPACE = "megaray"
STARTUP_REPORT_S = 15.0       # between the progress lines while the actors start


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


def as_ready(refs: list, report: Callable[[list], None]):
    """Each of ``refs`` as it completes; every ``STARTUP_REPORT_S`` while some are pending,
    ``report(pending)`` (the start-up's progress lines)."""
    due = time.perf_counter() + STARTUP_REPORT_S
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, timeout=max(0.0, due - time.perf_counter()))
        yield from done
        if pending and time.perf_counter() >= due:
            report(pending)
            due = time.perf_counter() + STARTUP_REPORT_S


def cuda_allocator_env(environ=os.environ) -> dict[str, str]:
    """The CUDA caching allocator's settings for a GPU worker: the driver's own
    ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` when set (passed on, so that they
    reach the worker on a cluster started elsewhere too), else expandable segments. The
    default allocator splits fixed segments: the qwen14b step with bf16 moments ran out
    with 11.5 GiB reserved but free, and a 524,288-token step with the 6 GiB accumulator of
    flash attention's backward, both within the plan (BENCHMARKS.md)."""
    mine = {k: environ[k] for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if environ.get(k)}
    return mine or {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


class TrainingSession:
    def __init__(self, cfg: RunConfig, run_id: str | None = None):
        self.cfg = cfg
        self.run_id = run_id or new_run_id(cfg.run.name)
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.pg = None
        self.buf: RunBuffers | None = None
        self.device = None
        self.rows_per_step = cfg.train.grad_accum * cfg.train.micro_batch_size
        self._ahead: dict[int, ray.ObjectRef] = {}      # prefetched batches by stream position

    def actor_name(self, role: str) -> str:
        return f"megaray:{self.run_id}:{role}"

    # ------------------------------------------------------------------ start
    def start(self) -> TrainingSession:
        stale = remove_stale(self.cfg.cluster.shm_dir)
        if stale:
            log.info("removed %d shared-memory files of dead runs", len(stale))
        try:
            self._start()
        except ray.exceptions.RayError as e:   # the cluster itself failed (a dead raylet, a lost node)
            self.close()
            alive = sum(1 for nd in ray.nodes() if nd["Alive"]) if ray.is_initialized() else 0
            raise MegarayError(f"the Ray cluster failed while the run's actors started ({type(e).__name__}: "
                               f"{str(e)[:200]}); {alive} node(s) alive: if a raylet died, restart Ray "
                               "(ray stop; ray start --head) and run again") from None
        except BaseException:
            self.close()
            raise
        return self

    def _decide(self) -> None:
        """Everything decided before anything is allocated: the model file checked, the
        device, the machine (host and /dev/shm here, the GPU through a probe task on a GPU of
        the cluster), the config's 'auto' choices resolved for it (``plan.resolve``, once: every
        actor reads the resolved config) and the memory plan checked."""
        cfg, o = self.cfg, self.cfg.optim
        if cfg.model.from_path:   # headers, names and shapes
            verify_source(build_layout(cfg.model), cfg.model.from_path)
        self.device = resolve_device(cfg)
        gpus = ray.cluster_resources().get("GPU", 0)
        if self.device == "cuda" and gpus < cfg.worker.count:     # never wait for a GPU that is not there
            raise ConfigError("worker.device", f"cuda: the run needs {cfg.worker.count} GPU(s) and the Ray cluster "
                                               f"has {gpus:g}; use worker.device=cpu or auto")
        gpu_free = ray.get(_gpu_free.remote()) if self.device == "cuda" else None
        machine = Machine.here(cfg.cluster.shm_dir, gpu_bytes=gpu_free)
        self.speeds = shard_speeds(cfg)
        if gpu_free is not None and "auto" in (o.resident_units, o.grad_placement):    # the cost model decides
            self.speeds = dataclasses.replace(self.speeds, update_scale=update_scale(cfg))
        self.cfg = resolve(cfg, machine, self.speeds)
        self.plan = check(self.cfg, machine, asked=cfg)

    def _start(self) -> None:
        """Decide, then spawn: the store, the scheduler, the workers, the shards, the feeder."""
        self._decide()
        cfg, o = self.cfg, self.cfg.optim
        self._reserve()
        started = time.perf_counter()
        log.info("starting the parameter store: %s parameters%s", count(cfg.model.num_params()),
                 f" from {cfg.model.from_path}" if cfg.model.from_path else ", initialised here")
        store = self._spawn(ParameterStore, "store", cfg, self.run_id, os.getpid())
        try:
            self.handles = get_or_raise(self._await_store(store.handles.remote(), started), self.actor_name("store"))
        except ActorFailure as e:
            raise ActorFailure(e.actor, f"failed to start: {e.message}") from None
        log.info("parameter store ready in %.1f s; starting %d worker(s)", time.perf_counter() - started,
                 cfg.worker.count)
        self.weights_report = ray.get(store.report.remote())
        if cfg.model.from_path:
            r = self.weights_report
            log.info("loaded %s: %d tensors, %.2f GB (%s) in %.1f s; store peak RSS %.2f GB for %.2f GB of "
                     "masters", cfg.model.from_path, r["tensors"], r["source_bytes"] / 1e9,
                     ",".join(r["source_dtypes"]), r["seconds"], r["peak_rss_bytes"] / 1e9, r["master_bytes"] / 1e9)
        self.buf = RunBuffers(self.handles, kinds=("control",))
        sched = self._spawn(Scheduler, "scheduler", cfg, self.handles, self.actor_name("scheduler"))
        relay = None
        if cfg.worker.node == "remote":
            relay = self._spawn(WeightRelay, "relay", cfg, self.handles, self.actor_name("relay"), max_concurrency=8)
        workers = self._spawn_workers(relay)
        # The workers first: a resident unit's initial values pass through the worker's host
        # memory (a few parameters at a time) before the shards take and touch their moments.
        self._ready([r for r in self.actors if r.startswith("worker")], started)
        log.info("worker(s) ready at %.1f s; starting %d optimizer shards", time.perf_counter() - started,
                 o.num_shards)
        shards = []
        sizes = [p.stop - p.start for p in self.handles.pieces]
        for k, pieces in enumerate(assign_pieces(len(sizes), o.num_shards, o.shard_layout, sizes)):
            role = f"optimizer-{k}"
            shards.append(self._spawn(shard_class(cfg), role, cfg, self.handles, pieces, self.actor_name(role),
                                      num_cpus=o.threads_per_shard))
        self._spawn_data()
        # the rest (the store and the workers are ready by now: never named as still starting)
        self._ready([r for r in self.actors if r != "store" and not r.startswith("worker")], started)
        log.info("optimizer shards and data ready at %.1f s", time.perf_counter() - started)
        if len(workers) > 1:
            addr, port = ray.get(workers[0].rendezvous.remote())
            self._call([w.join_group.remote(addr, port) for w in workers], "worker")
        ray.get(sched.attach.remote(workers, shards, [self.actor_name(f"optimizer-{k}") for k in range(len(shards))]))
        self.data_description = self._call(self.actors["data"].describe.remote(), "data")
        self.attention = self._call(self.actors["data"].describe_attention.remote(), "data")
        self.has_heldout = self._call(self.actors["data"].has_heldout.remote(), "data")
        kernel = self._call(shards[0].kernel.remote(), "optimizer-0")
        log.info("run %s: %d layer units in %d gradient pieces, %d optimizer shards (AdamW: %s), a ring of "
                 "%d x %s gradient slabs, %d worker(s) on %s; %s (optim.resident_units)", self.run_id,
                 self.handles.num_units, len(self.handles.pieces), len(shards), kernel, self.handles.ring_slabs,
                 size(self.handles.slab_bytes), len(workers), self.device,
                 describe_placement(len(self.handles.resident)))
        if cfg.worker.stride > 1:
            log.info("%s", describe_input_stride(cfg.worker.stride))

    def _await_store(self, ref, started: float):
        """Wait for the store's constructor, logging how far its weights have come every
        ``STARTUP_REPORT_S`` (a 14B model's take a minute or more); returns ``ref``."""
        path = startup_path(self.cfg.cluster.shm_dir, os.getpid(), self.run_id)
        how = "loaded" if self.cfg.model.from_path else "initialised"

        def report(_pending):
            counts = read_startup(path)
            if counts is not None and counts[1]:
                log.info("parameter store: %.0f%% of %.2f B values %s at %.0f s", 100 * counts[0] / counts[1],
                         counts[1] / 1e9, how, time.perf_counter() - started)

        for _ in as_ready([ref], report):
            pass
        return ref

    def _ready(self, roles: list[str], started: float) -> None:
        """Wait for these actors' constructors, naming those still starting every
        ``STARTUP_REPORT_S`` (a worker pinning a large model's buffers takes a while); an
        error names the actor as soon as it comes."""
        role = {self.actors[r].__ray_ready__.remote(): r for r in roles}

        def report(pending):
            log.info("still starting at %.0f s: %s", time.perf_counter() - started, ", ".join(role[p] for p in pending))

        for ref in as_ready(list(role), report):
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                raise ActorFailure(self.actor_name(role[ref]), f"failed to start: {e}") from None

    def _reserve(self) -> None:
        """One placement group (STRICT_PACK: one node) for every actor that shares memory."""
        bundle = run_bundle(self.cfg, self.device)
        have = ray.cluster_resources()
        if not have.get("CPU"):
            alive = sum(1 for nd in ray.nodes() if nd["Alive"])
            raise MegarayError(f"the Ray cluster reports no CPUs ({alive} node(s) alive): its raylet may have died; "
                               "restart Ray (ray stop; ray start --head) and run again")
        short = bundle_shortfall(bundle, have)
        if short:
            raise ConfigError("cluster", short)
        self.pg = placement_group([bundle], strategy="STRICT_PACK", name=self.actor_name("group"))
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise MegarayError(
                f"the Ray cluster cannot place the run's actors on one node: it needs {bundle} "
                f"(optim.num_shards x optim.threads_per_shard + worker.threads CPUs); it has "
                f"{ray.available_resources()}") from None

    def _spawn(self, cls, role: str, *args, num_cpus: float = 0, num_gpus: float = 0, node: str | None = None,
               **kw):
        """Start one actor of the run, named, in the placement group (or pinned to ``node``)."""
        where = (NodeAffinitySchedulingStrategy(node, soft=False) if node is not None else
                 PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0))
        self.actors[role] = ray.remote(cls).options(
            name=self.actor_name(role), namespace=NAMESPACE, num_cpus=num_cpus, num_gpus=num_gpus,
            scheduling_strategy=where, max_restarts=0, **kw).remote(*args)
        return self.actors[role]

    def _spawn_workers(self, relay) -> list:
        cfg = self.cfg
        n = cfg.worker.count
        nodes = self._worker_nodes(n) if relay is not None else [None] * n
        workers = []
        extra = {"runtime_env": {"env_vars": cuda_allocator_env()}} if self.device == "cuda" else {}
        for rank in range(n):          # rank 0 is "worker": it decides steps and ships gradients
            role = "worker" if rank == 0 else f"worker-{rank}"
            workers.append(self._spawn(worker_class(cfg), role, cfg, self.handles, self.device, self.actor_name(role),
                                       rank, n, relay, num_cpus=cfg.worker.threads,
                                       num_gpus=1 if self.device == "cuda" else 0, node=nodes[rank], **extra))
        return workers

    def _spawn_data(self) -> None:
        self._spawn(DataFeeder, "data", self.cfg)
        self._ahead.clear()

    def _worker_nodes(self, n: int) -> list[str]:
        """Nodes other than the store's with room for a worker each (round robin over them)."""
        store_node = ray.util.placement_group_table(self.pg)["bundles_to_node_id"][0]
        need = {"CPU": self.cfg.worker.threads, **({"GPU": 1} if self.device == "cuda" else {})}
        others = [nd["NodeID"] for nd in ray.nodes() if nd["Alive"] and nd["NodeID"] != store_node
                  and all(nd["Resources"].get(k, 0) >= v for k, v in need.items())]
        if not others:
            raise MegarayError(f"worker.node=remote needs a node other than the store's ({store_node[:12]}) "
                               f"with {need}; the cluster has none")
        return [others[r % len(others)] for r in range(n)]

    # ------------------------------------------------------------------ data
    def batch(self, position: int) -> tuple[Batch, float, float]:
        """The step batch at stream ``position``; also the seconds the driver waited for it
        and the seconds the feeder took to build it. The next ``data.prefetch`` steps'
        batches are asked for now."""
        feeder = self.actors["data"]
        for k in range(self.cfg.data.prefetch + 1):
            p = position + k * self.rows_per_step
            if p not in self._ahead:
                self._ahead[p] = feeder.step_batch.remote(p)
        ref = self._ahead.pop(position)
        for p in [p for p in self._ahead if p < position]:
            del self._ahead[p]
        t0 = time.perf_counter()
        batch, built_s = self._call(ref, "data")
        return batch, time.perf_counter() - t0, built_s

    def heldout(self) -> Batch:
        """The held-out batch (``train.eval_batches`` micro-batches)."""
        n = max(1, self.cfg.train.eval_batches)
        return self._call(self.actors["data"].step_batch.remote(0, n, "heldout"), "data")[0]

    def data_actor_alive(self) -> bool:
        try:
            ray.get(self.actors["data"].describe.remote(), timeout=60)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def replace_data_actor(self) -> None:
        """A new feeder in place of a dead one; it continues at the positions asked for."""
        try:
            ray.kill(self.actors["data"], no_restart=True)
        except Exception:
            pass
        self._spawn_data()

    # ------------------------------------------------------------------ driving
    def _call(self, ref, who: str = "scheduler"):
        return get_or_raise(ref, self.actor_name(who))

    def train_step(self, step: int, batch: Batch | np.ndarray) -> dict:
        """One step on ``batch`` (or on an array of tokens alone); its metrics row."""
        return self._call(self.actors["scheduler"].train_step.remote(step, Batch.of(batch)))

    def evaluate(self, step: int, batch: Batch | np.ndarray) -> float:
        """The forward-only loss of ``batch`` with step ``step``'s weights."""
        return self._call(self.actors["scheduler"].evaluate.remote(step, Batch.of(batch)))

    def drain(self) -> None:
        self._call(self.actors["scheduler"].drain.remote())

    def state_dict(self) -> dict[str, np.ndarray]:
        """Master weights (as fp32) by Hugging Face name, after all pending updates.

        Read straight from the shared master file (no copy through Ray's object store), but
        resident units' from the worker.
        """
        self.drain()
        resident = self._call(self.actors["worker"].resident_masters.remote(), "worker")
        master = RunBuffers(self.handles, kinds=("master",))
        out = {}
        for u in self.handles.units:
            flat = resident[u.index] if u.index in resident else master.master(u.index).float().numpy()
            for s in u.params:
                out[s.name] = flat[s.offset:s.offset + s.numel].reshape(s.shape).copy()
        return out

    def gradients(self) -> dict[str, np.ndarray]:
        """The last step's unclipped fp32 gradients by name (needs ``debug.keep_gradients``)."""
        by_unit = self._call(self.actors["worker"].gradients.remote(), "worker")
        return {s.name: by_unit[u.index][s.offset:s.offset + s.numel].reshape(s.shape)
                for u in self.handles.units for s in u.params}

    def logits(self, tokens: np.ndarray, doc: np.ndarray | None = None) -> np.ndarray:
        """fp32 logits [batch, seq, vocab] for tokens [batch, seq] with the current weights;
        with ``doc`` (each token's document, [batch, seq]) under document attention."""
        self.drain()
        return self._call(self.actors["worker"].logits.remote(tokens, doc))

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
        """Every store and shard (and the worker, for resident units) writes its own part of a
        checkpoint, in parallel."""
        self.drain()
        refs = ([self.actors["store"].save.remote(folder), self.actors["worker"].save_resident.remote(folder)]
                + [a.save.remote(folder, k) for k, a in self._shards()])
        # Every writer ends before a failure is raised: the caller then removes the folder,
        # and a part still being written would recreate a file in it (a full disk left a
        # step-*.tmp-* folder behind that way).
        ray.wait(refs, num_returns=len(refs))
        parts: dict = {}
        for p in self._call(refs, "checkpoint"):
            parts.update(p)
        return parts

    def load(self, folder: str, counters: dict) -> None:
        """The store, every shard and the worker (resident units) read their state from a
        checkpoint, in parallel."""
        refs = ([self.actors["store"].load.remote(folder), self.actors["worker"].load_resident.remote(folder)]
                + [a.load.remote(folder) for _, a in self._shards()])
        self._call(refs, "checkpoint")
        ray.get(self.actors["scheduler"].set_counters.remote(counters))

    def counters(self) -> dict:
        return ray.get(self.actors["scheduler"].state.remote())

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Let the run's calls end, abort waits, kill every actor, free the placement group
        and the shared memory."""
        if self.buf is not None:
            try:
                self.buf.control.abort()
            except Exception:  # the control file may already be gone
                pass
        if "scheduler" in self.actors:      # its pending calls end (aborted) before their actors go
            try:
                ray.get(self.actors["scheduler"].settle.remote(), timeout=30)
            except Exception:
                pass
        self._ahead.clear()
        # A graceful exit first: each actor ends after its last call and reports it as
        # finished (a killed worker's calls show as failed in the dashboard); then a kill for
        # any that did not go within the timeout.
        closes = [a.close.remote() for role, a in self.actors.items() if role == "worker" or
                  role.startswith(("worker-", "optimizer-"))]
        if closes:
            ray.wait(closes, num_returns=len(closes), timeout=15)
        ends = []
        for a in self.actors.values():
            try:
                ends.append(a.__ray_terminate__.remote())
            except Exception:
                pass
        if ends:
            ray.wait(ends, num_returns=len(ends), timeout=15)
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

    def __enter__(self) -> TrainingSession:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
