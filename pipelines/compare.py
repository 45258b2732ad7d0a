"""Compare entrypoint: ``megaray compare RUN REFERENCE_RUN`` pairs the steps two runs logged
(each a run directory: its metrics.jsonl and config.yaml) and prints, after the reference's
warm-up, the largest relative difference of their losses and where it is, and the last common
step's losses; it draws both curves and their difference into a PNG (by default
``compare-<REFERENCE>.png`` in RUN's directory). With ``--within`` / ``--final-within`` it
exits 1 when a judged step (or the last one) differs by more than that many percent."""
from __future__ import annotations

import sys
from pathlib import Path

from .args import parse, parser


def main(argv: list[str] | None = None, prog: str = "megaray compare") -> int:
    p = parser(prog, __doc__)
    p.add_argument("run", help="a run directory (the run judged)")
    p.add_argument("reference", help="a run directory (the reference: differences are relative to its loss)")
    p.add_argument("--png", help="where to write the picture (default: RUN/compare-<REFERENCE's id>.png); "
                                 "'none' writes none")
    p.add_argument("--within", type=float, metavar="PCT",
                   help="exit 1 when a step after the warm-up differs by more than PCT percent")
    p.add_argument("--final-within", type=float, metavar="PCT",
                   help="exit 1 when the last common step differs by more than PCT percent")
    a = parse(p, argv)
    from megaray.compare import compare, draw, read_curve
    from megaray.errors import MegarayError

    try:
        c = compare(read_curve(a.run), read_curve(a.reference))
        png = None
        if a.png != "none":
            png = draw(c, a.png or Path(a.run) / f"compare-{c.b.name}.png", a.within)
    except (MegarayError, OSError) as e:
        print(f"megaray: compare failed: {e}", file=sys.stderr)
        return 2
    print(c.summary())
    if png is not None:
        print(f"picture: {png}")
    failed = []
    if a.within is not None and c.worst_step is not None and 100 * c.worst > a.within:
        failed.append(f"step {c.worst_step} differs by {100 * c.worst:.3f}% (more than {a.within}%)")
    if a.final_within is not None and 100 * abs(c.final[2]) > a.final_within:
        failed.append(f"the last common step differs by {100 * abs(c.final[2]):.3f}% (more than {a.final_within}%)")
    for f in failed:
        print(f"megaray: compare: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m megaray.pipelines.compare"))
