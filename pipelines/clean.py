"""Clean entrypoint: ``megaray clean [--shm-dir /dev/shm] [--run-dir runs]`` deletes the
shared-memory files of runs whose driver process is dead (a driver killed with SIGKILL cannot
delete its own), and never those of a live run; and marks such runs' summary.json under
``--run-dir`` ``killed``, with their last step and last complete checkpoint. A later
``megaray train`` does the same when it starts."""
from __future__ import annotations

import os
import sys

from .args import parse, parser


def main(argv: list[str] | None = None, prog: str = "megaray clean") -> int:
    p = parser(prog, __doc__)
    p.add_argument("--shm-dir", default="/dev/shm", help="the runs' cluster.shm_dir")
    p.add_argument("--run-dir", default="runs", help="the runs' run.dir, whose killed runs' summaries are marked")
    a = parse(p, argv)
    from megaray.shm import remove_stale

    if not os.path.isdir(a.shm_dir):
        print(f"megaray: {a.shm_dir} is not a folder", file=sys.stderr)
        return 2
    removed = remove_stale(a.shm_dir)
    for path in removed:
        print(f"removed {path}")
    print(f"megaray: removed {len(removed)} shared-memory file(s) of dead runs from {a.shm_dir}"
          + ("" if removed else " (none left behind)"))
    if os.path.isdir(a.run_dir):
        from megaray.driver.runlog import mark_killed_runs

        for s in mark_killed_runs(a.run_dir):
            print(f"megaray: run {s['run_id']} was killed without ending: marked killed in {s['run_dir']}/summary.json "
                  f"(last step {s.get('last_step')}, last complete checkpoint {s.get('last_good_checkpoint', 'none')})")
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m megaray.pipelines.clean"))
