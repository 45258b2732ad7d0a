"""A checkpoint's part written to disk: one file, sequentially, a CRC32 per ``BLOCK`` bytes.

The store, every optimizer shard and the worker's resident units each write their own part
of a checkpoint in parallel (``PartWriter``); the driver writes ``trainer.json``
(``write_json``). ``megaray.checkpoint`` reads them back, verifying each block it uses, and
owns the manifest that lists them. Invariant: a part is reported as written (its manifest
entry returned) only after its bytes are flushed and fsynced.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch

BLOCK = 16 * 2**20          # bytes per CRC32 block of a part


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes (any dtype, bf16 included)."""
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class PartWriter:
    """Writes one part sequentially, with a CRC32 per BLOCK bytes; ``finish`` fsyncs it and
    returns its manifest entry. As a context manager, a part left unfinished (an exception,
    or no ``finish``) is closed, never reported as written."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.f = open(self.path, "wb")
        self.n = 0
        self.crcs: list[int] = []
        self._crc = 0

    def write(self, t: torch.Tensor) -> int:
        """Append a tensor's bytes; returns their byte offset in the part."""
        at = self.n
        data = as_bytes(t.contiguous())
        pos = 0
        while pos < len(data):
            room = BLOCK - self.n % BLOCK
            chunk = data[pos:pos + room]
            self.f.write(chunk)
            self._crc = zlib.crc32(chunk, self._crc)
            self.n += len(chunk)
            pos += len(chunk)
            if self.n % BLOCK == 0:
                self.crcs.append(self._crc)
                self._crc = 0
        return at

    def finish(self) -> dict:
        if self.n % BLOCK:
            self.crcs.append(self._crc)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"bytes": self.n, "block": BLOCK, "crc32": self.crcs}

    def abort(self) -> None:
        self.f.close()

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, *exc) -> None:
        if not self.f.closed:
            self.abort()


def write_json(path: Path, obj) -> dict:
    with PartWriter(path) as w:
        w.write(torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8))
        return w.finish()
