"""Packed token shards' rows: documents laid end to end and cut into rows of seq_len + 1
tokens, with their loss mask and document starts, written as Arrow batches (``megaray
prepare`` fills them; ``megaray.dataset`` reads them)."""
from __future__ import annotations

import numpy as np

from megaray.tokenizer import TextTokenizer


def schema(row_len: int):
    """A shard's columns: rows of ``row_len`` tokens, their loss mask, and the offsets of the
    documents that start in the row."""
    import pyarrow as pa

    return pa.schema([("tokens", pa.list_(pa.int32(), row_len)), ("mask", pa.list_(pa.uint8(), row_len)),
                      ("starts", pa.list_(pa.int32()))])


class Packer:
    """Documents laid end to end and cut into rows of ``row_len`` tokens (seq_len + 1), each
    token with its loss mask (1: trained on) and a flag where a document starts; whole rows go
    to the Arrow ``writer`` as each batch of records is added, and the last partial row is
    padded with end tokens (a document of its own, not trained on) at ``close``."""

    def __init__(self, writer, row_len: int, eos_id: int, eos_trained: bool):
        self.writer, self.row_len, self.eos_id, self.eos_trained = writer, row_len, eos_id, eos_trained
        self.schema = schema(row_len)
        self.parts: tuple[list, list, list] = ([], [], [])            # tokens, mask, start flags
        self.carry = (np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.uint8))
        self.rows = self.documents = self.tokens = 0

    def _append(self, tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray) -> None:
        for part, a in zip(self.parts, (tokens, mask, starts)):
            part.append(a)
        self.tokens += len(tokens)

    def add_records(self, records: list[list[tuple[str, bool]]], tok: TextTokenizer) -> None:
        """Each record's segments (text, trained on) tokenized in one call, then laid out as one
        document each: its first token flagged, and the end token after it (trained on for
        pretraining, not for chat data)."""
        if not records:
            return
        ids = iter(tok.encode([text for segs in records for text, _ in segs]))
        for segs in records:
            first = True
            for _, target in segs:
                piece = np.asarray(next(ids), dtype=np.int32)
                starts = np.zeros(len(piece), np.uint8)
                if first and len(piece):
                    starts[0], first = 1, False
                self._append(piece, np.full(len(piece), 1 if target else 0, np.uint8), starts)
            self._append(np.array([self.eos_id], np.int32), np.array([1 if self.eos_trained else 0], np.uint8),
                         np.array([1 if first else 0], np.uint8))
            self.documents += 1
        self._write(final=False)

    def _write(self, final: bool) -> None:
        import pyarrow as pa

        t, m, st = (np.concatenate([c, *part]) for c, part in zip(self.carry, self.parts))
        for part in self.parts:
            part.clear()
        S1 = self.row_len
        n = len(t) // S1
        if final and len(t) % S1:
            pad = S1 - len(t) % S1
            t = np.concatenate([t, np.full(pad, self.eos_id, np.int32)])
            m = np.concatenate([m, np.zeros(pad, np.uint8)])
            st = np.concatenate([st, np.eye(1, pad, dtype=np.uint8)[0]])     # the padding: a document of its own
            n += 1
        if n:
            rows_t = pa.FixedSizeListArray.from_arrays(pa.array(t[: n * S1]), S1)
            rows_m = pa.FixedSizeListArray.from_arrays(pa.array(m[: n * S1]), S1)
            rows_s = _starts_column(st[: n * S1].reshape(n, S1))
            self.writer.write_batch(pa.record_batch([rows_t, rows_m, rows_s], schema=self.schema))
            self.rows += n
        self.carry = (t[n * S1:], m[n * S1:], st[n * S1:])

    def close(self) -> None:
        """The last rows, padded; an empty batch where the task made no row (a valid, empty shard)."""
        import pyarrow as pa

        self._write(final=True)
        if self.rows == 0:
            S1 = self.row_len
            self.writer.write_batch(pa.record_batch([pa.array([], pa.list_(pa.int32(), S1)),
                                                     pa.array([], pa.list_(pa.uint8(), S1)),
                                                     pa.array([], pa.list_(pa.int32()))], schema=self.schema))


def _starts_column(flags: np.ndarray):
    """The ``starts`` list column of rows [n, S1] of document-start flags."""
    import pyarrow as pa

    rows, cols = np.nonzero(flags)
    offsets = np.zeros(len(flags) + 1, np.int32)
    np.cumsum(np.bincount(rows, minlength=len(flags)), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(cols.astype(np.int32), pa.int32()))
