"""What a dead process left behind: whether a writer still lives (by the pid its files and
folders are named with), and the unfinished ``<path>.tmp-<pid>`` folders of the commands that
write a folder there and rename it into place last (``megaray export``, ``megaray prepare``).
No torch here: ``megaray.prepare``'s tasks import the modules that use it."""
from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process of this id exists on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid: int) -> str | None:
    """When process ``pid`` of this host started (clock ticks since boot, /proc's field 22),
    which tells it from a later process given the same id; None where it does not exist."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def remove_dead_tmp(path: str | os.PathLike) -> list[Path]:
    """Delete the ``<path>.tmp-<pid>`` folders beside ``path`` whose writer is dead: what a
    killed ``megaray export`` or ``megaray prepare`` left. A live writer's folder stays."""
    path = Path(path)
    removed = []
    for left in path.parent.glob(f"{glob.escape(path.name)}.tmp-*"):
        pid = left.name.rsplit("-", 1)[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
            removed.append(left)
    return removed
