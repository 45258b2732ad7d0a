"""Learning-rate schedule (linear warmup, then cosine, linear or constant decay), the clip
factor and the gradient's squared norm that it is taken from.

Step numbers are 0-based: step s uses ``lr_at(s)``. During warmup the rate climbs linearly
to ``lr`` at the end of warmup (``lr * (s + 1) / warmup_steps``); then it decays from ``lr``
to ``min_lr`` over the remaining steps, reaching ``min_lr`` at the last step.
"""
from __future__ import annotations

import math

import torch

from megaray.config import OptimConfig

NORM_CHUNK = 1 << 24        # elements a squared norm sums in float64 at once (128 MiB of workspace)


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    span = max(1, total_steps - 1 - optim.warmup_steps)
    p = min(1.0, (step - optim.warmup_steps) / span)
    if optim.schedule == "linear":
        return optim.lr - (optim.lr - optim.min_lr) * p
    return optim.min_lr + (optim.lr - optim.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def square_norm(g: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of ``g``, summed in float64 (a 0-d tensor on g's device), over
    ``NORM_CHUNK`` elements at a time: in one call, ``vector_norm(g, dtype=float64)`` casts the
    whole tensor first, and a llama8b head's 525M-element fp32 gradient became a 3.9 GiB
    temporary that a 24 GiB run could not hold (BENCHMARKS.md, session 7)."""
    flat = g.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    for a in range(0, flat.numel(), NORM_CHUNK):
        total += torch.linalg.vector_norm(flat[a:a + NORM_CHUNK], dtype=torch.float64).square()
    return total
