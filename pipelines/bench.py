"""Bench entrypoint: ``python -m megaray.pipelines.bench --shape llama1b ...`` (= ``megaray bench``)."""
from __future__ import annotations

import json
import sys

from .args import parse, parser


def main(argv: list[str] | None = None, prog: str = "megaray bench") -> int:
    p = parser(prog, "megaray vs a GPU-resident PyTorch baseline of the same model and batches, in one "
                     "process tree: both step times, their ratio, and where megaray's time went")
    p.add_argument("--shape", help="a model shape of the registry (megaray.shapes; default llama1b, and "
                                   "llama3b's heads for --attention-alone)")
    p.add_argument("--seq", type=int, default=2048, help="tokens a row (train.seq_len)")
    p.add_argument("--tokens", type=int, default=65536, help="tokens per step")
    p.add_argument("--micro-batch", type=int, default=4, help="rows a micro-batch (train.micro_batch_size)")
    p.add_argument("--steps", type=int, default=4, help="steps measured (the first is a warm-up)")
    p.add_argument("--shards", type=int, default=7, help="optimizer shards (optim.num_shards)")
    p.add_argument("--threads", type=int, default=2, help="threads per optimizer shard")
    p.add_argument("--no-baseline", action="store_true", help="megaray alone (a model the GPU cannot hold)")
    p.add_argument("--attention-alone", metavar="SEQxBATCH,...",
                   help="instead: one attention layer alone on the GPU, causal and by document (--documents, "
                        "default 512), with --shape's heads and its window where it has one, e.g. 2048x4,131072x1")
    p.add_argument("--block-alone", metavar="SEQxBATCH,...",
                   help="instead: one decoder block of --shape alone on the GPU, its elementwise passes fused and "
                        "eager, against its matrix products and attention alone, e.g. 4096x1; rows of packed "
                        "documents with --documents; a model with sliding windows: a local and a global block")
    p.add_argument("--documents", type=int, metavar="MEAN_LEN",
                   help="rows of packed documents of this mean length, under document attention")
    p.add_argument("--set", nargs="*", default=[], help="section.key=value for the megaray config")
    p.add_argument("--json", help="append the result as one JSON line to this file")
    p.add_argument("--checkpoint-dir", help="also time writing and loading one checkpoint here")
    p.add_argument("--optimizer-scaling", help="also run megaray alone with these shard counts, e.g. 1,2,4,8, "
                   "sharing this machine's cores")
    p.add_argument("--adamw-alone", metavar="PxT,...", help="instead: the CPU AdamW alone, for every state "
                   "combination, P processes x T threads each, e.g. 1x16,4x4,8x2,16x1 (no GPU needed)")
    a = parse(p, argv)
    if a.shape is None and not a.attention_alone:
        a.shape = "llama1b"
    for key in ("attention_alone", "block_alone", "adamw_alone"):
        if getattr(a, key):
            return _alone(key, a, prog)
    import ray
    import yaml

    from megaray.bench.run import bench, bench_config, optimizer_scaling, print_table
    from megaray.driver.cluster import connect_ray
    from megaray.driver.runlog import log, log_to_console

    extra = {kv.split("=", 1)[0]: yaml.safe_load(kv.split("=", 1)[1]) for kv in a.set}
    cfg = bench_config(a.shape, a.seq, a.tokens, a.micro_batch, a.steps, a.shards, a.threads, extra)
    started = connect_ray(cfg)
    # the start-up's progress (the shards' measured rate, the store, the workers, the shards),
    # as megaray train logs it
    level = log.level
    shown = log_to_console()
    try:
        r = bench(cfg, baseline=not a.no_baseline, checkpoint_dir=a.checkpoint_dir, documents=a.documents)
        if a.optimizer_scaling:
            r["optimizer_scaling"] = optimizer_scaling(cfg, [int(n) for n in a.optimizer_scaling.split(",")])
        print_table(r)
        _append_json(a.json, r)
        return 0
    finally:
        if shown is not None:
            log.removeHandler(shown)
        log.setLevel(level)
        if started:
            ray.shutdown()


def _cases(text: str) -> list[tuple[int, ...]]:
    """``2048x4,131072x1`` -> [(2048, 4), (131072, 1)]."""
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",")]


def _alone(key: str, a, prog: str) -> int:
    """One of the measurements of a part alone (--attention-alone, --block-alone, --adamw-alone)."""
    if key == "attention_alone":
        from megaray.bench.attention import print_rows, run

        rows = run(_cases(a.attention_alone), a.documents or 512, shape=a.shape or "llama3b")
    elif key == "block_alone":
        import torch

        if not torch.cuda.is_available():
            print(f"{prog}: --block-alone times a block on a CUDA GPU, and this machine has none", file=sys.stderr)
            return 2
        from megaray.bench.block import print_rows, run

        rows = run(a.shape, _cases(a.block_alone), documents=a.documents)
    else:
        from megaray.bench.adamw import print_rows, run

        rows = run(_cases(a.adamw_alone))
    print_rows(rows)
    _append_json(a.json, {key: rows})
    return 0


def _append_json(path: str | None, record: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.exit(main(prog="python -m megaray.pipelines.bench"))
