"""Named shared-memory files that hold a run's weights, gradients and control words.

A ``ShmFile`` is a file in ``shm_dir`` (``/dev/shm`` by default) mapped MAP_SHARED by every
process that attaches it; torch tensors are views into the mapping, so an update written by
an optimizer actor is what the GPU worker reads next, with no copy and no Ray object.

Names are ``megaray_<pid>_<run_id>_<kind>``, where pid is the driver process that owns the
run. ``remove_stale`` deletes the files of runs whose driver is dead (on this host), never
those of a live one; ``remove_run`` deletes a run's files when it ends, however it ends.
"""
from __future__ import annotations

import glob
import os

import torch

from megaray.leftovers import pid_alive

PREFIX = "megaray_"


def file_name(owner_pid: int, run_id: str, kind: str) -> str:
    return f"{PREFIX}{owner_pid}_{run_id}_{kind}"


class ShmFile:
    """One shared-memory file, created by its owner and attached by others."""

    def __init__(self, path: str, nbytes: int, create: bool):
        self.path, self.nbytes = path, nbytes
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, max(nbytes, 1))
            finally:
                os.close(fd)
        elif os.path.getsize(path) < nbytes:
            raise RuntimeError(f"{path} holds {os.path.getsize(path)} bytes, expected {nbytes}")
        self.bytes = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)

    def view(self, dtype: torch.dtype, byte_offset: int, numel: int) -> torch.Tensor:
        """A ``dtype`` tensor of ``numel`` elements at ``byte_offset`` (aligned to the dtype)."""
        size = torch.empty(0, dtype=dtype).element_size()
        assert byte_offset % size == 0, "misaligned view"
        return self.bytes[byte_offset:byte_offset + numel * size].view(dtype)


def remove_run(shm_dir: str, run_id: str) -> list[str]:
    removed = []
    for p in glob.glob(os.path.join(shm_dir, f"{PREFIX}*_{run_id}_*")):
        try:
            os.unlink(p)
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


def remove_stale(shm_dir: str) -> list[str]:
    """Delete shared-memory files whose owning driver process no longer exists."""
    removed = []
    for p in glob.glob(os.path.join(shm_dir, f"{PREFIX}*")):
        parts = os.path.basename(p)[len(PREFIX):].split("_", 1)
        if not parts[0].isdigit() or pid_alive(int(parts[0])):
            continue
        try:
            os.unlink(p)
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed
