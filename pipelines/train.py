"""Train entrypoint: ``python -m megaray.pipelines.train CONFIG [section.key=value ...]``.

This is what ``megaray train`` runs and what ``ray job submit`` runs. It parses the config
and checks what it can without Ray (a bad config, a checkpoint the run cannot continue),
connects to Ray, trains, and shuts down in ``finally``. It ends saying where the run's
files are and the command that goes on from them. Exit status: 0 on success, 2 for a config
error, 1 for a failed run, 128 + the signal's number for a run stopped by SIGTERM (143) or
Ctrl-C (130).
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from megaray.errors import ConfigError, MegarayError, RunStopped
from megaray.loader import load_config

from .args import parse, parser


def main(argv: list[str] | None = None, prog: str = "megaray train") -> int:
    args = parse(parser(prog, "Train a model with megaray; the run directory lands under run.dir "
                              "(TensorBoard events, metrics.jsonl, train.log, checkpoints).", takes_config=True), argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from megaray.driver.runner import check_before_start

        check_before_start(cfg)
    except ConfigError as e:
        print(f"megaray: config error: {e}", file=sys.stderr)
        return 2
    from megaray.driver.cluster import connect_ray
    from megaray.driver.runner import interrupts_held, resume_command, train

    started = False
    try:
        started = connect_ray(cfg)
        s = train(cfg)
        again = resume_command(cfg, shlex.split(prog), args.config, args.overrides, Path(s["checkpoint"]).parent)
        print(finished_message(s, again))
        return 0
    except RunStopped as e:
        print(f"megaray: {e}; actors stopped and shared memory freed", file=sys.stderr)
        if e.checkpoint:
            again = resume_command(cfg, shlex.split(prog), args.config, args.overrides, Path(e.checkpoint).parent)
            print(f"megaray: checkpoint {e.checkpoint}; resume with:\n  {shlex.join(again)}", file=sys.stderr)
        else:
            print("megaray: no checkpoint written (checkpoint.on_sigterm: false)", file=sys.stderr)
        return 128 + e.signum
    except ConfigError as e:
        print(f"megaray: config error: {e}", file=sys.stderr)
        return 2
    except MegarayError as e:
        print(f"megaray: run failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("megaray: interrupted; actors stopped and shared memory freed (no checkpoint: a first Ctrl-C "
              "during training writes one)", file=sys.stderr)
        return 130
    finally:
        if started:
            import ray

            with interrupts_held():
                ray.shutdown()


def finished_message(s: dict, again: list[str]) -> str:
    """The end of a successful run: its figures, where its files are, what goes on from them
    (``again``: the command that continues its checkpoints)."""
    held = f", held-out {s['heldout_loss']:.4f}" if s.get("heldout_loss") is not None else ""
    loss = f", loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}{held}" if s.get("first_loss") is not None else ""
    ck = s["checkpoint"]
    more = [a for a in again if not a.startswith("train.steps=")] + ["train.steps=N"]
    return (f"megaray: run {s['run_id']} finished: steps {s['first_step']}..{s['steps']}{loss}, "
            f"{s['tokens_per_second']:,.0f} tokens/s\n"
            f"  run directory    {s['run_dir']} (tensorboard --logdir {s['run_dir']}/tb)\n"
            f"  final checkpoint {ck}\n"
            f"  export           megaray export {shlex.quote(ck)} OUT_DIR\n"
            f"  train on         {shlex.join(more)}  (N > {s['steps']}: from the final checkpoint)")


if __name__ == "__main__":
    sys.exit(main(prog="python -m megaray.pipelines.train"))
