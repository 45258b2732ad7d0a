"""Prepare entrypoint: ``megaray prepare INPUT [INPUT ...] --out DIR --seq-len N`` tokenizes
jsonl, parquet or text files (or folders of them) into packed token shards with Ray tasks,
for ``data.source: shards``, on the Ray cluster at ``--address`` or ``RAY_ADDRESS`` where one is
given, else on a local Ray it starts. Exit status 2 on bad data (the message names the file
and row), 1 when the cluster cannot be reached."""
from __future__ import annotations

import sys

from .args import parse, parser


def main(argv: list[str] | None = None, prog: str = "megaray prepare") -> int:
    p = parser(prog, __doc__)
    p.add_argument("inputs", nargs="+", help="jsonl/parquet/txt files or folders")
    p.add_argument("--out", required=True, help="the shard folder to create")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per training sequence (train.seq_len)")
    p.add_argument("--kind", default="pretrain", choices=["pretrain", "sft"],
                   help="pretrain: text, every token a target; sft: prompt/response or chat messages, the loss "
                        "on the responses only")
    p.add_argument("--tokenizer", help="a model directory with tokenizer.json (default: byte-level tokens)")
    p.add_argument("--text-column", default="text", help="the text of a pretrain row (jsonl key or parquet column)")
    p.add_argument("--prompt-column", default="prompt", help="an sft row's prompt")
    p.add_argument("--response-column", default="response", help="an sft row's response")
    p.add_argument("--messages-column", default="messages", help="an sft row's chat messages (instead of "
                                                                   "prompt and response)")
    p.add_argument("--on-bad-row", default="error", choices=["error", "skip"],
                   help="stop at the first bad row (naming it), or skip and count bad rows")
    p.add_argument("--holdout-fraction", type=float, default=0.01,
                   help="share of the rows held out for the evaluation loss (0: no evaluation)")
    p.add_argument("--max-undecodable", type=float, default=0.001,
                   help="share of a text file's bytes that may be invalid UTF-8 (replaced and counted); a file "
                        "with more is a bad row")
    p.add_argument("--split-mb", type=float, default=64.0, help="input MB per Ray task")
    p.add_argument("--address", help="a Ray cluster to run the tasks on (default: RAY_ADDRESS; every node must see "
                                     "the inputs and --out at the same paths); unset: a local Ray")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray that prepare starts (default: all)")
    a = parse(p, argv)
    from megaray.errors import ClusterError, DataError
    from megaray.prepare import PrepareOptions, prepare

    try:
        opts = PrepareOptions(seq_len=a.seq_len, kind=a.kind, text_column=a.text_column,
                              prompt_column=a.prompt_column, response_column=a.response_column,
                              messages_column=a.messages_column, tokenizer=a.tokenizer, on_bad_row=a.on_bad_row,
                              holdout_fraction=a.holdout_fraction, max_undecodable=a.max_undecodable,
                              split_mb=a.split_mb)
        prepare(a.inputs, a.out, opts, log=lambda s: print(s, flush=True), num_cpus=a.num_cpus, address=a.address)
    except DataError as e:
        print(f"megaray: data error: {e}", file=sys.stderr)
        return 2
    except ClusterError as e:
        print(f"megaray: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m megaray.pipelines.prepare"))
