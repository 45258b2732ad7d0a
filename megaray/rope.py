"""Rotary position embeddings: the tables (default, linear, llama3 and LongRoPE scaling; a
model's sliding-window blocks' own base: ``Ropes``) and their application to a head's
dimensions (partial rotary included). Like ``megaray.model``, no Ray, no CUDA streams."""
from __future__ import annotations

import math

import torch

from megaray.config import ModelConfig
from megaray.fused import fused


def rope_tables(cfg: ModelConfig, seq_len: int, device=None, dtype=torch.float32, local: bool = False):
    """cos, sin of shape [seq_len, rotary_dim] (``model.partial_rotary_factor`` of head_dim),
    with linear, llama3 frequency scaling, or LongRoPE's (its long factors for rows longer than
    the original length, its short ones otherwise, as transformers picks them; cos and sin times
    its attention factor), when configured. ``local``: the sliding-window blocks' tables
    (``model.rope_local_theta``, unscaled)."""
    dim = cfg.rotary_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / base
    rs, scale = (None if local else cfg.rope_scaling), 1.0
    kind = None if rs is None else rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif kind == "longrope":
        old = rs["original_max_position_embeddings"]
        ext = torch.tensor(rs["long_factor"] if seq_len > old else rs["short_factor"], dtype=torch.float32)
        inv_freq = 1.0 / (ext * base)
        factor = rs.get("factor") or cfg.max_position_embeddings / old
        scale = rs.get("attention_factor") or (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old)))
    elif rs is not None:
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    pos = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(device=device, dtype=dtype), (emb.sin() * scale).to(device=device, dtype=dtype)


class Ropes:
    """Every block's rotary tables: ``rope_tables``' for the full-attention blocks, and with
    ``model.rope_local_theta`` the sliding-window blocks' own (Gemma 3). ``ropes[i]`` is block
    i's (cos, sin)."""

    def __init__(self, cfg: ModelConfig, seq_len: int, device=None, dtype=torch.float32):
        self.cfg = cfg
        self.full = rope_tables(cfg, seq_len, device, dtype)
        self.local = (rope_tables(cfg, seq_len, device, dtype, local=True) if cfg.rope_local_theta is not None
                      else self.full)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.local if self.cfg.window(layer) else self.full


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@fused
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, hd]; cos/sin: [S, rotary_dim], or [B, 1, S, rotary_dim] at each
    token's own position. A partial rotary (rotary_dim < hd) turns the first rotary_dim
    dimensions of each head and passes the rest."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return _rope(x, cos, sin)
    return torch.cat([_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
