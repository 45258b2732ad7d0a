"""GpuWorker actor: streams layer units through the GPU (or the CPU) for whole steps.

One ``run_step`` call runs a step's forward and backward over all its micro-batches,
layer-major: while a unit's weights are on the device every micro-batch passes through it,
so weights cross the host link a fixed number of times per step however many tokens it has.
No Ray call sits on the per-layer path: the worker orders itself against the optimizer
shards through the shared control words (``megaray.protocol``) alone.

A step reads: forward (embedding, then each block, saving its input); head (the chunked
loss and its gradient); backward (each block from its saved input, recomputed unless kept,
its fp32 gradient accumulated over the micro-batches on the device, then waiting there in
``optim.grad_dtype`` (its squared norm taken from the fp32 sum first); with
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
from megaray.clipping import clip_coefficient, square_norm
from megaray.config import RunConfig
from megaray.layout import bind
from megaray.model import (
    IGNORE_INDEX,
    Ropes,
    block_forward,
    embed_forward,
    head_loss_and_grads,
)
from megaray.step import Batch, StepResult, WorkerTimes

from .activations import ActivationPolicy
from .calls import actor_guard
from .device import Device, StepClock
from .forward_only import ForwardOnly
from .group import DataParallelGroup
from .resident import ResidentUnits
from .shipping import GradientShipper
from .staging import RelaySource, SharedSource, WeightSlots
from .step_state import KeptBlock, RouterTally, StepState


class GpuWorker(ForwardOnly):
    def __init__(self, cfg: RunConfig, handles: Handles, device: str, name: str, rank: int = 0, world: int = 1,
                 relay=None):
        torch.set_num_threads(cfg.worker.threads)
        fused.configure(cfg.worker.fuse_elementwise)
        self.cfg, self.h, self.name, self.mcfg = cfg, handles, name, cfg.model
        self.units, self.num_blocks = handles.units, cfg.model.num_hidden_layers
        cap = cfg.worker.gpu_memory_gib
        self.dev = Device(device, None if cap is None else int(cap * 2**30))
        self.group = DataParallelGroup(rank, world, self.dev, cfg.worker.wait_timeout_s)
        self.buf = None if relay is not None else RunBuffers(handles, kinds=("master", "compute", "ring", "control"))
        source = RelaySource(relay, self.dev) if relay is not None else SharedSource(cfg, handles, self.buf, self.dev)
        self.resident = ResidentUnits(cfg, handles, self.dev) if handles.resident else None
        self.slots = WeightSlots(cfg, handles, self.dev, source, self.resident)
        dtype = DTYPES[cfg.train.compute_dtype]
        self.acts = ActivationPolicy(cfg, self.dev, self.units[1].numel if self.num_blocks else 0, dtype,
                                     handles.slab_bytes if handles.cast_on_device else 0)
        self.shipper = GradientShipper(cfg, handles, self.dev, self.buf, relay)
        self.rope = Ropes(self.mcfg, self.mcfg.max_position_embeddings, self.dev.device, torch.float32)
        self.recompute_lean = memory.StepShape.of(cfg).recompute_lean

    def __repr__(self) -> str:
        """What the Ray dashboard's Actors view shows (Ray reads it once, when the actor starts)."""
        if not hasattr(self, "group"):                 # __init__ failed: Ray still asks, to report it
            return f"GpuWorker({self.name!r}, not started)"
        res = len(self.h.resident)
        return (f"GpuWorker(rank {self.group.rank} of {self.group.world} on {self.dev.device}, "
                f"{self.num_blocks - res} blocks of "
                f"{self.units[1].numel / 1e6 if self.num_blocks else 0:.1f}M params streamed"
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
    def run_step(self, step: int, batch: Batch, total_tokens: int | None = None) -> StepResult:
        """Forward and backward of one step over ``batch`` [micro_batches, rows, seq + 1]: the
        whole step's, or with several workers this worker's share of its micro-batches and the
        count of target tokens in the whole step (the loss is divided by it)."""
        with actor_guard(self.name, step, self.shipper.abort, cause=self.shipper.error):
            return self._run_step(step, batch, total_tokens)

    def _run_step(self, step: int, batch: Batch, total_tokens: int | None) -> StepResult:
        t_start = time.perf_counter()
        self.shipper.check_previous()           # raise the previous step's copy-out failure, if any
        if self.dev.cuda:
            torch.cuda.reset_peak_memory_stats(self.dev.device)
        st = self._begin(step, batch, total_tokens)
        self._forward(st)
        self._head(st)
        self._backward(st)
        res = self._decide_and_ship(st)

        self.dev.wait_compute_and_copy_in()          # for the events' times; copy-out runs on
        st.clock.add_gpu_time(st.times)
        st.times += self.shipper.finished_stats()    # the previous step's copy-out (during this forward)
        res.kept_blocks, res.kept_block_bytes = self.num_blocks - st.keep_from, self.acts.kept_block_bytes
        res.kept_plain, res.offloaded_inputs, res.input_stride = not st.lean, st.offloaded, self.acts.stride
        res.worker_s = time.perf_counter() - t_start
        if self.dev.cuda:
            res.fused_elementwise = fused.active()      # false: off, or compiling failed (logged)
            res.gpu_peak_bytes = torch.cuda.max_memory_allocated(self.dev.device)
            self.acts.adapt(res.gpu_peak_bytes)
        return res

    def _begin(self, step: int, batch: Batch, total_tokens: int | None) -> StepState:
        """The step's inputs and targets on the device, and what the activation policy keeps."""
        inputs, targets, packs = self._inputs_targets(batch)
        tokens = int((targets != IGNORE_INDEX).sum()) if total_tokens is None else total_tokens
        policy = self.acts
        keep_from = self.num_blocks - policy.keep_count()
        router = (RouterTally.empty(self.num_blocks, self.mcfg.num_experts, self.dev.device) if self.mcfg.moe
                  else None)
        return StepState(step=step, inputs=inputs, targets=targets, packs=packs, inv_tokens=1.0 / max(tokens, 1),
                         tokens=tokens, times=WorkerTimes(), clock=StepClock(self.dev), num_units=len(self.units),
                         keep_from=keep_from, offloaded=policy.offload_count(keep_from), lean=policy.lean,
                         order=memory.recompute_order(keep_from, policy.stride), router=router)

    def _forward(self, st: StepState) -> None:
        """Embedding and blocks, saving each block's input (every stride-th recomputed block's);
        the last blocks keep their internals."""
        t0 = time.perf_counter()
        units, blocks, micro = len(self.units), self.num_blocks, st.micro_batches
        slots, policy, times, clock = self.slots, self.acts, st.times, st.clock
        slots.begin()
        slots.ready(slots.stage(0, st.step, times, clock), times)
        st.staged = slots.stage(1 if blocks else units - 1, st.step, times, clock)
        acts = st.acts = [[None] * micro for _ in range(blocks + 1)]
        mlp_chunk = self.cfg.train.mlp_chunk_tokens
        with torch.no_grad(), clock.span(0):
            _, we = slots.weights(0, grad=False)
            for m in range(micro):
                acts[0][m] = embed_forward(we, st.inputs[m], self.mcfg)
        for i in range(blocks):
            u = i + 1
            slots.ready(st.staged, times)
            st.staged = slots.stage(u + 1, st.step, times, clock)       # next block, or the head
            routed = [] if st.router is not None else None
            if i < st.keep_from:
                with torch.no_grad(), clock.span(u):
                    _, w = slots.weights(u, grad=False)
                    for m in range(micro):
                        acts[i + 1][m] = block_forward(w, acts[i][m], self.rope, self.mcfg, mlp_chunk,
                                                       pk=st.packs[m], routed=routed, layer=i)
                if i % policy.stride:       # rebuilt in the backward, from the saved input below
                    acts[i] = [None] * micro
                elif i < st.offloaded:
                    policy.host_buffer(st.offloaded, acts[i][0], micro)
                    policy.offload(i, acts, times)
            else:
                # Keep this block's internals (and a private copy of its weights, since
                # the slot is refilled) so its backward needs no recomputation.
                buf = policy.kept_buffer(i - st.keep_from)
                pairs = []
                before = self.dev.memory_allocated()
                with torch.enable_grad(), clock.span(u):
                    buf.copy_(slots.flat(u))
                    flat = buf.detach().requires_grad_()
                    w = bind(flat, self.units[u])
                    for m in range(micro):
                        x = acts[i][m].detach().requires_grad_()
                        y = block_forward(w, x, self.rope, self.mcfg, mlp_chunk, lean=st.lean, pk=st.packs[m],
                                          routed=routed, layer=i)
                        pairs.append((x, y))
                        acts[i + 1][m] = y.detach()
                st.kept[i] = KeptBlock(flat, w, pairs, [r.prob_sum for r in routed or ()])
                policy.measure_kept_block(before, buf)
            if routed is not None:
                st.router.add(i, routed)
            slots.release(u)
        if st.router is not None:       # the step's routing, whole: the load-balancing loss's gradient
            with clock.span(-1):
                if self.group.world > 1:
                    self.group.sum([st.router.counts, st.router.probs])
                st.router.decide(self.mcfg, self.group.world)
        times.forward_s += time.perf_counter() - t0

    def _head(self, st: StepState) -> None:
        """The chunked loss, the head's gradient, and the gradient into the last block's output."""
        t0 = time.perf_counter()
        head, blocks, slots = len(self.units) - 1, self.num_blocks, self.slots
        slots.ready(st.staged, st.times)
        if blocks and st.keep_from == blocks:   # the backward's first block (still in its slot from the forward)
            st.staged = slots.stage(st.order[0][0] + 1, st.step, st.times, st.clock)
        tied = self.mcfg.tie_word_embeddings
        g_head = self.dev.zeros(self.units[head].numel)
        st.g_embed = self.dev.zeros(self.units[0].numel)
        st.loss_sum = torch.zeros((), dtype=torch.float64, device=self.dev.device)
        st.dys = [None] * st.micro_batches
        chunk = self.cfg.train.loss_chunk_tokens
        with st.clock.span(head):
            head_flat, wh = slots.weights(head, grad=True)
            emb_flat, we = slots.weights(0, grad=True) if tied else (None, None)
            for m in range(st.micro_batches):
                x = st.acts[blocks][m]
                st.acts[blocks][m] = None
                b, s, hdim = x.shape
                xf, tf = x.reshape(b * s, hdim), st.targets[m].reshape(b * s)
                dx = torch.empty_like(xf)
                for c in range(0, b * s, chunk):
                    xc = xf[c:c + chunk].detach().requires_grad_()
                    ins = [head_flat, xc] + ([emb_flat] if tied else [])
                    loss, gs = head_loss_and_grads(wh, we, xc, tf[c:c + chunk], self.mcfg, st.inv_tokens, ins)
                    g_head += gs[0]
                    dx[c:c + chunk] = gs[1]
                    if tied:
                        st.g_embed += gs[2]
                    st.loss_sum += loss.detach().double()
                st.dys[m] = dx.view(b, s, hdim)
        slots.release(head)
        self._gradient_done(st, head, g_head)
        st.times.head_s += time.perf_counter() - t0

    def _backward(self, st: StepState) -> None:
        """The blocks in reverse: the kept ones from their saved internals, then the others
        in ``memory.recompute_order`` (each recomputed from its input, rebuilt first where it
        was not saved); then the embedding's lookup gradient (plus the tied head's
        contribution)."""
        t0 = time.perf_counter()
        slots, policy, acts, dys, order = self.slots, self.acts, st.acts, st.dys, st.order
        mlp_chunk = self.cfg.train.mlp_chunk_tokens
        # the first recomputed segment's saved input comes back from host memory first
        fetched = policy.fetch(order[0][0], acts) if order and order[0][0] < st.offloaded else None
        for i in reversed(range(st.keep_from, self.num_blocks)):
            u = i + 1
            kept = st.kept.pop(i)
            if i == st.keep_from and order:
                st.staged = slots.stage(order[0][0] + 1, st.step, st.times, st.clock)   # the first recomputed
            with st.clock.span(u):
                g = self.dev.zeros(self.units[u].numel)
                for m, (x, y) in enumerate(kept.pairs):
                    aux = (kept.probs[m], st.router.grad) if kept.probs else None
                    dys[m] = self._block_backward(self.units[u], kept.weights, y, x, dys[m], g, aux)
                    acts[i][m] = None
            del kept
            self._gradient_done(st, u, g)
            del g                               # (rounded, the fp32 sum goes now)
        for k, (i, with_grad, _) in enumerate(order):
            u = i + 1
            slots.ready(st.staged, st.times)
            after = order[k + 1] if k + 1 < len(order) else None
            if after is not None:
                st.staged = slots.stage(after[0] + 1, st.step, st.times, st.clock)
            self.dev.compute_waits(fetched)
            # the next segment's saved input, if it waits in host memory: back one pass ahead
            fetched = (policy.fetch(after[0], acts) if after is not None and after[2] and after[0] < st.offloaded
                       else None)
            if not with_grad:                   # rebuild the input of the block above
                with torch.no_grad(), st.clock.span(u):
                    _, w = slots.weights(u, grad=False)
                    for m in range(st.micro_batches):
                        acts[i + 1][m] = block_forward(w, acts[i][m], self.rope, self.mcfg, mlp_chunk,
                                                       pk=st.packs[m], layer=i)
                slots.release(u)
                continue
            with st.clock.span(u):
                g = self.dev.zeros(self.units[u].numel)
                _, w = slots.weights(u, grad=True)
                for m in range(st.micro_batches):
                    x = acts[i][m].detach().requires_grad_()
                    acts[i][m] = None
                    routed = [] if st.router is not None else None
                    with torch.enable_grad():
                        y = block_forward(w, x, self.rope, self.mcfg, mlp_chunk, lean=self.recompute_lean,
                                          pk=st.packs[m], routed=routed, layer=i)
                        aux = (routed[0].prob_sum, st.router.grad) if routed else None
                        dys[m] = self._block_backward(self.units[u], w, y, x, dys[m], g, aux)
            slots.release(u)
            self._gradient_done(st, u, g)
            del g
        with st.clock.span(0):
            emb_flat, we = slots.weights(0, grad=True)
            for m in range(st.micro_batches):
                with torch.enable_grad():
                    y = embed_forward(we, st.inputs[m], self.mcfg)
                    (gw,) = torch.autograd.grad(y, [emb_flat], grad_outputs=dys[m])
                st.g_embed += gw
        slots.release(0)
        g, st.g_embed = st.g_embed, None
        self._gradient_done(st, 0, g)
        st.times.backward_s += time.perf_counter() - t0

    def _gradient_done(self, st: StepState, u: int, g: torch.Tensor) -> None:
        """Unit u's gradient of the step is final: it is summed over the data-parallel workers,
        then waits on the device for the norm (``optim.grad_placement`` device: in bf16 with
        ``optim.grad_dtype`` bfloat16, its squared norm taken from the fp32 sum first), or,
        its squared norm taken, leaves for host memory at once (host)."""
        if self.group.world > 1:
            with st.clock.span(-1):
                self.group.sum([g])
        if not self.shipper.host:
            if self.shipper.rounds:
                with st.clock.span(-1):     # the norm from the fp32 sum, then it waits rounded
                    st.sq[u] = square_norm(g)
                    g = g.to(self.shipper.grad_dtype)
            st.grads[u] = g
            return
        with st.clock.span(-1):
            st.sq[u] = square_norm(g)
        if self.resident is not None and u in self.resident:
            st.grads[u] = g                             # stays for the worker's own update
        elif self.group.rank == 0:
            self.shipper.ship_unit(st.step, u, g, st.sq[u])

    def _block_backward(self, unit, w: dict, y: torch.Tensor, x: torch.Tensor, dy: torch.Tensor,
                        g: torch.Tensor, aux: tuple | None = None) -> torch.Tensor:
        """Backward of one block: each weight's gradient, taken at its own view (autograd never
        scatters it into a zero-filled flat tensor), added into the unit's flat fp32 ``g``;
        returns the gradient of the block's input. ``aux``: a mixture of experts' summed router
        probabilities of this forward and the load-balancing loss's gradient for them (None
        where the loss is not trained), which enters the same backward."""
        views = list(w.values())
        outs, douts = [y], [dy]
        if aux is not None and aux[1] is not None:
            outs.append(aux[0])
            douts.append(aux[1])
        out = torch.autograd.grad(outs, views + [x], grad_outputs=douts)
        for v, gv in zip(unit.views, out[:-1]):
            g[v.offset:v.offset + v.numel] += gv.reshape(-1)
        return out[-1]

    def _decide_and_ship(self, st: StepState) -> StepResult:
        """The global norm (summed over the data-parallel workers first), the verdict, exact
        clipping, and the gradients' way out (rank 0 only)."""
        t0 = time.perf_counter()
        host, clock = self.shipper.host, st.clock
        if self.group.world > 1:
            with clock.span(-1):
                self.group.sum([], st.loss_sum)
        sq = st.sq
        if not host:                        # a gradient waiting rounded had its norm taken before
            with clock.span(-1):
                sq = [square_norm(g) if s is None else s for g, s in zip(st.grads, st.sq)]
        sq = torch.stack(sq).cpu()                          # waits for the backward to finish
        loss_total = float(st.loss_sum)
        norm = math.sqrt(float(sq.sum()))
        finite = math.isfinite(norm) and math.isfinite(loss_total)
        coef = clip_coefficient(norm, self.cfg.optim.clip_grad_norm) if finite else 0.0
        if self.group.rank == 0:            # rank 0 decides the step and ships the (identical) sum
            if host:
                self.shipper.decide(st.step, finite, coef)
            elif finite:
                self.shipper.ship(st.step, st.grads, coef, clock)
            else:
                self.shipper.skip(st.step)
        if self.resident is not None:
            t1 = time.perf_counter()
            finite_units = {u: math.isfinite(float(sq[u])) for u in self.resident.units} if host else {}
            with clock.span(-1):
                self.resident.update(st.step, st.grads, finite, self.shipper.readers_coef(coef), finite_units)
            st.times.resident_update_s += time.perf_counter() - t1
        st.times.reduce_s += time.perf_counter() - t0
        res = StepResult(loss_sum=loss_total, tokens=st.tokens, grad_norm=norm, clip_coef=coef, applied=finite,
                         times=st.times)
        if st.router is not None:
            res.router_loss = st.router.loss(self.mcfg)
            res.expert_load_max, res.expert_load_mean = st.router.load()
        return res

    def _inputs_targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Inputs and targets of a batch: targets the loss leaves out (``Batch.targets_kept``)
        become IGNORE_INDEX; and each micro-batch's Packing (None for causal attention)."""
        toks = torch.tensor(np.asarray(batch.tokens), dtype=torch.int64).to(self.dev.device)
        targets = toks[..., 1:]
        keep = batch.targets_kept()
        if keep is not None:
            targets = targets.masked_fill(~torch.from_numpy(keep).to(self.dev.device), IGNORE_INDEX)
        packs = [None] * toks.shape[0]
        if batch.doc is not None:
            d = torch.from_numpy(np.asarray(batch.doc)[..., :-1]).to(self.dev.device)
            packs = [packing(d[m], self.mcfg.head_dim, self.mcfg.local_window) for m in range(d.shape[0])]
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
        scratch = WorkerTimes()
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
