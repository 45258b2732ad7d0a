"""Exact global-norm clipping: the gradient's squared norm, the clip factor, and when an
update may apply without waiting for them.

The norm exists only once the whole backward has run; every update of a step is scaled by
the same factor, taken from it. With clipping off and the gradients in host memory there is
nothing to wait for: each unit's update applies as soon as its gradient has landed, and a
unit whose own gradient is not finite is skipped (``applies_at_once``; the optimizer shards
and the worker's resident units both follow it).
"""
from __future__ import annotations

import torch

from megaray.config import OptimConfig

NORM_CHUNK = 1 << 24        # elements a squared norm sums in float64 at once (128 MiB of workspace)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def applies_at_once(optim: OptimConfig, grad_placement: str) -> bool:
    """Whether a unit's update applies as soon as its gradient is in host memory, without the
    step's verdict: gradients in host memory (``optim.grad_placement`` host) and clipping off."""
    return grad_placement == "host" and optim.clip_grad_norm is None


def square_norm(g: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of ``g``, summed in float64 (a 0-d tensor on g's device), over
    ``NORM_CHUNK`` elements at a time: in one call, ``vector_norm(g, dtype=float64)`` casts the
    whole tensor first, and a llama8b head's 525M-element fp32 gradient became a 3.9 GiB
    temporary that a 24 GiB run could not hold."""
    flat = g.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    for a in range(0, flat.numel(), NORM_CHUNK):
        total += torch.linalg.vector_norm(flat[a:a + NORM_CHUNK], dtype=torch.float64).square()
    return total
