"""``megaray bench --adamw-alone``: the CPU AdamW update rate measured alone, by state
combination and by processes x threads, beside torch's own paths and the host's bandwidth.

Each of P processes (forked, one per optimizer shard it stands for) updates its own ``n``
parameters ``reps`` times with T torch threads; the rates are summed. Bytes a parameter are
what the update must move: reading weight, gradient and two moments and writing three, in
the state's storage (28 for fp32 state and gradient; +2 with the host's bf16 copy).
"""
from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np


def random_state(numel: int, master_dtype: str, grad_dtype: str, moment_dtype: str, copy: bool,
                 seed: int = 0) -> tuple:
    """(master, gradient, m, v, the bf16 copy or None) of ``numel`` parameters in the given
    storage, random weights and gradient, zero moments: what the update benchmarks and the
    start-up measurement of the shards' rate update."""
    import torch

    from megaray.layout import DTYPES

    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(numel, generator=gen).to(DTYPES[master_dtype])
    g = torch.randn(numel, generator=gen).to(DTYPES[grad_dtype])
    m, v = torch.zeros(numel, dtype=DTYPES[moment_dtype]), torch.zeros(numel, dtype=DTYPES[moment_dtype])
    return p, g, m, v, (torch.empty(numel, dtype=torch.bfloat16) if copy else None)


COMBOS = {   # name: (master, gradient, moments, host copy, bytes a parameter)
    "fp32": ("float32", "float32", "float32", False, 28),
    "fp32+copy": ("float32", "float32", "float32", True, 30),
    "bf16 grad": ("float32", "bfloat16", "float32", False, 26),
    "bf16 moments": ("float32", "float32", "bfloat16", False, 20),
    "bf16 moments+grad": ("float32", "bfloat16", "bfloat16", False, 18),
    "bf16 master+moments+grad": ("bfloat16", "bfloat16", "bfloat16", False, 14),
}


def _worker(kind, combo, n, threads, reps, q, barrier):
    import torch

    from megaray import adamw

    torch.set_num_threads(threads)
    pdt, gdt, mdt, copy, _ = COMBOS[combo]
    p, g, m, v, c = random_state(n, pdt, gdt, mdt, copy)
    h = adamw.hyper(1e-4, (0.9, 0.95), 1e-8, 0.1, 1)
    if kind == "megaray":
        opt = adamw.AdamW(threads)

        def fn():
            opt.step(p, g, m, v, h, copy=c, sr_key=1, offset=0)
    else:                           # torch's own: fused on fp32 chunks, upcasting what is not fp32
        step = torch.zeros((), dtype=torch.float32)
        chunk = n if pdt == mdt == gdt == "float32" else 1 << 18

        def fn():
            step.add_(1)
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                pw, mm, vv = (t[a:b] if t.dtype == torch.float32 else t[a:b].float() for t in (p, m, v))
                torch._fused_adamw_([pw], [g[a:b].float()], [mm], [vv], [], [step], lr=1e-4, beta1=0.9, beta2=0.95,
                                    weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
                for dst, src in ((p, pw), (m, mm), (v, vv)):
                    if dst.dtype != torch.float32:
                        dst[a:b].copy_(src)
                if c is not None:
                    c[a:b].copy_(pw)
    fn()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    q.put(n * reps / (time.perf_counter() - t0))


def _triad(n, reps, q, barrier):
    a, b, c = np.ones(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)
    np.add(a, b, out=c)
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(reps):
        np.add(a, b, out=c)
    q.put(3 * 4 * n * reps / (time.perf_counter() - t0))


def _summed(target, procs: int, args: tuple) -> float:
    ctx = mp.get_context("fork")
    q, barrier = ctx.Queue(), ctx.Barrier(procs)
    ps = [ctx.Process(target=target, args=args + (q, barrier)) for _ in range(procs)]
    for p in ps:
        p.start()
    rates = [q.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    return sum(rates)


def run(layouts: list[tuple[int, int]], n: int = 16 * 2**20, reps: int = 4) -> list[dict]:
    """Rows of {kind, combo, procs, threads, gparams_per_s, gbytes_per_s} (and the triad)."""
    rows = []
    for procs in sorted({p for p, _ in layouts}):
        rows.append({"kind": "numpy a+b->c", "combo": "", "procs": procs, "threads": 1,
                     "gbytes_per_s": _summed(_triad, procs, (n * 2, reps)) / 1e9})
    for combo, (*_, bpp) in COMBOS.items():
        for kind in ("megaray", "torch"):
            for procs, threads in layouts:
                r = _summed(_worker, procs, (kind, combo, n, threads, reps))
                rows.append({"kind": kind, "combo": combo, "procs": procs, "threads": threads,
                             "gparams_per_s": r / 1e9, "gbytes_per_s": r * bpp / 1e9})
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        rate = f"{r['gparams_per_s']:.2f} G params/s = " if "gparams_per_s" in r else ""
        print(f"  {r['kind']:<13} {r['combo']:<25} {r['procs']:>2} x {r['threads']:<2} {rate}"
              f"{r['gbytes_per_s']:.0f} GB/s")
