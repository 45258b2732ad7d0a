"""The blocks' elementwise passes fused on the GPU: each small function of ``megaray.model``
(the RMSNorm's forward and backward, RoPE, SwiGLU's product and gradients) runs as one
compiled kernel (``torch.compile``, Triton) where its tensors are on a CUDA device, and eagerly
everywhere else.

Eagerly, PyTorch runs one kernel per operation, and each reads and writes whole
[tokens, hidden] or [tokens, intermediate] tensors, several in fp32: an RMSNorm is six passes,
RoPE five for each of q and k. On the H200 these passes were a quarter of a llama8b block's
forward and backward at 4,096 tokens (11.90 ms, of which 8.77 the matrix products and
attention); compiled, the block took 9.60 ms (BENCHMARKS.md).

The compiled kernels compute in fp32 the way the eager ones do, but may keep intermediate
values in fp32 where the eager ones round them to the compute dtype: results agree to the
compute dtype's rounding, not bit for bit. ``worker.fuse_elementwise`` false runs every pass
eagerly on the GPU too. Where compiling fails (no Triton, an unsupported Python or torch)
megaray says so once and runs eagerly from then on; a run never fails for it.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("megaray")

# enabled: worker.fuse_elementwise; devices: the device types that take compiled kernels (the
# GPU's: the CPU worker is a test and demo path, and the CPU compiler needs a C++ toolchain);
# backend: torch.compile's; failed: why compiling failed, once it has
_state = {"enabled": True, "devices": ("cuda",), "backend": "inductor", "failed": None}


def configure(enabled: bool = True, devices: tuple[str, ...] = ("cuda",), backend="inductor") -> None:
    """Fuse on these device types (the default: CUDA) or run every pass eagerly
    (``worker.fuse_elementwise`` false); a new configuration forgets an earlier failure."""
    _state.update(enabled=enabled, devices=tuple(devices), backend=backend, failed=None)


def active() -> bool:
    """Whether the compiled kernels are in use: enabled and compiling has not failed."""
    return _state["enabled"] and _state["failed"] is None


def failure() -> str | None:
    """Why compiling failed, or None."""
    return _state["failed"]


def fused(fn=None, *, eager=None):
    """Decorate ``fn`` (a function of tensors, its first argument one): compiled on the
    configured devices, ``eager`` (the same values, by default ``fn`` itself) elsewhere.
    ``eager`` may reuse its arguments' memory where ``fn``, which the compiler traces, stays pure."""
    if fn is None:
        return functools.partial(fused, eager=eager)
    slow = eager or fn
    compiled: dict = {}                      # backend -> fn compiled with it

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not (active() and args[0].device.type in _state["devices"]):
            return slow(*args, **kwargs)
        backend = _state["backend"]
        try:
            if backend not in compiled:     # some torch and Python pairs refuse here already
                compiled[backend] = torch.compile(fn, backend=backend)
            return compiled[backend](*args, **kwargs)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:     # noqa: BLE001 - any failure to compile: say it once, run eagerly
            _state["failed"] = _reason(e)
            log.warning("fusing the blocks' elementwise passes with torch.compile failed (%s); they run "
                        "eagerly from now on: the same results, slower", _state["failed"])
            return slow(*args, **kwargs)

    call.eager = slow
    return call


def _reason(e: BaseException) -> str:
    """The innermost cause of a compile failure (torch wraps the backend's own), in one line."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if inner is None:
            break
        e = inner
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
