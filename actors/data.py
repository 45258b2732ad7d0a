"""DataFeeder actor: reads the configured data source and hands out whole steps' batches.

The driver asks for the batches of the next ``data.prefetch`` steps ahead of time; calls to
one actor run in order, so while the GPU computes step t the feeder is already building
t+1 (memory-mapped shard rows gathered, shuffled by position). A batch is small (tokens and
a loss mask, 9 bytes a token; with document attention each token's document too, 13) and
travels through Ray's object store.
"""
from __future__ import annotations

import time

from megaray.config import RunConfig
from megaray.corpus import ByteCorpus
from megaray.dataset import ShardDataset
from megaray.step import Batch
from megaray.tokenizer import model_tokenizer


def open_source(cfg: RunConfig):
    """The configured data source: something with ``rows_at(position, n, split, documents)``,
    ``attention(asked)``, ``has_heldout()`` and ``describe()``."""
    if cfg.data.source == "shards":
        return ShardDataset(cfg.data.path, cfg.train.seq_len, cfg.model.vocab_size, cfg.run.seed, cfg.data.shuffle)
    return ByteCorpus(cfg.data, model_tokenizer(cfg.model.from_path), cfg.model.vocab_size, cfg.train.seq_len,
                      cfg.run.seed)


class DataFeeder:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.src = open_source(cfg)
        self.attention, self.attention_reason = self.src.attention(cfg.train.attention)

    def __repr__(self) -> str:
        return f"DataFeeder({self.cfg.data.source}, {self.cfg.train.micro_batch_size} x {self.cfg.train.seq_len} rows)"

    def describe(self) -> str:
        return self.src.describe()

    def describe_attention(self) -> str:
        """``train.attention`` as resolved for the data, and why."""
        return f"{self.attention} ({self.attention_reason})"

    def has_heldout(self) -> bool:
        """Whether the source holds out rows for the evaluation loss."""
        return self.src.has_heldout()

    def step_batch(self, position: int, micro_batches: int | None = None,
                   split: str = "train") -> tuple[Batch, float]:
        """The batch [micro_batches, micro_batch_size, seq_len + 1] that starts at stream
        ``position``, and the seconds it took to build."""
        t = self.cfg.train
        n = micro_batches or t.grad_accum
        t0 = time.perf_counter()
        rows = self.src.rows_at(position, n * t.micro_batch_size, split, documents=self.attention == "document")
        return Batch.from_rows(rows, n), time.perf_counter() - t0
