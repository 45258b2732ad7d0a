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
  fixed allowance per actor process for the interpreter and torch, one more per GPU worker
  for the CUDA libraries it maps, and, when the worker computes on the CPU, the step's
  gradients it holds until the norm is known;
- the GPU at the step's peak, item by item: ``megaray.memory``'s model, the same one the
  worker chooses its kept and offloaded blocks with at run time.

Host bytes per parameter counts the training state: everything in shared memory (Ray's
object store included) and the moments; not the per-process allowance.

What the machine has is ``megaray.machine.Machine``.

``megaray.fitting.check(cfg, machine)`` compares with what the machine has and raises
``PlanError`` with the whole report, the shortfall and what would fit; ``megaray train`` calls
it before starting any actor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megaray import memory
from megaray.adamw import writes_clipped_gradient
from megaray.buffers import DTYPES, Handles
from megaray.config import MIN_RING_SLABS_PER_SHARD, RING_SLABS_PER_SHARD, RunConfig, replaced
from megaray.cost import Speeds, predict
from megaray.layout import build_layout
from megaray.machine import Machine
from megaray.memory import GiB

_SHORT = {"float32": "fp32", "bfloat16": "bf16"}
_USABLE = "what is free, at most worker.gpu_memory_gib, less the allocator's reserve"
# What an actor process adds to the memory in use (its anonymous pages: interpreter, torch, Ray's
# core worker), and what a GPU worker adds beyond that (CUDA's host-side state). Measured on the
# H200 machine (BENCHMARKS.md: Pss_Anon of every process, during steps): 0.30 GiB an
# optimizer shard beyond its moments, the store and the scheduler; the GPU worker 0.88-0.99 GiB.
# A library's code pages are the page cache's, reclaimable, and not counted.
PROCESS_BYTES = int(0.3 * GiB)
CUDA_PROCESS_BYTES = int(0.7 * GiB)
RING_HEADROOM = 0.10             # of the host's memory, left free when the gradient ring deepens
# Host memory no plan uses: the plan's own error (measured use within 2.5% of it on the H200
# machine, BENCHMARKS.md) and what grows beside a run (the page cache a checkpoint
# dirties, the driver's copies): HOST_RESERVE of what is available, at least HOST_RESERVE_MIN.
HOST_RESERVE = 0.02
HOST_RESERVE_MIN = 2 * GiB
_HOST_USABLE = (f"what is available less {HOST_RESERVE:.0%}, at least {HOST_RESERVE_MIN / GiB:g} GiB, "
                "for the plan's error")


def count(n: float) -> str:
    """A parameter count a person reads: 35.3K, 0.77M, 1.24B (three significant digits)."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def size(b: float) -> str:
    """Bytes a person reads: 512 B, 4 KiB, 64 MiB, 1.25 GiB (three significant digits)."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= div:
            return f"{b / div:.3g} {unit}"
    return f"{b:.0f} B"


@dataclass
class Plan:
    params: int
    active: int = 0                 # the parameters a token's compute reads (a mixture's k experts)
    windows: str = ""               # the sliding-window blocks, in words ("" where every block attends fully)
    shm: dict = field(default_factory=dict)
    host_private: dict = field(default_factory=dict)
    gpu: dict = field(default_factory=dict)
    keep_blocks: int = 0
    lean: bool = True               # kept blocks saved lean (False: as plain autograd saves them)
    offload_inputs: int = 0
    input_stride: int = 1           # every how many blocks an input is saved (worker.input_stride)
    gpu_budget: int | None = None   # what the run may use of the machine's GPU (plan_for sets it)
    slab_bytes: int = 0             # one gradient slab (of the ring, or of a shard's clipped gradient)

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
        """megaray's training state in host memory per parameter: its shared files (masters,
        compute copy, gradient ring or buffer, control words) and the moments; not Ray's
        object store, a fixed allowance of the cluster listed beside it."""
        state = sum(v for k, v in self.shm.items() if k != "ray object store")
        state += sum(v for k, v in self.host_private.items() if k.startswith("adam moments"))
        return state / self.params

    def report(self, machine: Machine | None = None) -> str:
        def block(title, items, total, have=None):
            lines = [f"{title}: {size(total):>10}" + (f"  ({have})" if have is not None else "")]
            lines += [f"    {k:<48} {size(v):>10}" for k, v in items.items()]
            return lines

        active = f" ({count(self.active)} active a token)" if self.active and self.active != self.params else ""
        out = [f"model: {count(self.params)} parameters{active}; host state {self.host_bytes_per_param:.2f} "
               f"bytes/param" + (f"; {self.windows}" if self.windows else "")]
        out += block("host memory", {**self.shm, **self.host_private}, self.host_total,
                     f"usable {host_budget(machine) / GiB:.2f} GiB of {machine.host_bytes / GiB:.2f} available: "
                     f"{_HOST_USABLE}" if machine else None)
        out += block("  of which shared memory", self.shm, self.shm_total,
                     f"available {machine.shm_bytes / GiB:.2f} GiB" if machine else None)
        saved = f", {describe_input_stride(self.input_stride)}" if self.input_stride > 1 else ""
        plain = "" if self.lean or not self.keep_blocks else ", as plain autograd saves them"
        out += block(f"GPU (keeping {self.keep_blocks} blocks' activations{plain}, {self.offload_inputs} blocks' "
                     f"inputs in host memory{saved})", self.gpu, self.gpu_total)
        if self.gpu_budget is not None:
            out[-len(self.gpu) - 1] += f"  (usable {self.gpu_budget / GiB:.2f} GiB: {_USABLE})"
        return "\n".join(out)


def plan(cfg: RunConfig, keep: int | None = None, on_gpu: bool = True, offload: int | None = None,
         lean: bool = True) -> Plan:
    m, t = cfg.model, cfg.train
    units = build_layout(m)
    h = Handles.for_config(cfg, "plan", 0, units)
    local = m.local_blocks
    windows = (f"{local} of {m.num_hidden_layers} blocks attend within {m.local_window} tokens (TFLOP/s counts "
               "what a window computes)") if local else ""
    p = Plan(params=m.num_params(), active=m.active_params(), slab_bytes=h.slab_bytes, windows=windows)
    o = cfg.optim
    p.shm = {f"{_SHORT[o.master_dtype]} master weights": h.held_bytes("master")}     # resident: on the GPU
    if not h.aliased:
        p.shm[f"{t.compute_dtype} compute copy"] = h.held_bytes("compute")
    if h.grad_placement == "host":
        p.shm[f"gradients waiting for the norm ({_SHORT[h.grad_dtype]}, host)"] = h.held_bytes("grads")
    else:
        p.shm[f"gradient ring ({h.ring_slabs} x {size(h.slab_bytes)})"] = h.ring_bytes
    p.shm["control words"] = h.control_bytes
    if cfg.cluster.address is None:
        p.shm["ray object store"] = cfg.cluster.object_store_mb * 2**20
    streamed = p.params - sum(units[u].numel for u in h.resident)      # resident moments live on the device
    p.host_private = {f"adam moments ({_SHORT[o.moment_dtype]})": 2 * DTYPES[o.moment_dtype].itemsize * streamed,
                      "actor processes": PROCESS_BYTES * (cfg.optim.num_shards + 3 + cfg.worker.count)}
    if writes_clipped_gradient(o, h.grad_placement, h.grad_dtype):
        p.host_private["clipped gradient (a slab a shard)"] = h.slab_bytes * o.num_shards
    if on_gpu:
        p.host_private["CUDA libraries of the GPU worker(s)"] = CUDA_PROCESS_BYTES * cfg.worker.count
    else:
        p.host_private["step gradients held by the worker (CPU device)"] = 4 * p.params
    L = m.num_hidden_layers
    # With keep_activations unset the worker keeps as many blocks as fit; the plan counts
    # the minimum (none), which is what must fit.
    p.keep_blocks = min(L, keep if keep is not None else (cfg.worker.keep_activations or 0))
    p.offload_inputs = min(L - p.keep_blocks, offload if offload is not None else (cfg.worker.offload_inputs or 0))
    p.input_stride = cfg.worker.stride
    if p.offload_inputs:
        one_input = memory.StepShape.of(cfg).one_input
        n = memory.anchors(p.offload_inputs, p.input_stride)     # the saved ones among them
        p.host_private[f"offloaded block inputs ({n}, pinned)"] = n * one_input * cfg.worker.count
    p.lean = lean
    p.gpu = memory.gpu_items(cfg, p.keep_blocks, p.offload_inputs, h.slab_bytes if h.cast_on_device else 0, lean)
    return p


def shortfalls(p: Plan, machine: Machine) -> list[str]:
    out = []
    host = host_budget(machine)
    if p.host_total > host:
        out.append(f"host memory: needs {p.host_total / GiB:.2f} GiB, {host / GiB:.2f} GiB usable "
                   f"(short by {(p.host_total - host) / GiB:.2f} GiB; {_HOST_USABLE})")
    if p.shm_total > machine.shm_bytes:
        out.append(f"shared memory: needs {p.shm_total / GiB:.2f} GiB, {machine.shm_bytes / GiB:.2f} GiB free "
                   f"(short by {(p.shm_total - machine.shm_bytes) / GiB:.2f} GiB)")
    if p.gpu_budget is not None and p.gpu_total > p.gpu_budget:
        out.append(f"GPU memory: needs {p.gpu_total / GiB:.2f} GiB, {p.gpu_budget / GiB:.2f} GiB usable "
                   f"(short by {(p.gpu_total - p.gpu_budget) / GiB:.2f} GiB; {_USABLE})")
    return out


def cast_slab_bytes(cfg: RunConfig) -> int:
    """The worker's fp32 staging slab when it casts the master on the device, else 0."""
    h = Handles.for_config(cfg, "plan", 0, build_layout(cfg.model))
    return h.slab_bytes if h.cast_on_device else 0


def offload_needed(cfg: RunConfig, gpu_bytes: int) -> int:
    """The fewest first blocks whose inputs must wait in host memory for the plan to fit."""
    return memory.offload_count(cfg, gpu_bytes, cast_slab_bytes=cast_slab_bytes(cfg))


def host_budget(machine: Machine) -> int:
    """The host memory a run plans to use on ``machine``: what is available less the
    reserve for the plan's error (HOST_RESERVE, at least HOST_RESERVE_MIN)."""
    return max(0, machine.host_bytes - max(HOST_RESERVE_MIN, int(HOST_RESERVE * machine.host_bytes)))


def gpu_budget(cfg: RunConfig, machine: Machine) -> int | None:
    """The GPU memory the run plans to use on ``machine`` (``memory.gpu_budget``: the budget
    the worker plans against at run time), None without a GPU."""
    if machine.gpu_bytes is None:
        return None
    return memory.gpu_budget(machine.gpu_bytes, cfg.worker.gpu_memory_gib)


def resolve(cfg: RunConfig, machine: Machine, speeds: Speeds | None = None) -> RunConfig:
    """The config with its 'auto' choices decided for ``machine``, in one straight line:

    1. ``optim.grad_placement``: each home of the gradients (the device, host memory; the
       device alone without a GPU) is placed (2 and 3, ``_placed``); of the homes with which
       the run fits, the faster predicted step wins, the device among equals (within 0.5%);
    2. ``optim.resident_units``: the cost model's fastest number of resident units within the
       GPU budget and host memory (``choose_placement``; host without a GPU, or where resident
       units cannot be: a bf16 master, several workers, a remote worker);
    3. ``worker.input_stride`` null, once the placement is known (``input_stride``), then
       ``worker.offload_inputs`` null on a GPU: the inputs that must wait in host memory for
       the step to fit the GPU budget (``offload_needed``), the number the host plan counts;
    4. ``optim.grad_ring_slabs`` null: everything above is chosen with the shallowest ring,
       which ``ring_depth`` then deepens with what host memory spares, so a deep ring never
       costs a resident unit.

    A resolved config resolves to itself."""
    speeds = speeds or shard_speeds(cfg)
    deepen = cfg.optim.grad_ring_slabs is None
    if deepen:
        cfg = replaced(cfg, "optim", grad_ring_slabs=MIN_RING_SLABS_PER_SHARD * cfg.optim.num_shards)
    gpu = gpu_budget(cfg, machine)
    if cfg.optim.grad_placement != "auto":
        cfg = _placed(cfg, machine, speeds, gpu)
    else:
        homes = [_placed(replaced(cfg, "optim", grad_placement=g), machine, speeds, gpu)
                 for g in (("device", "host") if gpu is not None else ("device",))]
        cfg = _faster_home(homes, machine, speeds, gpu)
    if deepen:
        cfg = replaced(cfg, "optim", grad_ring_slabs=ring_depth(cfg, machine))
    return cfg


def _placed(cfg: RunConfig, machine: Machine, speeds: Speeds, gpu: int | None) -> RunConfig:
    """Steps 2 and 3 of ``resolve`` for a config whose gradients' home is decided."""
    if cfg.optim.resident_units == "auto":
        res = 0
        if gpu is not None and can_be_resident(cfg):
            rows = choose_placement(cfg, speeds, gpu, cast_slab_bytes(cfg), host_budget(machine))
            res = best(rows)["resident"] if rows else 0
        cfg = replaced(cfg, "optim", resident_units=res or "host")
    if cfg.worker.input_stride is None:
        cfg = replaced(cfg, "worker", input_stride=input_stride(cfg, machine))
    if cfg.worker.offload_inputs is None and gpu is not None:
        # the worker offloads exactly what the host plan counts, never its own count from the
        # free memory it sees at step 0 (the CUDA libraries loaded by then: a smaller budget)
        cfg = replaced(cfg, "worker", offload_inputs=offload_needed(cfg, gpu))
    return cfg


def _faster_home(homes: list[RunConfig], machine: Machine, speeds: Speeds, gpu: int | None) -> RunConfig:
    """Of the placed homes (the device first), the faster that fits; where none fits, the
    device if its GPU memory suffices, else the last (so the refusal names the real shortfall)."""
    timed = [(step, c) for c in homes if (step := _fitting_step(c, machine, speeds, gpu)) is not None]
    if not timed:
        return homes[0] if gpu is None or plan_for(homes[0], machine).gpu_total <= gpu else homes[-1]
    fastest = min(step for step, _ in timed)
    return next(c for step, c in timed if step <= fastest * 1.005)


def input_stride(cfg: RunConfig, machine: Machine) -> int:
    """``worker.input_stride`` null decided for a config resolved otherwise: 1 (every block's
    input saved, the fastest), unless the run does not fit ``machine`` that way and does with
    2, 3 or 4: the smallest. On the GPU the inputs that do not fit wait in host memory
    (``offload_needed``); a stride is for a step whose inputs fit neither there nor, offloaded,
    in host memory: each stride saves a 1/S share of them for (S-1)/S more forward passes."""
    if machine.gpu_bytes is None:
        return 1
    for s in (1, 2, 3, 4):
        if not shortfalls(plan_for(replaced(cfg, "worker", input_stride=s), machine), machine):
            return s
    return 1


def ring_depth(cfg: RunConfig, machine: Machine) -> int:
    """The gradient ring's slabs for a resolved config whose ring is set at its shallowest: up
    to RING_SLABS_PER_SHARD a shard, with what host memory and /dev/shm hold beyond the plan
    less RING_HEADROOM of the host's memory, or the plan's reserve where that is more (a deep
    ring buys a few percent of a step, a run killed for memory loses it all)."""
    o = cfg.optim
    if o.grad_placement == "host":
        return o.ring_slabs                         # no ring: the gradients wait in their own regions
    p = plan_for(cfg, machine)
    keep_free = max(int(RING_HEADROOM * machine.host_bytes), machine.host_bytes - host_budget(machine))
    spare = min(machine.host_bytes - p.host_total, machine.shm_bytes - p.shm_total) - keep_free
    extra = max(0, spare // p.slab_bytes)
    return min(RING_SLABS_PER_SHARD * o.num_shards, o.ring_slabs + extra)


def _fitting_step(cfg: RunConfig, machine: Machine, speeds: Speeds, gpu: int | None) -> float | None:
    """The predicted step of a resolved config on ``machine``, or None when it does not fit
    (with the inputs the worker would offload and the blocks it would keep)."""
    p = plan_for(cfg, machine)
    if shortfalls(p, machine):
        return None
    keep = 0
    if gpu is not None:     # the inputs the plan offloads (resolved: worker.offload_inputs)
        keep, _ = memory.keep_choice(cfg, gpu, p.offload_inputs, cast_slab_bytes(cfg))
    return predict(cfg, speeds, keep)["step_s"]


def choose_placement(cfg: RunConfig, speeds: Speeds, budget_bytes: int, cast_slab_bytes: int,
                     host_bytes: int | None = None) -> list[dict]:
    """Every resident unit count (the embedding, then blocks) that fits the GPU budget (with
    the inputs the worker would offload and the blocks it would keep) and, given
    ``host_bytes``, host memory (resident units leave it: a model too big for the host alone
    may fit), each with its predicted step, in order of N; the best is the fastest (the
    fewest units among equals)."""
    rows = []
    for res in range(cfg.model.num_hidden_layers + 2):
        c = replaced(cfg, "optim", resident_units=res)
        offload = memory.offload_count(c, budget_bytes, cast_slab_bytes=cast_slab_bytes)
        keep, lean = memory.keep_choice(c, budget_bytes, offload, cast_slab_bytes)    # the worker's choice
        need = memory.gpu_total(c, keep, offload, cast_slab_bytes, lean)
        if need > budget_bytes:
            break                                   # more resident units need more GPU memory
        host = plan(c, keep=keep, offload=offload).host_total
        if host_bytes is not None and host > host_bytes:
            continue                                # fewer resident units need more host memory
        rows.append({"resident": res, "keep": keep, "offload": offload, "gpu_bytes": need, "host_bytes": host,
                     **predict(c, speeds, keep)})
    return rows


def best(rows: list[dict]) -> dict:
    """The fastest placement; among those within 0.5% of it, the fewest resident units."""
    fastest = min(r["step_s"] for r in rows)
    return next(r for r in rows if r["step_s"] <= fastest * 1.005)


def describe_placement(resident_units: int) -> str:
    """``optim.resident_units`` N in words: which units are resident."""
    if resident_units <= 0:
        return "every unit streamed"
    if resident_units == 1:
        return "the embedding resident"
    if resident_units == 2:
        return "the embedding and the first block resident"
    return f"the embedding and the first {resident_units - 1} blocks resident"


def describe_input_stride(stride: int) -> str:
    """``worker.input_stride`` S > 1 in words: what is saved and what it costs."""
    return (f"one recomputed block's input in {stride} saved (worker.input_stride {stride}): the backward runs "
            f"{stride - 1} of every {stride} recomputed blocks forward again")


def can_be_resident(cfg: RunConfig) -> bool:
    o, w = cfg.optim, cfg.worker
    return o.master_dtype == "float32" and w.count == 1 and w.node == "local"


def shard_speeds(cfg: RunConfig) -> Speeds:
    """The default speeds with the cores the optimizer shards are given."""
    return Speeds(cores=cfg.optim.num_shards * cfg.optim.threads_per_shard)


def plan_for(cfg: RunConfig, machine: Machine) -> Plan:
    """The plan of the run as it would run on ``machine``: on its GPU (offloading the inputs
    the worker would offload) or, without one, on the CPU (which holds the step's gradients)."""
    cfg = resolve(cfg, machine)          # worker.offload_inputs decided: what the worker offloads
    gpu = gpu_budget(cfg, machine)
    p = plan(cfg, on_gpu=gpu is not None)
    p.gpu_budget = gpu
    return p


def plan_as_run(cfg: RunConfig, machine: Machine) -> Plan:
    """``plan_for``'s plan with the blocks the worker keeps (``worker.keep_activations``
    unset: as many as the GPU budget holds, ``memory.keep_choice``) where ``plan_for``
    counts the fewest that must fit: what ``megaray plan`` shows and predicts the step with."""
    p = plan_for(cfg, machine)
    if p.gpu_budget is None or cfg.worker.keep_activations is not None:
        return p
    cfg = resolve(cfg, machine)
    keep, lean = memory.keep_choice(cfg, p.gpu_budget, p.offload_inputs, cast_slab_bytes(cfg))
    shown = plan(cfg, keep=keep, on_gpu=True, offload=p.offload_inputs, lean=lean)
    shown.gpu_budget = p.gpu_budget
    return shown
