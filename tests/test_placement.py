"""Resident units (``optim.resident_units`` N: the embedding, then the first blocks): state on the
worker's device, updated there.

On the CPU a resident unit runs the shards' own AdamW calls piece by piece, so any placement
must equal the all-host one bit for bit: losses and every weight, with clipping that clips,
clipping off, a skipped non-finite step, weight-decay groups (matrices decayed, norms not),
gradient accumulation, both homes of the gradients, bf16 gradients and bf16 moments. A checkpoint written
with one placement resumes with another, exactly.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from safetensors.torch import load_file

from megaray.checkpoint import Checkpoint
from megaray.cost import ADAMW_PER_CORE, Speeds, predict
from megaray.driver.runner import train
from megaray.driver.session import TrainingSession
from megaray.errors import ConfigError, PlanError
from megaray.fitting import check
from megaray.hf.export import export_checkpoint
from megaray.layout import align, build_layout
from megaray.loader import load_config
from megaray.machine import Machine
from megaray.memory import GiB
from megaray.plan import best, cast_slab_bytes, choose_placement, gpu_budget, plan, resolve

BASE = ["train.grad_accum=2", "train.steps=3", "optim.num_shards=2", "optim.grad_slab_mib=0.01",
        "optim.weight_decay=0.1", "optim.warmup_steps=0"]


def _train(*extra: str, steps: int = 3):
    cfg = load_config("debug", [*BASE, *extra])
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (2, 2, 33)) for _ in range(steps)]
    with TrainingSession(cfg) as s:
        assert s.handles.resident == tuple(range(cfg.optim.resident_count))
        ms = [s.train_step(i, b) for i, b in enumerate(batches)]
        resident = ray.get(s.actors["worker"].resident_state.remote())
        return ms, s.state_dict(), resident


CASES = {
    "ring-clipped": ["optim.grad_placement=device", "optim.clip_grad_norm=0.05"],
    "ring-skipped-step": ["optim.grad_placement=device", "optim.clip_grad_norm=0.05", "debug.nonfinite_steps=[1]"],
    "host-clipped": ["optim.grad_placement=host", "optim.clip_grad_norm=0.05"],
    "host-clipping-off": ["optim.grad_placement=host", "optim.clip_grad_norm=null"],
    "host-bf16-gradients": ["optim.grad_placement=host", "optim.grad_dtype=bfloat16", "optim.clip_grad_norm=0.05"],
    "ring-bf16-gradients": ["optim.grad_placement=device", "optim.grad_dtype=bfloat16", "optim.clip_grad_norm=0.05"],
    "ring-bf16-moments": ["optim.grad_placement=device", "optim.moment_dtype=bfloat16", "optim.clip_grad_norm=0.05"],
    "host-bf16-moments-and-gradients": ["optim.grad_placement=host", "optim.moment_dtype=bfloat16",
                                        "optim.grad_dtype=bfloat16", "optim.clip_grad_norm=0.05"],
}


# the embedding alone; the embedding and block 0; the embedding and both blocks
PLACEMENT = {"ring-clipped": 1, "ring-skipped-step": 3, "host-clipped": 2, "host-clipping-off": 3,
             "host-bf16-gradients": 2, "ring-bf16-gradients": 2, "ring-bf16-moments": 3,
             "host-bf16-moments-and-gradients": 2}


@pytest.mark.parametrize("case", list(CASES))
def test_resident_units_equal_streamed_units_bit_for_bit(ray_cluster, case):
    opts = CASES[case]
    ref, ref_w, _ = _train("optim.resident_units=host", *opts)
    placement = PLACEMENT[case]
    got, got_w, resident = _train(f"optim.resident_units={placement}", *opts)
    np.testing.assert_array_equal([m["loss"] for m in got], [m["loss"] for m in ref])   # NaN = NaN
    assert [m["skipped"] for m in got] == [m["skipped"] for m in ref]
    if "debug.nonfinite_steps=[1]" in opts:
        assert [m["skipped"] for m in got] == [False, True, False]
    if "optim.clip_grad_norm=0.05" in opts:
        assert all(m["clip_coefficient"] < 0.9 for m in ref if not m["skipped"])   # clipping did clip
    for k in ref_w:
        np.testing.assert_array_equal(got_w[k], ref_w[k], err_msg=k)
    # the resident pieces' Adam steps: every applied step counted, the skipped one not
    applied = sum(not m["skipped"] for m in got)
    assert {k[0] for k in resident} == set(range(placement))
    assert {v["step"] for v in resident.values()} == {applied}
    moments = torch.bfloat16 if "optim.moment_dtype=bfloat16" in opts else torch.float32
    assert {v["exp_avg"].dtype for v in resident.values()} == {v["exp_avg_sq"].dtype for v in resident.values()} \
        == {moments}


def _losses(summary) -> dict[int, float]:
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


RUN = ["train.steps=6", "train.log_every=1", "train.eval_batches=1", "data.max_bytes=50000",
       "optim.grad_slab_mib=0.01"]


def _run_cfg(tmp: Path, *extra: str):
    return load_config("debug", [*RUN, f"run.dir={tmp}", *extra])


@pytest.fixture(scope="module")
def all_host_run(ray_cluster, tmp_path_factory):
    """Six uninterrupted steps with every block streamed (the reference of the resumes)."""
    return train(_run_cfg(tmp_path_factory.mktemp("ref"), "checkpoint.resume=null"))


@pytest.mark.parametrize("before, after", [("host", 2), (3, "host"), (1, 3)])
def test_a_checkpoint_resumes_with_another_placement(all_host_run, tmp_path, before, after):
    """Cut after step 4 (a checkpoint at 3), resume with another placement: steps 4-6 and
    the final weights equal the uninterrupted all-host run's, bit for bit."""
    cfg, ref = _run_cfg, all_host_run

    def interrupt(step, session):
        if step == 4:
            raise KeyError("interrupt")

    with pytest.raises(KeyError):
        train(cfg(tmp_path / "cut", "checkpoint.every=3", f"optim.resident_units={before}"), on_step=interrupt)
    written = Checkpoint(next((tmp_path / "cut").rglob("step-*")))
    assert ("resident.bin" in written.parts) == (before != "host")
    s = train(cfg(tmp_path / "cut", f"optim.resident_units={after}"))
    assert s["first_step"] == 4
    want = _losses(ref)
    assert _losses(s) == {k: want[k] for k in (4, 5, 6)}
    got, want = _masters(s["checkpoint"]), _masters(ref["checkpoint"])    # from whichever parts hold them
    for u in want:
        assert torch.equal(got[u], want[u]), u
    # and the export of the resumed run is the reference run's export
    a, _ = export_checkpoint(s["checkpoint"], tmp_path / "hf-got")
    b, _ = export_checkpoint(ref["checkpoint"], tmp_path / "hf-want")
    got_t = {k: v for f in sorted(a.glob("*.safetensors")) for k, v in load_file(f).items()}
    want_t = {k: v for f in sorted(b.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert got_t.keys() == want_t.keys() and all(torch.equal(got_t[k], want_t[k]) for k in want_t)


def test_bf16_moments_resume_from_resident_units_to_streamed_ones(ray_cluster, tmp_path):
    """bf16 moments written by resident units (the worker's resident.bin, in the shards' dtype)
    and read back by the shards: cut after step 4 with the embedding and both blocks resident,
    resumed with every unit streamed, steps 4-6 and the final masters equal an uninterrupted
    all-streamed run's, bit for bit."""
    bf16 = "optim.moment_dtype=bfloat16"
    ref = train(_run_cfg(tmp_path / "ref", "checkpoint.resume=null", bf16, "optim.resident_units=host"))

    def interrupt(step, session):
        if step == 4:
            raise KeyError("interrupt")

    with pytest.raises(KeyError):
        train(_run_cfg(tmp_path / "cut", "checkpoint.every=3", bf16, "optim.resident_units=3"), on_step=interrupt)
    written = Checkpoint(next((tmp_path / "cut").rglob("step-*")))
    assert "resident.bin" in written.parts and written.moment_dtype == torch.bfloat16
    s = train(_run_cfg(tmp_path / "cut", bf16, "optim.resident_units=host"))
    assert s["first_step"] == 4
    want = _losses(ref)
    assert _losses(s) == {k: want[k] for k in (4, 5, 6)}
    got, want = _masters(s["checkpoint"]), _masters(ref["checkpoint"])
    for u in want:
        assert torch.equal(got[u], want[u]), u


def _masters(path) -> dict[int, torch.Tensor]:
    ck = Checkpoint(path)
    out = {}
    for u in build_layout(load_config("debug", []).model):
        out[u.index] = torch.empty(u.numel)
        ck.read_range("master", u.index, 0, u.numel, [out[u.index]])
    return out


def test_placement_is_checked_with_the_key_named():
    with pytest.raises(ConfigError, match="optim.resident_units.*4 resident units, but the model has the embedding "
                                          r"and 2 blocks before the head \(at most 3"):
        load_config("debug", ["optim.resident_units=4"])
    with pytest.raises(ConfigError, match=r"optim.resident_units.*fp32 master \(their moments fp32 or bf16\); "
                                          "got optim.master_dtype=bfloat16"):
        load_config("debug", ["optim.resident_units=1", "optim.master_dtype=bfloat16", "train.compute_dtype=bfloat16"])
    assert load_config("debug", ["optim.resident_units=1", "optim.moment_dtype=bfloat16"]).optim.resident_count == 1
    with pytest.raises(ConfigError, match="optim.resident_units.*one worker"):
        load_config("debug", ["optim.resident_units=1", "worker.count=2"])
    with pytest.raises(ConfigError, match="optim.resident_units.*must be host, auto or a number"):
        load_config("debug", ["optim.resident_units=everywhere"])


def test_the_plan_moves_resident_state_from_host_to_gpu():
    """llama1b's embedding and two of its 16 blocks resident: their moments, master and bf16
    copy leave host memory (8 + 4 + 2 bytes a parameter with fp32 moments, 4 + 4 + 2 with bf16
    ones, the shared regions page-aligned; the regions stay in the files, never written); the
    GPU gains 4 + 8 + 2 (4 + 4 + 2) bytes a parameter (the embedding's copy in place of its
    slot), 4 more for the blocks' gradients when gradients wait in host memory (whose host
    regions they do not use; the embedding's gradient is counted among the ends' in any case)."""
    over = ["model.shape=llama1b", "train.seq_len=2048", "train.compute_dtype=bfloat16", "optim.num_shards=4",
            "optim.compute_copy=host"]
    block = 2 * 2048 + 2048 * 2048 * 2 + 2 * 2048 * 512 + 3 * 2048 * 8192     # llama1b: 32/8 heads of 64
    embed = 128256 * 2048
    for gp, mo, per_param, grads in (("device", "float32", 14, 0), ("host", "float32", 18, 4),
                                     ("device", "bfloat16", 10, 0), ("host", "bfloat16", 14, 4)):
        mb = 2 if mo == "bfloat16" else 4                 # a moment's bytes
        host = plan(load_config("debug", [*over, f"optim.grad_placement={gp}", f"optim.moment_dtype={mo}"]))
        res = plan(load_config("debug", [*over, "optim.resident_units=3", f"optim.grad_placement={gp}",
                                         f"optim.moment_dtype={mo}"]))
        assert (res.gpu["resident units (embedding + 2 blocks: master, moments, copy)"]
                == 2 * block * per_param + embed * (4 + 2 * mb + 2))
        assert res.gpu["weight slots (head, 2 blocks)"] == host.gpu["weight slots (embed, head, 2 blocks)"] - 2 * embed
        key = f"adam moments ({'bf16' if mb == 2 else 'fp32'})"
        assert host.host_private[key] - res.host_private[key] == 2 * mb * (2 * block + embed)
        assert (host.shm["fp32 master weights"] - res.shm["fp32 master weights"]
                == 2 * align(4 * block) + align(4 * embed))
        assert (host.shm["bfloat16 compute copy"] - res.shm["bfloat16 compute copy"]
                == 2 * align(2 * block) + align(2 * embed))
        saved = sum(2 * mb * n + align(4 * n) + align(2 * n) + (align(grads * n) if grads else 0)
                    for n in (block, block, embed))

        def total(p):     # less the control words (the resident units' pieces have none)
            return p.host_total - p.shm["control words"]

        assert total(host) - total(res) == saved
        assert res.shm["control words"] < host.shm["control words"]


def test_the_forward_waits_for_each_streamed_update():
    """cost.predict's schedule in the regime where updates are the bound (one core): all
    units streamed, the forward's last block starts when every block's update is done; the
    embedding resident, the first block waits for its own update only; the embedding and both
    blocks resident, no block waits. The head (here the final norm: the embedding is tied) is
    never resident and computes once its own update, the last, is done. The shards reach
    ``update_share`` of the rate measured alone."""
    cfg = load_config("debug", ["train.grad_accum=1", "optim.grad_placement=device"])
    speeds = Speeds(gpu_tflops=1000.0, cores=1, update_share=0.5)
    rate = ADAMW_PER_CORE[("float32", "float32", "float32")] * 1e9 * 0.5
    embed, block, head = 256 * 32, 9280, 32
    t = cfg.train.tokens_per_step
    f = (6.0 * block * t + 6.0 * 32 * cfg.train.seq_len * t) / 3 / 1e15      # one block's forward
    assert block / rate > f and head / rate > 2 * f                           # updates are the bound
    streamed = predict(cfg, speeds)
    assert streamed["wait_updates_s"] == pytest.approx((embed + 2 * block + head) / rate - 2 * f)

    def placed(n):
        return predict(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, resident_units=n)), speeds)

    assert placed(1)["wait_updates_s"] == pytest.approx((2 * block + head) / rate - 2 * f)
    assert placed(2)["wait_updates_s"] == pytest.approx((block + head) / rate - 2 * f)   # block 1's, then the head's
    assert placed(3)["wait_updates_s"] == pytest.approx(head / rate - 2 * f)             # the head's alone
    # with the measured rates (no one gpu_tflops) the forward runs 1.25x the step's average
    # (the debug model's hidden size and length are below the tables: their end values)
    f_measured = 2.0 * t * (block / 446e12 + 32 * cfg.train.seq_len / 281e12) / 1.25
    assert predict(cfg, Speeds(cores=1, update_share=0.5))["wait_updates_s"] == pytest.approx(
        (embed + 2 * block + head) / rate - 2 * f_measured)
    assert placed(3)["updates_s"] == pytest.approx((streamed["updates_s"] * rate - 2 * block - embed) / rate)
    # gradients in host memory with clipping: torch's fused AdamW moves 36 bytes a parameter, not 28
    host = load_config("debug", ["train.grad_accum=1", "optim.grad_placement=host", "optim.clip_grad_norm=1.0"])
    unclipped = load_config("debug", ["train.grad_accum=1", "optim.grad_placement=host",
                                      "optim.clip_grad_norm=null"])
    assert predict(host, speeds)["updates_s"] == pytest.approx(predict(unclipped, speeds)["updates_s"] * 36 / 28)
    assert predict(unclipped, speeds)["updates_s"] == pytest.approx(streamed["updates_s"])


def test_auto_placement_is_the_fastest_that_fits():
    over = ["model.shape=llama3b", "train.seq_len=2048", "train.micro_batch_size=4", "train.grad_accum=2",
            "train.compute_dtype=bfloat16", "optim.num_shards=7", "optim.threads_per_shard=2",
            "optim.resident_units=auto"]
    cfg = load_config("debug", over)
    big = Machine(10**15, 10**15, 139 * GiB)
    chosen = resolve(cfg, big).optim.resident_units
    rows = choose_placement(resolve(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim,
                                                                                       resident_units="host")), big),
                            Speeds(cores=14), gpu_budget(cfg, big), cast_slab_bytes(cfg))
    by_n = {r["resident"]: r for r in rows}
    assert isinstance(chosen, int) and chosen > 0
    assert by_n[chosen]["step_s"] <= 1.005 * min(r["step_s"] for r in rows) < by_n[0]["step_s"]
    assert all(r["gpu_bytes"] <= gpu_budget(cfg, big) for r in rows)
    # a smaller GPU holds fewer resident blocks; without a GPU, or with a bf16 master, none;
    # bf16 moments are resident too, and take less of a GPU budget than fp32 ones
    small = dataclasses.replace(cfg, worker=dataclasses.replace(cfg.worker, gpu_memory_gib=24))
    small_res = resolve(small, big).optim.resident_units
    assert small_res in ("host", *range(chosen + 1))
    assert resolve(cfg, Machine(10**15, 10**15, None)).optim.resident_units == "host"
    bf16 = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, moment_dtype="bfloat16"))
    assert isinstance(resolve(bf16, big).optim.resident_units, int) and resolve(bf16, big).optim.resident_units > 0
    small_bf16 = dataclasses.replace(small, optim=bf16.optim)
    assert resolve(small_bf16, big).optim.resident_units >= (0 if small_res == "host" else small_res)
    master = dataclasses.replace(cfg, optim=dataclasses.replace(bf16.optim, master_dtype="bfloat16"))
    assert resolve(master, big).optim.resident_units == "host"


def test_auto_chooses_where_gradients_live_with_the_placement():
    """optim.grad_placement and optim.resident_units auto, chosen together: under a 24 GiB budget
    the step's gradients held on the GPU leave room for no resident unit, while in host memory
    they leave room for several, and without clipping that predicted step is the faster. With
    clipping, fp32 state updated from host memory moves 36 bytes a parameter (the clipped
    gradient is written first) against the ring's 28, which here costs more than the resident
    units save: the device is chosen. With the whole GPU both homes fit the same and the device
    (the exact sum on the GPU) is kept."""
    over = ["model.shape=llama3b", "train.seq_len=2048", "train.micro_batch_size=4", "train.grad_accum=2",
            "train.compute_dtype=bfloat16", "optim.num_shards=7", "optim.threads_per_shard=2"]
    big = Machine(10**15, 10**15, 139 * GiB)
    speeds = Speeds(cores=14)

    def home(cfg, g):
        c = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, grad_placement=g))
        rows = choose_placement(c, speeds, gpu_budget(c, big), cast_slab_bytes(c), big.host_bytes)
        return best(rows)

    capped = load_config("debug", [*over, "worker.gpu_memory_gib=24", "optim.clip_grad_norm=null"])
    dev, host = home(capped, "device"), home(capped, "host")
    assert dev["resident"] == 0 < host["resident"] and host["step_s"] < dev["step_s"]
    chosen = resolve(capped, big).optim
    assert (chosen.grad_placement, chosen.resident_units) == ("host", host["resident"])
    clipped = load_config("debug", [*over, "worker.gpu_memory_gib=24", "optim.clip_grad_norm=1.0"])
    dev_c, host_c = home(clipped, "device"), home(clipped, "host")
    assert host_c["resident"] == host["resident"]
    assert host_c["updates_s"] == pytest.approx(host["updates_s"] * 36 / 28)
    assert dev_c["step_s"] < host_c["step_s"] and resolve(clipped, big).optim.grad_placement == "device"
    whole = load_config("debug", over)
    assert resolve(whole, big).optim.grad_placement == "device"
    assert home(whole, "device")["step_s"] <= home(whole, "host")["step_s"]


def test_resident_units_take_no_host_memory(ray_cluster):
    """A resident unit's regions of the shared files are never written: the files stay
    sparse there (tmpfs allocates only the streamed units' pages)."""
    cfg = load_config("debug", [*BASE, "optim.resident_units=2", "optim.grad_placement=host"])
    rng = np.random.default_rng(0)
    with TrainingSession(cfg) as s:
        for i in range(2):
            s.train_step(i, rng.integers(0, 256, (2, 2, 33)))
        h = s.handles
        for kind, size in (("master", h.master_bytes), ("grads", h.grad_bytes)):
            allocated = os.stat(h.path(kind)).st_blocks * 512
            assert allocated == h.held_bytes(kind) < size, kind


def test_a_14b_model_with_fp32_state_fits_one_h200_through_resident_units():
    """qwen14b with fp32 master and moments (177 GB of training state) does not fit 120 GiB
    of host memory streamed; auto finds the resident units that make it fit with the GPU."""
    cfg = load_config("qwen14b", [])                    # configs/qwen14b.yaml: optim.resident_units auto
    machine = Machine(120 * GiB, 120 * GiB, 139 * GiB)
    assert 12 * cfg.model.num_params() > 120 * GiB               # fp32 master and moments alone: 177 GB
    with pytest.raises(PlanError, match="host memory: needs") as e:
        check(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, resident_units="host")), machine)
    assert "optim.resident_units=auto (the embedding and the first" in str(e.value)   # the refusal names the way out
    p = check(resolve(cfg, machine), machine)
    n = resolve(cfg, machine).optim.resident_units
    assert isinstance(n, int) and 1 < n < 49
    assert p.host_total <= 120 * GiB and p.gpu_total <= gpu_budget(cfg, machine)


def test_the_gpu_worker_runs_expandable_segments_unless_the_user_chose_the_allocator():
    """The worker's allocator settings: the user's, from either variable torch reads, passed on
    as they are; otherwise expandable segments (fixed ones stranded 11.5 GiB of a 14B step)."""
    from megaray.driver.session import cuda_allocator_env

    default = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert cuda_allocator_env({}) == default
    assert cuda_allocator_env({"PYTORCH_CUDA_ALLOC_CONF": ""}) == default
    assert cuda_allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert cuda_allocator_env({"PYTORCH_ALLOC_CONF": "expandable_segments:False", "HOME": "/x"}) == {
        "PYTORCH_ALLOC_CONF": "expandable_segments:False"}


def _llama8b_on_the_h200_machine():
    over = ["model.shape=llama8b", "train.seq_len=4096", "train.micro_batch_size=1", "train.grad_accum=16",
            "train.compute_dtype=bfloat16", "optim.num_shards=7", "optim.threads_per_shard=2",
            "optim.resident_units=auto", "optim.grad_placement=device"]
    return load_config("debug", over), Machine(int(119.8 * GiB), int(119.8 * GiB), int(139.8 * GiB))


def test_a_host_with_slower_updates_gets_more_resident_units():
    """The shards' rate measured at start scales the cost model's (``Speeds.update_scale``):
    the updates take 1/scale as long, and where they no longer hide under the forward (llama8b
    at 64k tokens, the H200 machine, a host updating at 0.72 of the reference's: session 15's
    lease) the placement moves more units to the GPU."""
    cfg, h200 = _llama8b_on_the_h200_machine()
    placed = resolve(cfg, h200, Speeds(cores=14))
    assert predict(placed, Speeds(cores=14, update_scale=0.5))["updates_s"] == pytest.approx(
        2 * predict(placed, Speeds(cores=14))["updates_s"])
    slow = resolve(cfg, h200, Speeds(cores=14, update_scale=0.72))
    assert slow.optim.resident_units > placed.optim.resident_units
    assert (predict(slow, Speeds(cores=14, update_scale=0.72))["step_s"]
            < predict(placed, Speeds(cores=14, update_scale=0.72))["step_s"])


def test_the_shards_update_rate_is_measured_on_this_node(ray_cluster, caplog):
    """One actor a shard with the shard's threads, on the driver's node, all timed over one
    window (every one built first: three shards' processes start together, and no window is
    timed alone): a rate, and its scale against the reference machine's rate for the same cores
    and state (fp32: 6.2 G params/s over 16 cores). A measurement that cannot be placed (a shard
    wider than the node) leaves the reference rate, says so, and leaves no actor holding the
    node's CPUs."""
    from megaray.actors.calibrate import update_rate, update_scale
    from megaray.cost import reference_update_rate

    cfg = load_config("debug", ["optim.num_shards=3", "optim.threads_per_shard=1"])
    assert reference_update_rate(cfg) == pytest.approx(3 * 6.2e9 / 16)
    with caplog.at_level("INFO", logger="megaray"):
        # a lead of 0.1 s from the timing call: far less than a process takes to start
        assert update_rate(cfg, numel=2**18, window_s=0.3, start_after_s=0.1) > 1e6
        scale = update_scale(cfg, numel=2**18, window_s=0.3, start_after_s=0.1)
    messages = [r.getMessage() for r in caplog.records]
    assert scale > 0 and any("optimizer shards measured alone" in m for m in messages)
    assert not any("overlapped for" in m for m in messages), messages
    for _ in range(50):                     # the timers are gone
        if ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]
    wide = load_config("debug", ["optim.num_shards=1", "optim.threads_per_shard=8"])
    caplog.clear()
    with caplog.at_level("WARNING", logger="megaray"):
        assert update_scale(wide, numel=2**16, timeout_s=3.0) == 1.0
    assert any("could not measure the optimizer shards' update rate" in r.getMessage() for r in caplog.records)
    for _ in range(50):                     # the cancelled task gives its claim back
        if ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]
