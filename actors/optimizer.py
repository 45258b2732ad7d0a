"""OptimizerShard actor: AdamW over its share of the gradient pieces, in place.

The shard maps the master (and compute-copy) regions and the gradient ring, and keeps the
fp32 Adam moments of its pieces (``megaray.buffers``: slab-sized slices of a unit's flat
parameters, split at the decay boundary) in its own memory. Each piece has its own torch
AdamW (fused where torch has it) over a view of the master region: decayed when the piece
holds matrices, and 1-D tensors only when ``optim.decay_norms_and_biases`` is set. AdamW is
elementwise, so updating a unit piece by piece equals updating it whole. The moments are
allocated when the shard starts.

``apply(step, lr)`` is called once per step, before the worker starts it, and runs while
the worker computes: it waits for the worker's verdict on the step (``decided``), then for
each of its pieces in order waits for the piece in its ring slab, updates the master from
the slab, refreshes the compute copy, bumps ``version[p]`` and frees the slab, in that
order, so the worker never reads a half-written layer nor overwrites an unread gradient.
The gradient arrives already clipped: the worker scales it on the GPU by the exact global
clip coefficient before it leaves. A skipped step (non-finite loss or gradient) bumps the
versions and touches nothing else.

Reduced precision (``optim.moment_dtype`` / ``optim.master_dtype`` bfloat16): the update
runs the same fused AdamW kernel in fp32 on cache-sized chunks of the piece, upcasting the
stored moments and weights into scratch and storing them back: moments rounded to nearest,
bf16 master weights with stochastic rounding (a uniform 16-bit dither below the bf16 mantissa
before truncation, drawn from (seed, piece, step), so a resumed run rounds as the
uninterrupted one would), so an update smaller than half a bf16 step still moves a weight by that
amount on average instead of vanishing.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from megaray.buffers import DTYPES, Handles, RunBuffers
from megaray.config import RunConfig
from megaray.checkpoint import crc32_file, verify_file
from megaray.errors import ActorFailure, CheckpointError, InjectedFault, RunAborted

from .metrics import RunMetrics

CHUNK = 1 << 18     # elements of one fp32 scratch chunk in the reduced-precision update


def stochastic_round_bf16(x: torch.Tensor, out: torch.Tensor, gen: torch.Generator) -> None:
    """Store fp32 ``x`` into bf16 ``out`` rounding up with probability equal to the dropped
    fraction: add uniform noise to the 16 bits bf16 drops, then truncate them."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=gen)
    finite = torch.isfinite(x)
    dithered = torch.where(finite, (bits + noise) & ~0xFFFF, bits)   # inf and nan keep their bits
    out.copy_(dithered.view(torch.float32))                          # exact: the low 16 bits are zero


class OptimizerShard:
    def __init__(self, cfg: RunConfig, handles: Handles, pieces: list[int], name: str):
        torch.set_num_threads(cfg.optim.threads_per_shard)
        self.cfg, self.h, self.pieces, self.name = cfg, handles, list(pieces), name
        self.buf = RunBuffers(handles, kinds=("master", "compute", "ring", "control"))
        o = cfg.optim
        self.opts: dict[int, torch.optim.AdamW] = {}
        self.params: dict[int, torch.Tensor] = {}
        self.moment_dtype = DTYPES[o.moment_dtype]
        # torch's own fused AdamW step when everything is fp32; else the chunked fp32 update.
        self.reduced = o.moment_dtype != "float32" or handles.master_dtype != "float32"
        self._gen = torch.Generator()
        for i in self.pieces:
            piece = handles.pieces[i]
            wd = o.weight_decay if piece.decay or o.decay_norms_and_biases else 0.0
            self.params[i] = self.buf.piece_master(piece)
            self.opts[i] = torch.optim.AdamW([self.params[i]], lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                             weight_decay=wd, fused=True)
            # Moments allocated (and their pages touched) now, not in the first step: the
            # memory the plan counted is taken before training starts, and step 0's update
            # runs as fast as the others.
            self.opts[i].state[self.params[i]] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros(piece.numel, dtype=self.moment_dtype),
                "exp_avg_sq": torch.zeros(piece.numel, dtype=self.moment_dtype)}
        self.metrics = RunMetrics(handles.run_id, name.rsplit(":", 1)[-1], {
            "optimizer_seconds": "Time this optimizer shard spent updating in its last step",
            "optimizer_params_per_second": "This shard's AdamW update rate in its last step"})

    def _fault(self, step: int) -> None:
        d = self.cfg.debug
        if d.crash_actor == "optimizer" and d.crash_step == step:
            raise InjectedFault(f"{self.name}: injected crash at step {step}")

    def apply(self, step: int, lr: float) -> dict:
        """Apply step ``step`` to every piece of this shard as its gradient arrives.

        Returns {"update_s": seconds updating, "wait_s": seconds waiting for gradients,
        "params": parameters updated, "skipped": bool}."""
        try:
            self._fault(step)
            return self._apply(step, lr)
        except RunAborted as e:
            raise ActorFailure(self.name, str(e), step, aborted=True) from None
        except Exception as e:
            self.buf.abort()
            raise ActorFailure(self.name, f"{type(e).__name__}: {e}", step) from e

    def _apply(self, step: int, lr: float) -> dict:
        timeout = self.cfg.worker.wait_timeout_s
        out = {"update_s": 0.0, "wait_s": 0.0, "params": 0, "skipped": False}
        if not self.pieces:
            return out
        out["wait_s"] += self.buf.wait(lambda: self.buf.decided(step), f"the verdict on step {step}", timeout)
        if not self.buf.verdict:
            for i in self.pieces:
                self.buf.set_version(i, step + 1)
            out["skipped"] = True
            return out
        R = self.h.ring_slabs
        for i in self.pieces:
            s = i % R
            out["wait_s"] += self.buf.wait(
                lambda: self.buf.slab_piece(s) == i + 1,
                f"the gradient of piece {i} ({self.h.units[self.h.pieces[i].unit].name}) of step {step}", timeout)
            if self.buf.slab_step(s) != step:
                raise RuntimeError(f"slab {s} holds piece {i} of step {self.buf.slab_step(s)}, expected step {step}")
            t0 = time.perf_counter()
            self._update(i, self.buf.slab(s, self.h.pieces[i].numel), lr)
            self.buf.set_version(i, step + 1)
            self.buf.free_slab(s)
            out["update_s"] += time.perf_counter() - t0
            out["params"] += self.h.pieces[i].numel
        if out["update_s"] > 0:
            self.metrics.set(optimizer_seconds=out["update_s"],
                             optimizer_params_per_second=out["params"] / out["update_s"])
        return out

    def _update(self, i: int, grad: torch.Tensor, lr: float) -> None:
        p, opt = self.params[i], self.opts[i]
        opt.param_groups[0]["lr"] = lr
        if self.reduced:
            self._update_chunked(i, p, grad, opt)
        else:
            p.grad = grad
            opt.step()
            p.grad = None
        if not self.h.aliased:
            self.buf.piece_compute(self.h.pieces[i]).copy_(p)

    def _update_chunked(self, i: int, p: torch.Tensor, grad: torch.Tensor, opt: torch.optim.AdamW) -> None:
        """AdamW in fp32 over CHUNK-sized scratch copies of reduced-precision weights or moments."""
        g = opt.param_groups[0]
        st = opt.state[p]
        st["step"] += 1
        # The rounding noise is a function of (seed, piece, its step count): a resumed run
        # draws exactly what the uninterrupted one did.
        self._gen.manual_seed((self.cfg.run.seed * 1_000_003 + i) * 1_000_033 + int(st["step"]))
        m_all, v_all = st["exp_avg"], st["exp_avg_sq"]
        for a in range(0, p.numel(), CHUNK):
            b = min(a + CHUNK, p.numel())
            pw = p[a:b] if p.dtype == torch.float32 else p[a:b].float()
            m = m_all[a:b] if m_all.dtype == torch.float32 else m_all[a:b].float()
            v = v_all[a:b] if v_all.dtype == torch.float32 else v_all[a:b].float()
            torch._fused_adamw_([pw], [grad[a:b]], [m], [v], [], [st["step"]], lr=g["lr"], beta1=g["betas"][0],
                                beta2=g["betas"][1], weight_decay=g["weight_decay"], eps=g["eps"],
                                amsgrad=False, maximize=False)
            if p.dtype != torch.float32:
                stochastic_round_bf16(pw, p[a:b], self._gen)
            if m_all.dtype != torch.float32:
                m_all[a:b].copy_(m)
                v_all[a:b].copy_(v)

    def save(self, folder: str, k: int) -> dict:
        """Write this shard's AdamW states (moments, step counts) by piece as ``optim-<k>.pt``."""
        name = f"optim-{k}.pt"
        path = Path(folder) / name
        torch.save({"pieces": {i: self.opts[i].state_dict() for i in self.pieces}}, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        crc, n = crc32_file(path)
        return {name: {"bytes": n, "crc32": crc, "pieces": list(self.pieces), "slab_numel": self.h.slab_numel}}

    def load(self, folder: str, parts: dict) -> None:
        """Load the states of this shard's pieces from whichever parts hold them."""
        need = set(self.pieces)
        for name, part in parts.items():
            if not name.startswith("optim-"):
                continue
            if part.get("slab_numel") != self.h.slab_numel:
                raise CheckpointError(
                    f"{folder}: optimizer part {name} was cut into gradient pieces of {part.get('slab_numel')} "
                    f"elements, this run into {self.h.slab_numel} (optim.grad_slab_mib must match the checkpoint's)")
            mine = need & set(part.get("pieces", []))
            if not mine:
                continue
            path = Path(folder) / name
            verify_file(path, part)
            try:
                states = torch.load(path, map_location="cpu", weights_only=True)["pieces"]
            except Exception as e:
                raise CheckpointError(f"checkpoint part {path} cannot be read: {e}") from None
            for i in mine:
                self.opts[i].load_state_dict(states[i])
                st = self.opts[i].state[self.params[i]]     # load_state_dict casts to the master's dtype
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = st[k].to(self.moment_dtype)
            need -= mine
        if need:
            raise CheckpointError(f"{folder}: no optimizer state for gradient pieces {sorted(need)}")

    def optimizer_state(self) -> dict:
        """Adam state (moments, step) by piece (tests)."""
        return {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[self.params[i]].items()}
                for i, opt in self.opts.items()}
