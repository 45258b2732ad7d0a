"""The worker's forward-only passes, outside training steps: the evaluation loss and logits.

Both run every unit forward once with one step's weights through the same weight slots as a
training step (``staging.WeightSlots``), without gradients and without saving anything for a
backward. ``ForwardOnly`` is a part of ``GpuWorker``: it reads the worker's slots, rotary
tables, model config and inputs (``_inputs_targets``), and a failure ends the run's copy-out
as a step's would.
"""
from __future__ import annotations

import numpy as np
import torch

from megaray.attention import packing
from megaray.model import block_forward, embed_forward, head_loss_sum, norm
from megaray.step import Batch, EvalResult, WorkerTimes

from .calls import actor_guard
from .device import StepClock


class ForwardOnly:
    def evaluate(self, step: int, batch: Batch) -> EvalResult:
        """Forward-only loss on ``batch`` [micro_batches, rows, seq + 1] with step ``step``'s weights."""
        with actor_guard(self.name, step, self.shipper.abort):
            return self._evaluate(step, batch)

    @torch.no_grad()
    def _evaluate(self, step: int, batch: Batch) -> EvalResult:
        inputs, targets, packs = self._inputs_targets(batch)
        xs, wh, we = self._forward_only(step, list(inputs), packs)
        loss, count = 0.0, 0
        chunk = self.cfg.train.loss_chunk_tokens
        for m, x in enumerate(xs):
            xf, tf = x.reshape(-1, x.shape[-1]), targets[m].reshape(-1)
            for c in range(0, xf.shape[0], chunk):
                ls, n = head_loss_sum(wh, we, xf[c:c + chunk], tf[c:c + chunk], self.mcfg)
                loss += float(ls)
                count += int(n)
        self.slots.release(len(self.units) - 1)      # after the loss has read the head and embedding
        self.slots.release(0)
        return EvalResult(loss_sum=loss, tokens=count)

    @torch.no_grad()
    def logits(self, tokens: np.ndarray, doc: np.ndarray | None = None) -> np.ndarray:
        """fp32 logits of a small batch [batch, seq] (tests and interop checks); with ``doc``
        (each token's document, [batch, seq]) under document attention."""
        step = self.slots.source.version()
        pk = ([packing(torch.from_numpy(np.asarray(doc)).to(self.dev.device), self.mcfg.head_dim,
                       self.mcfg.local_window)]
              if doc is not None else [None])
        (h,), wh, we = self._forward_only(step, [torch.tensor(tokens, dtype=torch.int64).to(self.dev.device)], pk)
        h = norm(h, wh["model.norm.weight"], self.mcfg)
        out = we["model.embed_tokens.weight"] if self.mcfg.tie_word_embeddings else wh["lm_head.weight"]
        logits = torch.nn.functional.linear(h, out).float().cpu().numpy()
        self.slots.release(len(self.units) - 1)
        self.slots.release(0)
        return logits

    @torch.no_grad()
    def _forward_only(self, step: int, inputs: list, packs: list) -> tuple[list, dict, dict]:
        """Final hidden states of each input through every block, with step ``step``'s weights;
        also the head's and the embedding's bound weights, still resident: the caller
        releases those two slots once it has used them."""
        times, clock, slots = WorkerTimes(), StepClock(self.dev), self.slots
        slots.begin()
        slots.ready(slots.stage(0, step, times, clock), times)
        _, we = slots.weights(0, grad=False)
        xs = [embed_forward(we, x, self.mcfg) for x in inputs]
        for u in range(1, len(self.units)):
            slots.ready(slots.stage(u, step, times, clock), times)
            _, w = slots.weights(u, grad=False)
            if u <= self.num_blocks:
                xs = [block_forward(w, x, self.rope, self.mcfg, pk=pk, layer=u - 1) for x, pk in zip(xs, packs)]
                slots.release(u)
        return xs, w, we
