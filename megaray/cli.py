"""``megaray`` command line: ``megaray COMMAND ...``, one entrypoint module per command.

Each command is a thin module in ``megaray.pipelines`` with a ``main(argv, prog)``; it is
imported only when asked for, so ``megaray --help`` does not wait for torch and Ray.
Output cut short by its reader (``megaray train -h | head``) ends quietly, not in a traceback.
"""
from __future__ import annotations

import importlib
import os
import sys
from importlib import metadata

COMMANDS = {   # name: (entrypoint module, arguments, what it does)
    "train": ("megaray.pipelines.train", "CONFIG [section.key=value ...]",
              "train a model (CONFIG: a YAML file or 'demo')"),
    "plan": ("megaray.pipelines.plan", "CONFIG [section.key=value ...]",
             "the run's host/shared/GPU memory plan, checked here"),
    "prepare": ("megaray.pipelines.prepare", "INPUT... --out DIR --seq-len N",
                "tokenize jsonl/parquet/text into packed shards (Ray tasks)"),
    "export": ("megaray.pipelines.export", "RUN_OR_CHECKPOINT OUT_DIR", "write a Hugging Face model directory"),
    "compare": ("megaray.pipelines.compare", "RUN REFERENCE_RUN [--within PCT ...]",
                "two runs' loss curves: their largest difference, a PNG"),
    "clean": ("megaray.pipelines.clean", "[--shm-dir DIR]", "delete the shared-memory files of runs whose driver died"),
    "bench": ("megaray.pipelines.bench", "[--shape S --seq N --tokens N ...]",
              "megaray vs a GPU-resident PyTorch baseline (needs a GPU)"),
}
USAGE = ("usage: megaray [--version] COMMAND ...\n\ncommands:\n" + "\n".join(
    f"  {name:<8} {args:<37} {what}" for name, (_, args, what) in COMMANDS.items())
    + "\n\n'megaray COMMAND --help' describes a command's arguments and their defaults.\n")


def version() -> str:
    try:
        return metadata.version("megaray")
    except metadata.PackageNotFoundError:          # a source tree that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # The reader went away (``| head``): point stdout at nothing so the interpreter's
        # last flush does not raise again, and end as a cut-short pipe does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"megaray {version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"megaray: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[cmd][0]).main(rest, prog=f"megaray {cmd}")


if __name__ == "__main__":
    sys.exit(main())
