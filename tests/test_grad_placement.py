"""Where a step's gradients wait for the norm (``optim.grad_placement``), and planning for GPUs
and machines one does not have (issue 17), on the CPU.

Gradients that leave for host memory as soon as each unit's backward is done must give the
same training as gradients held until the norm is known, bit for bit in fp32: with clipping
that clips, with clipping off, across a skipped non-finite step, with accumulation. bf16
gradients must give AdamW written out here on bf16-rounded gradients.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from megaray.clipping import NORM_CHUNK, square_norm
from megaray.config import replaced
from megaray.driver.session import TrainingSession
from megaray.errors import PlanError
from megaray.fitting import check
from megaray.loader import load_config
from megaray.lr_schedule import lr_at
from megaray.machine import Machine
from megaray.memory import GiB
from megaray.plan import plan_for, resolve, shortfalls

BASE = ["train.grad_accum=2", "train.steps=4", "optim.num_shards=2", "optim.grad_slab_mib=0.01",
        "optim.weight_decay=0.1"]


def _train(*extra: str, steps: int = 4, keep_gradients: bool = False):
    cfg = load_config("debug", [*BASE, *extra] + (["debug.keep_gradients=true"] if keep_gradients else []))
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (2, 2, 33)) for _ in range(steps)]
    with TrainingSession(cfg) as s:
        assert s.handles.grad_placement == ("host" if "optim.grad_placement=host" in extra else "device")
        first = s.state_dict() if keep_gradients else None
        ms, grads = [], []
        for i, b in enumerate(batches):
            ms.append(s.train_step(i, b))
            if keep_gradients:
                grads.append(s.gradients())
        return ms, s.state_dict(), first, grads


@pytest.mark.parametrize("opts", [["optim.clip_grad_norm=0.05"], ["optim.clip_grad_norm=null"],
                                  ["optim.clip_grad_norm=0.05", "debug.nonfinite_steps=[1]"]],
                         ids=["clipped", "clipping-off", "a-skipped-step"])
def test_gradients_in_host_memory_equal_gradients_on_the_device(ray_cluster, opts):
    dev, dev_w, _, _ = _train("optim.grad_placement=device", *opts)
    host, host_w, _, _ = _train("optim.grad_placement=host", *opts)
    np.testing.assert_array_equal([m["loss"] for m in host], [m["loss"] for m in dev])   # NaN = NaN
    assert [m["skipped"] for m in host] == [m["skipped"] for m in dev]
    if "optim.clip_grad_norm=0.05" in opts:
        assert all(m["clip_coefficient"] < 0.9 for m in dev if not m["skipped"])    # clipping did clip
    for k in dev_w:
        np.testing.assert_array_equal(host_w[k], dev_w[k], err_msg=k)


@pytest.mark.parametrize("opts", [["optim.clip_grad_norm=0.05"],
                                  ["optim.clip_grad_norm=0.05", "debug.nonfinite_steps=[1]"]],
                         ids=["clipped", "a-skipped-step"])
def test_bf16_gradients_waiting_on_the_device_equal_bf16_gradients_in_host_memory(ray_cluster, opts):
    """Rounded on the device as each unit's backward ends (half the GPU memory), they reach the
    shards unscaled, and the shards apply the coefficient as from host memory: the same
    training bit for bit, and not the fp32 gradients' (so the rounding did happen)."""
    dev, dev_w, _, _ = _train("optim.grad_placement=device", "optim.grad_dtype=bfloat16", *opts)
    host, host_w, _, _ = _train("optim.grad_placement=host", "optim.grad_dtype=bfloat16", *opts)
    _, fp32_w, _, _ = _train("optim.grad_placement=device", *opts)
    np.testing.assert_array_equal([m["loss"] for m in host], [m["loss"] for m in dev])
    assert [m["skipped"] for m in host] == [m["skipped"] for m in dev]
    np.testing.assert_array_equal([m["grad_norm"] for m in host], [m["grad_norm"] for m in dev])
    assert all(m["clip_coefficient"] < 0.9 for m in dev if not m["skipped"])
    for k in dev_w:
        np.testing.assert_array_equal(host_w[k], dev_w[k], err_msg=k)
    assert any(not np.array_equal(fp32_w[k], dev_w[k]) for k in dev_w if dev_w[k].ndim == 2)


@pytest.mark.parametrize("placement", ["host", "device"])
def test_bf16_gradients_are_adamw_on_the_rounded_gradients(ray_cluster, placement):
    """One step with bf16 gradients in host memory, or waiting on the device: every weight is
    AdamW's update (written out here, in float64) of the fp32 gradient rounded to bf16 and
    scaled by the clip coefficient the fp32 norm gave."""
    ms, after, before, grads = _train(f"optim.grad_placement={placement}", "optim.grad_dtype=bfloat16",
                                      "optim.clip_grad_norm=0.05", steps=1, keep_gradients=True)
    cfg = load_config("debug", BASE)
    lr, (b1, b2), eps, wd = lr_at(0, cfg.optim, 4), cfg.optim.betas, cfg.optim.eps, 0.1
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads[0].values()))
    coef = min(1.0, 0.05 / (norm + 1e-6))
    assert ms[0]["clip_coefficient"] == pytest.approx(coef, rel=1e-12)
    for name, g in grads[0].items():
        g = torch.tensor(g).to(torch.bfloat16).double() * coef
        p = torch.from_numpy(before[name]).double()
        decay = wd if p.dim() >= 2 else 0.0
        m, v = (1 - b1) * g, (1 - b2) * g * g
        want = p * (1 - lr * decay) - lr / (1 - b1) * m / ((v / (1 - b2)).sqrt() + eps)
        torch.testing.assert_close(torch.from_numpy(after[name]).double(), want, rtol=1e-6, atol=1e-8, msg=name)


def test_auto_keeps_gradients_on_the_gpu_while_they_fit():
    cfg = load_config("debug", ["model.shape=llama8b", "train.seq_len=4096", "train.grad_accum=16",
                                "train.micro_batch_size=1", "train.compute_dtype=bfloat16", "optim.num_shards=4",
                                "optim.resident_units=host"])          # every unit's gradient through host memory
    big = Machine(10**15, 10**15, 141 * GiB)
    small = Machine(10**15, 10**15, 24 * GiB)
    assert resolve(cfg, big).optim.grad_placement == "device"
    assert resolve(cfg, small).optim.grad_placement == "host"
    # on the device, 4 bytes a parameter of gradients alone exceed 24 GiB; in host memory they
    # are the tied embedding's (none: untied) and two units' at a time
    n = cfg.model.num_params()
    assert 4 * n > 24 * GiB
    host = plan_for(cfg, small)
    head, block = 128256 * 4096 + 4096, (2 * 4096 + 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert host.gpu["fp32 gradients (at the peak)"] == 4 * 2 * max(head, block)    # the head's: the largest unit
    assert host.gpu_total <= 24 * GiB
    assert host.shm["gradients waiting for the norm (fp32, host)"] >= 4 * n
    # each shard holds one slab for the clipped fp32 gradient of torch's fused AdamW (64 MiB by
    # default); without clipping, or on the device, there is none
    scratch = "clipped gradient (a slab a shard)"
    assert host.host_private[scratch] == 4 * 64 * 2**20
    unclipped = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, clip_grad_norm=None))
    assert scratch not in plan_for(unclipped, small).host_private
    assert scratch not in plan_for(cfg, big).host_private
    # bf16 gradients wait on the GPU in half the bytes: on a 40 GiB GPU the fp32 ones go to host
    # memory, the bf16 ones stay, and a run that asks for fp32 ones there is told so
    mid = Machine(10**15, 10**15, 40 * GiB)
    half = replaced(cfg, "optim", grad_dtype="bfloat16")
    assert resolve(cfg, mid).optim.grad_placement == "host"
    assert resolve(half, mid).optim.grad_placement == "device"
    with pytest.raises(PlanError, match=r"any one of: optim\.grad_placement=host; optim\.grad_dtype=bfloat16;"):
        check(replaced(cfg, "optim", grad_placement="device"), mid)


def test_a_refusal_names_bf16_gradients_where_they_free_the_gpu_for_resident_units():
    """gemma3_12b with fp32 master, moments and gradients on an H100 with 121 GiB of host
    memory available (issue 46's row, refused so on one in run 72): fp32 gradients fill the
    GPU, so every unit streams and its state exceeds host memory. bf16 gradients free the GPU
    for resident units, whose state leaves host memory: the refusal names them, though the
    failing run's own placement (none resident) would not fit with them."""
    asked = load_config("gemma3_12b", ["train.micro_batch_size=1", "train.grad_accum=16",
                                       "train.loss_chunk_tokens=2048", "optim.num_shards=7"])
    h100 = Machine(int(121.04 * GiB), 10**15, int(78.6 * GiB))
    run = resolve(asked, h100)                     # what the session checks
    assert run.optim.resident_units == "host" and run.optim.grad_dtype == "float32"
    half = replaced(replaced(run, "optim", grad_dtype="bfloat16"), "worker", offload_inputs=None)
    assert shortfalls(plan_for(half, h100), h100)                 # on the failing run's placement: short
    with pytest.raises(PlanError, match=r"any one of: optim\.grad_dtype=bfloat16; optim\.moment_dtype=bfloat16"):
        check(run, h100, asked=asked)
    fixed = resolve(replaced(asked, "optim", grad_dtype="bfloat16"), h100)
    assert fixed.optim.resident_units >= 5            # the embedding and 4+ blocks
    assert check(fixed, h100).host_total < plan_for(run, h100).host_total - 15 * GiB


def test_the_gpu_budget_caps_the_plan_and_refuses_before_allocating():
    cfg = load_config("debug", ["model.shape=llama3b", "train.seq_len=2048", "train.compute_dtype=bfloat16",
                                "train.grad_accum=8", "train.loss_chunk_tokens=2048", "worker.gpu_memory_gib=12",
                                "optim.num_shards=4"])
    machine = Machine(10**15, 10**15, 141 * GiB)
    p = check(cfg, machine)                   # fits within 12 of the 141 GiB, less the allocator's reserve
    assert p.gpu_total <= int(12 * GiB * 0.94) - 2 * GiB and resolve(cfg, machine).optim.grad_placement == "host"
    # micro-batches of 4 rows with a loss chunk of all their 8192 tokens would not fit
    wide = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=4, grad_accum=4,
                                                              loss_chunk_tokens=8192))
    with pytest.raises(PlanError, match=r"GPU memory: needs [\d.]+ GiB, 9.28 GiB usable \(short by") as e:
        check(wide, machine)
    # and the refusal says what would: the largest loss chunk (a multiple of 256), which is
    # the edge, or smaller micro-batches at the same tokens per step
    assert "train.micro_batch_size=2 train.grad_accum=8" in str(e.value)
    chunk = int(str(e.value).split("train.loss_chunk_tokens=")[1].split(";")[0].split()[0])
    assert chunk % 256 == 0 and chunk < 8192
    check(dataclasses.replace(wide, train=dataclasses.replace(wide.train, loss_chunk_tokens=chunk)), machine)
    with pytest.raises(PlanError):
        check(dataclasses.replace(wide, train=dataclasses.replace(wide.train, loss_chunk_tokens=chunk + 256)), machine)
    tight = dataclasses.replace(cfg, worker=dataclasses.replace(cfg.worker, gpu_memory_gib=3.0))
    with pytest.raises(PlanError, match=r"GPU memory: needs [\d.]+ GiB, 0.82 GiB usable \(short by"):
        check(tight, machine)


def test_the_squared_norm_is_a_float64_sum_over_chunks():
    """Every unit's squared norm: numpy's float64 sum of squares, for a tensor of one chunk,
    of several with a ragged end, and of a 2-D weight."""
    rng = np.random.default_rng(0)
    for shape in [(1000,), (2 * NORM_CHUNK + 12345,), (37, 53)]:
        g = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
        ref = np.sum(g.numpy().astype(np.float64) ** 2)
        got = square_norm(g)
        assert got.dtype == torch.float64 and got.shape == ()
        assert abs(float(got) - ref) <= 1e-12 * ref, shape


def test_the_gpu_need_is_independent_of_depth():
    """Gradients in host memory and every block's input offloaded: the GPU holds the two block
    slots, the embedding and head slots, two blocks' inputs, the activation gradient, one
    micro-batch's workspace, the loss chunk, two units' gradients, the staging slab and the
    CUDA context, whatever the number of blocks."""
    def need(layers: int) -> int:
        cfg = load_config("llama70b", [f"model.num_hidden_layers={layers}"])
        return plan_for(cfg, Machine(10**15, 10**15, 10 * GiB)).gpu_total   # too small: everything offloaded

    assert need(40) == need(80) == need(160)


@pytest.mark.parametrize("config, host, gpu, max_bytes", [("llama70b", 1024, 80, 14.0), ("dense120b", 1536, 141, 14.0)])
def test_plans_for_big_machines_fit(config, host, gpu, max_bytes):
    r = subprocess.run([sys.executable, "-m", "megaray.cli", "plan", config, "--host-gib", str(host), "--gpu-gib",
                        str(gpu)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DOES NOT FIT" not in r.stdout
    per_param = float(r.stdout.split("host state ")[1].split(" bytes/param")[0])
    assert per_param <= max_bytes
    assert "predicted step:" in r.stdout and "gradients wait for the norm on the host" in r.stdout


def test_a_524k_token_llama8b_step_fits_the_h200_machine_by_input_stride():
    """llama8b, one 524,288-token sequence, on the H200 machine (119.8 GiB of host memory
    available, a 139.8 GiB GPU: what ``Machine.here`` reports there): every block's input fits
    neither the GPU nor, offloaded, host memory; ``worker.input_stride`` null resolves to 2,
    with which the plan fits. Forced to 1 it is refused, and the refusal names the stride."""
    cfg = load_config("llama8b_512k")
    machine = Machine(int(119.8 * GiB), int(119.8 * GiB), int(139.8 * GiB))
    assert resolve(cfg, machine).worker.input_stride == 2
    p = check(cfg, machine)
    assert (p.input_stride, p.offload_inputs) == (2, 0)
    # saved: blocks 0, 2, ..., 30's inputs, and block 31's beside its output: 18 of 4 GiB (2 x 524,288 x 4096)
    assert p.gpu["saved block inputs (at the peak)"] == 18 * 4 * GiB
    one = replaced(cfg, "worker", input_stride=1)
    p1 = plan_for(one, machine)
    assert p1.offload_inputs > 0 and p1.host_total > machine.host_bytes
    with pytest.raises(PlanError, match=r"worker\.input_stride=2"):
        check(one, machine)
    assert resolve(replaced(cfg, "train", seq_len=65536), machine).worker.input_stride == 1
    r = subprocess.run([sys.executable, "-m", "megaray.cli", "plan", "llama8b_512k", "--host-gib", "119.8",
                        "--gpu-gib", "139.8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "worker.input_stride 2" in r.stdout and "DOES NOT FIT" not in r.stdout


def test_the_worker_offloads_the_inputs_the_host_plan_counts():
    """``worker.offload_inputs`` null is decided by the plan (``resolve``), so the worker
    offloads exactly what the host plan counts. qwen3moe30b's 24 layers at 4 x 4096 tokens a
    micro-batch on an H100 machine fit with none; from a budget a little smaller (what the
    worker saw at step 0 once its CUDA libraries were loaded) it counted its own and offloaded
    every block's input, 24 x 0.5 GiB of pinned host memory the plan never had, and the host's
    OOM killer ended the run (BENCHMARKS.md run 68)."""
    from megaray import memory
    from megaray.bench.run import bench_config
    from megaray.plan import cast_slab_bytes, gpu_budget

    cfg = bench_config("qwen3moe30b", 4096, 131072, 4, 4, 4, 4, {"model.num_hidden_layers": 24,
                                                                   "optim.moment_dtype": "bfloat16",
                                                                   "worker.device": "cuda"})
    machine = Machine(int(123.3 * GiB), int(123.3 * GiB), int(79.6 * GiB))
    resolved = resolve(cfg, machine)
    assert resolved.worker.offload_inputs == 0 == plan_for(cfg, machine).offload_inputs
    assert resolve(resolved, machine) == resolved
    # the old worker's own count from any budget below the step's need: every block
    slab = cast_slab_bytes(resolved)
    need = memory.gpu_total(resolved, 0, 0, slab)
    assert need <= gpu_budget(resolved, machine) < need + 2 * GiB
    assert memory.offload_count(resolved, need - 1, cast_slab_bytes=slab) == 24
    # where the step needs some (llama8b's 524k-token row with every input saved), the same
    # number is the worker's and the host plan's
    one = replaced(load_config("llama8b_512k"), "worker", input_stride=1)
    h200 = Machine(int(119.8 * GiB), int(119.8 * GiB), int(139.8 * GiB))
    assert resolve(one, h200).worker.offload_inputs == plan_for(one, h200).offload_inputs > 0
