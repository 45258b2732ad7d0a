"""Plan entrypoint: ``megaray plan CONFIG [section.key=value ...]`` prints the memory plan
(host, shared memory, GPU, each component), checks it against this machine, and prints the
largest micro-batch and sequence length that fit the GPU. Exit status 1 when it does not fit."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None, prog: str = "megaray plan") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    from megaray.errors import ConfigError
    from megaray.loader import load_config
    from megaray.plan import Machine, largest_fit, plan_for, savings, shortfalls

    try:
        cfg = load_config(a.config, a.overrides)
    except ConfigError as e:
        print(f"megaray: config error: {e}", file=sys.stderr)
        return 2
    machine = Machine.here(cfg.cluster.shm_dir, probe_gpu=cfg.worker.device != "cpu")
    pl = plan_for(cfg, machine)
    print(pl.report(machine))
    for override, saved, per_param in savings(cfg):
        print(f"option {override}: saves {saved / 2**30:.2f} GiB of host memory ({per_param:.2f} bytes/param)")
    if machine.gpu_bytes is not None:
        mb, seq = largest_fit(cfg, machine)
        print(f"largest micro_batch_size at seq_len {cfg.train.seq_len}: {mb}; "
              f"largest seq_len at micro_batch_size {cfg.train.micro_batch_size}: {seq}")
    else:
        print("no GPU visible here: the GPU column is not checked")
    short = shortfalls(pl, machine)
    for line in short:
        print(f"DOES NOT FIT: {line}")
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m megaray.pipelines.plan"))
