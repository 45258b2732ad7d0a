"""GpuWorker actor: streams layer units through the GPU (or the CPU) for whole steps.

One ``run_step`` call runs a step's forward and backward over all its micro-batches,
layer-major: while a unit's weights are on the device every micro-batch passes through it,
so weights cross the host link a fixed number of times per step however many tokens it has.
No Ray call sits on the per-layer path: the worker orders itself against the optimizer
shards through the shared control words (``megaray.protocol``) alone.

A step reads: forward (embedding, then each block, saving its input); head (the chunked
loss and its gradient); backward (each block from its saved input, recomputed unless kept,
its fp32 gradient accumulated over the micro-batches on the device; with
``worker.input_stride`` S > 1 only every S-th block's input is saved, and the blocks above
it run forward again to rebuild the others': ``memory.recompute_order``); decide and ship (the
global norm, the verdict, exact clipping, copy-out). The concerns live beside this file:
``staging`` (the double-buffered weight slots and where weights come from), ``activations``
(what is kept, recomputed or offloaded), ``shipping`` (the verdict and the gradients'
way out), ``device`` (streams, events, the step's clock), ``group`` (data parallelism) and
``forward_only`` (the evaluation loss and logits, outside training steps).

The loss is a token sum computed in chunks and scaled by 1/(tokens in the step), so
accumulation over micro-batches equals one big batch exactly.

Several workers (``worker.count``): each runs its share of the step's micro-batches with
the whole step's token count, all-reduces every unit's gradient and the loss before the
norm, and only rank 0 publishes the verdict and ships. Test hooks (injected faults, forced
non-finite steps, kept gradients) live in ``actors.debug``'s subclass, not here.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext

import numpy as np
import torch

from megaray import fused, memory
from megaray.attention import packing
from megaray.buffers import DTYPES, Handles, RunBuffers
from megaray.config import RunConfig
from megaray.data import split_batch, targets_kept
from megaray.errors import ActorFailure, RunAborted
from megaray.layout import bind
from megaray.model import (
    IGNORE_INDEX,
    block_forward,
    embed_forward,
    head_loss_and_grads,
    rope_tables,
)
from megaray.schedule import clip_coefficient, square_norm

from .activations import ActivationPolicy
from .device import Device, StepClock, StepTimer
from .forward_only import ForwardOnly
from .group import DataParallelGroup
from .resident import ResidentUnits
from .shipping import GradientShipper
from .staging import RelaySource, SharedSource, WeightSlots


class GpuWorker(ForwardOnly):
    def __init__(self, cfg: RunConfig, handles: Handles, device: str, name: str, rank: int = 0, world: int = 1,
                 relay=None):
        torch.set_num_threads(cfg.worker.threads)
        fused.configure(cfg.worker.fuse_elementwise)
        self.cfg, self.h, self.name, self.mcfg = cfg, handles, name, cfg.model
        self.units, self.L = handles.units, cfg.model.num_hidden_layers
        cap = cfg.worker.gpu_memory_gib
        self.dev = Device(device, None if cap is None else int(cap * 2**30))
        self.group = DataParallelGroup(rank, world, self.dev, cfg.worker.wait_timeout_s)
        self.buf = None if relay is not None else RunBuffers(handles, kinds=("master", "compute", "ring", "control"))
        source = RelaySource(relay, self.dev) if relay is not None else SharedSource(cfg, handles, self.buf, self.dev)
        self.resident = ResidentUnits(cfg, handles, self.dev) if handles.resident else None
        self.slots = WeightSlots(cfg, handles, self.dev, source, self.resident)
        dtype = DTYPES[cfg.train.compute_dtype]
        self.acts = ActivationPolicy(cfg, self.dev, self.units[1].numel if self.L else 0, dtype,
                                     handles.slab_bytes if handles.cast_on_device else 0)
        self.shipper = GradientShipper(cfg, handles, self.dev, self.buf, relay)
        self.rope = rope_tables(self.mcfg, self.mcfg.max_position_embeddings, self.dev.device, torch.float32)
        self.recompute_lean = memory.StepShape.of(cfg).recompute_lean

    def __repr__(self) -> str:
        """What the Ray dashboard's Actors view shows (Ray reads it once, when the actor starts)."""
        if not hasattr(self, "group"):                 # __init__ failed: Ray still asks, to report it
            return f"GpuWorker({self.name!r}, not started)"
        res = len(self.h.resident)
        return (f"GpuWorker(rank {self.group.rank} of {self.group.world} on {self.dev.device}, "
                f"{self.L - res} blocks of {self.units[1].numel / 1e6 if self.L else 0:.1f}M params streamed"
                + (f", {res} resident)" if res else ")"))

    def close(self) -> None:
        """End the copy threads (the session calls this before the actor exits)."""
        self.slots.copy_in.shutdown(wait=True)
        self.shipper.close()
        self.acts.free_host_buffer()
        if self.resident is not None:
            self.resident.close()

    # ------------------------------------------------------------------ data parallel
    def rendezvous(self) -> tuple[str, int]:
        return self.group.rendezvous()

    def join_group(self, addr: str, port: int) -> None:
        self.group.join(addr, port)

    # ------------------------------------------------------------------ steps
    def run_step(self, step: int, tokens: np.ndarray, total_tokens: int | None = None) -> dict:
        """Forward and backward of one step over tokens [micro_batches, batch, seq + 1]: the
        whole step's, or with several workers this worker's share of its micro-batches and the
        count of target tokens in the whole step (the loss is divided by it)."""
        try:
            return self._run_step(step, tokens, total_tokens)
        except RunAborted as e:
            why = self.shipper.error()
            raise ActorFailure(self.name, why or str(e), step, aborted=why is None) from None
        except Exception as e:
            self.shipper.abort()
            raise ActorFailure(self.name, f"{type(e).__name__}: {e}", step) from e

    def _run_step(self, step: int, tokens: np.ndarray, total_tokens: int | None) -> dict:
        t_start = time.perf_counter()
        self.shipper.check_previous()           # raise the previous step's copy-out failure, if any
        timer, clock = StepTimer(), StepClock(self.dev)
        if self.dev.cuda:
            torch.cuda.reset_peak_memory_stats(self.dev.device)
        inputs, targets, packs = self._inputs_targets(tokens)
        n_tokens = int((targets != IGNORE_INDEX).sum()) if total_tokens is None else total_tokens
        inv_n = 1.0 / max(n_tokens, 1)

        grads: list = [None] * len(self.units)
        sq: list = [None] * len(self.units)          # each unit's squared gradient norm, on the device
        acts, kept, nxt = self._forward(step, inputs, packs, timer, clock)
        dys, g_embed, loss_sum, nxt = self._head(step, acts, kept, targets, inv_n, nxt, grads, sq, timer, clock)
        self._backward(step, inputs, acts, kept, dys, g_embed, nxt, grads, sq, timer, clock)
        out = self._decide_and_ship(step, grads, sq, loss_sum, timer, clock)

        self.dev.wait_compute_and_copy_in()          # for the events' times; copy-out runs on
        for k, v in clock.gpu_time().items():
            timer.add(k, v)
        out.update(tokens=n_tokens, kept_blocks=self.L - kept["keep_from"], kept_block_bytes=self.acts.kept_block_bytes,
                   kept_plain=float(not kept["lean"]), offloaded_inputs=kept["offloaded"],
                   input_stride=self.acts.stride,
                   worker_s=time.perf_counter() - t_start)
        out.update(timer.t)
        for k, v in self.shipper.finished_stats().items():   # the previous step's copy-out (during this forward)
            out[k] = out.get(k, 0.0) + v
        if self.dev.cuda:
            out["fused_elementwise"] = float(fused.active())     # false: off, or compiling failed (logged)
            out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(self.dev.device)
            self.acts.adapt(out["gpu_peak_bytes"])
        return out

    def _forward(self, step: int, inputs, packs: list, timer: StepTimer, clock: StepClock):
        """Embedding and blocks, saving each block's input (every stride-th recomputed block's);
        the last blocks keep their internals."""
        t0 = time.perf_counter()
        U, L, M = len(self.units), self.L, inputs.shape[0]
        slots, acts_policy = self.slots, self.acts
        slots.begin()
        slots.ready(slots.stage(0, step, timer, clock), timer)
        nxt = slots.stage(1 if L else U - 1, step, timer, clock)
        acts: list[list[torch.Tensor]] = [[None] * M for _ in range(L + 1)]
        keep_from = L - acts_policy.keep_count()
        n_off = acts_policy.offload_count(keep_from)
        stride = acts_policy.stride
        # blocks: block -> (flat, views, [(x, y)]); packs: each micro-batch's documents, for the
        # recomputation; order: the backward's passes over the recomputed blocks
        kept = {"blocks": {}, "keep_from": keep_from, "offloaded": n_off, "packs": packs, "lean": acts_policy.lean,
                "order": memory.recompute_order(keep_from, stride)}
        mlp_chunk = self.cfg.train.mlp_chunk_tokens
        with torch.no_grad(), clock.span(0):
            _, we = slots.weights(0, grad=False)
            for m in range(M):
                acts[0][m] = embed_forward(we, inputs[m])
        for i in range(L):
            u = i + 1
            slots.ready(nxt, timer)
            nxt = slots.stage(u + 1, step, timer, clock)           # next block, or the head
            if i < keep_from:
                with torch.no_grad(), clock.span(u):
                    _, w = slots.weights(u, grad=False)
                    for m in range(M):
                        acts[i + 1][m] = block_forward(w, acts[i][m], self.rope, self.mcfg, mlp_chunk,
                                                       pk=packs[m])
                if i % stride:              # rebuilt in the backward, from the saved input below
                    acts[i] = [None] * M
                elif i < n_off:
                    acts_policy.host_buffer(n_off, acts[i][0], M)
                    acts_policy.offload(i, acts, timer)
            else:
                # Keep this block's internals (and a private copy of its weights, since
                # the slot is refilled) so its backward needs no recomputation.
                buf = acts_policy.kept_buffer(i - keep_from)
                pairs = []
                before = self.dev.memory_allocated()
                with torch.enable_grad(), clock.span(u):
                    buf.copy_(slots.flat(u))
                    flat = buf.detach().requires_grad_()
                    w = bind(flat, self.units[u])
                    for m in range(M):
                        x = acts[i][m].detach().requires_grad_()
                        y = block_forward(w, x, self.rope, self.mcfg, mlp_chunk, lean=acts_policy.lean,
                                          pk=packs[m])
                        pairs.append((x, y))
                        acts[i + 1][m] = y.detach()
                kept["blocks"][i] = (flat, w, pairs)
                acts_policy.measure_kept_block(before, buf)
            slots.release(u)
        timer.add("forward_s", time.perf_counter() - t0)
        return acts, kept, nxt

    def _head(self, step: int, acts: list, kept: dict, targets, inv_n: float, nxt, grads: list, sq: list,
              timer: StepTimer, clock: StepClock):
        """The chunked loss, the head's gradient, and the gradient into the last block's output."""
        t0 = time.perf_counter()
        U, L, M = len(self.units), self.L, len(acts[0])
        slots = self.slots
        slots.ready(nxt, timer)
        if L and kept["keep_from"] == L:      # the backward's first block (still in its slot from the forward)
            nxt = slots.stage(kept["order"][0][0] + 1, step, timer, clock)
        tied = self.mcfg.tie_word_embeddings
        g_head = self.dev.zeros(self.units[-1].numel)
        g_embed = self.dev.zeros(self.units[0].numel)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.dev.device)
        dys: list[torch.Tensor] = [None] * M
        chunk = self.cfg.train.loss_chunk_tokens
        with clock.span(U - 1):
            head_flat, wh = slots.weights(U - 1, grad=True)
            emb_flat, we = slots.weights(0, grad=True) if tied else (None, None)
            for m in range(M):
                x = acts[L][m]
                acts[L][m] = None
                b, s, hdim = x.shape
                xf, tf = x.reshape(b * s, hdim), targets[m].reshape(b * s)
                dx = torch.empty_like(xf)
                for c in range(0, b * s, chunk):
                    xc = xf[c:c + chunk].detach().requires_grad_()
                    ins = [head_flat, xc] + ([emb_flat] if tied else [])
                    loss, gs = head_loss_and_grads(wh, we, xc, tf[c:c + chunk], self.mcfg, inv_n, ins)
                    g_head += gs[0]
                    dx[c:c + chunk] = gs[1]
                    if tied:
                        g_embed += gs[2]
                    loss_sum += loss.detach().double()
                dys[m] = dx.view(b, s, hdim)
        slots.release(U - 1)
        self._gradient_done(step, U - 1, g_head, grads, sq, clock)
        timer.add("head_s", time.perf_counter() - t0)
        return dys, g_embed, loss_sum, nxt

    def _backward(self, step: int, inputs, acts: list, kept: dict, dys: list, g_embed, nxt, grads: list, sq: list,
                  timer: StepTimer, clock: StepClock) -> None:
        """The blocks in reverse: the kept ones from their saved internals, then the others
        in ``memory.recompute_order`` (each recomputed from its input, rebuilt first where it
        was not saved); then the embedding's lookup gradient (plus the tied head's
        contribution)."""
        t0 = time.perf_counter()
        L, M = self.L, len(dys)
        slots, policy = self.slots, self.acts
        keep_from, n_off, order = kept["keep_from"], kept["offloaded"], kept["order"]
        mlp_chunk = self.cfg.train.mlp_chunk_tokens
        # the first recomputed segment's saved input comes back from host memory first
        fetched = policy.fetch(order[0][0], acts) if order and order[0][0] < n_off else None
        for i in reversed(range(keep_from, L)):
            u = i + 1
            flat, w, pairs = kept["blocks"].pop(i)
            if i == keep_from and order:
                nxt = slots.stage(order[0][0] + 1, step, timer, clock)   # the first recomputed block
            with clock.span(u):
                g = self.dev.zeros(self.units[u].numel)
                for m, (x, y) in enumerate(pairs):
                    dys[m] = self._block_backward(self.units[u], w, y, x, dys[m], g)
                    acts[i][m] = None
            del pairs, flat, w
            self._gradient_done(step, u, g, grads, sq, clock)
        for k, (i, with_grad, _) in enumerate(order):
            u = i + 1
            slots.ready(nxt, timer)
            after = order[k + 1] if k + 1 < len(order) else None
            if after is not None:
                nxt = slots.stage(after[0] + 1, step, timer, clock)
            self.dev.compute_waits(fetched)
            # the next segment's saved input, if it waits in host memory: back one pass ahead
            fetched = policy.fetch(after[0], acts) if after is not None and after[2] and after[0] < n_off else None
            if not with_grad:                   # rebuild the input of the block above
                with torch.no_grad(), clock.span(u):
                    _, w = slots.weights(u, grad=False)
                    for m in range(M):
                        acts[i + 1][m] = block_forward(w, acts[i][m], self.rope, self.mcfg, mlp_chunk,
                                                       pk=kept["packs"][m])
                slots.release(u)
                continue
            with clock.span(u):
                g = self.dev.zeros(self.units[u].numel)
                _, w = slots.weights(u, grad=True)
                for m in range(M):
                    x = acts[i][m].detach().requires_grad_()
                    acts[i][m] = None
                    with torch.enable_grad():
                        y = block_forward(w, x, self.rope, self.mcfg, mlp_chunk, lean=self.recompute_lean,
                                          pk=kept["packs"][m])
                        dys[m] = self._block_backward(self.units[u], w, y, x, dys[m], g)
            slots.release(u)
            self._gradient_done(step, u, g, grads, sq, clock)
        with clock.span(0):
            emb_flat, we = slots.weights(0, grad=True)
            for m in range(M):
                with torch.enable_grad():
                    y = embed_forward(we, inputs[m])
                    (gw,) = torch.autograd.grad(y, [emb_flat], grad_outputs=dys[m])
                g_embed += gw
        slots.release(0)
        self._gradient_done(step, 0, g_embed, grads, sq, clock)
        timer.add("backward_s", time.perf_counter() - t0)

    def _gradient_done(self, step: int, u: int, g: torch.Tensor, grads: list, sq: list, clock: StepClock) -> None:
        """Unit u's gradient of the step is final: it is summed over the data-parallel workers,
        then waits on the device for the norm (``optim.grad_placement`` device), or, its
        squared norm taken, leaves for host memory at once (host)."""
        if self.group.world > 1:
            with clock.span(-1):
                self.group.sum([g])
        if not self.shipper.host:
            grads[u] = g
            return
        with clock.span(-1):
            sq[u] = square_norm(g)
        if self.resident is not None and u in self.resident:
            grads[u] = g                                # stays for the worker's own update
        elif self.group.rank == 0:
            self.shipper.ship_unit(step, u, g, sq[u])

    def _block_backward(self, unit, w: dict, y: torch.Tensor, x: torch.Tensor, dy: torch.Tensor,
                        g: torch.Tensor) -> torch.Tensor:
        """Backward of one block: each weight's gradient, taken at its own view (autograd never
        scatters it into a zero-filled flat tensor), added into the unit's flat fp32 ``g``;
        returns the gradient of the block's input."""
        views = list(w.values())
        out = torch.autograd.grad(y, views + [x], grad_outputs=dy)
        for spec, gv in zip(unit.params, out[:-1]):
            g[spec.offset:spec.offset + spec.numel] += gv.reshape(-1)
        return out[-1]

    def _decide_and_ship(self, step: int, grads: list, sq: list, loss_sum: torch.Tensor, timer: StepTimer,
                         clock: StepClock) -> dict:
        """The global norm (summed over the data-parallel workers first), the verdict, exact
        clipping, and the gradients' way out (rank 0 only)."""
        t0 = time.perf_counter()
        host = self.shipper.host
        if self.group.world > 1:
            with clock.span(-1):
                self.group.sum([], loss_sum)
        if not host:
            with clock.span(-1):
                sq = [square_norm(g) for g in grads]
        sq = torch.stack(sq).cpu()                          # waits for the backward to finish
        loss_total = float(loss_sum)
        norm = math.sqrt(float(sq.sum()))
        finite = math.isfinite(norm) and math.isfinite(loss_total)
        coef = clip_coefficient(norm, self.cfg.optim.clip_grad_norm) if finite else 0.0
        if self.group.rank == 0:            # rank 0 decides the step and ships the (identical) sum
            if host:
                self.shipper.decide(step, finite, coef)
            elif finite:
                self.shipper.ship(step, grads, coef, clock)
            else:
                self.shipper.skip(step)
        if self.resident is not None:
            t1 = time.perf_counter()
            finite_units = {u: math.isfinite(float(sq[u])) for u in self.resident.units} if host else {}
            with clock.span(-1):
                self.resident.update(step, grads, finite, coef, finite_units)
            timer.add("resident_update_s", time.perf_counter() - t1)
        timer.add("reduce_s", time.perf_counter() - t0)
        return {"loss_sum": loss_total, "grad_norm": norm, "clip_coef": coef, "applied": finite}

    def _inputs_targets(self, batch) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Inputs and targets of a batch [micro_batches, batch, seq + 1] (a token array, or
        tokens with a loss mask and, with document attention, each token's document):
        targets the loss leaves out (``data.targets_kept``) become IGNORE_INDEX; and each
        micro-batch's Packing (None for causal attention)."""
        tokens, _, doc = split_batch(batch)
        toks = torch.tensor(np.asarray(tokens), dtype=torch.int64).to(self.dev.device)
        targets = toks[..., 1:]
        keep = targets_kept(batch)
        if keep is not None:
            targets = targets.masked_fill(~torch.from_numpy(keep).to(self.dev.device), IGNORE_INDEX)
        packs = [None] * toks.shape[0]
        if doc is not None:
            d = torch.from_numpy(np.asarray(doc)[..., :-1]).to(self.dev.device)
            packs = [packing(d[m], self.mcfg.head_dim) for m in range(d.shape[0])]
        return toks[..., :-1], targets, packs

    # ------------------------------------------------------------------ outside training steps
    def resident_masters(self) -> dict[int, np.ndarray]:
        """The resident units' fp32 masters by unit (none without resident units)."""
        return {u: t.numpy() for u, t in self.resident.masters().items()} if self.resident is not None else {}

    def save_resident(self, folder: str) -> dict:
        """The resident units' masters and moments as a checkpoint part (none without resident units)."""
        return self.resident.save(folder) if self.resident is not None else {}

    def load_resident(self, folder: str) -> None:
        """The resident units' state from a checkpoint."""
        if self.resident is not None:
            self.resident.load(folder)

    def resident_state(self) -> dict:
        """Adam state of the resident pieces by (unit, start) (tests)."""
        return self.resident.optimizer_state() if self.resident is not None else {}

    def link_speed(self, repeats: int = 5) -> dict:
        """Copy-in and copy-out bandwidth of the pinned buffers measured alone (nothing else
        running): every block's weights host->device as a step streams them (the compute
        copy, or the fp32 master cast on the device), and every block's fp32 gradient
        device->host as a step sends it (slab-sized pieces into the gradient ring, or whole
        units into the host gradient buffer, rounded to ``optim.grad_dtype``). Benchmarks;
        call between steps."""
        units = ([self.units[u] for u in self.h.streamed if self.units[u].kind == "block"]
                 or [self.units[u] for u in self.h.streamed])
        dst = self.slots.slots["block0"]

        def timed(fn) -> float:
            fn()                                            # warm-up
            self.dev.synchronize()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            self.dev.synchronize()
            return (time.perf_counter() - t0) / repeats

        self.slots.forget("block0")                         # its contents are overwritten below
        scratch = StepTimer()
        t_in = timed(lambda: [self.slots.copy_in_range(dst[: u.numel], self.buf.compute(u.index), scratch, None)
                              for u in units])
        if self.shipper.host:                               # the units' own regions (overwritten by the next step)
            outs = [self.buf.grad(u.index) for u in units]
        else:                                               # the ring's slabs, round robin
            n_out = max(1, sum(u.numel for u in units) // self.h.slab_numel)
            outs = [self.buf.slab(k % self.h.ring_slabs) for k in range(n_out)]
        g = self.dev.zeros(max(o.numel() for o in outs))
        with torch.cuda.stream(self.dev.copy_stream) if self.dev.cuda else nullcontext():
            t_out = timed(lambda: [o.copy_(g[: o.numel()], non_blocking=True) for o in outs])
        bytes_in = sum(u.numel for u in units) * self.buf.compute(0).element_size()   # as they cross the link
        bytes_out = sum(o.numel() * o.element_size() for o in outs)
        return {"copy_in_gbps": bytes_in / t_in / 1e9, "copy_out_gbps": bytes_out / t_out / 1e9}
