"""Export entrypoint: ``megaray export RUN_OR_CHECKPOINT OUT_DIR`` writes a Hugging Face
model directory (config.json, sharded safetensors with index, and the tokenizer and
generation files of the model it started from) that transformers loads. OUT_DIR must be new
or empty; each shard is reported as it is written."""
from __future__ import annotations

import sys
import time

from .args import parse, parser


def main(argv: list[str] | None = None, prog: str = "megaray export") -> int:
    p = parser(prog, __doc__)
    p.add_argument("source", help="a checkpoint folder, a run directory (its newest checkpoint), or a folder "
                                  "of checkpoints")
    p.add_argument("out_dir", help="the model folder to write (new or empty)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    p.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors shard, in GiB")
    a = parse(p, argv)
    from megaray.errors import MegarayError
    from megaray.hf.export import export_checkpoint

    t0 = time.perf_counter()

    def shard(i: int, n: int, name: str, size: int) -> None:
        print(f"megaray: export: shard {i}/{n} {name} ({size / 1e9:.2f} GB) at {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)

    try:
        ck, written = export_checkpoint(a.source, a.out_dir, a.dtype, int(a.shard_gb * 2**30), shard)
    except MegarayError as e:
        print(f"megaray: export failed: {e}", file=sys.stderr)
        return 1
    print(f"megaray: exported {ck} to {a.out_dir}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m megaray.pipelines.export"))
