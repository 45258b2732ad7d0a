"""Several nodes on a simulated Ray cluster (ray.cluster_utils.Cluster: three raylets on this
machine). With ``worker.node=remote`` the store, the optimizer shards and the relay stay
on one node and the workers run on the others, reading weights and returning gradients
through Ray's object store, never the run's shared memory: the result must be what the same
run gives with its worker beside the store."""
from __future__ import annotations

import numpy as np
import pytest
import ray
import ray._private.state
from conftest import shm_files
from ray.cluster_utils import Cluster

from megaray.driver.session import NAMESPACE, TrainingSession
from megaray.errors import MegarayError
from megaray.loader import load_config

START_TRIES = 3      # a loaded machine can time a raylet's start out ("Could not read 'dashboard' from GCS")


@pytest.fixture(scope="module")
def cluster():
    """Three raylets, without the dashboard (the tests read the actor table from the GCS);
    a start that a loaded machine times out is tried again from scratch."""
    for attempt in range(START_TRIES):
        c = Cluster()
        try:
            c.add_node(num_cpus=2, include_dashboard=False)
            for _ in range(2):
                c.add_node(num_cpus=1)
            c.wait_for_nodes(timeout=300)
            break
        except Exception:
            c.shutdown()
            if attempt == START_TRIES - 1:
                raise
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _alive_actors() -> list[dict]:
    """The cluster's live actors, from the GCS's actor table (no dashboard needed)."""
    return [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]


def _run(placement: str, workers: int = 1, extra: tuple = (), coefs: list | None = None):
    cfg = load_config("debug", [f"worker.node={placement}", f"worker.count={workers}", "worker.device=cpu",
                                "train.grad_accum=2", "optim.num_shards=1", "optim.grad_slab_mib=0.015625",
                                "cluster.object_store_mb=80", *extra])
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (2, 2, 33)) for _ in range(3)]
    with TrainingSession(cfg) as s:
        ms = [s.train_step(i, b) for i, b in enumerate(batches)]
        losses = [m["loss"] for m in ms]
        if coefs is not None:
            coefs.extend(m["clip_coefficient"] for m in ms)
        where = {}
        for role, a in s.actors.items():
            if role.startswith(("worker", "store", "relay")):
                where[role] = ray._private.state.actors(a._actor_id.hex())["Address"]["NodeID"]
        weights = s.state_dict()
        run_id = s.run_id
    assert shm_files(run_id) == []
    return losses, weights, where


def test_remote_workers_match_a_local_worker(cluster):
    local_l, local_w, where = _run("local")
    assert where["worker"] == where["store"]
    for workers in (1, 2):
        remote_l, remote_w, where = _run("remote", workers)
        workers_at = {where[r] for r in where if r.startswith("worker")}
        assert where["store"] == where["relay"] and where["store"] not in workers_at
        assert len(workers_at) == workers                   # one per other node
        if workers == 1:                                    # the same arithmetic, bit for bit
            assert remote_l == local_l
            for k in local_w:
                np.testing.assert_array_equal(remote_w[k], local_w[k], err_msg=k)
        else:                                               # summed over two workers: to fp32 rounding
            np.testing.assert_allclose(remote_l, local_l, rtol=1e-6)
            for k in local_w:
                np.testing.assert_allclose(remote_w[k], local_w[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_a_remote_worker_casts_the_fp32_master_itself(cluster):
    """bf16 compute with no host copy (``optim.compute_copy=device``): the relay ships the
    fp32 master and the remote worker casts it; the same as a local run whose shards keep
    the bf16 copy, bit for bit (both round to nearest)."""
    bf16 = ("train.compute_dtype=bfloat16",)
    local_l, local_w, _ = _run("local", extra=bf16 + ("optim.compute_copy=host",))
    remote_l, remote_w, _ = _run("remote", extra=bf16 + ("optim.compute_copy=device",))
    assert remote_l == local_l
    for k in local_w:
        np.testing.assert_array_equal(remote_w[k], local_w[k], err_msg=k)


def test_a_remote_worker_ships_bf16_gradients_with_the_clip_coefficient(cluster):
    """bf16 gradients waiting on the worker's device (``optim.grad_dtype``) leave it rounded and
    unscaled, the clip coefficient travelling in the verdict: through the relay the shards
    apply it as the local shards do, bit for bit, with clipping that clips."""
    half = ("optim.grad_placement=device", "optim.grad_dtype=bfloat16", "optim.clip_grad_norm=0.05")
    coefs: list = []
    local_l, local_w, _ = _run("local", extra=half)
    remote_l, remote_w, _ = _run("remote", extra=half, coefs=coefs)
    assert all(c < 0.9 for c in coefs), coefs                      # clipping did clip
    full_l, _, _ = _run("local", extra=half[:1] + half[2:])
    assert remote_l == local_l and full_l[1:] != local_l[1:]      # the rounding changed training
    for k in local_w:
        np.testing.assert_array_equal(remote_w[k], local_w[k], err_msg=k)


def test_remote_placement_needs_another_node(cluster):
    # no node has 3 CPUs for a worker, wherever the store lands
    cfg = load_config("debug", ["worker.node=remote", "worker.device=cpu", "worker.threads=3",
                                "optim.num_shards=1"])
    session = TrainingSession(cfg)
    try:
        with pytest.raises(MegarayError, match="worker.node=remote needs a node"):
            session.start()
    finally:
        session.close()             # (a no-op after the refusal, which already closed it)
    assert not [a for a in _alive_actors() if (a.get("Name") or "").startswith("megaray:")]
