"""A model's initial weights: deterministic, each parameter from its own generator seeded by
its name, so a unit's values do not depend on sharding, order or threads."""
from __future__ import annotations

import torch

from megaray.config import ModelConfig
from megaray.layout import UnitLayout
from megaray.machine import on_cores


def init_unit(unit: UnitLayout, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """Deterministic fp32 initialization of one unit, independent of sharding and order."""
    flat = torch.empty(unit.numel, dtype=torch.float32)
    for s in unit.params:
        init_param(s, cfg, seed, flat[s.offset:s.offset + s.numel])
    return flat


def init_param(s, cfg: ModelConfig, seed: int, out: torch.Tensor) -> torch.Tensor:
    """Parameter ``s``'s initial fp32 values into ``out`` (its own generator, seeded by its
    name: a unit's parameters can be made one at a time, with the same values)."""
    if s.decay:
        g = torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(s.name)) % (2**63))
        out.normal_(0.0, cfg.initializer_range, generator=g)
    elif s.name.endswith("bias"):
        out.zero_()
    else:
        out.fill_(1.0 - cfg.norm_offset)      # a norm scales by 1 at the start (Gemma's weight 0 + offset 1)
    return out


def init_params(jobs: list[tuple], cfg: ModelConfig, seed: int, threads: int | None = None,
                progress=None) -> None:
    """``init_param`` for each ``(parameter, out)`` of ``jobs``, on ``threads`` threads (every
    core this process may use by default; torch releases the GIL while it samples). Each
    parameter has its own generator, so the values are ``init_unit``'s whatever the threads
    and the order. An ``out`` that is not fp32 in host memory (a bf16 master, a GPU buffer)
    takes the fp32 values through a temporary of the parameter's size: at most ``threads``
    such temporaries exist at once. ``progress(values)`` is called as each parameter is done."""
    def one(job) -> None:
        s, out = job
        if out.dtype == torch.float32 and out.device.type == "cpu":
            init_param(s, cfg, seed, out)
        else:
            out.copy_(init_param(s, cfg, seed, torch.empty(s.numel, dtype=torch.float32)))

    on_cores(one, jobs, threads, size=lambda j: j[0].numel,
             done=None if progress is None else lambda j: progress(j[0].numel))
    if any(out.is_cuda for _, out in jobs):     # the threads' copies ran on their own default streams
        torch.cuda.synchronize()


def _stable_hash(text: str) -> int:
    h = 1469598103934665603
    for b in text.encode():
        h = ((h ^ b) * 1099511628211) % (2**64)
    return h
