"""Reading a small Hugging Face model saved by a test through megaray's own reader (the
family tests' one helper: tests/test_moe.py, tests/test_families.py)."""
from __future__ import annotations

import torch

from megaray.config import ModelConfig
from megaray.hf.read import load_into, read_hf_config
from megaray.layout import build_layout


def megaray_units(folder):
    """The model config and one fp32 flat leaf a unit, loaded by megaray's reader."""
    cfg = ModelConfig(**read_hf_config(folder), from_path=str(folder))
    units = build_layout(cfg)
    flats = [torch.zeros(u.numel) for u in units]
    load_into(units, lambda u: flats[u], folder, threads=1)
    return cfg, units, [f.requires_grad_() for f in flats]


def train_cfg(folder, lr: float, wd: float, steps: int, **debug):
    """A RunConfig that fine-tunes the model in ``folder``: fp32 compute, two micro-batches of
    one 12-token row a step, two shards, constant ``lr`` and weight decay ``wd``, no clipping."""
    from megaray.loader import build_config

    return build_config({
        "model": {"from": str(folder)},
        "train": {"steps": steps, "micro_batch_size": 1, "grad_accum": 2, "seq_len": 12, "compute_dtype": "float32"},
        "optim": {"lr": lr, "weight_decay": wd, "clip_grad_norm": None, "num_shards": 2, "warmup_steps": 0,
                  "schedule": "constant", "grad_slab_mib": 0.01},
        "data": {"max_bytes": 20000},
        **({"debug": debug} if debug else {}),
    })


def reference_adamw(ref, cfg, lr: float, wd: float):
    """torch's AdamW over a transformers model as megaray's shards run it: decay on matrices
    only, the config's betas and eps."""
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    rest = [p for p in ref.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)


def save_checkpoint(session, cfg, folder, step: int):
    """A checkpoint of ``session`` at ``step`` in ``folder`` (megaray's own Checkpointer), for
    ``megaray export`` to read back."""
    import dataclasses
    import logging

    from megaray.checkpoint import Checkpointer

    ck = Checkpointer(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=str(folder))),
                      session.run_id, logging.getLogger("megaray"))
    try:
        return ck.save(session, step, {})
    finally:
        ck.close()


def assert_adam_close(weights: dict, want: dict, lr: float) -> None:
    """megaray's weights after a few AdamW steps against the reference's: Adam turns
    rounding-level gradients into lr-sized steps where a gradient is a sum that nearly
    cancels, so all but a few elements in a thousand agree to 1e-6 and none is off by more
    than a small part of one step (test_parity's bound)."""
    for name, t in want.items():
        if name == "lm_head.weight" and name not in weights:     # tied: the embedding, compared as itself
            continue
        diff = (torch.from_numpy(weights[name]).double() - t.double()).abs()
        assert float((diff > 1e-6).float().mean()) < 2e-3, (name, int((diff > 1e-6).sum()))
        assert float(diff.max()) < 0.05 * lr, name


class warnings_of:
    """Collect the warnings a logger (and its children) emits inside the block."""

    def __init__(self, name: str):
        import logging

        self.logger, self.said = logging.getLogger(name), []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.said.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.said

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
