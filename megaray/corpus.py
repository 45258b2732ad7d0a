"""The demo corpus: the running Python's standard-library source, a data source that needs
no download (``megaray prepare``'s shards are the other, ``megaray.dataset``; the data feeder
opens one of them).

Every machine that runs megaray has it. Tokens are bytes (vocab 256), or, when the model
comes from a Hugging Face directory with a tokenizer.json, that tokenizer's ids (through the
``tokenizers`` library: ``tokenizer.model_tokenizer``). Rows are windows at random
offsets drawn from a generator seeded by (seed, stream position), so the rows at a position
are the same however the run got there.
"""
from __future__ import annotations

import os
import sysconfig

import numpy as np

from megaray.config import DataConfig
from megaray.errors import DataError


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, subdirs, files in os.walk(root):
        subdirs[:] = sorted(s for s in subdirs if s not in ("site-packages", "dist-packages", "__pycache__"))
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


class ByteCorpus:
    """The standard library's source files as two flat token arrays, train and held out.

    The held-out part is whole files, every k-th file of the corpus (k = 1 / holdout
    fraction, at most half the files), so it samples every part of the library as training does (a tail of the
    sorted files would be a few packages, some of them near-identical tables that are far
    easier to predict), and no held-out window shares a byte with a training one."""

    def __init__(self, data: DataConfig, tokenizer=None, vocab_size: int = 256, seq_len: int = 256, seed: int = 0):
        self.seq_len, self.seed = seq_len, seed
        self.kind = "byte" if tokenizer is None else "tokenizer.json"
        files, total = [], 0
        for path in stdlib_files():
            try:
                with open(path, "rb") as f:
                    b = f.read()
            except OSError:
                continue
            b = b[: data.max_bytes - total]
            files.append(b + b"\n")
            total += len(b) + 1
            if total >= data.max_bytes:
                break
        if total < 4096:
            raise DataError(f"the standard library under {sysconfig.get_paths()['stdlib']} has too little source")
        # one file in 1/fraction; a small corpus (tests) still holds out two files at least
        every = min(round(1 / data.holdout_fraction), max(2, len(files) // 2)) if data.holdout_fraction > 0 else 0
        held = [f for i, f in enumerate(files) if every and i % every == every - 1]
        train = [f for i, f in enumerate(files) if not (every and i % every == every - 1)]
        self.train, self.heldout = (self._tokens(part, tokenizer, vocab_size) for part in (train, held))
        self.heldout_files, self.every = len(held), every

    @staticmethod
    def _tokens(files: list[bytes], tokenizer, vocab_size: int) -> np.ndarray:
        raw = b"".join(files)
        if tokenizer is None:
            return np.frombuffer(raw, dtype=np.uint8)
        texts = raw.decode("utf-8", errors="replace").split("\n\n")
        ids = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        tokens = np.fromiter((i for seq in ids for i in seq), dtype=np.int64)
        if len(tokens) and int(tokens.max()) >= vocab_size:
            raise DataError(f"the tokenizer produced id {int(tokens.max())}, outside the model's "
                            f"vocabulary of {vocab_size}")
        return tokens

    def attention(self, asked: str) -> tuple[str, str]:
        """``train.attention`` for this corpus: causal (it records no documents; the config
        refuses 'document' with it)."""
        return "causal", f"{asked}: the standard library's bytes record no documents"

    def rows_at(self, position: int, n: int, split: str = "train", documents: bool = False) -> dict:
        """``n`` windows of seq_len + 1 tokens for stream position ``position``:
        {"tokens": int64 [n, seq_len + 1]}, every token a target (``documents`` is never
        asked of it: ``attention`` is causal)."""
        src = self.train if split == "train" else self.heldout
        if len(src) <= self.seq_len + 1:
            raise DataError(f"the {split} corpus ({len(src)} tokens) is shorter than train.seq_len + 1")
        rng = np.random.default_rng([self.seed, position, 0 if split == "train" else 1])
        starts = rng.integers(0, len(src) - self.seq_len - 1, size=n)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return {"tokens": src[idx].astype(np.int64)}

    def has_heldout(self) -> bool:
        return len(self.heldout) > self.seq_len + 1

    def describe(self) -> str:
        held = f"{self.heldout_files} whole files held out, one in {self.every}" if self.every else "none held out"
        return (f"{len(self.train)} train / {len(self.heldout)} held-out {self.kind} tokens from the standard "
                f"library ({held})")
