"""The learning-rate schedule: linear warmup, then cosine, linear or constant decay.

Step numbers are 0-based: step s uses ``lr_at(s)``. During warmup the rate climbs linearly
to ``lr`` at the end of warmup (``lr * (s + 1) / warmup_steps``); then it decays from ``lr``
to ``min_lr`` over the remaining steps, reaching ``min_lr`` at the last step.
"""
from __future__ import annotations

import math

from megaray.config import OptimConfig


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
