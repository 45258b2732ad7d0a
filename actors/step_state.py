"""The state one worker step threads through its stages: forward; head; backward; decide.

A ``StepState`` is made by ``GpuWorker`` at the start of ``run_step`` and dropped at its end;
nothing of it outlives the step (the gradients that are still leaving belong to the
shipper's copy-out thread by then). It lives on the worker's device and never crosses a
process boundary: what leaves the worker is a ``megaray.step.StepResult``.

Invariants:
- ``acts[i][m]`` is block i's input for micro-batch m while a later stage still needs it
  (saved, offloaded to host memory, or rebuilt by recomputation), None once consumed;
- ``kept[i]`` exists for every block i >= ``keep_from`` from its forward until its backward;
- ``grads[u]`` / ``sq[u]`` are unit u's final gradient / squared norm once its backward is done
  (``sq`` only with the gradients in host memory, until the decision);
- ``staged`` is the one copy-in the next stage waits for (the unit staged ahead);
- a mixture of experts' ``router`` holds every layer's routing of the whole step (all its
  micro-batches, all the data-parallel workers) before the first backward reads its gradient.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from megaray.moe import Routed, aux_loss_grad, balance_loss
from megaray.step import WorkerTimes

from .device import StepClock


@dataclass
class RouterTally:
    """What a mixture of experts' routers did over the step's forward, layer by layer."""

    counts: torch.Tensor
    """[layers, experts] fp32: the tokens each expert received."""
    probs: torch.Tensor
    """[layers, experts] fp32: the routers' probabilities summed over the tokens (detached)."""
    rows: float = 0.0
    """The rows routed, over every layer and every worker (the load-balancing loss's R): known
    from the shapes on the host, so the step never waits on the device for it."""
    grad: torch.Tensor | None = None
    """The loss's gradient with respect to a layer's summed probabilities (``moe.aux_loss_grad``),
    once the forward is done, where the loss is trained; else None."""

    @classmethod
    def empty(cls, layers: int, experts: int, device) -> RouterTally:
        z = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=device)
        return cls(z(layers, experts), z(layers, experts))

    def add(self, layer: int, routed: list[Routed]) -> None:
        for r in routed:
            self.counts[layer] += r.counts
            self.probs[layer] += r.prob_sum.detach()
            self.rows += r.rows

    def decide(self, cfg, workers: int) -> None:
        """The forward is done and the tallies summed over the ``workers`` (each routed as many
        rows: equal shares of the step's micro-batches): the loss's gradient."""
        self.rows *= workers
        if cfg.output_router_logits and cfg.router_aux_loss_coef > 0:
            self.grad = aux_loss_grad(cfg, self.counts.sum(0), self.rows)

    def loss(self, cfg) -> float:
        """The step's load-balancing loss before its coefficient (``moe.balance_loss``)."""
        return balance_loss(cfg, self.counts.sum(0), self.probs.sum(0), self.rows)

    def load(self) -> tuple[float, float]:
        """The experts' load, most-loaded expert over the mean, per layer: (the worst layer's,
        the layers' mean)."""
        ratio = self.counts.max(dim=1).values / self.counts.mean(dim=1).clamp_min(1e-9)
        return float(ratio.max()), float(ratio.mean())


@dataclass
class KeptBlock:
    """A block whose internals stay on the device from its forward to its backward."""

    flat: torch.Tensor
    """A private copy of its weights (its slot is refilled meanwhile), a leaf that requires grad."""
    weights: dict
    """Views into ``flat``, by parameter name."""
    pairs: list
    """(input, output) of each micro-batch, with the autograd graph between them."""
    probs: list = field(default_factory=list)
    """A mixture of experts' summed router probabilities of each micro-batch (in the graph)."""


@dataclass
class StepState:
    step: int
    inputs: torch.Tensor
    """Token ids [micro_batches, rows, seq_len] on the device."""
    targets: torch.Tensor
    """Target ids, IGNORE_INDEX where the loss leaves a target out."""
    packs: list
    """Each micro-batch's ``attention.Packing`` (None: causal attention)."""
    inv_tokens: float
    """1 / (target tokens in the whole step): the loss's scale, so accumulation is exact."""
    tokens: int
    times: WorkerTimes
    clock: StepClock
    num_units: int
    keep_from: int = 0
    """Blocks from here on keep their internals (no recomputation)."""
    offloaded: int = 0
    """Blocks below this one whose saved inputs wait in host memory."""
    lean: bool = False
    """Kept blocks hold the lean set of internals."""
    order: list = field(default_factory=list)
    """The backward's passes over the recomputed blocks (``memory.recompute_order``)."""
    acts: list = field(default_factory=list)
    kept: dict[int, KeptBlock] = field(default_factory=dict)
    staged: Future | None = None
    grads: list = field(default_factory=list)
    sq: list = field(default_factory=list)
    dys: list = field(default_factory=list)
    """The gradient into the current block's output, per micro-batch."""
    g_embed: torch.Tensor | None = None
    """The embedding's gradient (the tied head adds into it first)."""
    loss_sum: torch.Tensor | None = None
    router: RouterTally | None = None

    def __post_init__(self):
        self.grads = [None] * self.num_units
        self.sq = [None] * self.num_units

    @property
    def micro_batches(self) -> int:
        return self.inputs.shape[0]
