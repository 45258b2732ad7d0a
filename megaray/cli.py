"""``megaray`` command line: ``megaray train CONFIG [key=value ...]``."""
from __future__ import annotations

import sys

USAGE = """usage: megaray COMMAND ...

commands:
  train CONFIG [section.key=value ...]   train a model (CONFIG: a YAML file or 'demo')
  plan CONFIG [section.key=value ...]    the run's host/shared/GPU memory plan, checked here
  prepare INPUT... --out DIR --seq-len N   tokenize jsonl/parquet/text into packed shards (Ray tasks)
  export RUN_OR_CHECKPOINT OUT_DIR         write a Hugging Face model directory
  bench [--shape S --seq N --tokens N ...] megaray vs a GPU-resident PyTorch baseline (needs a GPU)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        from megaray.pipelines.train import main as train_main

        return train_main(rest)
    if cmd == "plan":
        from megaray.pipelines.plan import main as plan_main

        return plan_main(rest)
    if cmd == "prepare":
        from megaray.pipelines.prepare import main as prepare_main

        return prepare_main(rest)
    if cmd == "export":
        from megaray.pipelines.export import main as export_main

        return export_main(rest)
    if cmd == "bench":
        from megaray.pipelines.bench import main as bench_main

        return bench_main(rest)
    print(f"megaray: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
