"""The GPU-resident baseline ``megaray bench`` measures megaray against: an ordinary
nn.Module holding every weight on the device (megaray's own block arithmetic, so the two
differ only in where the weights live), trained with bf16 autocast and fused AdamW, the same
tokens per step through gradient accumulation, from megaray's initial weights."""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn as nn

from megaray import fused
from megaray.config import RunConfig
from megaray.layout import EXPERTS, build_layout
from megaray.model import Ropes, block_forward, embed_forward, norm


class BaselineLlama(nn.Module):
    """Every weight an nn.Parameter on one device (a mixture's experts as one stacked
    parameter per projection, as the templates read them); the same math as megaray's."""

    def __init__(self, cfg, state: dict[str, np.ndarray], device):
        super().__init__()
        self.cfg = cfg
        self.units = build_layout(cfg)
        self.params = nn.ParameterDict()
        for u in self.units:
            for v in u.views:
                names = [s.name for s in u.params if s.key == v.key]
                t = (torch.stack([torch.tensor(state[n]) for n in names]) if v.key.startswith(EXPERTS)
                     else torch.tensor(state[names[0]]))     # copies: training never writes into ``state``
                self.params[f"{u.index}__{v.key}".replace(".", "__")] = nn.Parameter(t.to(device).reshape(v.shape))
        self.rope = Ropes(cfg, cfg.max_position_embeddings, device)

    def _w(self, unit) -> dict:
        return {v.key: self.params[f"{unit.index}__{v.key}".replace(".", "__")] for v in unit.views}

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = embed_forward(self._w(self.units[0]), tokens, self.cfg)
        for u in self.units[1:-1]:
            x = block_forward(self._w(u), x, self.rope, self.cfg, lean=False, layer=u.index - 1)   # plain autograd
        wh = self._w(self.units[-1])
        h = norm(x, wh["model.norm.weight"], self.cfg)
        tied = self.cfg.tie_word_embeddings
        out = self._w(self.units[0])["model.embed_tokens.weight"] if tied else wh["lm_head.weight"]
        logits = (h @ out.t()).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def run_baseline(cfg: RunConfig, state, batches, device: str = "cuda") -> dict:
    """Train the baseline on ``batches`` [grad_accum, micro_batch, seq + 1]: bf16 autocast on
    CUDA (fp32 on the CPU), loss divided by the micro-batches, exact clipping, fused AdamW;
    the blocks' elementwise passes fused as megaray's are (``worker.fuse_elementwise``)."""
    cuda = device == "cuda"
    fused.configure(cfg.worker.fuse_elementwise)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = BaselineLlama(cfg.model, state, device)
    o = cfg.optim
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in model.parameters() if p.ndim < 2],
               "weight_decay": o.weight_decay if o.decay_norms_and_biases else 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for tok in batches:
        sync()
        t0 = time.perf_counter()
        t = torch.as_tensor(tok, device=device)
        total = 0.0
        for m in range(t.shape[0]):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = model(t[m, :, :-1], t[m, :, 1:]) / t.shape[0]
            loss.backward()
            total += loss.detach()
        if cfg.optim.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return {"times": times, "losses": losses, "gpu_peak_gib": peak / 2**30}
