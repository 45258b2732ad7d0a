"""What travels with a training step: the ``Batch`` that goes in, the worker's ``StepResult``
that comes out, and the ``WorkerTimes`` inside it.

Each crosses a process boundary (the data feeder -> the driver -> the scheduler -> the
workers, and back), so each is a small frozen-or-plain dataclass that pickles as it is:
numpy arrays and numbers, no tensors and no actor handles. Nothing here imports Ray or CUDA.

Invariants:
- a ``Batch`` is always [micro_batches, rows, seq_len + 1] in every array it holds; its loss
  mask and document ids, when present, have the tokens' shape;
- the targets a step's loss counts are decided once, by ``Batch.targets_kept``: the
  scheduler's token count, the worker's loss and the evaluation read the same rule;
- ``StepResult.metrics()`` is the only place the worker's fields become metric names
  (``worker/<field>`` in metrics.jsonl and TensorBoard).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from megaray.model_config import windowed_square

# The run's metric names: each per-step quantity has one name everywhere, the key in
# metrics.jsonl, the TensorBoard tag train/<name> and the Prometheus series ray_megaray_<name>
# (``actors.metrics`` exports them).
STEP_GAUGES = {   # per-step values: metrics.jsonl, TensorBoard train/<name>, ray_megaray_<name>
    "loss": "Training loss of the last step",
    "learning_rate": "Learning rate of the last step",
    "grad_norm": "Global gradient norm of the last step, before clipping (-1 for a skipped step)",
    "tokens_per_second": "Training tokens per second over the last step",
    "step_time_seconds": "Wall time of the last training step",
    "tflops": "Model TFLOP/s of the last step (ARCHITECTURE.md formula; each document's own attention work)",
    "gpu_idle_seconds": "Time in the last step the GPU did no compute",
    "exposed_optimizer_seconds": "Time the worker waited for optimizer updates in the last step",
    "copy_in_gbps": "Host-to-device weight staging rate of the last step, GB/s",
    "copy_out_gbps": "Device-to-host gradient rate of the last step, GB/s",
    "node_memory_used_bytes": "Host memory in use on the run's node (all processes, not only the run's)",
    "gpu_memory_peak_bytes": "Peak device memory of the worker in the last step",
    "skipped_steps": "Steps skipped so far for a non-finite loss or gradient (exported from the first step)",
}
MOE_GAUGES = {   # a mixture of experts' rows add these
    "router_loss": "Load-balancing loss of the last step, unweighted (1.0: balanced routing)",
    "expert_load_max": "Most-loaded expert's tokens over the mean, worst layer, last step",
    "expert_load_mean": "Most-loaded expert's tokens over the mean, averaged over the layers, last step",
}
STEP_COUNTERS = {"steps_total": "Training steps completed", "tokens_total": "Training tokens processed"}
SHARD_GAUGES = {
    "optimizer_seconds": "Time this optimizer shard spent updating in its last step",
    "optimizer_params_per_second": "This shard's AdamW update rate in its last step",
}


def document_lengths(doc: np.ndarray) -> np.ndarray:
    """The lengths of the documents of rows of tokens' document ids (``doc`` [..., seq]): each
    run of one id within a row is a document (one ends where its row ends)."""
    rows = doc.reshape(-1, doc.shape[-1])
    starts = np.ones(rows.shape, dtype=bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    begin = np.flatnonzero(starts.ravel())
    return np.diff(np.append(begin, rows.size)).astype(np.int64)


def square_document_lengths(doc: np.ndarray, window: int | None = None) -> int:
    """The documents' squared lengths summed (``document_lengths``), or with ``window`` what a
    sliding window leaves of each (``model_config.windowed_square``): attention's work in pair-units."""
    lengths = document_lengths(doc)
    return int((lengths * lengths if window is None else windowed_square(lengths, window)).sum())


@dataclass(frozen=True)
class Batch:
    """One step's rows (or an evaluation's), [micro_batches, rows, seq_len + 1] each."""

    tokens: np.ndarray
    """int64 token ids: inputs are ``[..., :-1]``, targets ``[..., 1:]``."""
    loss_mask: np.ndarray | None = None
    """Nonzero where a token counts as a target (supervised fine-tuning); None: all do."""
    doc: np.ndarray | None = None
    """Each token's document within its row, under document attention; None: causal."""

    @classmethod
    def of(cls, x: Batch | np.ndarray) -> Batch:
        """``x`` itself, or a batch of plain tokens (the driver's convenience for an array)."""
        if isinstance(x, Batch):
            return x
        tokens = np.asarray(x)
        if not np.issubdtype(tokens.dtype, np.integer) or tokens.ndim != 3:
            raise TypeError(f"a batch is a megaray.step.Batch or an integer token array [micro_batches, rows, "
                            f"seq_len + 1]; got {type(x).__name__} ({tokens.dtype}, {tokens.ndim} dimensions)")
        return cls(tokens)

    @classmethod
    def from_rows(cls, rows: dict, micro_batches: int) -> Batch:
        """A data source's rows ({"tokens", "loss_mask"?, "doc"?}, [n, seq_len + 1]) cut into
        ``micro_batches`` equal micro-batches."""
        return cls(**{k: v.reshape(micro_batches, -1, v.shape[-1]) for k, v in rows.items()})

    @property
    def micro_batches(self) -> int:
        return len(self.tokens)

    def shares(self, n: int) -> list[Batch]:
        """``n`` contiguous, equal shares of the micro-batches (one a data-parallel worker)."""
        m = self.micro_batches // n
        return [Batch(*(None if a is None else a[r * m:(r + 1) * m] for a in self._arrays())) for r in range(n)]

    def targets_kept(self) -> np.ndarray | None:
        """Which targets (tokens 1.. of each row) the loss counts, bool [..., seq_len], or None
        for all: those the loss mask marks, and with document attention none that begins a new
        document (a document alone has no token before its first to predict it from)."""
        keep = None if self.loss_mask is None else np.asarray(self.loss_mask)[..., 1:] != 0
        if self.doc is not None:
            d = np.asarray(self.doc)
            same = d[..., 1:] == d[..., :-1]
            keep = same if keep is None else keep & same
        return keep

    def target_tokens(self) -> int:
        """Target tokens the loss counts (what it is divided by)."""
        keep = self.targets_kept()
        if keep is not None:
            return int(keep.sum())
        shape = np.shape(self.tokens)
        return int(np.prod(shape[:-1])) * (shape[-1] - 1)

    def square_document_lengths(self, window: int | None = None) -> int | None:
        """The sum over the batch's documents of their squared lengths in input tokens (a
        document ends where its row ends), or None without document attention: what
        ``model.flops_per_step`` counts the attention's work by. With ``window``, what a
        sliding window leaves of each (``model_config.windowed_square``)."""
        if self.doc is None:
            return None
        return square_document_lengths(np.asarray(self.doc)[..., :-1], window)

    def _arrays(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclass
class CopyOut:
    """A step's gradients on their way out (counted when they have left, during the next step)."""

    copy_out_s: float = 0.0
    copy_out_bytes: int = 0
    wait_slab_s: float = 0.0
    """Waiting for a free slab of the gradient ring (a shard still applying an earlier piece)."""

    def __iadd__(self, other: CopyOut) -> CopyOut:
        for f in dataclasses.fields(other):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


@dataclass
class WorkerTimes(CopyOut):
    """Where one worker step's time went (seconds, or bytes where the name says so)."""

    forward_s: float = 0.0
    head_s: float = 0.0
    backward_s: float = 0.0
    reduce_s: float = 0.0
    """The global norm, the verdict and the clip (after the backward)."""
    resident_update_s: float = 0.0
    """The worker's own update of its resident units."""
    copy_in_s: float = 0.0
    copy_in_bytes: int = 0
    wait_copy_in_s: float = 0.0
    """The host waiting for a unit's weights to arrive before it could issue its compute."""
    wait_optimizer_s: float = 0.0
    """Waiting for the shards' updates of the previous step before staging a unit."""
    offload_bytes: int = 0
    compute_s: float = 0.0
    """The GPU's busy time (events around every compute region)."""
    gap_optimizer_s: float = 0.0
    """Idle gaps between compute regions spent waiting for the optimizer."""
    gap_other_s: float = 0.0
    """Idle gaps waiting for copy-in or for kernel launches."""
    first_unit_optimizer_s: float = 0.0
    """Before the first region, outside the GPU work: how long of it waited for updates."""


@dataclass
class StepResult:
    """What a worker's ``run_step`` returns to the scheduler."""

    loss_sum: float
    """The loss summed over the step's targets (the scheduler divides by ``tokens``)."""
    tokens: int
    grad_norm: float
    clip_coef: float
    applied: bool
    """False: a non-finite loss or gradient; the step was skipped."""
    times: WorkerTimes = field(default_factory=WorkerTimes)
    worker_s: float = 0.0
    kept_blocks: int = 0
    """Blocks whose internals stayed on the GPU (no recomputation)."""
    kept_block_bytes: int = 0
    kept_plain: bool = True
    """Kept blocks hold their plain internals (not the lean set)."""
    offloaded_inputs: int = 0
    input_stride: int = 1
    fused_elementwise: bool | None = None
    """On CUDA: whether the compiled elementwise kernels ran (None on the CPU)."""
    gpu_peak_bytes: int = 0
    router_loss: float | None = None
    """A mixture of experts': the load-balancing loss over the step, unweighted
    (experts x sum_e f_e P_e, transformers' ``aux_loss``; 1.0 when the routing is balanced)."""
    expert_load_max: float | None = None
    """The most-loaded expert's tokens over the mean, in the worst layer."""
    expert_load_mean: float | None = None
    """The same, averaged over the layers."""

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)

    def moe_metrics(self) -> dict:
        """A mixture of experts' row keys (none for a dense model)."""
        if self.router_loss is None:
            return {}
        return {"router_loss": self.router_loss, "expert_load_max": self.expert_load_max,
                "expert_load_mean": self.expert_load_mean}

    def metrics(self) -> dict:
        """The worker's side of a step's metrics row, ``worker/<name>`` each."""
        out = {f"worker/{k}": v for k, v in dataclasses.asdict(self.times).items()}
        out.update({"worker/worker_s": self.worker_s, "worker/kept_blocks": self.kept_blocks,
                    "worker/kept_block_bytes": self.kept_block_bytes, "worker/kept_plain": float(self.kept_plain),
                    "worker/offloaded_inputs": self.offloaded_inputs, "worker/input_stride": self.input_stride})
        if self.fused_elementwise is not None:
            out["worker/fused_elementwise"] = float(self.fused_elementwise)
            out["worker/gpu_peak_bytes"] = self.gpu_peak_bytes
        return out


@dataclass
class EvalResult:
    """A forward-only loss over held-out rows."""

    loss_sum: float
    tokens: int

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)
