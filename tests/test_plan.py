"""The memory planner against hand arithmetic, and the refusal before anything is allocated."""
from __future__ import annotations

import dataclasses
import math

import pytest
from conftest import shm_files

from megaray import memory
from megaray.config import replaced
from megaray.errors import ConfigError, PlanError
from megaray.fitting import check, largest_fit, savings
from megaray.loader import load_config
from megaray.machine import Machine, ray_memory_view
from megaray.plan import (
    CUDA_PROCESS_BYTES,
    PROCESS_BYTES,
    GiB,
    host_budget,
    plan,
    plan_for,
    resolve,
)


def test_debug_plan_by_hand():
    cfg = load_config("debug", ["cluster.object_store_mb=100", "optim.grad_slab_mib=0.015625",
                                "optim.grad_ring_slabs=3"])
    p = plan(cfg)
    # units: embed 256x32 fp32 = 32768 B; block 9280 params = 37120 B -> 40960 aligned; head 32 -> 4096
    assert p.shm["fp32 master weights"] == 32768 + 2 * 40960 + 4096 == 118784
    # slabs of 16 KiB = 4096 fp32; pieces: embed 8192 -> 2; block: 9216 matrix elements -> 3,
    # 64 norm scales -> 1; head (tied: the final norm only) -> 1; 2 + 2 x 4 + 1 = 11 pieces
    assert p.shm["gradient ring (3 x 16 KiB)"] == 3 * 16384
    assert "float32 compute copy" not in p.shm                   # fp32 compute reads the master
    # abort, decided, verdict, clip coefficient; a version and a ready word a piece; two a slab
    assert p.shm["control words"] == 8 * (4 + 2 * 11 + 2 * 3)
    assert p.shm["ray object store"] == 100 * 2**20
    assert p.host_private["adam moments (fp32)"] == 8 * 26784
    assert p.host_private["actor processes"] == PROCESS_BYTES * (2 + 4)
    # a GPU worker adds CUDA's host-side state (0.88-0.99 GiB in all measured on the H200 machine); a CPU
    # worker holds the step's gradients
    assert p.host_private["CUDA libraries of the GPU worker(s)"] == CUDA_PROCESS_BYTES == int(0.7 * 2**30)
    assert p.host_total == p.shm_total + 8 * 26784 + PROCESS_BYTES * 6 + CUDA_PROCESS_BYTES
    cpu = plan(cfg, on_gpu=False)
    assert cpu.host_total == p.shm_total + 8 * 26784 + PROCESS_BYTES * 6 + 4 * 26784


def test_llama3b_gpu_items_by_hand():
    cfg = load_config("debug", ["model.shape=llama3b", "train.seq_len=2048", "train.micro_batch_size=4",
                                "train.grad_accum=8", "train.compute_dtype=bfloat16", "train.loss_chunk_tokens=4096",
                                "optim.num_shards=4"])
    p = plan(cfg)
    block = 2 * 3072 + 3072 * 3072 + 2 * 3072 * 1024 + 3072 * 3072 + 3 * 3072 * 8192
    assert p.gpu["weight slots (embed, head, 2 blocks)"] == 2 * (128256 * 3072 + 3072 + 2 * block)
    # the peak is at the head: every block's input and the last output (29 x 384 MiB) outweigh
    # the blocks' fp32 gradients at the backward's end (28 x 384.02 MiB)
    assert p.gpu["saved block inputs (at the peak)"] == 2 * 29 * 65536 * 3072
    # the loss chunk's peak: bf16 logits and their gradient [4096, vocab] and two fp32 blocks
    # of 1024 rows, more than the projection backward's bf16 logits gradient and two bf16
    # [vocab, 3072] gradients
    assert p.gpu["loss chunk (logits, gradients)"] == 2 * 2 * 4096 * 128256 + 2 * 4 * 1024 * 128256
    assert 2 * 2 * 4096 + 2 * 4 * 1024 > 2 * 4096 + 2 * 2 * 3072
    small = plan(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loss_chunk_tokens=512)))
    assert small.gpu["loss chunk (logits, gradients)"] == 2 * 512 * 128256 + 2 * 2 * 128256 * 3072
    # 64k tokens a step: the worker casts on the device (optim.compute_copy auto), no bf16 copy
    assert "bfloat16 compute copy" not in p.shm
    assert p.gpu["fp32 staging of the on-device cast"] == 64 * 2**20
    # 4 master + 8 moments, plus the ring (8 slabs of 64 MiB) and page alignment (Ray's object
    # store is listed, not counted as megaray's state); with the copy on the host 2 bytes more
    ring = 8 * 64 * 2**20
    assert p.shm["gradient ring (8 x 64 MiB)"] == 8 * 64 * 2**20 and p.shm["ray object store"] == 256 * 2**20
    assert p.host_bytes_per_param == pytest.approx(12 + ring / cfg.model.num_params(), abs=1e-3)
    host = plan(load_config("debug", ["model.shape=llama3b", "train.seq_len=2048", "train.micro_batch_size=4",
                                      "train.grad_accum=8", "train.compute_dtype=bfloat16", "optim.num_shards=4",
                                      "optim.compute_copy=host"]))
    assert host.shm["bfloat16 compute copy"] >= 2 * cfg.model.num_params()
    assert host.host_bytes_per_param == pytest.approx(14 + ring / cfg.model.num_params(), abs=1e-3)
    assert host.host_bytes_per_param < 14.5
    assert p.gpu["fp32 gradients (at the peak)"] == 4 * (128256 * 3072 + 3072)
    # a 4x longer micro-batch through 2 of 4 blocks' inputs offloaded: the peak moves to
    # where the blocks' gradients outweigh what is left of the inputs
    small = load_config("debug", ["model.shape=llama3b", "model.num_hidden_layers=4", "train.seq_len=1024",
                                  "train.micro_batch_size=1", "train.compute_dtype=bfloat16"])
    i, g = 2 * 2048 * 3072, 4 * block            # one block's inputs (2 micro-batches), its fp32 gradient
    ends = 4 * (128256 * 3072 + 3072)
    q = plan(small, offload=2)
    # the walk j = 4..0 keeps 3, 2, 2, 1, 0 inputs on the GPU with 0..4 blocks' gradients: the end wins
    assert q.gpu["saved block inputs (at the peak)"] == 0
    assert q.gpu["fp32 gradients (at the peak)"] == ends + 4 * g
    assert q.host_private["offloaded block inputs (2, pinned)"] == 2 * i
    # bf16 gradients waiting on the GPU: 2 bytes a finished block's, beside the fp32 sum of the
    # block under way; the (tied) embedding's summed in fp32 to the end. At j = 1 (block 0 under
    # way) 3 rounded blocks and block 0's sum (10 bytes a block's parameter) outweigh the 4
    # rounded blocks of j = 0 (8) and, by far more than an input, j = 2's (8, with 2 inputs).
    r = plan(replaced(small, "optim", grad_dtype="bfloat16"), offload=2)
    assert r.gpu["gradients, bf16 (one block's summed in fp32; at the peak)"] == (
        4 * 128256 * 3072 + 2 * 3072 + 3 * 2 * block + 4 * block)
    assert r.gpu["saved block inputs (at the peak)"] == i
    # at 128k tokens a block's inputs (1.5 GiB) outweigh its gradients: the head is the peak
    long = dataclasses.replace(small, train=dataclasses.replace(small.train, seq_len=131072))
    big = 2 * 2 * 131072 * 3072
    assert plan(long).gpu["saved block inputs (at the peak)"] == 5 * big
    assert plan(long, offload=2).gpu["saved block inputs (at the peak)"] == 3 * big
    # the MLP runs in 32k-token chunks, so the attention's backward is the larger workspace: the
    # saved q, k, v, output and lse; d(output), dq, dk, dv; flash's fp32 dq accumulator; k's and
    # v's gradients per query head (24 of them for 8 kv heads) before the sum per group
    mlp_phase = 131072 * (55400 - 2 * 2 * 8192 + 2 * 3072) + 32768 * 3 * 2 * 8192
    q, kv = 3072, 1024
    attn_phase = 131072 * (2 * (2 * q + 2 * kv) + 4 * 24 + 2 * q + 2 * (q + 2 * kv) + 4 * q + 2 * 2 * q)
    assert attn_phase == 131072 * 57440 > mlp_phase
    assert plan(long).gpu["recomputation workspace (1 micro-batch)"] == attn_phase
    # at 2k-token micro-batches the unchunked MLP's backward is the larger; the recomputed block
    # runs as plain autograd, which also keeps both norms' outputs and the product, and eagerly
    # silu(gate) too (the compiled SwiGLU rebuilds it in its backward)
    plain = 55400 + 2 * (2 * 3072 + 8192)
    assert plan(small).gpu["recomputation workspace (1 micro-batch)"] == 1024 * (plain + 3 * 2 * 8192)
    eager = dataclasses.replace(small, worker=dataclasses.replace(small.worker, fuse_elementwise=False))
    assert plan(eager).gpu["recomputation workspace (1 micro-batch)"] == 1024 * (plain + 2 * 8192 + 3 * 2 * 8192)
    kept = plan(cfg, keep=20)            # kept blocks are freed as the backward walks them
    assert kept.gpu["kept blocks (internals + weights, at the peak)"] == 20 * (
        55400 * 65536 + 2 * block)


def test_reduced_precision_options_by_hand():
    base = ["model.shape=llama3b", "train.seq_len=2048", "train.compute_dtype=bfloat16", "optim.num_shards=4"]
    cfg = load_config("debug", base)
    n = cfg.model.num_params()
    ring = 8 * 64 * 2**20 / n
    by = {k: per for k, _, per in savings(cfg)}
    # bf16 moments: 8 -> 4 bytes; a bf16 master that the worker reads itself: 4 + 2 -> 2
    assert by["optim.moment_dtype=bfloat16"] == pytest.approx(10 + ring, abs=1e-3)
    assert by["optim.master_dtype=bfloat16"] == pytest.approx(10 + ring, abs=1e-3)
    assert by["both"] == pytest.approx(6 + ring, abs=1e-3)
    # 16k tokens a step: auto keeps the bf16 copy on the host; casting on the device drops it
    assert by["optim.compute_copy=device"] == pytest.approx(12 + ring, abs=1e-3)
    dev = plan(load_config("debug", base + ["optim.compute_copy=device"]))
    assert "bfloat16 compute copy" not in dev.shm
    assert dev.gpu["fp32 staging of the on-device cast"] == 64 * 2**20
    both = plan(load_config("debug", base + ["optim.moment_dtype=bfloat16", "optim.master_dtype=bfloat16"]))
    assert both.host_private["adam moments (bf16)"] == 4 * n
    assert both.shm["bf16 master weights"] >= 2 * n and "bfloat16 compute copy" not in both.shm
    assert savings(load_config("debug", base + ["optim.moment_dtype=bfloat16", "optim.master_dtype=bfloat16"])) == []
    with pytest.raises(ConfigError, match="optim.master_dtype"):            # a bf16 master needs bf16 compute
        load_config("debug", ["optim.master_dtype=bfloat16"])


def test_check_refuses_with_the_shortfall():
    cfg = load_config("debug", ["optim.grad_placement=device"])
    p = plan(cfg, on_gpu=False)          # no GPU on this machine: the worker computes on the CPU
    # host memory is planned to what is available less 2% of it, at least 2 GiB (the plan's error)
    assert host_budget(Machine(200 * GiB, 0, None)) == 200 * GiB - int(0.02 * 200 * GiB)
    assert host_budget(Machine(50 * GiB, 0, None)) == 48 * GiB
    machine = Machine(host_bytes=p.host_total + GiB, shm_bytes=10 * GiB, gpu_bytes=None)
    with pytest.raises(PlanError) as e:
        check(cfg, machine)
    assert "host memory" in str(e.value) and "short by 1.00 GiB" in str(e.value)
    assert "fp32 master weights" in str(e.value)                  # the whole report comes along
    assert check(cfg, Machine(p.host_total + 2 * GiB, 10 * GiB, None)) is not None
    # the GPU is planned to its budget: what is free less the allocator's reserve (6% + 2 GiB),
    # the same budget the worker plans against at run time
    assert memory.budget(12 * GiB) == int(12 * GiB * 0.94) - 2 * GiB
    enough = math.ceil((p.gpu_total + 2 * GiB + 1) / 0.94)
    assert memory.budget(enough) >= p.gpu_total > memory.budget(p.gpu_total + 2 * GiB)
    tight = Machine(host_bytes=100 * GiB, shm_bytes=p.shm_total - 1, gpu_bytes=p.gpu_total + 2 * GiB)
    with pytest.raises(PlanError, match=r"shared memory.*\n.*GPU memory: needs [\d.]+ GiB, [\d.]+ GiB usable"):
        check(cfg, tight)
    assert check(cfg, Machine(100 * GiB, 100 * GiB, enough)) is not None


def test_gradient_ring_deepens_with_what_host_memory_spares():
    # 4 shards: 8 slabs at the shallowest, 32 at the deepest; llama3b's pieces fill 64 MiB slabs
    cfg = load_config("debug", ["model.shape=llama3b", "train.compute_dtype=bfloat16", "optim.num_shards=4",
                                "optim.resident_units=host", "optim.grad_placement=device"])
    slab = 64 * 2**20
    shallow = plan_for(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, grad_ring_slabs=8)),
                       Machine(10**15, 10**15, None))
    need = shallow.host_total

    def ring(host_bytes, shm_bytes=10**15):
        return resolve(cfg, Machine(host_bytes, shm_bytes, None)).optim.grad_ring_slabs

    assert ring(10**15) == 32                                   # ample memory: 8 a shard
    assert ring(need) == 8                                      # none to spare: the shallowest
    # 10% of the host stays free; what is left beyond the plan buys whole slabs: 5.5 slabs -> 5
    host = math.ceil((need + 5.5 * slab) / 0.9)
    assert ring(host) == 8 + 5
    assert ring(host, shm_bytes=shallow.shm_total + 2 * slab + int(0.1 * host)) == 8 + 2   # /dev/shm is short
    # gradients waiting in host memory have no ring at all
    home = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, grad_placement="host"))
    assert "gradient ring" not in " ".join(plan_for(home, Machine(10**15, 10**15, None)).shm)
    # never more slabs than pieces: the debug model has 11 pieces of 16 KiB slabs
    tiny = load_config("debug", ["optim.grad_slab_mib=0.015625", "optim.num_shards=2"])
    assert plan_for(tiny, Machine(10**15, 10**15, None)).shm["gradient ring (11 x 16 KiB)"] == 11 * 16384


def test_largest_fit_is_the_edge():
    cfg = load_config("debug", ["model.shape=llama1b", "train.seq_len=2048", "train.compute_dtype=bfloat16"])
    machine = Machine(10**15, 10**15, 40 * GiB)
    mb, seq = largest_fit(cfg, machine)

    def gpu(mb_, seq_):          # as the run would be set up: gradients' home and offloaded inputs decided
        return plan_for(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=mb_,
                                                                          seq_len=seq_)), machine).gpu_total
    usable = memory.budget(40 * GiB)
    assert gpu(mb, 2048) <= usable < gpu(mb + 1, 2048)
    assert gpu(cfg.train.micro_batch_size, seq) <= usable
    if seq < cfg.model.max_position_embeddings:       # else the model's positions, not the GPU, are the edge
        assert usable < gpu(cfg.train.micro_batch_size, seq + 256)


def test_train_refuses_an_8b_model_here_before_any_actor(ray_cluster, tmp_path):
    import ray

    from megaray.driver.runner import train

    cfg = load_config("debug", ["model.shape=llama8b", "train.seq_len=512", "train.compute_dtype=bfloat16",
                                f"run.dir={tmp_path}", "run.name=big"])
    with pytest.raises(PlanError, match="short by"):
        train(cfg)
    assert shm_files() == []
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "big-" in a["name"]]
    assert names == []


def test_data_parallel_workers_each_plan_their_share():
    one = load_config("debug", ["model.shape=llama3b", "train.compute_dtype=bfloat16", "train.grad_accum=4"])
    two = load_config("debug", ["model.shape=llama3b", "train.compute_dtype=bfloat16", "train.grad_accum=4",
                                "worker.count=2"])
    a, b = plan(one), plan(two)
    assert b.gpu["gradient of the step's activations"] * 2 == a.gpu["gradient of the step's activations"]
    assert b.gpu["weight slots (embed, head, 2 blocks)"] == a.gpu["weight slots (embed, head, 2 blocks)"]
    assert b.host_private["actor processes"] - a.host_private["actor processes"] == PROCESS_BYTES
    assert b.shm == a.shm                                   # one store, whatever the workers


def test_compute_time_by_shape_by_hand():
    """cost.compute_seconds: the matrix products at the H200's rate for the hidden size, the
    attention at flash attention's for the sequence length, recomputed blocks' forwards too;
    one rate for all with --gpu-tflops."""
    from megaray.cost import Speeds, compute_seconds, rates

    def cfg(shape, seq):
        return load_config("debug", [f"model.shape={shape}", f"train.seq_len={seq}", "train.micro_batch_size=1",
                                     "train.grad_accum=4", "train.compute_dtype=bfloat16",
                                     f"model.max_position_embeddings={max(seq, 2048)}"])

    c = cfg("llama3b", 2048)
    n, t = c.model.num_params(), 4 * 2048
    block = 2 * 3072 + 3072 * 3072 + 2 * 3072 * 1024 + 3072 * 3072 + 3 * 3072 * 8192
    assert rates(c, Speeds()) == (514e12, 281e12)                          # measured points
    assert compute_seconds(c, Speeds()) == pytest.approx(6 * n * t / 514e12 + 6 * 28 * 3072 * 2048 * t / 281e12)
    assert compute_seconds(c, Speeds(), recomputed=5) - compute_seconds(c, Speeds()) == pytest.approx(
        5 * (2 * block * t / 514e12 + 2 * 3072 * 2048 * t / 281e12))
    assert compute_seconds(c, Speeds(gpu_tflops=500)) == pytest.approx(
        (6 * n * t + 6 * 28 * 3072 * 2048 * t) / 500e12)
    # between the points: linear in the hidden size, linear in log2 of the length
    assert rates(cfg("llama3b", 4096), Speeds())[1] == pytest.approx(281e12 + (470e12 - 281e12) / 3)
    assert rates(cfg("llama1b", 1024), Speeds()) == (446e12, 281e12)       # below: the end values
    assert rates(cfg("qwen14b", 65536), Speeds()) == (573e12, 470e12)      # above: never extrapolated


def test_ray_memory_view_by_hand(tmp_path, monkeypatch):
    """What Ray's memory monitor counts (it kills workers past RAY_memory_usage_threshold of
    it): a cgroup v2's memory.current less inactive file pages, against the cgroup's limit
    where it is below the machine's memory; without a cgroup, total less available."""
    from megaray.machine import ray_kill_fraction

    info = {"MemTotal": 128 * GiB, "MemAvailable": 100 * GiB, "MemFree": 90 * GiB}
    assert ray_memory_view(info, str(tmp_path / "none")) == (28 * GiB, 128 * GiB)
    (tmp_path / "memory.max").write_text("max\n")             # no limit: the machine's total
    (tmp_path / "memory.current").write_text(f"{40 * GiB}\n")
    (tmp_path / "memory.stat").write_text(f"anon {30 * GiB}\nfile {10 * GiB}\ninactive_file {3 * GiB}\n")
    assert ray_memory_view(info, str(tmp_path)) == (37 * GiB, 128 * GiB)
    (tmp_path / "memory.max").write_text(f"{64 * GiB}\n")
    assert ray_memory_view(info, str(tmp_path)) == (37 * GiB, 64 * GiB)
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    monkeypatch.delenv("RAY_memory_monitor_refresh_ms", raising=False)
    assert ray_kill_fraction() == 0.95
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.98")
    assert ray_kill_fraction() == 0.98
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")      # the monitor off
    assert ray_kill_fraction() is None
    # on this machine: the kernel's available memory with the monitor off, nothing once the
    # memory in use passes the threshold
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(Machine.here("/dev/shm").host_bytes - avail) < 256 * 2**20
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "250")
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.001")
    assert Machine.here("/dev/shm").host_bytes == 0


def test_megaray_plan_says_when_the_blocks_keep_plain_activations():
    """llama1b at 64k tokens: on a 139.8 GiB GPU every block keeps plain autograd's
    activations (105 GiB by the model, 104.1 measured on the H200); on a 64 GiB one the
    blocks keep the lean block's, and fewer of them."""
    import subprocess
    import sys

    def predicted(gpu_gib: float) -> str:
        r = subprocess.run([sys.executable, "-m", "megaray.cli", "plan", "debug", "model.shape=llama1b",
                            "train.seq_len=2048", "train.micro_batch_size=4", "train.grad_accum=8",
                            "train.compute_dtype=bfloat16", "worker.device=cuda", "--host-gib", "120",
                            "--gpu-gib", str(gpu_gib)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return next(line for line in r.stdout.splitlines() if line.startswith("predicted step:"))

    assert "keeping 16 blocks' activations, as plain autograd saves them" in predicted(139.8)
    small = predicted(64)
    assert "plain" not in small and "keeping 16 blocks" not in small


def test_a_mixtures_experts_run_at_their_own_rate_by_hand():
    """A mixture's experts (k of them a token) at cost.EXPERT_TFLOPS by one expert group's work
    in a micro-batch (rows x width), everything else at the dense rates."""
    from megaray.cost import Speeds, compute_seconds, expert_rate

    def cfg(mb):
        return load_config("debug", ["model.shape=qwen3moe30b", "model.num_hidden_layers=2", "train.seq_len=4096",
                                     f"train.micro_batch_size={mb}", "train.grad_accum=2",
                                     "train.compute_dtype=bfloat16"])

    c = cfg(1)
    # 4096 tokens x top-8 over 128 experts: 256 rows an expert, 768 wide: the first point
    assert expert_rate(c, Speeds()) == pytest.approx(175e12)
    assert expert_rate(cfg(2), Speeds()) == pytest.approx(226e12)        # 512 rows x 768
    assert expert_rate(cfg(4), Speeds()) == pytest.approx(245e12)        # beyond the points: the last
    h, t = 2048, 2 * 4096
    experts = 2 * 8 * 3 * h * 768                                      # 2 layers' active experts
    attn = 6 * 2 * h * 4096 * t / (281e12 + (470e12 - 281e12) / 3)
    dense = c.model.active_params() - experts
    assert compute_seconds(c, Speeds()) == pytest.approx(6 * t * (dense / 446e12 + experts / 175e12) + attn)
    assert compute_seconds(c, Speeds(gpu_tflops=300)) == pytest.approx(
        (6 * t * c.model.active_params() + 6 * 2 * h * 4096 * t) / 300e12)
