"""Train entrypoint: ``python -m megaray.pipelines.train CONFIG [section.key=value ...]``.

This is what ``megaray train`` runs and what ``ray job submit`` runs. It parses the config
(refusing a bad one before touching Ray), connects to Ray, trains, and shuts down in
``finally``. Exit status: 0 on success, 2 for a config error, 1 for a failed run.
"""
from __future__ import annotations

import sys

from megaray.errors import ConfigError, MegarayError, RunStopped
from megaray.loader import load_config

from .args import parse, parser


def main(argv: list[str] | None = None, prog: str = "megaray train") -> int:
    args = parse(parser(prog, "Train a model with megaray; the run directory lands under run.dir "
                              "(TensorBoard events, metrics.jsonl, train.log, checkpoints).", takes_config=True), argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"megaray: config error: {e}", file=sys.stderr)
        return 2
    from megaray.driver.cluster import connect_ray
    from megaray.driver.runner import interrupts_held, train

    started = connect_ray(cfg)
    try:
        summary = train(cfg)
        print(f"megaray: run {summary['run_id']} finished; run directory {summary['run_dir']}")
        return 0
    except RunStopped as e:
        print(f"megaray: {e}; actors stopped and shared memory freed", file=sys.stderr)
        return 143
    except MegarayError as e:
        print(f"megaray: run failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("megaray: interrupted; actors stopped and shared memory freed", file=sys.stderr)
        return 130
    finally:
        if started:
            import ray

            with interrupts_held():
                ray.shutdown()


if __name__ == "__main__":
    sys.exit(main(prog="python -m megaray.pipelines.train"))
