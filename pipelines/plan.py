"""Plan entrypoint: ``megaray plan CONFIG [section.key=value ...]`` prints the memory plan (host,
shared memory, GPU, each component) and the predicted step time, checks it against this
machine (or, with ``--host-gib``/``--gpu-gib``, against a machine you do not have), and prints
the largest micro-batch and sequence length that fit the GPU. Exit status 1 when it does not
fit."""
from __future__ import annotations

import os
import sys

from .args import parse, parser


def main(argv: list[str] | None = None, prog: str = "megaray plan") -> int:
    p = parser(prog, __doc__, takes_config=True)
    p.add_argument("--host-gib", type=float, help="plan for a machine with this much host memory (GiB) "
                                                  "(default: this machine's)")
    p.add_argument("--gpu-gib", type=float, help="... and a GPU with this much memory (GiB); implies a GPU "
                                                 "(default: this machine's GPU, if any)")
    p.add_argument("--cores", type=int, help="CPU cores for the optimizer shards (default: this machine's, or "
                                             "16 with --host-gib)")
    p.add_argument("--link-gbps", type=float, help="host<->GPU copy rate, GB/s each way (default 53.7: pinned, PCIe 5)")
    p.add_argument("--gpu-tflops", type=float,
                   help="one bf16 TFLOP/s for all of a step's compute (default: the measured rates, "
                        "446-573 for the matrix products by hidden size, 281-470 for attention by sequence length)")
    a = parse(p, argv)

    from megaray.errors import ConfigError
    from megaray.fitting import remedies, savings
    from megaray.loader import load_config
    from megaray.plan import (
        describe_placement,
        plan_as_run,
        plan_for,
        resolve,
        shortfalls,
        size,
    )

    try:
        cfg = load_config(a.config, a.overrides)
        machine, where, speeds = _machine(a, cfg)
    except ConfigError as e:
        print(f"megaray: config error: {e}", file=sys.stderr)
        return 2
    asked = cfg
    cfg = resolve(cfg, machine, speeds)
    pl = plan_as_run(cfg, machine)          # with the blocks the worker would keep
    short = shortfalls(plan_for(cfg, machine), machine)
    print(f"plan for {where}; gradients wait for the norm on the "
          f"{'GPU' if cfg.optim.grad_placement != 'host' else 'host'} (optim.grad_placement); "
          f"{describe_placement(cfg.optim.resident_count)} (optim.resident_units {asked.optim.resident_units}; "
          f"{cfg.model.num_hidden_layers} blocks)")
    print(pl.report(machine))
    resident = cfg.optim.resident_count
    for override, saved, per_param in savings(cfg):
        what = f"saves {size(saved)}" if saved >= 0 else f"needs {size(-saved)} more"
        why = ""
        if resident and ("master_dtype" in override or override == "both"):
            why = (f"; a bf16 master is never resident, so the {resident} resident units' state moves to host memory "
                   "with it")
        print(f"option {override}: {what} of host memory ({per_param:.2f} bytes/param{why})")
    if machine.gpu_bytes is not None:
        print_step(cfg, machine, pl, speeds)
        if a.gpu_gib is not None or a.gpu_tflops is not None:
            print(f"assumed for the step: {_assumed(speeds)}")
    else:
        print("no GPU visible here: the GPU column is not checked, and no step is predicted "
              "(--gpu-gib N plans for an N GiB GPU and predicts it)")
    for line in short:
        print(f"DOES NOT FIT: {line}")
    if short:
        for fix in remedies(asked, machine):
            print(f"fits with: {fix}")
    cluster = _cluster_shortfall(cfg)
    if cluster:
        print(f"DOES NOT FIT: {cluster}")
    if short or cluster:
        print(f"DOES NOT FIT {where}" + (" and its Ray cluster" if cluster and short else "") if short else
              f"DOES NOT FIT the Ray cluster at {cfg.cluster.address or os.environ['RAY_ADDRESS']}")
        return 1
    print(f"FITS {where}")
    return 0


def _machine(a, cfg):
    """The machine planned for (this one, or the one --host-gib/--gpu-gib describe), its
    description, and the speeds the step is predicted with."""
    from megaray.cost import Speeds
    from megaray.machine import Machine
    from megaray.memory import GiB

    if a.host_gib is not None or a.gpu_gib is not None:
        here = Machine.here(cfg.cluster.shm_dir)
        host = int(a.host_gib * GiB) if a.host_gib is not None else here.host_bytes
        machine = Machine(host, host, int(a.gpu_gib * GiB) if a.gpu_gib is not None else None)
        where = (f"a machine of {host / GiB:.0f} GiB host memory and "
                 + (f"a {a.gpu_gib:g} GiB GPU" if a.gpu_gib is not None else "no GPU"))
    else:
        machine = Machine.here(cfg.cluster.shm_dir, probe_gpu=cfg.worker.device != "cpu")
        where = "this machine"
    speeds = Speeds(gpu_tflops=a.gpu_tflops, link_gbps=a.link_gbps or 53.7,
                    cores=a.cores or (16 if a.host_gib is not None else os.cpu_count() or 1))
    return machine, where, speeds


def print_step(cfg, machine, pl, speeds) -> None:
    """The predicted step with the blocks the worker would keep, what resident units buy, and
    the largest micro-batch and sequence that fit the GPU."""
    from megaray.cost import predict
    from megaray.fitting import largest_fit
    from megaray.plan import (
        best,
        can_be_resident,
        cast_slab_bytes,
        choose_placement,
        describe_input_stride,
        gpu_budget,
        host_budget,
    )

    gpu = gpu_budget(cfg, machine)
    keep, lean = pl.keep_blocks, pl.lean       # the worker's choice, as the GPU header shows it
    t = predict(cfg, speeds, keep)
    print(f"predicted step: {_secs(t['step_s'])} (compute {_secs(t['compute_s'])}, forward waiting for updates "
          f"{_secs(t['wait_updates_s'])}, copy-in {_secs(t['copy_in_s'])}, copy-out {_secs(t['copy_out_s'])}, "
          f"updates {_secs(t['updates_s'])} on {speeds.cores} cores; keeping {keep} blocks' activations"
          f"{'' if lean else ', as plain autograd saves them'}"
          f"{'; ' + describe_input_stride(cfg.worker.stride) if cfg.worker.stride > 1 else ''}), "
          f"{cfg.train.tokens_per_step / t['step_s']:,.0f} tokens/s")
    if can_be_resident(cfg):
        print_placements(choose_placement(cfg, speeds, gpu, cast_slab_bytes(cfg), host_budget(machine)), best)
    mb, seq = largest_fit(cfg, machine)
    print(f"largest micro_batch_size at seq_len {cfg.train.seq_len}: {mb}; "
          f"largest seq_len at micro_batch_size {cfg.train.micro_batch_size}: {seq}")


def _cluster_shortfall(cfg) -> str | None:
    """Where the run would attach to a Ray cluster (cluster.address, RAY_ADDRESS): why that
    cluster cannot hold it, or None (a local Ray is started with what the run needs)."""
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    if not address:
        return None
    import ray

    from megaray.driver.cluster import attach, bundle_shortfall, run_bundle
    from megaray.errors import ClusterError

    try:
        attach(address, log_to_driver=False, logging_level="ERROR")
        have = ray.cluster_resources()
    except ClusterError as e:
        return str(e)
    finally:
        ray.shutdown()
    device = cfg.worker.device if cfg.worker.device != "auto" else ("cuda" if have.get("GPU", 0) >= 1 else "cpu")
    why = bundle_shortfall(run_bundle(cfg, device), have)
    return why


def _secs(x: float) -> str:
    """Seconds a person reads: 15.32 s, 0.74 s, 3.1 ms, 0.0421 ms."""
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1000:.3g} ms"


def _assumed(speeds) -> str:
    """The speeds a step on a GPU that is not this machine's is predicted with."""
    gpu = (f"{speeds.gpu_tflops:g} bf16 TFLOP/s for all compute (--gpu-tflops)" if speeds.gpu_tflops else
           "the reference H200's measured bf16 rates (matrix products by hidden size, attention by sequence "
           "length; --gpu-tflops sets one rate)")
    return (f"{gpu}; {speeds.link_gbps:g} GB/s host<->GPU each way (--link-gbps); AdamW on {speeds.cores} cores at "
            "the reference machine's rate per core (--cores)")


def print_placements(rows: list[dict], best) -> None:
    """What resident units buy: a few placements that fit the GPU and host memory, with
    their GPU need and predicted step, and the seconds each saves per GiB of GPU memory over
    the fewest resident units that fit (all-host, where that fits)."""
    if not rows:
        print("placements: none fits both the GPU and host memory")
        return
    pick, first = best(rows)["resident"], rows[0]
    show = sorted({0, len(rows) - 1, len(rows) // 4, len(rows) // 2, 3 * len(rows) // 4,
                   next(i for i, r in enumerate(rows) if r["resident"] == pick)})
    print("placements (optim.resident_units N: the first N units resident, the embedding first; host memory "
          f"allows N >= {first['resident']}):")
    for r in (rows[k] for k in show):
        extra = (r["gpu_bytes"] - first["gpu_bytes"]) / 2**30
        per_gib = (first["step_s"] - r["step_s"]) / extra if extra > 0 else 0.0
        mark = "  <- auto" if r["resident"] == pick else ""
        print(f"  {r['resident']:4d}: GPU {r['gpu_bytes'] / 2**30:7.2f} GiB, host {r['host_bytes'] / 2**30:7.2f} GiB, "
              f"step {r['step_s']:7.3f} s (waiting for updates {r['wait_updates_s']:.3f}), "
              f"saves {per_gib:.3f} s per GiB{mark}")


if __name__ == "__main__":
    sys.exit(main(prog="python -m megaray.pipelines.plan"))
