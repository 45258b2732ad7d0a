"""``megaray bench``: megaray against a plain-PyTorch GPU-resident baseline, one process tree.

The baseline is an ordinary nn.Module holding every weight on the device, trained with bf16
autocast and fused AdamW, the same tokens per step through gradient accumulation. Both start
from the same initial weights (the baseline loads megaray's) and see the same random tokens,
so their first losses must agree within bf16 tolerance. TFLOP/s is ARCHITECTURE.md's formula.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import statistics
import subprocess
import time

import numpy as np
import ray
import torch

from megaray.actors.metrics import node_memory_used_bytes
from megaray.checkpoint import Checkpointer
from megaray.config import RunConfig
from megaray.cost import predict
from megaray.driver.session import TrainingSession
from megaray.loader import build_config
from megaray.memory import CUDA_CONTEXT_BYTES
from megaray.model import flops_per_step
from megaray.plan import describe_placement, plan
from megaray.step import Batch

from .baseline import run_baseline


def bench_config(shape: str, seq_len: int, tokens_per_step: int, micro_batch: int, steps: int, shards: int,
                 threads: int, extra: dict | None = None) -> RunConfig:
    """The megaray config a bench runs: bf16 compute on CUDA, constant lr, clipping at 1.0."""
    ga = tokens_per_step // (seq_len * micro_batch)
    data = {
        "model": {"shape": shape},
        "train": {"steps": steps, "micro_batch_size": micro_batch, "grad_accum": ga, "seq_len": seq_len,
                  "compute_dtype": "bfloat16", "loss_chunk_tokens": 8192},
        "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant", "num_shards": shards,
                  "threads_per_shard": threads, "clip_grad_norm": 1.0},
        "worker": {"device": "cuda", "threads": 2},
        "cluster": {"num_cpus": 2 * (os.cpu_count() or 1)},
    }
    for k, v in (extra or {}).items():
        sec, key = k.split(".", 1)
        data.setdefault(sec, {})[key] = v
    return build_config(data)


def _median_step(ms: list[dict]) -> dict:
    """The step with the median step time among the warm ones (its parts add up to it)."""
    warm = ms[1:] if len(ms) > 1 else ms
    return sorted(warm, key=lambda m: m["step_time_seconds"])[len(warm) // 2]


def breakdown(m: dict) -> dict:
    """Where one step's time went; the first four parts add up to the step time exactly.

    - compute: the GPU's busy time (CUDA events around every compute region);
    - idle waiting for the optimizer (the exposed optimizer time): gaps between compute
      regions before a layer whose weights had to wait for their update (counted up to that
      wait), and the wait for the first layer's update before the step's first region;
    - idle waiting for copy-in or launches: the other gaps between compute regions;
    - outside the GPU work: the rest of the step (the Ray call that starts it, the first
      layer's copy-in, the loss and norm reaching the host, the verdict).
    Copy-in, copy-out and the optimizer's update time overlap compute; they are listed after,
    with the optimizer's span (the verdict to the slowest shard's last update) and the most any
    shard waited in it for its gradient pieces (the ring's delivery, not its own updates).
    """
    step, compute = m["step_time_seconds"], m.get("worker/compute_s", 0.0)
    opt, other = m.get("worker/gap_optimizer_s", 0.0), m.get("worker/gap_other_s", 0.0)
    opt += min(m.get("worker/first_unit_optimizer_s", 0.0), max(0.0, step - compute - opt - other))
    outside = step - compute - opt - other
    return {"step_s": step, "compute_s": compute, "idle_optimizer_s": opt, "idle_copy_in_s": other,
            "outside_s": outside, "gpu_idle_fraction": (step - compute) / step,
            "overlapped": {"copy_in_s": m.get("worker/copy_in_s", 0.0), "copy_out_s": m.get("worker/copy_out_s", 0.0),
                           "optimizer_update_s": m.get("optimizer_update_seconds_slowest_shard", 0.0),
                           "optimizer_span_s": m.get("optimizer_span_seconds_slowest_shard", 0.0),
                           "optimizer_gradient_wait_s": m.get("optimizer_gradient_wait_seconds_most_shard", 0.0)}}


def document_ids(rng, shape: tuple, mean_len: int) -> np.ndarray:
    """Each token's document, int32 ``shape`` [..., row]: rows cut into documents of
    exponentially distributed lengths (mean ``mean_len``, at least 1), as packed rows are."""
    rows = np.empty(shape, np.int32).reshape(-1, shape[-1])
    for r in rows:
        starts = np.cumsum(np.maximum(1, rng.exponential(mean_len, shape[-1]).astype(np.int64)))
        r[:] = np.searchsorted(starts, np.arange(shape[-1]), side="right")
    return rows.reshape(shape)


def bench(cfg: RunConfig, baseline: bool = True, checkpoint_dir: str | None = None, seed: int = 0,
          documents: int | None = None) -> dict:
    """Train ``cfg.train.steps`` steps of random tokens with megaray, then the same batches
    with the GPU-resident baseline from megaray's initial weights. With ``documents`` (a mean
    length) the rows are packed documents under document attention for megaray (the
    baseline stays causal)."""
    t, steps = cfg.train, cfg.train.steps
    tokens_per_step = t.tokens_per_step
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, cfg.model.vocab_size, (t.grad_accum, t.micro_batch_size, t.seq_len + 1))
              for _ in range(steps)]
    batches = [Batch(b, doc=document_ids(rng, b.shape, documents) if documents else None) for b in tokens]
    causal = flops_per_step(cfg.model, tokens_per_step, t.seq_len)      # the baseline's work
    # megaray's work per step: under document attention, each document's own
    flops = [flops_per_step(cfg.model, tokens_per_step, t.seq_len, b.square_document_lengths(),
                            b.square_document_lengths(cfg.model.local_window)) for b in batches]
    out: dict = {"shape": cfg.model.shape, "params": cfg.model.num_params(), "seq_len": t.seq_len,
                 "attention": (f"document (mean length {documents})" if documents else "causal") + (
                     f", windows of {cfg.model.local_window} tokens on "
                     f"{cfg.model.local_blocks} of "
                     f"{cfg.model.num_hidden_layers} blocks" if cfg.model.local_window else ""),
                 "tokens_per_step": tokens_per_step, "micro_batch": t.micro_batch_size, "grad_accum": t.grad_accum,
                 "shards": cfg.optim.num_shards, "threads_per_shard": cfg.optim.threads_per_shard}
    ms = []
    host_before = node_memory_used_bytes()
    with TrainingSession(cfg) as s:
        t0 = time.perf_counter()
        state = s.state_dict() if baseline else None
        out["state_dict_s"] = time.perf_counter() - t0
        for i, b in enumerate(batches):
            ms.append(s.train_step(i, b))
            m = ms[-1]       # now, so that a long step measured is not lost to a later failure
            kept = m.get("worker/kept_blocks", 0)
            print(f"megaray step {i}: {m['step_time_seconds']:.3f} s, {flops[i] / m['step_time_seconds'] / 1e12:.1f} "
                  f"TFLOP/s, loss {m['loss']:.4f}, GPU peak {m.get('worker/gpu_peak_bytes', 0) / 2**30:.2f} GiB, "
                  f"GPU idle {100 * breakdown(m)['gpu_idle_fraction']:.1f}%; {kept} blocks kept, step "
                  f"{predict(s.cfg, s.speeds, keep=kept)['step_s']:.3f} s predicted", flush=True)
        s.drain()
        out["resident_units"] = len(s.handles.resident)     # optim.resident_units, as the session resolved it
        out["ring_slabs"] = s.handles.ring_slabs            # optim.grad_ring_slabs, likewise (0: no ring)
        out["host_bytes_per_param"] = plan(s.cfg).host_bytes_per_param
        try:
            out["link_alone"] = ray.get(s.actors["worker"].link_speed.remote())
        except ray.exceptions.RayError as e:     # a figure beside the result, not the result
            out["link_alone"] = {"error": str(e).splitlines()[-1]}
        if checkpoint_dir:
            out["checkpoint"] = _time_checkpoint(cfg, s, steps, checkpoint_dir)
    med = _median_step(ms)
    step_s = med["step_time_seconds"]
    kept = med.get("worker/kept_blocks", 0)
    offloaded = med.get("worker/offloaded_inputs", 0)
    plain = bool(med.get("worker/kept_plain", 0))
    predicted = plan(s.cfg, keep=kept, on_gpu=cfg.worker.device == "cuda", offload=offloaded, lean=not plain)
    predicted_step = predict(s.cfg, s.speeds, keep=kept)["step_s"]
    gpu_peak = max(m.get("worker/gpu_peak_bytes", 0) for m in ms)
    # the plan's figure is for the median step's choices: its peak is that of the steps that made them
    # (the first step may keep more blocks than the worker keeps after measuring it)
    chose = ("worker/kept_blocks", "worker/offloaded_inputs", "worker/kept_plain")
    like_med = [m for m in ms if all(m.get(k, 0) == med.get(k, 0) for k in chose)]
    gpu_peak_planned = max(m.get("worker/gpu_peak_bytes", 0) for m in like_med)
    # less the copy of the initial weights this process holds for the baseline
    state_bytes = sum(v.nbytes for v in state.values()) if state else 0
    host_peak = max(m["node_memory_used_bytes"] for m in ms) - host_before - state_bytes
    out["planner"] = {"host_predicted_gib": predicted.host_total / 2**30, "host_measured_gib": host_peak / 2**30,
                      "gpu_predicted_gib": predicted.gpu_total / 2**30, "gpu_measured_gib": gpu_peak_planned / 2**30,
                      # what the allocator's peak counts: the plan less the CUDA context and slack
                      "gpu_predicted_allocated_gib": max(0, predicted.gpu_total - CUDA_CONTEXT_BYTES) / 2**30,
                      "kept_blocks": kept, "kept_plain": plain, "offloaded_inputs": offloaded,
                      "step_predicted_s": predicted_step, "update_scale": s.speeds.update_scale}
    key = "optimizer_params_per_second_all_shards"
    rates = [m[key] for m in ms[1:] if key in m]
    if documents or cfg.model.local_window:     # the attention's work against causal attention over whole rows
        full = 6.0 * cfg.model.num_hidden_layers * cfg.model.hidden_size * t.seq_len * tokens_per_step
        products = 6.0 * cfg.model.active_params() * tokens_per_step
        out["attention_work_of_causal"] = (flops[ms.index(med)] - products) / full
    out["megaray"] = {"step_s": step_s, "tflops": flops[ms.index(med)] / step_s / 1e12,
                      "tokens_per_s": tokens_per_step / step_s,
                      "losses": [m["loss"] for m in ms],
                      "breakdown": breakdown(med),
                      "optimizer_gparams_per_s": statistics.median(rates) / 1e9 if rates else None,
                      "worker": {k[7:]: v for k, v in med.items() if k.startswith("worker/") and k.endswith("_s")},
                      "gpu_peak_gib": gpu_peak / 2**30,
                      "fused_elementwise": bool(med.get("worker/fused_elementwise", 0))}
    if baseline:
        if cfg.worker.device == "cuda":     # fp32 weights, gradients, two moments, and some activations
            _await_gpu_memory(cfg.model.num_params() * 20)
        try:
            b = run_baseline(cfg, state, tokens, "cuda" if cfg.worker.device == "cuda" else "cpu")
            bs = statistics.median(b["times"][1:] if len(b["times"]) > 1 else b["times"])
            out["baseline"] = {"step_s": bs, "tflops": causal / bs / 1e12, "losses": b["losses"],
                               "gpu_peak_gib": b["gpu_peak_gib"]}
            out["ratio"] = bs / step_s        # the same tokens; the baseline's attention is causal
            out["first_loss_diff"] = max(abs(a - c) for a, c in zip(out["megaray"]["losses"][:2], b["losses"][:2]))
        except torch.cuda.OutOfMemoryError:
            out["baseline"] = "out of memory"
    return out


def _await_gpu_memory(need: int, timeout_s: float = 60.0) -> None:
    """Wait until ``need`` bytes of GPU memory are free: killing the session's worker only
    asks Ray to end its process, and the baseline must not start while that process still
    holds the GPU. Asked of nvidia-smi, not of CUDA: this process has no CUDA context yet,
    and making one on a full GPU fails (``cudaMemGetInfo``: out of memory, seen with a
    127 GiB worker still exiting)."""
    t0 = time.perf_counter()
    while _gpu_free_bytes() < need and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.5)


def _gpu_free_bytes() -> int:
    """Free memory of the first visible GPU; 0 while it cannot be read."""
    dev = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits",
                              f"--id={dev}"], capture_output=True, text=True, timeout=10, check=True)
        return int(out.stdout.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    try:
        return torch.cuda.mem_get_info()[0]
    except (RuntimeError, AssertionError):    # torch.AcceleratorError is a RuntimeError; no CUDA build: an assertion
        return 0


def optimizer_scaling(cfg: RunConfig, counts: list[int], cores: int | None = None) -> list[dict]:
    """megaray alone with 1, 2, 4, ... optimizer shards sharing ``cores`` cores (cores // N
    threads each): the shards' summed update rate and the GPU's wait on them."""
    cores = cores or os.cpu_count() or 1
    rows = []
    for n in counts:
        c = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, num_shards=n,
                                                                threads_per_shard=max(1, cores // n)))
        r = bench(c, baseline=False)
        m = r["megaray"]
        rows.append({"shards": n, "threads_per_shard": c.optim.threads_per_shard,
                     "optimizer_gparams_per_s": m["optimizer_gparams_per_s"], "step_s": m["step_s"],
                     "idle_optimizer_s": m["breakdown"]["idle_optimizer_s"], "tflops": m["tflops"]})
    return rows


def _time_checkpoint(cfg: RunConfig, session, step: int, folder: str) -> dict:
    """Write one checkpoint of the trained state and load it back, timing both."""
    ck = Checkpointer(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=folder)),
                      session.run_id, logging.getLogger("megaray"))
    t0 = time.perf_counter()
    path = ck.save(session, step, {})
    save_s = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.iterdir())
    t0 = time.perf_counter()
    ck.load(session, path)
    load_s = time.perf_counter() - t0
    shutil.rmtree(path)
    ck.close()
    return {"bytes": size, "save_s": save_s, "load_s": load_s,
            "save_gbps": size / save_s / 1e9, "load_gbps": size / load_s / 1e9}


def print_table(r: dict) -> None:
    m = r["megaray"]
    print(f"{r['shape']} ({r['params'] / 1e9:.2f}B params) seq {r['seq_len']}, {r['tokens_per_step']} tokens/step "
          f"({r['grad_accum']} x {r['micro_batch']} x {r['seq_len']}), "
          f"{r['shards']} shards x {r['threads_per_shard']} threads, "
          f"{r['host_bytes_per_param']:.2f} host bytes/param, {r.get('ring_slabs', 0)} ring slabs, "
          + describe_placement(r.get("resident_units", 0)) + f", {r.get('attention', 'causal')} attention"
          + (f" ({100 * r['attention_work_of_causal']:.1f}% of causal attention's work, as TFLOP/s counts it)"
             if "attention_work_of_causal" in r else ""))
    print(f"  megaray : {m['step_s']:.3f} s/step  {m['tflops']:.1f} TFLOP/s  {m['tokens_per_s']:.0f} tok/s  "
          f"GPU peak {m['gpu_peak_gib']:.1f} GiB")
    b = r.get("baseline")
    if isinstance(b, dict):
        print(f"  baseline: {b['step_s']:.3f} s/step  {b['tflops']:.1f} TFLOP/s  GPU peak {b['gpu_peak_gib']:.1f} GiB"
              f"  ratio {r['ratio']:.3f}  first-loss diff {r['first_loss_diff']:.4f}")
    elif b:
        print(f"  baseline: {b}")
    d = m["breakdown"]
    print(f"  step {d['step_s']:.3f} s = compute {d['compute_s']:.3f} + GPU idle waiting for the optimizer "
          f"{d['idle_optimizer_s']:.3f} + waiting for copy-in/launch {d['idle_copy_in_s']:.3f} + outside the GPU work "
          f"{d['outside_s']:.3f} (GPU idle {100 * d['gpu_idle_fraction']:.1f}%)")
    print("  overlapped (s): " + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in d["overlapped"].items())
          + (f"; optimizer {m['optimizer_gparams_per_s']:.2f} G params/s summed"
             if m["optimizer_gparams_per_s"] else ""))
    la = r.get("link_alone", {})
    if "error" in la:
        print(f"  measured alone: failed ({la['error']})")
    elif la:
        print(f"  measured alone: copy-in {la['copy_in_gbps']:.1f} GB/s, copy-out {la['copy_out_gbps']:.1f} GB/s")
    print("  worker (median step, s): " + ", ".join(f"{k[:-2]}={v:.3f}" for k, v in m["worker"].items()))
    if "checkpoint" in r:
        c = r["checkpoint"]
        print(f"  checkpoint: {c['bytes'] / 1e9:.1f} GB written in {c['save_s']:.1f} s ({c['save_gbps']:.2f} GB/s), "
              f"loaded in {c['load_s']:.1f} s ({c['load_gbps']:.2f} GB/s)")
    pl = r["planner"]
    print(f"  planner: host {pl['host_predicted_gib']:.1f} GiB predicted, {pl['host_measured_gib']:.1f} GiB measured "
          "(system memory in use, less what was in use before and the baseline's copy of the weights); "
          f"GPU {pl['gpu_predicted_gib']:.1f} GiB predicted "
          f"(keeping {pl['kept_blocks']}{' plain' if pl.get('kept_plain') else ''} blocks; "
          f"{pl['gpu_predicted_allocated_gib']:.2f} less the CUDA context and slack), "
          f"{pl['gpu_measured_gib']:.1f} GiB peak allocated in the steps that kept as many; "
          f"step {pl['step_predicted_s']:.3f} s predicted (the reference speeds, the shards' AdamW at "
          f"{pl.get('update_scale', 1.0):.2f} of the reference's as measured at start), {m['step_s']:.3f} s measured")
    for row in r.get("optimizer_scaling", []):
        print(f"  optimizer {row['shards']} shards x {row['threads_per_shard']} threads: "
              f"{row['optimizer_gparams_per_s'] or 0:.2f} G params/s summed, GPU waits {row['idle_optimizer_s']:.3f} s "
              f"a step, {row['step_s']:.3f} s/step")
    print("JSON " + json.dumps(r))
