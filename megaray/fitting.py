"""Whether a run fits a machine, and what would make it fit: ``check`` (``megaray train``
calls it before starting any actor) raises ``PlanError`` with the shortfall, the whole report
of ``megaray.plan`` and the single overrides that would fit (``remedies``); ``savings`` is what
each memory-saving option would save, ``largest_fit`` the largest micro-batch and sequence
that fit the GPU (both for ``megaray plan``)."""
from __future__ import annotations

from megaray import memory
from megaray.config import RunConfig, replaced
from megaray.errors import PlanError
from megaray.machine import Machine
from megaray.plan import (
    Plan,
    can_be_resident,
    describe_placement,
    gpu_budget,
    plan,
    plan_for,
    resolve,
    shortfalls,
)


def savings(cfg: RunConfig) -> list[tuple[str, int, float]]:
    """What each memory-saving option not yet on would save: (override, host bytes saved,
    host bytes per parameter with it)."""
    base = plan(cfg)

    def alt(name: str, **changes) -> tuple[str, int, float]:
        if "master_dtype" in changes:
            changes["resident_units"] = "host"            # a bf16 master is never resident
        q = plan(replaced(cfg, "optim", **changes))
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


def remedies(cfg: RunConfig, machine: Machine) -> list[str]:
    """Single overrides, each of which alone makes a run that does not fit ``machine`` fit
    (tried in this order): gradients to host memory, in bf16 on the GPU, in bf16 in host
    memory, bf16 moments or master, resident units (their state leaves host memory), the
    largest loss chunk that fits (a multiple of 256), the largest micro-batch that fits with
    the same tokens per step.

    ``cfg`` is the config as asked, its 'auto' choices unresolved: each candidate is resolved
    anew, so an override that lets the placement change (bf16 gradients free the GPU memory
    that resident units then take out of host memory) is found. On a resolved config the
    placement chosen for the failing run would stay fixed."""
    def fits(c: RunConfig) -> bool:
        return not shortfalls(plan_for(c, machine), machine)

    def with_(section: str, **changes) -> RunConfig:
        return replaced(cfg, section, **changes)

    out = []
    o, t = cfg.optim, cfg.train
    if resolve(cfg, machine).optim.grad_placement == "device" and machine.gpu_bytes is not None:
        if fits(with_("optim", grad_placement="host")):
            out.append("optim.grad_placement=host")
        if o.grad_dtype == "float32" and fits(with_("optim", grad_placement="device", grad_dtype="bfloat16")):
            out.append("optim.grad_dtype=bfloat16")
    if o.grad_dtype == "float32" and fits(with_("optim", grad_placement="host", grad_dtype="bfloat16")):
        out.append("optim.grad_placement=host optim.grad_dtype=bfloat16")
    if o.moment_dtype == "float32" and fits(with_("optim", moment_dtype="bfloat16")):
        out.append("optim.moment_dtype=bfloat16")
    if o.master_dtype == "float32" and t.compute_dtype == "bfloat16" and fits(with_("optim", master_dtype="bfloat16")):
        out.append("optim.master_dtype=bfloat16")
    if cfg.worker.input_stride == 1 and machine.gpu_bytes is not None:
        if fits(with_("worker", input_stride=2)):
            out.append("worker.input_stride=2")
    if o.resident_units == "host" and can_be_resident(cfg) and machine.gpu_bytes is not None:
        n = resolve(with_("optim", resident_units="auto"), machine).optim.resident_units
        if n != "host" and fits(with_("optim", resident_units=n)):
            out.append(f"optim.resident_units=auto ({describe_placement(n)})")
    chunk = min(t.loss_chunk_tokens, t.micro_batch_size * t.seq_len)
    k = memory._largest(lambda k: fits(with_("train", loss_chunk_tokens=256 * k)), 1, chunk // 256 - 1)
    if k >= 1:
        out.append(f"train.loss_chunk_tokens={256 * k}")
    rows = t.micro_batch_size * t.grad_accum
    mbs = [mb for mb in range(t.micro_batch_size - 1, 0, -1) if rows % mb == 0]
    for mb in mbs:
        if fits(with_("train", micro_batch_size=mb, grad_accum=rows // mb)):
            out.append(f"train.micro_batch_size={mb} train.grad_accum={rows // mb}")
            break
    return out


def largest_fit(cfg: RunConfig, machine: Machine) -> tuple[int, int]:
    """Largest micro_batch_size at this seq_len, and largest seq_len (a multiple of 256) at
    this micro-batch, on the GPU, as the run would be set up for each (a bisection)."""
    if machine.gpu_bytes is None:
        return cfg.train.micro_batch_size, cfg.train.seq_len
    gpu = gpu_budget(cfg, machine)

    def fits(mb, seq):         # as the run would be set up: its gradients' home and offloaded inputs decided
        c = replaced(cfg, "train", micro_batch_size=mb, seq_len=seq)
        return plan_for(c, machine).gpu_total <= gpu

    mb = max(0, memory._largest(lambda k: fits(k, cfg.train.seq_len), 1, 4096))
    seq = 256 * max(0, memory._largest(lambda k: fits(cfg.train.micro_batch_size, 256 * k), 1,
                                       cfg.model.max_position_embeddings // 256))
    return mb, seq


def check(cfg: RunConfig, machine: Machine | None = None, asked: RunConfig | None = None) -> Plan:
    """Raise PlanError with the report when the machine cannot hold the run; the remedies it
    names are tried on ``asked``, the config before ``resolve`` (``cfg`` by default)."""
    machine = machine or Machine.here(cfg.cluster.shm_dir)
    p = plan_for(cfg, machine)
    short = shortfalls(p, machine)
    if short:
        fixes = remedies(asked or cfg, machine)
        hint = ("\nit would fit with any one of: " + "; ".join(fixes)) if fixes else ""
        raise PlanError("the run does not fit this machine:\n  " + "\n  ".join(short) + hint + "\n"
                        + p.report(machine))
    return p
