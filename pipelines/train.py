"""Train entrypoint: ``python -m megaray.pipelines.train CONFIG [section.key=value ...]``.

This is what ``megaray train`` runs and what ``ray job submit`` runs. It parses the config
(refusing a bad one before touching Ray), connects to Ray, trains, and shuts down in
``finally``. Exit status: 0 on success, 2 for a config error, 1 for a failed run.
"""
from __future__ import annotations

import argparse
import sys

from megaray.errors import ConfigError, MegarayError, RunStopped
from megaray.loader import load_config


def build_parser(prog: str = "megaray train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a model with megaray.")
    p.add_argument("config", help="YAML config file, or the name of a shipped one (demo)")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=20")
    return p


def main(argv: list[str] | None = None, prog: str = "megaray train") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"megaray: config error: {e}", file=sys.stderr)
        return 2
    from megaray.cluster import connect_ray
    from megaray.runner import interrupts_held, train

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
