"""Checkpoint directories: parts written in parallel, a manifest with checksums written last.

Layout of one checkpoint (``<checkpoint.dir>/step-00000120/``):

    manifest.json     written last: step, parts with byte counts and CRC32s, when, what run
    master.bin        master weights (fp32, or bf16: optim.master_dtype), every unit, as the
                      store's shared file holds them
    optim-<k>.pt      optimizer shard k's AdamW state (moments, step counts) by unit index
    trainer.json      scheduler counters, the next step (= data position), LR schedule inputs

A checkpoint is written into ``step-XXXXXXXX.tmp-<pid>`` and renamed into place only after
its manifest is on disk, so a crash or a full disk at any moment leaves the previous
checkpoints untouched and no half checkpoint that looks valid. Loading verifies every
part's size and CRC32 and raises ``CheckpointError`` naming the part; ``latest`` then falls
back to the previous checkpoint.

Data sampling is a pure function of (seed, step) and training draws no other random
numbers, so "the next step" is the whole data position and random state.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path

from megaray.errors import CheckpointError

MANIFEST = "manifest.json"
CHUNK = 64 * 2**20


def crc32_file(path: Path) -> tuple[int, int]:
    crc, n = 0, 0
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                return crc, n
            crc = zlib.crc32(b, crc)
            n += len(b)


def write_bytes(path: Path, data: memoryview) -> dict:
    """Write ``data`` to ``path`` with fsync; returns its {bytes, crc32}."""
    crc = 0
    with open(path, "wb") as f:
        for off in range(0, len(data), CHUNK):
            chunk = data[off:off + CHUNK]
            crc = zlib.crc32(chunk, crc)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "crc32": crc}


def read_into(path: Path, out: memoryview, part: dict) -> None:
    """Read a part into ``out`` and verify its size and checksum."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint part {path} is missing")
    size = path.stat().st_size
    if size != part["bytes"] or size != len(out):
        raise CheckpointError(f"checkpoint part {path} holds {size} bytes, expected {part['bytes']}")
    crc = 0
    with open(path, "rb") as f:
        for off in range(0, size, CHUNK):
            n = f.readinto(out[off:off + CHUNK])
            crc = zlib.crc32(out[off:off + n], crc)
    if crc != part["crc32"]:
        raise CheckpointError(f"checkpoint part {path} is corrupt (CRC32 {crc:#010x}, manifest says "
                              f"{part['crc32']:#010x})")


def verify_file(path: Path, part: dict) -> None:
    if not path.is_file():
        raise CheckpointError(f"checkpoint part {path} is missing")
    crc, n = crc32_file(path)
    if n != part["bytes"] or crc != part["crc32"]:
        raise CheckpointError(f"checkpoint part {path} is corrupt or truncated ({n} bytes, "
                              f"expected {part['bytes']})")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}.tmp-{os.getpid()}"


def commit(tmp: Path, final: Path, step: int, parts: dict, meta: dict) -> Path:
    """Write the manifest last, then make the checkpoint visible by renaming its folder."""
    manifest = {"format": 1, "step": step, "time": time.time(), "parts": parts, **meta}
    p = tmp / MANIFEST
    with open(p, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def read_manifest(path: Path) -> dict:
    p = Path(path) / MANIFEST
    if not p.is_file():
        raise CheckpointError(f"{path} has no {MANIFEST}: not a complete checkpoint")
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p} is not valid JSON: {e}") from None
    for name, part in m.get("parts", {}).items():
        f = Path(path) / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint part {f} is missing")
        if f.stat().st_size != part["bytes"]:
            raise CheckpointError(f"checkpoint part {f} holds {f.stat().st_size} bytes, expected {part['bytes']}")
    return m


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders with a manifest, newest first (temporary folders excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and ".tmp" not in p.name
           and (p / MANIFEST).is_file()]
    return sorted(out, key=lambda p: p.name, reverse=True)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and stale temporary folders."""
    removed = []
    for p in complete_checkpoints(root)[keep:]:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    for p in Path(root).glob("step-*.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
