"""Reading the packed token shards ``megaray prepare`` wrote (``megaray.prepare`` has the format).

Shards are memory-mapped Arrow IPC files, never read whole; rows are addressed by position
in a seeded, shuffled stream, so a resumed run reads exactly the rows that come next.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megaray.errors import DataError


class ShardDataset:
    """Packed shards, memory-mapped; rows of a seeded shuffled stream by position.

    The training stream is epoch after epoch of the training rows, each epoch in the order
    of a permutation drawn from (seed, epoch); position p of the stream is row
    ``perm_e[p mod N]`` with e = p // N. So a run that resumes at position p continues with
    exactly the rows an uninterrupted run would have read next.
    """

    def __init__(self, path: str, seq_len: int, vocab_size: int, seed: int, shuffle: bool = True):
        import pyarrow as pa

        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.is_file():
            raise DataError(f"{path}: no manifest.json (not a folder written by megaray prepare, or incomplete)")
        try:
            self.manifest = m = json.loads(mf.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{mf} is not valid JSON: {e}") from None
        _check_manifest(mf, m)
        if m.get("seq_len") != seq_len:
            raise DataError(f"{path}: shards hold rows of seq_len {m.get('seq_len')}, but train.seq_len is {seq_len}")
        if m.get("vocab_size", 0) > vocab_size:
            raise DataError(f"{path}: tokenized with a vocabulary of {m['vocab_size']}, larger than the model's "
                            f"vocab_size {vocab_size}")
        self.vocab_size, self.seed, self.shuffle = vocab_size, seed, shuffle
        self.S1 = seq_len + 1
        self.has_documents = m.get("document_starts") is True      # earlier versions of prepare did not record them
        # (first row, file, row in file, tokens, mask, (starts offsets, starts values) or None)
        self._blocks: list[tuple[int, str, int, np.ndarray, np.ndarray, tuple | None]] = []
        row = 0
        for sh in m["shards"]:
            f = self.path / sh["file"]
            try:
                reader = pa.ipc.open_file(pa.memory_map(str(f), "r"))
                in_file = 0
                for b in range(reader.num_record_batches):
                    batch = reader.get_batch(b)
                    if batch.num_rows == 0:
                        continue
                    t = batch.column("tokens").values.to_numpy(zero_copy_only=True).reshape(-1, self.S1)
                    mk = batch.column("mask").values.to_numpy(zero_copy_only=True).reshape(-1, self.S1)
                    st = None
                    if self.has_documents:
                        col = batch.column("starts")
                        st = (col.offsets.to_numpy(zero_copy_only=False), col.values.to_numpy(zero_copy_only=True))
                    self._blocks.append((row, sh["file"], in_file, t, mk, st))
                    row += batch.num_rows
                    in_file += batch.num_rows
            except (OSError, pa.ArrowInvalid, KeyError, ValueError) as e:
                raise DataError(f"{f}: unreadable shard ({e})") from None
            if in_file != sh["rows"]:
                raise DataError(f"{f}: {in_file} rows, the manifest says {sh['rows']}")
        self.rows = row
        if row != m["rows"]:
            raise DataError(f"{mf}: 'rows' says {m['rows']}, the shards hold {row}")
        self.heldout_rows = m["heldout_rows"]
        self.train_rows = row - self.heldout_rows
        self._starts = np.array([b[0] for b in self._blocks])
        self._perm: tuple[int, np.ndarray] | None = None

    def has_heldout(self) -> bool:
        return self.heldout_rows > 0

    def describe(self) -> str:
        m = self.manifest
        docs = ("document starts recorded" if self.has_documents else
                "no document starts recorded (prepared before they were): attention crosses documents")
        return (f"{self.train_rows} train / {self.heldout_rows} held-out rows of {self.S1} tokens from {self.path} "
                f"({m['kind']}, {m['tokenizer']} tokens; {docs})")

    def attention(self, asked: str) -> tuple[str, str]:
        """``train.attention`` resolved for these shards, and why: 'auto' is 'document' for SFT
        shards that record document starts, else 'causal'; 'document' needs the starts."""
        kind = self.manifest.get("kind")
        if asked == "document" and not self.has_documents:
            raise DataError(f"{self.path}: train.attention is document, but these shards record no document starts "
                            "(prepared before megaray recorded them): prepare them again, or set "
                            "train.attention=causal")
        if asked == "auto":
            asked = "document" if kind == "sft" and self.has_documents else "causal"
            return asked, f"auto: {kind} shards" + ("" if self.has_documents else " without document starts")
        return asked, "train.attention"

    def _row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, str]:
        k = int(np.searchsorted(self._starts, r, side="right")) - 1
        first, file, in_file, t, mk, st = self._blocks[k]
        i = r - first
        starts = st[1][st[0][i]:st[0][i + 1]] if st is not None else None
        return t[i], mk[i], starts, f"{self.path / file} row {in_file + i}"

    def _train_row(self, p: int) -> int:
        e, i = divmod(p, self.train_rows)
        if not self.shuffle:
            return i
        if self._perm is None or self._perm[0] != e:
            self._perm = (e, np.random.default_rng([self.seed, e]).permutation(self.train_rows))
        return int(self._perm[1][i])

    def rows_at(self, position: int, n: int, split: str = "train", documents: bool = False) -> dict:
        """``n`` rows from ``position`` of the train stream (or of the held-out rows, in order)
        as {"tokens": int64 [n, seq_len + 1], "loss_mask": uint8 [n, seq_len + 1]}, and with
        ``documents`` "doc": int32 [n, seq_len + 1], each token's document within its row
        (0 for a row's leading continuation, then 1, 2, ... at each start)."""
        if split == "train":
            idx = [self._train_row(position + j) for j in range(n)]
        else:
            if self.heldout_rows == 0:
                raise DataError(f"{self.path}: no held-out rows (prepare with holdout_fraction > 0)")
            idx = [self.train_rows + (position + j) % self.heldout_rows for j in range(n)]
        toks = np.empty((n, self.S1), np.int64)
        mask = np.empty((n, self.S1), np.uint8)
        doc = np.empty((n, self.S1), np.int32) if documents else None
        for j, r in enumerate(idx):
            t, mk, starts, where = self._row(r)
            if t.size and (int(t.max()) >= self.vocab_size or int(t.min()) < 0):
                bad = int(t.max()) if int(t.max()) >= self.vocab_size else int(t.min())
                raise DataError(f"{where}: token id {bad} is outside the model's vocabulary of {self.vocab_size}")
            toks[j], mask[j] = t, mk
            if doc is not None:
                if starts is None:
                    raise DataError(f"{where}: no document starts recorded")
                if starts.size and (np.any(np.diff(starts) <= 0) or starts[0] < 0 or starts[-1] >= self.S1):
                    raise DataError(f"{where}: document starts {starts.tolist()} are not increasing positions "
                                    f"in a row of {self.S1}")
                doc[j] = np.searchsorted(starts, np.arange(self.S1), side="right")
        out = {"tokens": toks, "loss_mask": mask}
        if doc is not None:
            out["doc"] = doc
        return out


def _check_manifest(path: Path, m) -> None:
    """The keys the reader relies on, with sane values, before any shard is opened."""
    if not isinstance(m, dict):
        raise DataError(f"{path}: not a JSON object")
    for key in ("seq_len", "rows", "heldout_rows"):
        if not isinstance(m.get(key), int) or isinstance(m.get(key), bool) or m[key] < 0:
            raise DataError(f"{path}: '{key}' must be a non-negative integer (got {m.get(key)!r})")
    if not m["heldout_rows"] < m["rows"]:
        raise DataError(f"{path}: 'heldout_rows' ({m['heldout_rows']}) leaves no training rows of {m['rows']}")
    shards = m.get("shards")
    if not isinstance(shards, list) or not shards:
        raise DataError(f"{path}: 'shards' must be a non-empty list")
    for k, sh in enumerate(shards):
        if not (isinstance(sh, dict) and isinstance(sh.get("file"), str) and isinstance(sh.get("rows"), int)
                and "/" not in sh["file"] and sh["rows"] >= 0):
            raise DataError(f"{path}: shards[{k}] must be {{'file': a file name, 'rows': a count}} (got {sh!r})")
        if not (path.parent / sh["file"]).is_file():
            raise DataError(f"{path}: shards[{k}] names {sh['file']}, which is not in {path.parent}")

