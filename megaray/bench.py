"""``megaray bench``: megaray against a plain-PyTorch GPU-resident baseline, one process tree.

The baseline is an ordinary nn.Module holding every weight on the device, trained with bf16
autocast and fused AdamW, the same tokens per step through gradient accumulation. Both start
from the same initial weights (the baseline loads megaray's) and see the same random tokens,
so their first losses must agree within bf16 tolerance. TFLOP/s is DESIGN.md's formula.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time

import numpy as np
import torch
import torch.nn as nn

from megaray.config import RunConfig, build_config
from megaray.model import block_forward, build_layout, embed_forward, flops_per_step, rope_tables


class BaselineLlama(nn.Module):
    """Every weight an nn.Parameter on one device; the same math as megaray's templates."""

    def __init__(self, cfg, state: dict[str, np.ndarray], device):
        super().__init__()
        self.cfg = cfg
        self.units = build_layout(cfg)
        self.params = nn.ParameterDict({
            k.replace(".", "__"): nn.Parameter(torch.tensor(v, device=device)) for k, v in state.items()})
        self.rope = rope_tables(cfg, cfg.max_position_embeddings, device)

    def _w(self, unit) -> dict:
        from megaray.model import short_name

        return {short_name(s.name): self.params[s.name.replace(".", "__")] for s in unit.params}

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = embed_forward(self._w(self.units[0]), tokens)
        for u in self.units[1:-1]:
            x = block_forward(self._w(u), x, self.rope, self.cfg)
        wh = self._w(self.units[-1])
        from megaray.model import rms_norm

        h = rms_norm(x, wh["model.norm.weight"], self.cfg.rms_norm_eps)
        out = self.params["model__embed_tokens__weight"] if self.cfg.tie_word_embeddings else wh["lm_head.weight"]
        logits = (h @ out.t()).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def run_baseline(cfg: RunConfig, state, batches, device="cuda") -> dict:
    model = BaselineLlama(cfg.model, state, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                            weight_decay=cfg.optim.weight_decay, fused=True)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for tok in batches:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        t = torch.as_tensor(tok, device=device)
        total = 0.0
        for m in range(t.shape[0]):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(t[m, :, :-1], t[m, :, 1:]) / t.shape[0]
            loss.backward()
            total += loss.detach()
        if cfg.optim.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    torch.cuda.empty_cache()
    return {"times": times, "losses": losses, "gpu_peak_gib": peak / 2**30}


def bench(shape: str, seq_len: int, tokens_per_step: int, micro_batch: int, steps: int,
          shards: int, threads: int, baseline: bool = True, extra: dict | None = None,
          checkpoint_dir: str | None = None) -> dict:

    from megaray.actors.session import TrainingSession

    ga = tokens_per_step // (seq_len * micro_batch)
    data = {
        "model": {"shape": shape},
        "train": {"steps": steps, "micro_batch_size": micro_batch, "grad_accum": ga, "seq_len": seq_len,
                  "compute_dtype": "bfloat16", "loss_chunk_tokens": 8192},
        "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant", "num_shards": shards,
                  "threads_per_shard": threads, "clip_grad_norm": 1.0},
        "worker": {"device": "cuda", "threads": 2},
    }
    for k, v in (extra or {}).items():
        sec, key = k.split(".", 1)
        data.setdefault(sec, {})[key] = v
    cfg = build_config(data)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.model.vocab_size, (ga, micro_batch, seq_len + 1)) for _ in range(steps)]
    flops = flops_per_step(cfg.model, tokens_per_step, seq_len)
    from megaray.plan import plan

    out: dict = {"shape": shape, "params": cfg.model.num_params(), "seq_len": seq_len,
                 "host_bytes_per_param": plan(cfg).host_bytes_per_param,
                 "tokens_per_step": tokens_per_step, "micro_batch": micro_batch, "grad_accum": ga,
                 "shards": shards, "threads_per_shard": threads}
    ms = []
    with TrainingSession(cfg) as s:
        t0 = time.perf_counter()
        state = s.state_dict() if baseline else None
        out["state_dict_s"] = time.perf_counter() - t0
        for i, b in enumerate(batches):
            ms.append(s.train_step(i, b))
        s.drain()
        if checkpoint_dir:
            out["checkpoint"] = _time_checkpoint(cfg, s, steps, checkpoint_dir)
    warm = ms[1:] if len(ms) > 1 else ms
    step_s = statistics.median(m["step_time_s"] for m in warm)
    out["megaray"] = {"step_s": step_s, "tflops": flops / step_s / 1e12,
                      "tokens_per_s": tokens_per_step / step_s,
                      "losses": [m["loss"] for m in ms],
                      "breakdown": {k: statistics.median(m.get(k, 0.0) for m in warm)
                                    for k in warm[0] if k.startswith("worker/") and k.endswith("_s")},
                      "gpu_peak_gib": max(m.get("worker/gpu_peak_bytes", 0) for m in ms) / 2**30}
    if baseline:
        try:
            b = run_baseline(cfg, state, batches)
            bs = statistics.median(b["times"][1:] if len(b["times"]) > 1 else b["times"])
            out["baseline"] = {"step_s": bs, "tflops": flops / bs / 1e12, "losses": b["losses"],
                               "gpu_peak_gib": b["gpu_peak_gib"]}
            out["ratio"] = out["megaray"]["tflops"] / out["baseline"]["tflops"]
            out["first_loss_diff"] = max(abs(a - c) for a, c in zip(out["megaray"]["losses"][:2], b["losses"][:2]))
        except torch.cuda.OutOfMemoryError:
            out["baseline"] = "out of memory"
    return out


def _time_checkpoint(cfg: RunConfig, session, step: int, folder: str) -> dict:
    """Write one checkpoint of the trained state and load it back, timing both."""
    import shutil

    from megaray.runner import Checkpointer

    ck = Checkpointer(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=folder)),
                      session.run_id)
    t0 = time.perf_counter()
    path = ck.save(session, step, {})
    save_s = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.iterdir())
    t0 = time.perf_counter()
    ck.load(session, path)
    load_s = time.perf_counter() - t0
    shutil.rmtree(path)
    return {"bytes": size, "save_s": save_s, "load_s": load_s,
            "save_gbps": size / save_s / 1e9, "load_gbps": size / load_s / 1e9}


def print_table(r: dict) -> None:
    m = r["megaray"]
    print(f"{r['shape']} ({r['params'] / 1e9:.2f}B params) seq {r['seq_len']}, {r['tokens_per_step']} tokens/step "
          f"({r['grad_accum']} x {r['micro_batch']} x {r['seq_len']}), {r['shards']} shards x {r['threads_per_shard']} threads, "
          f"{r['host_bytes_per_param']:.2f} host bytes/param")
    print(f"  megaray : {m['step_s']:.3f} s/step  {m['tflops']:.1f} TFLOP/s  {m['tokens_per_s']:.0f} tok/s  "
          f"GPU peak {m['gpu_peak_gib']:.1f} GiB")
    b = r.get("baseline")
    if isinstance(b, dict):
        print(f"  baseline: {b['step_s']:.3f} s/step  {b['tflops']:.1f} TFLOP/s  GPU peak {b['gpu_peak_gib']:.1f} GiB"
              f"  ratio {r['ratio']:.3f}  first-loss diff {r['first_loss_diff']:.4f}")
    elif b:
        print(f"  baseline: {b}")
    print("  breakdown (median s): " + ", ".join(f"{k[7:]}={v:.3f}" for k, v in m["breakdown"].items()))
    if "checkpoint" in r:
        c = r["checkpoint"]
        print(f"  checkpoint: {c['bytes'] / 1e9:.1f} GB written in {c['save_s']:.1f} s ({c['save_gbps']:.2f} GB/s), "
              f"loaded in {c['load_s']:.1f} s ({c['load_gbps']:.2f} GB/s)")
    print("JSON " + json.dumps(r))
