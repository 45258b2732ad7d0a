"""GpuWorker actor: streams layer units through the GPU (or the CPU) for whole steps.

One ``run_step`` call runs a step's forward and backward over all its micro-batches,
layer-major: while a unit's weights are on the device every micro-batch passes through it,
so weights cross the host link a fixed number of times per step however many tokens it has.
No Ray call sits on the per-layer path: the worker orders itself against the optimizer
shards through the shared control words (``megaray.buffers``) alone.

Double buffering: block units alternate between two device buffers; the embedding and the
head have one each. While unit i computes, a copy thread stages unit i+1 into the other
buffer, piece by piece, each piece as soon as its ``version == step`` (a unit whose pieces
several shards update at once starts crossing the link before its last piece is done). On
CUDA the copies run on their own stream from pinned (cudaHostRegister'ed) shared memory and
compute waits on events; on the CPU the same thread schedule runs with plain copies, so CI
exercises the same ordering. With ``optim.compute_copy`` device there is no bf16 copy on
the host: the fp32 master crosses the link one slab at a time into a staging buffer and is
cast into the weight buffer on the copy stream.

Backward recomputes each block from its saved input, except the last K blocks, whose
internals (and a private device copy of their weights) stay resident from the forward:
K is ``worker.keep_activations`` or, when unset, what free GPU memory holds
(``megaray.memory``). Backward accumulates each unit's flat fp32 gradient over the
micro-batches on the device, and takes its squared norm there. When the backward ends the
global norm is known: the worker publishes the step's verdict (applied, or skipped when the
loss or norm is not finite), scales every gradient by the exact clip coefficient on the
device, and returns; a copy-out thread then streams the gradients, in forward order and in
slab-sized pieces, through the pinned gradient ring to the optimizer shards, while the next
step's forward begins (its first layers wait only for their own pieces' updates). The loss
is a token-sum computed in chunks and scaled by 1/(tokens in the step), so accumulation over
micro-batches equals one big batch exactly.

Time accounting: every compute region (a unit's forward, the head, a unit's backward) is
bracketed by events on the compute stream (wall clock on the CPU), so ``compute_s`` is the
GPU's busy time. The gaps between regions are the GPU idle inside a step; a gap before a
unit whose weights had to wait for the optimizer counts as optimizer wait (up to that wait),
the rest as waiting for copy-in or for kernel launches.

Several workers (``worker.count``): each runs its share of the step's micro-batches with
the whole step's token count, all-reduces every unit's gradient and the loss before the
norm, and only rank 0 publishes the verdict and ships. On another node than the store
(``worker.placement=remote``) a worker stages weights from the relay actor
(``actors.relay``) and hands its gradients to it, through Ray's object store.

Recomputation policy when ``worker.keep_activations`` is unset: the first step keeps what
the estimate in ``megaray.memory`` says fits; afterwards the worker measures what one kept
block really costs and the step's peak, and keeps more (or fewer) blocks to use the free
GPU memory less a margin.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from megaray.buffers import DTYPES, Handles, RunBuffers
from megaray.config import RunConfig
from megaray.data import split_batch
from megaray.errors import ActorFailure, InjectedFault, RunAborted
from megaray.memory import keep_blocks
from megaray.schedule import clip_coefficient
from megaray.model import (IGNORE_INDEX, bind, block_forward, embed_forward, head_loss_sum, rms_norm,
                           rope_tables)

from .calls import get_or_raise


class _Timer:
    def __init__(self):
        self.t = {}

    def add(self, key: str, dt: float) -> None:
        self.t[key] = self.t.get(key, 0.0) + dt


class GpuWorker:
    def __init__(self, cfg: RunConfig, handles: Handles, device: str, name: str, rank: int = 0, world: int = 1,
                 relay=None):
        self.cfg, self.h, self.name = cfg, handles, name
        self.rank, self.world = rank, world
        self.relay = relay      # a WeightRelay when this worker runs on another node than the store
        self.mcfg = cfg.model
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        torch.set_num_threads(cfg.worker.threads)
        self.buf = None if relay is not None else RunBuffers(handles, kinds=("master", "compute", "ring", "control"))
        self.dtype = DTYPES[cfg.train.compute_dtype]
        self.units = handles.units
        self.L = self.mcfg.num_hidden_layers
        if self.cuda:
            if relay is None:
                self._pin()
            self.copy_stream = torch.cuda.Stream(self.device)
            self.out_stream = torch.cuda.Stream(self.device)
            self.offload_stream = torch.cuda.Stream(self.device)
            self.compute_stream = torch.cuda.current_stream(self.device)
        # Device weight buffers: embedding, head, and two alternating block buffers.
        block_numel = self.units[1].numel if self.L else 0
        mk = lambda n: torch.empty(n, dtype=self.dtype, device=self.device)  # noqa: E731
        self.slots = {"embed": mk(self.units[0].numel), "head": mk(self.units[-1].numel),
                      "block0": mk(block_numel), "block1": mk(block_numel)}
        self.slot_unit = {k: -1 for k in self.slots}        # which unit a slot holds now
        self.slot_free = {k: None for k in self.slots}      # CUDA event: last compute that read it
        self._slot_step: dict[str, int] = {}                # the step whose weights a slot holds
        self.rope = rope_tables(self.mcfg, self.mcfg.max_position_embeddings, self.device, torch.float32)
        self._auto_keep: int | None = None
        self._kept_block_bytes = 0                  # measured device memory of one kept block
        self._opt_wait: dict[int, float] = {}       # unit -> optimizer wait before its copy-in
        self._copy_events: list = []
        self._spans: list = []
        self._kept_bufs: list[torch.Tensor] = []
        self._shipping: Future | None = None      # the previous step's gradients leaving
        self._shipped: list[dict] = []              # copy-out statistics of finished steps
        self._last_grads: dict[int, np.ndarray] = {}
        self._host_inputs: torch.Tensor | None = None     # offloaded block inputs (pinned on CUDA)
        self._staging: torch.Tensor | None = None         # fp32 slab for the on-device cast
        self._offload_auto: int | None = None
        self.copy_in = ThreadPoolExecutor(1, thread_name_prefix="copy-in")
        self.copy_out = ThreadPoolExecutor(1, thread_name_prefix="copy-out")

    # ------------------------------------------------------------------ data parallel
    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: an address and a free port of this node for the workers' process group."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_group(self, addr: str, port: int) -> None:
        """Join the data-parallel process group (NCCL on GPUs, gloo on the CPU); every rank
        calls this at once."""
        import datetime

        import torch.distributed as dist

        dist.init_process_group("nccl" if self.cuda else "gloo", init_method=f"tcp://{addr}:{port}",
                                rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=self.cfg.worker.wait_timeout_s))
        probe = torch.ones(1, device=self.device)
        dist.all_reduce(probe)                      # the group works before the first step needs it
        if int(probe.item()) != self.world:
            raise RuntimeError(f"process group all-reduce gave {probe.item()}, expected {self.world}")

    def _sum_across_workers(self, grads: list, loss_sum: torch.Tensor) -> None:
        """Sum every unit's gradient and the loss over the data-parallel workers, in place."""
        import torch.distributed as dist

        for g in grads:
            dist.all_reduce(g)
        dist.all_reduce(loss_sum)

    # ------------------------------------------------------------------ plumbing
    def _pin(self) -> None:
        """Register every shared file the GPU reads or writes, once for the whole run."""
        cudart = torch.cuda.cudart()
        for kind in ("compute" if not self.h.aliased else "master", "ring"):
            t = self.buf.files[kind].bytes
            err = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {kind} ({t.numel()} bytes) failed: {err}")

    def _keep_count(self, tokens_per_step: int) -> int:
        """Blocks whose activations stay resident: the config's number, or what fits."""
        k = self.cfg.worker.keep_activations
        if k is not None:
            return min(k, self.L)
        if not self.cuda:
            return 0
        if self._auto_keep is None:
            free, _ = torch.cuda.mem_get_info(self.device)
            # Room for the saved block inputs, the step's fp32 gradients (held until the
            # norm is known), the loss chunks and the allocator.
            inputs = (self.L + 1) * tokens_per_step * self.mcfg.hidden_size * self.dtype.itemsize
            grads = 4 * sum(u.numel for u in self.units)
            reserve = int(0.1 * free) + 2 * inputs + grads + 6 * 2**30
            chunked = self.cfg.train.micro_batch_size * self.cfg.train.seq_len > self.cfg.train.mlp_chunk_tokens
            self._auto_keep = keep_blocks(self.mcfg, tokens_per_step, self.dtype.itemsize, free, reserve, chunked)
        return self._auto_keep

    def _kept_buffer(self, k: int) -> torch.Tensor:
        while len(self._kept_bufs) <= k:
            self._kept_bufs.append(torch.empty(self.units[1].numel, dtype=self.dtype, device=self.device))
        return self._kept_bufs[k]

    def _slot_name(self, u: int) -> str:
        kind = self.units[u].kind
        return f"block{(u - 1) % 2}" if kind == "block" else kind

    def _stage(self, u: int, step: int, timer: _Timer) -> Future:
        """Start bringing unit u's compute weights (as of step ``step``) into its slot."""
        slot = self._slot_name(u)
        if self.slot_unit[slot] == u and self._slot_step.get(slot) == step:
            fut: Future = Future()
            fut.set_result(None)
            return fut
        self.slot_unit[slot] = u
        self._slot_step[slot] = step
        free_ev = self.slot_free[slot]
        dst = self.slots[slot][: self.units[u].numel]

        def work():
            if self.relay is not None:      # from the store's node, through the object store
                t0 = time.perf_counter()
                src = get_or_raise(self.relay.unit.remote(u, step), "relay")
                waited = time.perf_counter() - t0
                if self.cuda:
                    src = src.pin_memory()
                parts = [(None, 0, src.numel())]
            else:
                src, waited = self.buf.compute(u), 0.0
                parts = [(i, self.h.pieces[i].start, self.h.pieces[i].stop) for i in self.h.unit_pieces(u)]
            timer.add("copy_in_bytes", src.numel() * src.element_size())
            ev = None
            if self.cuda and free_ev is not None:
                self.copy_stream.wait_event(free_ev)
            # Piece by piece, each as soon as its update is in: a unit updated by several
            # shards at once starts crossing the link before its last piece is done.
            for piece, a, b in parts:
                if piece is not None:
                    waited += self.buf.wait(lambda: self.buf.version(piece) >= step,
                                            f"optimizer update of {self.units[u].name} for step {step}",
                                            self.cfg.worker.wait_timeout_s)
                ev = self._copy_in(dst[a:b], src[a:b], timer)
            timer.add("wait_optimizer_s", waited)
            self._opt_wait[u] = self._opt_wait.get(u, 0.0) + waited
            return ev

        return self.copy_in.submit(work)

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor, timer: _Timer):
        """Copy host ``src`` into device ``dst``; on CUDA on the copy stream, returning the
        event after it. A source in another dtype (the fp32 master, ``optim.compute_copy``
        device) crosses the link as it is, one slab at a time into an fp32 staging buffer,
        and is cast into ``dst`` there, on the same stream."""
        if not self.cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            timer.add("copy_in_s", time.perf_counter() - t0)
            return None
        with torch.cuda.stream(self.copy_stream):
            start, ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
            if src.dtype == dst.dtype:
                dst.copy_(src, non_blocking=True)
            else:
                if self._staging is None or self._staging.dtype != src.dtype:
                    self._staging = torch.empty(self.h.slab_numel, dtype=src.dtype, device=self.device)
                n = self._staging.numel()
                for a in range(0, src.numel(), n):
                    part = self._staging[: min(n, src.numel() - a)]
                    part.copy_(src[a:a + n], non_blocking=True)
                    dst[a:a + n].copy_(part)
            ev.record(self.copy_stream)
        self._copy_events.append((start, ev))
        return ev

    def _ready(self, fut: Future, timer: _Timer) -> None:
        t0 = time.perf_counter()
        ev = fut.result()
        if ev is not None:
            self.compute_stream.wait_event(ev)
        timer.add("wait_copy_in_s", time.perf_counter() - t0)

    def _release(self, u: int) -> None:
        """Compute issued so far has finished reading unit u's slot before it is refilled."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.compute_stream)
            self.slot_free[self._slot_name(u)] = ev

    def _weights(self, u: int, grad: bool):
        flat = self.slots[self._slot_name(u)][: self.units[u].numel]
        if grad:
            flat = flat.detach().requires_grad_()
        return flat, bind(flat, self.units[u])

    @contextmanager
    def _span(self, u: int):
        """Bracket unit u's compute region: CUDA events on the compute stream, or wall time on the CPU."""
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(self.compute_stream)
            yield
            b.record(self.compute_stream)
        else:
            a = time.perf_counter()
            yield
            b = time.perf_counter()
        self._spans.append((u, a, b))

    def _gpu_time(self) -> dict:
        """Busy time of the step's compute regions and the idle gaps between them."""
        el = (lambda a, b: a.elapsed_time(b) / 1e3) if self.cuda else (lambda a, b: b - a)
        busy = opt = other = first = 0.0
        for k, (u, a, b) in enumerate(self._spans):
            busy += el(a, b)
            waited = self._opt_wait.pop(u, 0.0)         # only a unit's first region waited
            if k:
                gap = max(0.0, el(self._spans[k - 1][2], a))
                w = min(gap, waited)
                opt, other = opt + w, other + gap - w
            else:                                       # before the first region: outside the GPU
                first = waited                          # work, of which this long waiting for updates
        return {"compute_s": busy, "gap_optimizer_s": opt, "gap_other_s": other, "first_unit_optimizer_s": first}

    def _adapt_keep(self) -> None:
        """Re-choose the kept blocks from this step's measured peak and per-block cost."""
        if self.cfg.worker.keep_activations is not None or not self.cuda or not self._kept_block_bytes:
            return
        usable = torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device)
        margin = int(0.06 * usable) + 2 * 2**30
        headroom = usable - margin - torch.cuda.max_memory_allocated(self.device)
        change = int(headroom // self._kept_block_bytes) if headroom > 0 else -int(-headroom // self._kept_block_bytes) - 1
        self._auto_keep = max(0, min(self.L, self._auto_keep + change))

    def _ship(self, step: int, grads: list, ready) -> None:
        """Copy-out thread: every piece of the step's (clipped) gradients into its ring slab,
        in forward order; each slab is handed to its shard as soon as its copy has landed."""
        st = {"wait_slab_s": 0.0, "copy_out_s": 0.0, "copy_out_bytes": 0}
        try:
            if ready is not None:
                self.out_stream.wait_event(ready)
            last = {p.unit: p.index for p in self.h.pieces}
            for piece in self.h.pieces:
                src = grads[piece.unit][piece.start:piece.stop]

                def copy(dst, src=src):
                    t0 = time.perf_counter()
                    if self.cuda:
                        with torch.cuda.stream(self.out_stream):
                            dst.copy_(src, non_blocking=True)
                        self.out_stream.synchronize()       # landed before the shard may read it
                    else:
                        dst.copy_(src)
                    st["copy_out_s"] += time.perf_counter() - t0

                st["wait_slab_s"] += self.buf.put_piece(piece, step, copy, self.cfg.worker.wait_timeout_s)
                st["copy_out_bytes"] += 4 * piece.numel
                if last[piece.unit] == piece.index:
                    grads[piece.unit] = None                # its device memory goes back now
            self._shipped.append(st)
        except RunAborted:
            raise
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        """Release every waiter of the run (through the relay when the shared files are elsewhere)."""
        if self.relay is not None:
            self.relay.abort.remote()
        else:
            self.buf.abort()

    def _ship_remote(self, step: int, grads: list) -> None:
        """Copy-out thread of a worker on another node: the step's gradients to the relay."""
        t0 = time.perf_counter()
        st = get_or_raise(self.relay.ship.remote(step, grads), "relay")
        st["copy_out_s"] = time.perf_counter() - t0
        self._shipped.append(st)

    def _shipping_error(self) -> str | None:
        """Why the copy-out of gradients failed, when that is what aborted the run."""
        f = self._shipping
        if f is not None and f.done() and f.exception() is not None and not isinstance(f.exception(), RunAborted):
            return f"gradient copy-out failed: {type(f.exception()).__name__}: {f.exception()}"
        return None

    def _offload_count(self, keep_from: int) -> int:
        """Blocks (the first ones) whose inputs wait in host memory: the config's number, or,
        when unset, those the memory plan cannot fit on the GPU. Never a kept block's."""
        k = self.cfg.worker.offload_inputs
        if k is None:
            if self._offload_auto is None:
                self._offload_auto = 0
                if self.cuda:
                    from megaray.plan import offload_needed

                    self._offload_auto = offload_needed(self.cfg, torch.cuda.mem_get_info(self.device)[0]
                                                        + torch.cuda.memory_allocated(self.device))
            k = self._offload_auto
        return min(k, keep_from, self.L)

    def _host_buffer(self, n: int, like: torch.Tensor, M: int) -> torch.Tensor:
        """Host memory for n blocks' inputs of M micro-batches, allocated (and pinned) once."""
        shape = (n, M) + tuple(like.shape)
        if self._host_inputs is None or tuple(self._host_inputs.shape) != shape:
            self._host_inputs = None
            self._host_inputs = torch.empty(shape, dtype=like.dtype, pin_memory=self.cuda)
        return self._host_inputs

    def _offload(self, j: int, acts: list, host: torch.Tensor, timer: _Timer) -> None:
        """Send block j's saved inputs to host memory (after the compute that wrote them)."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.compute_stream)
            with torch.cuda.stream(self.offload_stream):
                self.offload_stream.wait_event(ev)
                for m, x in enumerate(acts[j]):
                    host[j, m].copy_(x, non_blocking=True)
                    x.record_stream(self.offload_stream)   # its memory is reused only after the copy
        else:
            for m, x in enumerate(acts[j]):
                host[j, m].copy_(x)
        timer.add("offload_bytes", sum(x.numel() * x.element_size() for x in acts[j]))
        acts[j] = [None] * len(acts[j])

    def _fetch(self, j: int, acts: list, host: torch.Tensor):
        """Bring block j's inputs back to the device; returns the event compute waits on."""
        if not self.cuda:
            acts[j] = [host[j, m].clone() for m in range(host.shape[1])]
            return None
        with torch.cuda.stream(self.offload_stream):
            back = [host[j, m].to(self.device, non_blocking=True) for m in range(host.shape[1])]
            ev = torch.cuda.Event()
            ev.record(self.offload_stream)
        for x in back:
            x.record_stream(self.compute_stream)
        acts[j] = back
        return ev

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

    def _inputs_targets(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of a batch [micro_batches, batch, seq + 1] (a token array, or
        tokens with a loss mask): targets the mask leaves out become IGNORE_INDEX."""
        tokens, mask = split_batch(batch)
        toks = torch.tensor(np.asarray(tokens), dtype=torch.int64).to(self.device)
        targets = toks[..., 1:]
        if mask is not None:
            keep = torch.tensor(np.asarray(mask)[..., 1:] != 0).to(self.device)
            targets = targets.masked_fill(~keep, IGNORE_INDEX)
        return toks[..., :-1], targets

    # ------------------------------------------------------------------ steps
    def run_step(self, step: int, tokens: np.ndarray, total_tokens: int | None = None) -> dict:
        """Forward and backward of one step over tokens [micro_batches, batch, seq + 1]: the
        whole step's, or with several workers this worker's share of its micro-batches and the
        count of target tokens in the whole step (the loss is divided by it)."""
        try:
            d = self.cfg.debug
            if d.crash_actor == "worker" and d.crash_step == step:
                raise InjectedFault(f"injected crash at step {step}")
            return self._run_step(step, tokens, total_tokens)
        except RunAborted as e:
            raise ActorFailure(self.name, self._shipping_error() or str(e), step,
                               aborted=self._shipping_error() is None) from None
        except Exception as e:
            self._abort()
            raise ActorFailure(self.name, f"{type(e).__name__}: {e}", step) from e

    def _run_step(self, step: int, tokens: np.ndarray, total_tokens: int | None = None) -> dict:
        t_start = time.perf_counter()
        timer = _Timer()
        if self._shipping is not None and self._shipping.done():
            self._shipping.result()             # raise the previous step's copy-out failure, if any
        self._copy_events, self._spans, self._opt_wait = [], [], {}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        inputs, targets = self._inputs_targets(tokens)
        M = inputs.shape[0]
        n_tokens = int((targets != IGNORE_INDEX).sum()) if total_tokens is None else total_tokens
        inv_n = 1.0 / max(n_tokens, 1)
        if step in self.cfg.debug.nonfinite_steps:       # tests of step skipping
            inv_n = float("nan")
        U, L = len(self.units), self.L
        grads: list[torch.Tensor | None] = [None] * U

        # ---- forward: embedding, blocks, saving each block's input
        t0 = time.perf_counter()
        nxt = self._stage(0, step, timer)
        self._ready(nxt, timer)
        nxt = self._stage(1, step, timer) if L else self._stage(U - 1, step, timer)
        acts: list[list[torch.Tensor]] = [[None] * M for _ in range(L + 1)]
        keep_from = L - self._keep_count(M * inputs[0].numel())
        n_off = self._offload_count(keep_from)
        kept: dict[int, tuple] = {}     # block -> (flat leaf, bound views, [(x, y) per micro-batch])
        mlp_chunk = self.cfg.train.mlp_chunk_tokens
        with torch.no_grad(), self._span(0):
            _, we = self._weights(0, grad=False)
            for m in range(M):
                acts[0][m] = embed_forward(we, inputs[m])
        for i in range(L):
            u = i + 1
            self._ready(nxt, timer)
            nxt = self._stage(u + 1, step, timer)           # next block, or the head
            if i < keep_from:
                with torch.no_grad(), self._span(u):
                    _, w = self._weights(u, grad=False)
                    for m in range(M):
                        acts[i + 1][m] = block_forward(w, acts[i][m], self.rope, self.mcfg, mlp_chunk)
                if i < n_off:
                    self._offload(i, acts, self._host_buffer(n_off, acts[i][0], M), timer)
            else:
                # Keep this block's internals (and a private copy of its weights, since
                # the slot is refilled) so its backward needs no recomputation.
                buf = self._kept_buffer(i - keep_from)
                pairs = []
                before = torch.cuda.memory_allocated(self.device) if self.cuda else 0
                with torch.enable_grad(), self._span(u):
                    buf.copy_(self.slots[self._slot_name(u)][: self.units[u].numel])
                    flat = buf.detach().requires_grad_()
                    w = bind(flat, self.units[u])
                    for m in range(M):
                        x = acts[i][m].detach().requires_grad_()
                        y = block_forward(w, x, self.rope, self.mcfg, mlp_chunk)
                        pairs.append((x, y))
                        acts[i + 1][m] = y.detach()
                kept[i] = (flat, w, pairs)
                if self.cuda and not self._kept_block_bytes:   # one kept block: internals + its weights
                    self._kept_block_bytes = (torch.cuda.memory_allocated(self.device) - before
                                              + buf.numel() * buf.element_size())
            self._release(u)
        timer.add("forward_s", time.perf_counter() - t0)

        # ---- head: chunked loss, its gradient, and the gradient into the last block's output
        t0 = time.perf_counter()
        self._ready(nxt, timer)
        if L and L - 1 < keep_from:
            nxt = self._stage(L, step, timer)               # the last block, still resident
        tied = self.mcfg.tie_word_embeddings
        g_head = torch.zeros(self.units[-1].numel, dtype=torch.float32, device=self.device)
        g_embed = torch.zeros(self.units[0].numel, dtype=torch.float32, device=self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        dys: list[torch.Tensor] = [None] * M
        chunk = self.cfg.train.loss_chunk_tokens
        with self._span(U - 1):
            head_flat, wh = self._weights(U - 1, grad=True)
            emb_flat, we = self._weights(0, grad=True) if tied else (None, None)
            for m in range(M):
                x = acts[L][m]
                acts[L][m] = None
                b, s, hdim = x.shape
                xf, tf = x.reshape(b * s, hdim), targets[m].reshape(b * s)
                dx = torch.empty_like(xf)
                for c in range(0, b * s, chunk):
                    xc = xf[c:c + chunk].detach().requires_grad_()
                    loss, _ = head_loss_sum(wh, we, xc, tf[c:c + chunk], self.mcfg)
                    ins = [head_flat, xc] + ([emb_flat] if tied else [])
                    gs = torch.autograd.grad(loss * inv_n, ins)
                    g_head += gs[0]
                    dx[c:c + chunk] = gs[1]
                    if tied:
                        g_embed += gs[2]
                    loss_sum += loss.detach().double() * (1.0 if inv_n == inv_n else float("nan"))
                dys[m] = dx.view(b, s, hdim)
        self._release(U - 1)
        grads[U - 1] = g_head
        timer.add("head_s", time.perf_counter() - t0)

        # ---- backward through the blocks, recomputing each from its saved input
        t0 = time.perf_counter()
        first = keep_from - 1                               # the first recomputed block: its inputs
        fetched = self._fetch(first, acts, self._host_inputs) if 0 <= first < n_off else None   # come back first
        for i in reversed(range(L)):
            u = i + 1
            if i in kept:
                flat, w, pairs = kept.pop(i)
                if i - 1 == keep_from - 1 and i > 0:
                    nxt = self._stage(u - 1, step, timer)   # first recomputed block below
                with self._span(u):
                    g = torch.zeros(self.units[u].numel, dtype=torch.float32, device=self.device)
                    for m, (x, y) in enumerate(pairs):
                        dys[m] = self._block_backward(self.units[u], w, y, x, dys[m], g)
                        acts[i][m] = None
                del pairs, flat, w
            else:
                self._ready(nxt, timer)
                if i > 0:
                    nxt = self._stage(u - 1, step, timer)
                if fetched is not None:
                    self.compute_stream.wait_event(fetched)
                fetched = self._fetch(i - 1, acts, self._host_inputs) if 0 < i <= n_off else None
                with self._span(u):
                    g = torch.zeros(self.units[u].numel, dtype=torch.float32, device=self.device)
                    flat, w = self._weights(u, grad=True)
                    for m in range(M):
                        x = acts[i][m].detach().requires_grad_()
                        acts[i][m] = None
                        with torch.enable_grad():
                            y = block_forward(w, x, self.rope, self.mcfg, mlp_chunk)
                            dys[m] = self._block_backward(self.units[u], w, y, x, dys[m], g)
                self._release(u)
            grads[u] = g
        # ---- the embedding: its lookup gradient (plus the tied head's contribution)
        with self._span(0):
            emb_flat, we = self._weights(0, grad=True)
            for m in range(M):
                with torch.enable_grad():
                    y = embed_forward(we, inputs[m])
                    (gw,) = torch.autograd.grad(y, [emb_flat], grad_outputs=dys[m])
                g_embed += gw
        self._release(0)
        grads[0] = g_embed
        timer.add("backward_s", time.perf_counter() - t0)

        # ---- the step's verdict, exact clipping, and the gradients' way out
        t0 = time.perf_counter()
        if self.world > 1:
            with self._span(-1):
                self._sum_across_workers(grads, loss_sum)
        with self._span(-1):
            sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64).square() for g in grads])
        sq = sq.cpu()                                       # waits for the backward to finish
        loss_total = float(loss_sum)
        norm = math.sqrt(float(sq.sum()))
        finite = math.isfinite(norm) and math.isfinite(loss_total)
        coef = clip_coefficient(norm, self.cfg.optim.clip_grad_norm) if finite else 0.0
        if self.cfg.debug.keep_gradients:
            self._last_grads = {u: g.cpu().numpy() for u, g in enumerate(grads)}
        if self.rank:
            pass            # rank 0 decides the step and ships the (identical) summed gradients
        elif self.relay is not None:
            if finite:
                for g in grads:
                    g.mul_(coef)
                self._shipping = self.copy_out.submit(self._ship_remote, step, [g.cpu() for g in grads])
            else:
                get_or_raise(self.relay.decide.remote(step, False), "relay")
        elif finite:
            if coef != 1.0:
                with self._span(-1):
                    for g in grads:
                        g.mul_(coef)
            ready = None
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record(self.compute_stream)
                for g in grads:
                    g.record_stream(self.out_stream)
            self.buf.decide(step, True)
            self._shipping = self.copy_out.submit(self._ship, step, grads, ready)
        else:
            self.buf.decide(step, False)
        del grads
        timer.add("reduce_s", time.perf_counter() - t0)
        if self.cuda:   # copy-in time on the copy stream, from its events
            self.copy_stream.synchronize()
            self.compute_stream.synchronize()
            timer.add("copy_in_s", sum(a.elapsed_time(b) for a, b in self._copy_events) / 1e3)
        timer.t.update(self._gpu_time())
        out = {"loss_sum": loss_total, "tokens": n_tokens, "grad_norm": norm, "clip_coef": coef,
               "applied": finite, "kept_blocks": L - keep_from, "kept_block_bytes": self._kept_block_bytes,
               "offloaded_inputs": n_off,
               "worker_s": time.perf_counter() - t_start}
        out.update(timer.t)
        # Copy-out of the previous step's gradients (it ran during this step's forward).
        while self._shipped:
            for k, v in self._shipped.pop(0).items():
                out[k] = out.get(k, 0.0) + v
        if self.cuda:
            out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            self._adapt_keep()
        return out

    def link_speed(self, repeats: int = 5) -> dict:
        """Copy-in and copy-out bandwidth of the pinned buffers measured alone (nothing else
        running): every block's weights host->device as a step streams them (the compute
        copy, or the fp32 master cast on the device), and slab-sized pieces
        device->host into the gradient ring (benchmarks; call between steps)."""
        units = [u for u in self.units if u.kind == "block"] or list(self.units)
        dst = self.slots["block0"]
        g = torch.zeros(self.h.slab_numel, dtype=torch.float32, device=self.device)

        def timed(fn) -> float:
            fn()                                            # warm-up
            if self.cuda:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            return (time.perf_counter() - t0) / repeats

        self.slot_unit["block0"] = -1                       # its contents are overwritten below
        scratch = _Timer()
        t_in = timed(lambda: [self._copy_in(dst[: u.numel], self.buf.compute(u.index), scratch) for u in units])
        self._copy_events = []
        with torch.cuda.stream(self.copy_stream) if self.cuda else nullcontext():
            slabs = [self.buf.slab(k) for k in range(self.h.ring_slabs)]
            n_out = max(1, sum(u.numel for u in units) // self.h.slab_numel)
            t_out = timed(lambda: [slabs[k % len(slabs)].copy_(g, non_blocking=True) for k in range(n_out)])
        bytes_in = sum(u.numel for u in units) * self.buf.compute(0).element_size()   # as they cross the link
        return {"copy_in_gbps": bytes_in / t_in / 1e9, "copy_out_gbps": n_out * 4 * self.h.slab_numel / t_out / 1e9}

    def gradients(self) -> dict[int, np.ndarray]:
        """The last step's unclipped fp32 gradients by unit (needs ``debug.keep_gradients``)."""
        if not self.cfg.debug.keep_gradients:
            raise RuntimeError("gradients() needs debug.keep_gradients: true")
        return self._last_grads

    def evaluate(self, step: int, tokens: np.ndarray) -> dict:
        """Forward-only loss on tokens [micro_batches, batch, seq + 1] with step ``step``'s weights."""
        try:
            return self._evaluate(step, tokens)
        except RunAborted as e:
            raise ActorFailure(self.name, str(e), step, aborted=True) from None
        except Exception as e:
            self._abort()
            raise ActorFailure(self.name, f"{type(e).__name__}: {e}", step) from e

    @torch.no_grad()
    def _evaluate(self, step: int, tokens: np.ndarray) -> dict:
        inputs, targets = self._inputs_targets(tokens)
        xs, wh, we = self._forward_only(step, list(inputs))
        loss, count = 0.0, 0
        chunk = self.cfg.train.loss_chunk_tokens
        for m, x in enumerate(xs):
            xf, tf = x.reshape(-1, x.shape[-1]), targets[m].reshape(-1)
            for c in range(0, xf.shape[0], chunk):
                ls, n = head_loss_sum(wh, we, xf[c:c + chunk], tf[c:c + chunk], self.mcfg)
                loss += float(ls)
                count += int(n)
        self._release(len(self.units) - 1)      # after the loss has read the head and embedding
        self._release(0)
        return {"loss_sum": loss, "tokens": count}

    @torch.no_grad()
    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """fp32 logits of a small batch [batch, seq] (tests and interop checks)."""
        step = (get_or_raise(self.relay.version.remote(), "relay") if self.relay is not None
                else min(self.buf.unit_version(u.index) for u in self.units))
        (h,), wh, we = self._forward_only(step, [torch.tensor(tokens, dtype=torch.int64).to(self.device)])
        h = rms_norm(h, wh["model.norm.weight"], self.mcfg.rms_norm_eps)
        out = we["model.embed_tokens.weight"] if self.mcfg.tie_word_embeddings else wh["lm_head.weight"]
        logits = torch.nn.functional.linear(h, out).float().cpu().numpy()
        self._release(len(self.units) - 1)
        self._release(0)
        return logits

    @torch.no_grad()
    def _forward_only(self, step: int, inputs: list) -> tuple[list, dict, dict]:
        """Final hidden states of each input through every block, with step ``step``'s weights;
        also the head's and the embedding's bound weights, still resident: the caller
        releases those two slots once it has used them."""
        timer = _Timer()
        self._ready(self._stage(0, step, timer), timer)
        _, we = self._weights(0, grad=False)
        xs = [embed_forward(we, x) for x in inputs]
        for u in range(1, len(self.units)):
            self._ready(self._stage(u, step, timer), timer)
            _, w = self._weights(u, grad=False)
            if u <= self.L:
                xs = [block_forward(w, x, self.rope, self.mcfg) for x in xs]
                self._release(u)
        return xs, w, we
