"""Memory plan of a run: what host memory, /dev/shm and the GPU must hold, before anything
is allocated.

``plan(cfg)`` counts, from the config alone:
- host shared memory (``cluster.shm_dir``): masters (``optim.master_dtype``), the
  compute-dtype copy (none when it is the master's dtype, or when the worker casts on the
  device: ``optim.compute_copy``), the gradient ring (``optim.grad_ring_slabs`` slabs of
  ``optim.grad_slab_mib``), control words, all page-aligned as ``megaray.buffers`` lays
  them out; plus Ray's object store, which lives in /dev/shm too;
- host private memory: Adam moments (8 bytes a parameter in fp32, 4 in bf16:
  ``optim.moment_dtype``; in the optimizer shards), a
  fixed allowance per actor process for the interpreter and torch, and, when the worker
  computes on the CPU, the step's gradients it holds until the norm is known;
- the GPU (each GPU's, with ``worker.count`` data-parallel workers: its share of the
  step's tokens): the four weight slots (embedding, head, two blocks), and at the step's peak
  (found by walking the backward: saved inputs and kept internals are freed block by block
  as the fp32 gradients, held until the global norm is known, grow) the saved block inputs
  of a step (less those offloaded to pinned host memory: ``worker.offload_inputs``), the
  kept blocks' internals and weights (``megaray.memory``) and the gradients; the
  recomputation workspace of one micro-batch (one MLP chunk's for long sequences), the loss
  chunk's logits, the fp32 staging slab of the on-device cast, and the CUDA context.

Host bytes per parameter counts the training state: everything in shared memory (Ray's
object store included) and the moments; not the per-process allowance.

``check(cfg, machine)`` compares with what the machine has and raises ``PlanError`` with the
whole report and the shortfall; ``megaray train`` calls it before starting any actor.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from megaray.buffers import DTYPES, Handles
from megaray.config import RunConfig
from megaray.errors import PlanError
from megaray.memory import block_internal_bytes_per_token
from megaray.model import build_layout

GiB = 2**30
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}
PROCESS_BYTES = int(0.4 * GiB)   # one actor process: interpreter, torch, Ray worker
CUDA_CONTEXT_BYTES = 1 * GiB


@dataclass
class Machine:
    host_bytes: int          # memory available to the run
    shm_bytes: int           # free space in cluster.shm_dir
    gpu_bytes: int | None    # free device memory, None when no GPU is visible here

    @classmethod
    def here(cls, shm_dir: str, gpu_bytes: int | None = None, probe_gpu: bool = False) -> "Machine":
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        st = os.statvfs(shm_dir)
        gpu = gpu_bytes
        if gpu is None and probe_gpu:
            import torch

            if torch.cuda.is_available():
                gpu = torch.cuda.mem_get_info()[0]
        return cls(info.get("MemAvailable", info["MemFree"]), st.f_bavail * st.f_frsize, gpu)


@dataclass
class Plan:
    params: int
    shm: dict = field(default_factory=dict)
    host_private: dict = field(default_factory=dict)
    gpu: dict = field(default_factory=dict)
    keep_blocks: int = 0
    offload_inputs: int = 0

    @property
    def shm_total(self) -> int:
        return sum(self.shm.values())

    @property
    def host_total(self) -> int:
        return self.shm_total + sum(self.host_private.values())

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_bytes_per_param(self) -> float:
        """Training state per parameter: shared memory (object store included) and moments."""
        state = self.shm_total + sum(v for k, v in self.host_private.items() if k.startswith("adam moments"))
        return state / self.params

    def report(self, machine: Machine | None = None) -> str:
        def block(title, items, total, have=None):
            lines = [f"{title}: {total / GiB:8.2f} GiB" + (f"  (available {have / GiB:.2f} GiB)" if have is not None
                                                             else "")]
            lines += [f"    {k:<42} {v / GiB:8.2f} GiB" for k, v in items.items()]
            return lines

        out = [f"model: {self.params / 1e9:.3f}B parameters; host state {self.host_bytes_per_param:.2f} bytes/param"]
        out += block("host memory", {**self.shm, **self.host_private}, self.host_total,
                     machine.host_bytes if machine else None)
        out += block("  of which shared memory", self.shm, self.shm_total, machine.shm_bytes if machine else None)
        out += block(f"GPU (keeping {self.keep_blocks} blocks' activations, {self.offload_inputs} blocks' inputs "
                     "in host memory)", self.gpu, self.gpu_total,
                     machine.gpu_bytes if machine else None)
        return "\n".join(out)


def plan(cfg: RunConfig, keep: int | None = None, on_gpu: bool = True, offload: int | None = None) -> Plan:
    m, t = cfg.model, cfg.train
    units = build_layout(m)
    h = Handles.for_config(cfg, "plan", 0, units)
    p = Plan(params=m.num_params())
    o = cfg.optim
    p.shm = {f"{_SHORT[o.master_dtype]} master weights": h.master_bytes}
    if not h.aliased:
        p.shm[f"{t.compute_dtype} compute copy"] = h.compute_bytes
    p.shm.update({f"gradient ring ({h.ring_slabs} x {h.slab_bytes / 2**20:g} MiB)": h.ring_bytes,
                  "control words": h.control_bytes})
    if cfg.cluster.address is None:
        p.shm["ray object store"] = cfg.cluster.object_store_mb * 2**20
    p.host_private = {f"adam moments ({_SHORT[o.moment_dtype]})": 2 * DTYPES[o.moment_dtype].itemsize * p.params,
                      "actor processes": PROCESS_BYTES * (cfg.optim.num_shards + 3 + cfg.worker.count)}
    if not on_gpu:
        p.host_private["step gradients held by the worker (CPU device)"] = 4 * p.params
    s = DTYPES[t.compute_dtype].itemsize
    L = m.num_hidden_layers
    tokens = t.tokens_per_step // cfg.worker.count          # what one GPU of the data-parallel workers holds
    micro_tokens = t.micro_batch_size * t.seq_len
    chunked = micro_tokens > t.mlp_chunk_tokens
    block_numel = units[1].numel
    per_block_internal = block_internal_bytes_per_token(m, s, chunked)
    # With keep_activations unset the worker keeps as many blocks as fit; the plan counts
    # the minimum (none), which is what must fit.
    p.keep_blocks = min(L, keep if keep is not None else (cfg.worker.keep_activations or 0))
    p.offload_inputs = min(L - p.keep_blocks, offload if offload is not None else (cfg.worker.offload_inputs or 0))
    chunk = min(t.loss_chunk_tokens, micro_tokens)
    one_input = s * tokens * m.hidden_size                      # one block's saved inputs, all micro-batches
    kept_one = per_block_internal * tokens + s * block_numel
    grads_ends = 4 * (units[0].numel + units[-1].numel)          # head's and embedding's, from the backward's start
    # Through the backward, block j's input and (if kept) internals are freed as its fp32
    # gradient appears: the peak is the largest of (inputs still saved + kept internals still
    # alive + gradients so far) over the backward's positions, and the head (every input,
    # the last block's output too). Offloaded inputs (the first blocks') come back one block
    # ahead, so at most two of them are on the GPU at once.
    n_off = p.offload_inputs
    best = (((L + 1 - n_off) * one_input + p.keep_blocks * kept_one + grads_ends), L + 1 - n_off, p.keep_blocks, L)
    for j in range(L, -1, -1):                                  # blocks 0..j-1 not yet backwarded
        on_gpu_inputs = max(0, j - n_off) + (min(2, j) if j <= n_off else min(1, n_off))
        alive_kept = max(0, j - (L - p.keep_blocks))
        total = on_gpu_inputs * one_input + alive_kept * kept_one + grads_ends + 4 * block_numel * (L - j)
        if total > best[0]:
            best = (total, on_gpu_inputs, alive_kept, j)
    _, n_inputs, n_kept, j = best
    if p.offload_inputs:
        p.host_private[f"offloaded block inputs ({p.offload_inputs}, pinned)"] = (
            p.offload_inputs * one_input * cfg.worker.count)
    mlp_chunk = min(t.mlp_chunk_tokens, micro_tokens) * 3 * s * m.intermediate_size if chunked else 0
    p.gpu = {
        "weight slots (embed, head, 2 blocks)": s * (units[0].numel + units[-1].numel + 2 * block_numel),
        "saved block inputs (at the peak)": n_inputs * one_input,
        "gradient of the step's activations": one_input,
        "fp32 gradients (at the peak)": grads_ends + 4 * block_numel * (L - j),
        # a recomputed block's internals, and its MLP backward's rebuilt silu(gate), the
        # product's gradient and the gate's and up's gradients
        "recomputation workspace (1 micro-batch)": per_block_internal * micro_tokens + (
            mlp_chunk or 3 * s * m.intermediate_size * micro_tokens),
        "loss chunk logits (fp32, with grad)": 2 * 4 * chunk * m.vocab_size,
        "kept blocks (internals + weights, at the peak)": n_kept * kept_one,
        "CUDA context and allocator slack": CUDA_CONTEXT_BYTES,
    }
    if h.cast_on_device:
        p.gpu["fp32 staging of the on-device cast"] = h.slab_bytes
    return p


def offload_needed(cfg: RunConfig, gpu_bytes: int) -> int:
    """The fewest first blocks whose inputs must wait in host memory for the plan to fit
    ``gpu_bytes`` (every block's, when nothing fits)."""
    L = cfg.model.num_hidden_layers
    for n in range(L + 1):
        if plan(cfg, offload=n).gpu_total <= gpu_bytes:
            return n
    return L


def savings(cfg: RunConfig) -> list[tuple[str, int, float]]:
    """What each memory-saving option not yet on would save: (override, host bytes saved,
    host bytes per parameter with it)."""
    import dataclasses

    base = plan(cfg)

    def alt(name: str, **changes) -> tuple[str, int, float]:
        q = plan(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **changes)))
        return name, base.host_total - q.host_total, q.host_bytes_per_param

    out = []
    for key, value in (("moment_dtype", "bfloat16"), ("master_dtype", "bfloat16")):
        if getattr(cfg.optim, key) == value:
            continue
        if key == "master_dtype" and cfg.train.compute_dtype != "bfloat16":
            continue            # a bf16 master needs bf16 compute
        out.append(alt(f"optim.{key}={value}", **{key: value}))
    if len(out) == 2:
        out.append(alt("both", moment_dtype="bfloat16", master_dtype="bfloat16"))
    if cfg.host_compute_copy:
        out.append(alt("optim.compute_copy=device", compute_copy="device"))
    return out


def shortfalls(p: Plan, machine: Machine) -> list[str]:
    out = []
    if p.host_total > machine.host_bytes:
        out.append(f"host memory: needs {p.host_total / GiB:.2f} GiB, {machine.host_bytes / GiB:.2f} GiB available "
                   f"(short by {(p.host_total - machine.host_bytes) / GiB:.2f} GiB)")
    if p.shm_total > machine.shm_bytes:
        out.append(f"shared memory: needs {p.shm_total / GiB:.2f} GiB, {machine.shm_bytes / GiB:.2f} GiB free "
                   f"(short by {(p.shm_total - machine.shm_bytes) / GiB:.2f} GiB)")
    if machine.gpu_bytes is not None and p.gpu_total > machine.gpu_bytes:
        out.append(f"GPU memory: needs {p.gpu_total / GiB:.2f} GiB, {machine.gpu_bytes / GiB:.2f} GiB free "
                   f"(short by {(p.gpu_total - machine.gpu_bytes) / GiB:.2f} GiB)")
    return out


def largest_fit(cfg: RunConfig, machine: Machine) -> tuple[int, int]:
    """Largest micro_batch_size at this seq_len, and largest seq_len at this micro-batch, on the GPU."""
    import dataclasses

    if machine.gpu_bytes is None:
        return cfg.train.micro_batch_size, cfg.train.seq_len

    def fits(mb, seq):
        tr = dataclasses.replace(cfg.train, micro_batch_size=mb, seq_len=seq)
        return plan(dataclasses.replace(cfg, train=tr)).gpu_total <= machine.gpu_bytes

    mb = 0
    while mb < 4096 and fits(mb + 1, cfg.train.seq_len):
        mb += 1
    seq = 0
    step = 256
    while seq + step <= cfg.model.max_position_embeddings and fits(cfg.train.micro_batch_size, seq + step):
        seq += step
    return mb, seq


def check(cfg: RunConfig, machine: Machine | None = None) -> Plan:
    """Raise PlanError with the report when the machine cannot hold the run."""
    machine = machine or Machine.here(cfg.cluster.shm_dir)
    offload = None
    if cfg.worker.offload_inputs is None and machine.gpu_bytes is not None:
        offload = offload_needed(cfg, machine.gpu_bytes)     # what the worker will choose
    p = plan(cfg, on_gpu=machine.gpu_bytes is not None, offload=offload)
    short = shortfalls(p, machine)
    if short:
        raise PlanError("the run does not fit this machine:\n  " + "\n  ".join(short) + "\n" + p.report(machine))
    return p
