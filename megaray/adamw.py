"""The optimizer shards' AdamW: one pass over memory per update, in C, with a torch fallback.

``AdamW.step(...)`` updates a contiguous range of one layer unit in place: the master
weight (fp32, or bf16 with stochastic rounding), the two moments (fp32, or bf16 rounded to
nearest even), from a gradient (fp32 or bf16, scaled by the clip coefficient), and refreshes
the host's bf16 compute copy when there is one, all in the same pass. Bytes moved a
parameter: 28 with fp32 state and gradient (+2 with the compute copy), 26 with a bf16
gradient, 18 with bf16 moments and gradient.

Which code runs was chosen by measurement on the reference host (16 cores, BENCHMARKS.md),
under one constraint: where the compute copy is made (``optim.compute_copy``)
must never change the training. With fp32 master, moments and gradient, torch's own fused
AdamW (``torch._fused_adamw_``, already one pass: 6.2 G params/s over 16 processes against the
C kernel's 4.6), and the host's bf16 copy, where there is one, in a second pass over the
updated weights (the C kernel would write it in the same pass, 5.1 against 4.1, but with its
own arithmetic the weights would then depend on where the copy is made). Every combination
with bf16 state or gradients runs the C kernel (bf16 moments and gradients 7.9 G params/s
against 2.7 for torch's upcasting path).

The kernel (``megaray/kernels/adamw.c``) is compiled on first use with the machine's C
compiler into a per-user cache (``$XDG_CACHE_HOME/megaray`` or ``~/.cache/megaray``, else
the temporary folder), keyed by the source, the flags and the CPU's features, and loaded
with ctypes, which releases the GIL, so a shard's threads each update a slice at once.
Where it cannot be built (no compiler) the same arithmetic runs as torch operations over
cache-sized chunks: slower, and equal bit for bit, so a run may move between machines with
and without a compiler and still resume exactly. The arithmetic is stated in the C file.

Stochastic rounding of a bf16 master draws each element's noise from (seed, unit, step,
element offset in the unit), so the result does not depend on how the unit was cut into
pieces, shards or threads, and a resumed run rounds as the uninterrupted one would.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megaray.fused import fused

log = logging.getLogger("megaray")

SOURCE = Path(__file__).with_name("kernels") / "adamw.c"
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off")
CHUNK = 1 << 16            # elements per torch-fallback chunk (the chunk's temporaries stay in cache)
_M32 = 0xFFFFFFFF


def _f32(x: float) -> float:
    """x rounded to float32 (as a Python float), the value both paths compute with."""
    return float(np.float32(x))


@dataclass(frozen=True)
class Hyper:
    """One update's float32 scalars, derived once per (piece, step) by ``hyper`` (and the
    plain hyperparameters, for torch's fused path)."""
    grad_scale: float
    decay: float
    b1c: float
    beta2: float
    b2c: float
    step_size: float
    bc2_sqrt: float
    eps: float
    lr: float = 0.0
    beta1: float = 0.9
    weight_decay: float = 0.0
    eps_raw: float = 1e-8


def hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: int,
          grad_scale: float = 1.0) -> Hyper:
    """Scalars of AdamW's ``step``-th update (1-based), as torch.optim.AdamW derives them."""
    b1, b2 = betas
    return Hyper(grad_scale=_f32(grad_scale), decay=_f32(1.0 - lr * weight_decay), b1c=_f32(1.0 - b1),
                 beta2=_f32(b2), b2c=_f32(1.0 - b2), step_size=_f32(lr / (1.0 - b1 ** step)),
                 bc2_sqrt=_f32((1.0 - b2 ** step) ** 0.5), eps=_f32(eps), lr=lr, beta1=b1,
                 weight_decay=weight_decay, eps_raw=eps)


def mix32(x: int) -> int:
    """The C kernel's lowbias32 hash of a 32-bit integer."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def rounding_key(seed: int, unit: int, step: int) -> int:
    """The 32-bit key of a unit's stochastic rounding at one step."""
    return mix32(mix32(mix32(seed & _M32) ^ unit) ^ (step & _M32))


def piece_decay(o, piece) -> float:
    """A piece's weight decay (``optim``: matrices decayed; 1-D tensors only with
    ``decay_norms_and_biases``)."""
    return o.weight_decay if piece.decay or o.decay_norms_and_biases else 0.0


def update_piece(adam: AdamW, o, seed: int, piece, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor,
                 v: torch.Tensor, lr: float, adam_step: int, grad_scale: float,
                 copy: torch.Tensor | None = None) -> None:
    """One piece's ``adam_step``-th update with ``optim``'s settings: the one call the shards
    and the worker's resident units make, so both do the same arithmetic."""
    adam.step(master, grad, m, v, hyper(lr, tuple(o.betas), o.eps, piece_decay(o, piece), adam_step,
                                        grad_scale=grad_scale), copy,
              rounding_key(seed, piece.unit, adam_step), piece.start, adam_step)


# ----------------------------------------------------------------------------- the C kernel
_lib = None
_lib_lock = threading.Lock()
_lib_error: str | None = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for d in (Path(base) / "megaray", Path(tempfile.gettempdir()) / f"megaray-{os.getuid()}"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError("no writable cache folder for the compiled AdamW kernel")


def _cpu_tag() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return f"{platform.machine()}:{flags}"


def _build() -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise OSError("no C compiler (cc, gcc or clang) on the PATH")
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + " ".join(FLAGS).encode() + _cpu_tag().encode() + cc.encode()).hexdigest()[:16]
    out = _cache_dir() / f"adamw-{tag}.so"
    if not out.is_file():
        # Several shards start at once: each builds into its own file and renames it into place.
        tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        r = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise OSError(f"{cc} failed to build {SOURCE.name}: {r.stderr.strip()[:500]}")
        os.replace(tmp, out)
    lib = ctypes.CDLL(str(out))
    f = lib.megaray_adamw
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 8 + \
        [ctypes.c_uint32, ctypes.c_uint32]
    return lib


def kernel():
    """The compiled kernel, or None (then the reason is logged once, and the fallback runs)."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is None and _lib_error is None:
            try:
                _lib = _build()
            except Exception as e:          # no compiler, a read-only home, a broken toolchain
                _lib_error = f"{type(e).__name__}: {e}"
                log.warning("the fused C AdamW kernel is not available (%s); the optimizer uses the "
                            "torch fallback: the same results, slower", _lib_error)
        return _lib


def kernel_error() -> str | None:
    """Why the kernel is not available (None when it is, or was not tried)."""
    return _lib_error


# ----------------------------------------------------------------------------- the update
def _flags(master, grad, m, copy) -> int:
    bf = torch.bfloat16
    return ((master.dtype == bf) | (grad.dtype == bf) << 1 | (m.dtype == bf) << 2 | (copy is not None) << 3)


def _check(master, grad, m, v, copy) -> None:
    n = master.numel()
    for name, t in (("gradient", grad), ("exp_avg", m), ("exp_avg_sq", v)) + ((("copy", copy),) if copy is not None
                                                                             else ()):
        assert t.numel() == n and t.is_contiguous() and t.device.type == "cpu", f"{name} does not match the master"
    assert master.is_contiguous() and m.dtype == v.dtype
    assert master.dtype in (torch.float32, torch.bfloat16) and grad.dtype in (torch.float32, torch.bfloat16)
    assert copy is None or (master.dtype == torch.float32 and copy.dtype == torch.bfloat16)


def writes_clipped_gradient(optim, grad_placement: str, grad_dtype: str) -> bool:
    """Whether the shards' updates first write the clipped gradient (``AdamW._torch_fused``:
    fp32 state and gradients from host memory, with clipping): one slab a shard of host memory,
    and 36 bytes a parameter moved instead of 28."""
    return (grad_placement == "host" and optim.clip_grad_norm is not None
            and (optim.master_dtype, optim.moment_dtype, grad_dtype) == ("float32",) * 3)


def torch_fused_applies(master, grad, m) -> bool:
    """fp32 master, moments and gradient: torch's fused AdamW (with or without a copy)."""
    return master.dtype == grad.dtype == m.dtype == torch.float32


class AdamW:
    """AdamW updates of contiguous ranges with ``threads`` threads (the shard's own)."""

    def __init__(self, threads: int = 1, use_kernel: bool = True):
        self.threads = max(1, threads)
        self.lib = kernel() if use_kernel else None
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="adamw") if self.threads > 1 else None
        self._scaled: torch.Tensor | None = None    # the clipped gradient of torch's fused path (host memory)

    @property
    def fused(self) -> bool:
        return self.lib is not None

    def describe(self, master_dtype: str, moment_dtype: str, grad_dtype: str, copy: bool) -> str:
        """Which code updates this state (for the run's log)."""
        if master_dtype == moment_dtype == grad_dtype == "float32":
            return "torch's fused AdamW (fp32 state)" + (" and a pass for the bf16 copy" if copy else "")
        return "the fused C kernel" if self.fused else "the torch fallback of the C kernel (no C compiler)"

    def step(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper,
             copy: torch.Tensor | None = None, sr_key: int = 0, offset: int = 0, adam_step: int = 1) -> None:
        """Update ``master`` (and ``copy``), ``m`` and ``v`` in place from ``grad``; ``offset`` is the
        range's first element within its unit (stochastic rounding of a bf16 master); ``adam_step``
        is the update's 1-based count (torch's fused path takes it)."""
        _check(master, grad, m, v, copy)
        n = master.numel()
        if n == 0:
            return
        if torch_fused_applies(master, grad, m):
            self._torch_fused(master, grad, m, v, h, adam_step)
            if copy is not None:
                copy.copy_(master)                    # rounded to nearest, as the GPU's cast would
            return
        run = self._kernel_range if self.lib is not None else _torch_range
        if self.pool is None or n < 2 * CHUNK:
            run(master, grad, m, v, h, copy, sr_key, offset, 0, n)
            return
        bounds = np.linspace(0, n, self.threads + 1).astype(np.int64) // 64 * 64   # cache-line aligned cuts
        bounds[-1] = n
        futs = [self.pool.submit(run, master, grad, m, v, h, copy, sr_key, offset, int(a), int(b))
                for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        for f in futs:
            f.result()

    def reserve_scaled(self, numel: int) -> None:
        """Hold (and touch) the host buffer of a clipped fp32 gradient of ``numel`` elements."""
        if self._scaled is None or self._scaled.numel() < numel:
            self._scaled = None
            self._scaled = torch.zeros(numel, dtype=torch.float32)

    def _torch_fused(self, master, grad, m, v, h: Hyper, adam_step: int) -> None:
        """torch's fused AdamW on fp32 state, the gradient scaled first when clipping applies
        (a multiply in fp32, as the worker's on the device). In host memory the scaled copy
        goes to one buffer kept for the purpose (``reserve_scaled``; the plan counts a slab a
        shard): a fresh 64 MiB tensor a piece cost as much in page faults as the update itself
        (llama8b, gradients in host memory: 2.1 G params/s summed against 3.9 through the
        ring, BENCHMARKS.md)."""
        if h.grad_scale != 1.0:
            if grad.device.type == "cpu":
                n = grad.numel()
                self.reserve_scaled(n)
                grad = torch.mul(grad, h.grad_scale, out=self._scaled[:n])
            else:
                grad = grad * h.grad_scale
        torch._fused_adamw_([master], [grad], [m], [v], [], [torch.tensor(float(adam_step))], lr=h.lr,
                            beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay, eps=h.eps_raw,
                            amsgrad=False, maximize=False)

    def _kernel_range(self, master, grad, m, v, h: Hyper, copy, sr_key: int, offset: int, a: int, b: int) -> None:
        def ptr(t):
            return None if t is None else t.data_ptr() + a * t.element_size()

        rc = self.lib.megaray_adamw(_flags(master, grad, m, copy), ptr(master), ptr(copy), ptr(grad), ptr(m), ptr(v),
                                    b - a, h.grad_scale, h.decay, h.b1c, h.beta2, h.b2c, h.step_size, h.bc2_sqrt,
                                    h.eps, sr_key & _M32, (offset + a) & _M32)
        if rc != 0:
            raise ValueError(f"no AdamW kernel for flags {_flags(master, grad, m, copy)}")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x < 2**32, without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stochastic_round(p: torch.Tensor, out: torch.Tensor, sr_key: int, first: int) -> None:
    """Store fp32 ``p`` into bf16 ``out`` as the kernel does: add the hashed 16-bit noise of
    elements ``first``, ``first + 1``, ... below the bf16 mantissa and truncate; inf and NaN
    round to nearest."""
    bits = p.view(torch.int32).to(torch.int64) & _M32
    idx = torch.arange(first, first + p.numel(), dtype=torch.int64)
    noise = _mix32((idx + sr_key) & _M32) & 0xFFFF
    r = (bits + noise) >> 16                                     # < 2**16 for finite values
    special = (bits & 0x7F800000) == 0x7F800000
    r = torch.where(special, p.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF, r)
    out.view(torch.int16).copy_((r - ((r >> 15) << 16)).to(torch.int16))   # two's complement to int16


def _torch_range(master, grad, m_all, v_all, h: Hyper, copy, sr_key: int, offset: int, a: int, b: int,
                 chunk: int = CHUNK) -> None:
    """The kernel's arithmetic as torch operations, chunk by chunk (each op one IEEE rounding)."""
    f32 = torch.float32
    for c in range(a, b, chunk):
        d = min(b, c + chunk)
        g = grad[c:d].to(f32) * h.grad_scale
        p = master[c:d].to(f32) * h.decay
        m = m_all[c:d].to(f32)
        v = v_all[c:d].to(f32)
        t = g - m
        t.mul_(h.b1c)
        m.add_(t)
        v.mul_(h.beta2)
        t = g * h.b2c
        t.mul_(g)
        v.add_(t)
        denom = v.double().sqrt_().float()    # correctly rounded, as C's sqrtf (torch's float sqrt is not)
        denom.div_(h.bc2_sqrt)
        denom.add_(h.eps)
        u = m * h.step_size
        u.div_(denom)
        p.sub_(u)
        if master.dtype == f32:
            master[c:d].copy_(p)
        else:
            stochastic_round(p, master[c:d], sr_key, offset + c)
        if m_all.dtype == f32:
            m_all[c:d].copy_(m)
            v_all[c:d].copy_(v)
        else:
            m_all[c:d].copy_(m)     # fp32 -> bf16: round to nearest even
            v_all[c:d].copy_(v)
        if copy is not None:
            copy[c:d].copy_(p)


# ----------------------------------------------------------------------------- on the GPU
DEVICE_CHUNK = 1 << 24      # elements a pass of the eager device path (its fp32 temporaries: 64 MiB each)


def _device_adamw_eager(master, grad, m, v, hv: torch.Tensor) -> None:
    h = Hyper(*hv.tolist())           # the float32 scalars as they were: the same values
    _torch_range(master, grad, m, v, h, None, 0, 0, 0, master.numel(), chunk=DEVICE_CHUNK)


@fused(eager=_device_adamw_eager)
def _device_adamw(master, grad, m, v, hv: torch.Tensor) -> None:
    """The C kernel's arithmetic in one compiled pass, the step's scalars read from the device
    tensor ``hv`` (new values never recompile)."""
    g = grad.float() * hv[0]
    p = master * hv[1]
    mf, vf = m.float(), v.float()
    mf = mf + hv[2] * (g - mf)
    vf = vf * hv[3] + (hv[4] * g) * g
    p = p - (hv[5] * mf) / (torch.sqrt(vf) / hv[6] + hv[7])
    master.copy_(p)
    m.copy_(mf)
    v.copy_(vf)


def device_step(master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper) -> None:
    """AdamW of an fp32 ``master`` with bf16 (or fp32) moments ``m``, ``v`` on the worker's
    device (resident units with bf16 moments, which torch's fused AdamW does not take): the C
    kernel's arithmetic in one compiled pass on CUDA (``megaray.fused``: equal to fp32 rounding,
    the moments to bf16 rounding, since the compiler may fuse a multiply and an add and Triton
    divides to within two ulp; measured in ``tests/test_cuda.py``), or eagerly
    (``worker.fuse_elementwise`` false, the CPU) the torch fallback's operations, bit for bit the
    kernel's."""
    hv = torch.tensor([h.grad_scale, h.decay, h.b1c, h.beta2, h.b2c, h.step_size, h.bc2_sqrt, h.eps],
                      dtype=torch.float32).to(master.device, non_blocking=True)
    _device_adamw(master, grad, m, v, hv)
