"""Run configuration: one dataclass per YAML section, each field documented under it.

Cross-field checks run in ``__post_init__`` and raise ``ConfigError`` naming the dotted YAML
key. ``megaray.loader`` is the only way YAML becomes a ``RunConfig`` (it also type-checks
every field against its annotation and refuses unknown keys), all before any Ray actor
starts. Actors receive the ``RunConfig`` object itself, never loose keyword arguments or
environment variables.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from megaray.errors import ConfigError
from megaray.model_config import ModelConfig
from megaray.optim_config import _DTYPES, MIN_RING_SLABS_PER_SHARD, RING_SLABS_PER_SHARD, OptimConfig

__all__ = ["RunConfig", "replaced", "RING_SLABS_PER_SHARD", "MIN_RING_SLABS_PER_SHARD", "ModelConfig", "RunSection",
           "DataConfig", "TrainConfig", "OptimConfig", "WorkerConfig", "ClusterConfig", "CheckpointConfig",
           "DebugConfig"]



@dataclass(kw_only=True)
class RunSection:
    name: str = "run"
    """Run name (letters, digits, '.', '_', '-'); the run directory is ``<dir>/<name>-<id>``,
    and with ``checkpoint.resume: auto`` the name is also the checkpoint folder's."""
    dir: str = "runs"
    """Folder that holds run directories."""
    seed: int = 0
    """Seed of weight initialization and of data sampling (0 <= seed < 2**63)."""

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", self.name):
            raise ConfigError("run.name", f"{self.name!r} must be 1-64 letters, digits, '.', '_' or '-', starting "
                                          "with a letter or digit (it names folders)")
        if not 0 <= self.seed < 2**63:
            raise ConfigError("run.seed", f"must be in [0, 2**63) (got {self.seed})")
        if not self.dir:
            raise ConfigError("run.dir", "must be a folder name")


@dataclass(kw_only=True)
class DataConfig:
    source: str = "stdlib"
    """'stdlib': the running Python's standard-library source, byte-level tokens (no
    download); 'shards': packed token shards written by ``megaray prepare`` (data.path)."""
    path: str | None = None
    """The folder ``megaray prepare`` wrote (source: shards)."""
    shuffle: bool = True
    """Shuffle the shards' rows, epoch by epoch, with run.seed (source: shards)."""
    prefetch: int = 2
    """Steps of batches the data actor prepares ahead of the one training."""
    max_bytes: int = 8_000_000
    """How many bytes of the source corpus to read (source: stdlib)."""
    holdout_fraction: float = 0.02
    """Tail of the corpus kept out of training, for the evaluation loss (source: stdlib;
    shards hold out what ``megaray prepare`` was told to)."""

    def __post_init__(self):
        if self.source not in ("stdlib", "shards"):
            raise ConfigError("data.source", f"unknown source {self.source!r} (known: 'stdlib', 'shards')")
        if self.source == "shards" and not self.path:
            raise ConfigError("data.path", "source: shards needs the folder megaray prepare wrote")
        if self.prefetch < 1:
            raise ConfigError("data.prefetch", "must be >= 1")
        if self.max_bytes < 4096:
            raise ConfigError("data.max_bytes", "must be at least 4096")
        if not 0.0 <= self.holdout_fraction < 0.5:
            raise ConfigError("data.holdout_fraction", "must be in [0, 0.5)")


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps to run."""
    micro_batch_size: int = 8
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per step; the step's gradient is exactly that of one batch of them all."""
    seq_len: int = 256
    """Tokens per sequence."""
    compute_dtype: str = "bfloat16"
    """Dtype of the weights and activations the worker computes with: bfloat16 or float32."""
    loss_chunk_tokens: int = 4096
    """Tokens per cross-entropy chunk: the logits of more tokens never exist at once."""
    mlp_chunk_tokens: int = 32768
    """A micro-batch of more tokens than this runs each MLP in chunks of this many tokens,
    recomputed in the backward, so a long sequence's [tokens, intermediate] tensors never
    exist whole (costs one more MLP forward per block)."""
    log_every: int = 1
    """Steps between log lines and TensorBoard points."""
    eval_every: int | None = None
    """Steps between held-out evaluations (0: only at the end). null: ten points over the run
    (every ``steps // 10`` steps) when it has 20 steps or more, so TensorBoard's eval/loss is a
    curve; only at the end for a shorter one."""
    eval_batches: int = 4
    """Micro-batches in one evaluation."""

    @property
    def eval_interval(self) -> int:
        """``eval_every`` with null resolved: steps between evaluations, 0 for only at the end."""
        if self.eval_every is not None:
            return self.eval_every
        return self.steps // 10 if self.steps >= 20 else 0
    max_skipped_steps: int = 5
    """Consecutive steps with a non-finite loss or gradient after which the run stops."""
    attention: str = "auto"
    """Attention inside a packed row: 'causal' (every token sees all earlier tokens of the
    row, across documents), 'document' (each token sees only its own document's earlier
    tokens, and positions restart at each document: needs shards that record document
    starts, as ``megaray prepare`` writes them; earlier versions did not), or 'auto' (the
    default: 'document' for SFT shards that record starts, 'causal' otherwise; the run says
    which at start)."""

    def __post_init__(self):
        if self.attention not in ("auto", "causal", "document"):
            raise ConfigError("train.attention", f"must be auto, causal or document (got {self.attention!r})")
        for key in ("steps", "micro_batch_size", "grad_accum", "seq_len", "loss_chunk_tokens", "mlp_chunk_tokens",
                    "log_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}", f"must be >= 1 (got {getattr(self, key)})")
        if self.max_skipped_steps < 1:
            raise ConfigError("train.max_skipped_steps", "must be >= 1")
        if self.eval_every is not None and self.eval_every < 0:
            raise ConfigError("train.eval_every", f"must be >= 0 (got {self.eval_every})")
        if self.eval_batches < 1:
            raise ConfigError("train.eval_batches", f"must be >= 1 (got {self.eval_batches})")
        if self.compute_dtype not in _DTYPES:
            raise ConfigError("train.compute_dtype", f"must be one of {_DTYPES} (got {self.compute_dtype!r})")

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.seq_len


AUTO_DEVICE_CAST_TOKENS = 32768   # optim.compute_copy=auto casts on the device from this many tokens a worker


@dataclass(kw_only=True)
class WorkerConfig:
    device: str = "auto"
    """'auto' (CUDA when present), 'cuda' or 'cpu'."""
    threads: int = 1
    """torch threads of the worker (and its Ray num_cpus) when it computes on the CPU."""
    count: int = 1
    """Data-parallel GPU workers (one GPU each) sharing the one parameter store: each computes
    train.grad_accum / count of a step's micro-batches, and their gradients are summed (NCCL
    on GPUs, gloo on the CPU) before the norm, so the step equals one worker's whole batch."""
    node: str = "local"
    """Where the workers run (named ``worker.placement`` until megaray 0.2, a name still read
    in 0.3 with a warning). 'local': the workers share the store's node and its shared memory; 'remote': the
    workers run on other nodes of the Ray cluster (the store and the optimizer shards stay on
    one), and weights and gradients cross through Ray's object store via a relay actor."""
    keep_activations: int | None = None
    """Blocks (the last ones) whose activations stay on the device instead of being
    recomputed in backward; null: as many as fit in free GPU memory (0 on the CPU)."""
    offload_inputs: int | None = None
    """Blocks (the first ones) whose saved inputs wait in pinned host memory between the
    forward and the backward instead of on the GPU; null: none, unless the memory plan does
    not fit the GPU, then as many as it takes, decided once by the plan at start (the host
    plan counts them; the worker never offloads more)."""
    input_stride: int | None = None
    """Every how many blocks a recomputed block's input is saved between the forward and the
    backward. 1: every block's. S > 1: only every S-th block's (blocks 0, S, 2S, ... below the
    kept ones); the backward rebuilds the others' by running the blocks below them forward
    again from the saved one, each block's weights still crossing the link once: a 1/S share
    of the inputs' memory for (S-1)/S more forward passes of those blocks (S=2: an eighth more
    compute for a recomputed block, half its inputs). The long-context setting for a step whose
    inputs neither fit the GPU nor, offloaded, host memory. Null: 1, unless the run does not
    fit this machine that way and does with 2, 3 or 4 (the smallest; megaray.plan.resolve)."""
    wait_timeout_s: float = 600.0
    """Longest wait for an optimizer update or a free gradient slab before the run fails."""
    fuse_elementwise: bool = True
    """Run the blocks' elementwise passes (norms, RoPE, SwiGLU) as kernels compiled by
    torch.compile on the GPU (megaray.fused); false: eagerly, one kernel per operation."""
    gpu_memory_gib: float | None = None
    """Cap on the GPU memory a worker uses (the caching allocator's per-process fraction and the
    plan both hold to it): share a GPU, or size a run for a smaller card on a large one; null:
    all that is free."""

    def __post_init__(self):
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError("worker.device", f"must be auto, cuda or cpu (got {self.device!r})")
        if self.threads < 1:
            raise ConfigError("worker.threads", "must be >= 1")
        if self.count < 1:
            raise ConfigError("worker.count", "must be >= 1")
        if self.node not in ("local", "remote"):
            raise ConfigError("worker.node", f"must be local or remote (got {self.node!r})")
        if self.keep_activations is not None and self.keep_activations < 0:
            raise ConfigError("worker.keep_activations", "must be >= 0 or null")
        if self.offload_inputs is not None and self.offload_inputs < 0:
            raise ConfigError("worker.offload_inputs", "must be >= 0 or null")
        if self.input_stride is not None and self.input_stride < 1:
            raise ConfigError("worker.input_stride", f"must be >= 1 or null (got {self.input_stride})")
        if self.wait_timeout_s <= 0:
            raise ConfigError("worker.wait_timeout_s", "must be > 0")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise ConfigError("worker.gpu_memory_gib", f"must be > 0 or null (got {self.gpu_memory_gib})")

    @property
    def stride(self) -> int:
        """Every how many blocks an input is saved (``input_stride``; 1 until a machine resolves null)."""
        return self.input_stride or 1


@dataclass(kw_only=True)
class ClusterConfig:
    address: str | None = None
    """Ray address to attach to; null uses RAY_ADDRESS if set, else starts a local Ray."""
    num_cpus: int | None = None
    """CPUs of a local Ray started by megaray (null: this machine's count, at least what the run needs)."""
    object_store_mb: int = 256
    """Object store of a local Ray; small, because weights travel in megaray's own shared memory."""
    shm_dir: str = "/dev/shm"
    """Folder of the shared-memory files that hold weights, gradients and control words."""

    def __post_init__(self):
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError("cluster.num_cpus", f"must be >= 1 or null (got {self.num_cpus})")
        if self.object_store_mb < 64:
            raise ConfigError("cluster.object_store_mb", f"must be at least 64 (got {self.object_store_mb})")


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    """Folder of this run's checkpoints; null: ``<run.dir>/checkpoints/<run.name>``, shared by
    every launch of the same run name, so ``resume: auto`` finds them."""
    every: int = 0
    """Steps between periodic checkpoints (0: none); a final checkpoint is always written."""
    keep: int = 3
    """Complete checkpoints to keep; older ones are deleted once a newer one is complete."""
    resume: str | None = "auto"
    """'auto': continue from the newest complete checkpoint if there is one; null: start
    fresh; or the path of one checkpoint folder."""
    on_damaged: str = "refuse"
    """When every checkpoint ``resume: auto`` finds is damaged: 'refuse' (the run fails before
    training, naming each checkpoint and its bad part, and leaves them as they are) or
    'start_over' (train from the initial weights in the same folder, replacing them as the run
    reaches their steps)."""
    on_sigterm: bool = True
    """On SIGTERM (``ray job stop``) or a first Ctrl-C, write a checkpoint after the current
    step, then exit (a second Ctrl-C quits at once, without it)."""
    narrow_moments: bool = False
    """Resume a checkpoint whose AdamW moments are stored wider than optim.moment_dtype keeps
    them (fp32 into bf16), rounding them; false refuses such a resume, naming both dtypes."""
    max_restarts: int = 2
    """Times a run restarts its actors from the last checkpoint after an actor dies."""

    def __post_init__(self):
        if self.every < 0:
            raise ConfigError("checkpoint.every", "must be >= 0")
        if self.keep < 1:
            raise ConfigError("checkpoint.keep", "must be >= 1")
        if self.max_restarts < 0:
            raise ConfigError("checkpoint.max_restarts", "must be >= 0")
        if self.on_damaged not in ("refuse", "start_over"):
            raise ConfigError("checkpoint.on_damaged", f"must be refuse or start_over (got {self.on_damaged!r})")


@dataclass(kw_only=True)
class DebugConfig:
    crash_actor: str | None = None
    """Inject a failure in this actor kind (optimizer, worker) ... (tests only)."""
    crash_step: int | None = None
    """... at this step."""
    nonfinite_steps: list = field(default_factory=list)
    """Steps (0-based indices: 0 is the first step) whose loss and gradients the worker makes
    NaN (tests of step skipping)."""
    keep_gradients: bool = False
    """The worker keeps a host copy of each step's unclipped gradients for
    ``TrainingSession.gradients()`` (tests and interop checks; costs 4 bytes a parameter)."""

    def __post_init__(self):
        if self.crash_actor not in (None, "optimizer", "worker"):
            raise ConfigError("debug.crash_actor", "must be null, optimizer or worker")
        if (self.crash_actor is None) != (self.crash_step is None):
            raise ConfigError("debug.crash_step", "crash_actor and crash_step go together")


@dataclass(kw_only=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=lambda: ModelConfig.from_shape("debug"))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def resident_blocks(self) -> int:
        """Blocks among the resident units (``optim.resident_units`` N: the embedding, then N - 1 blocks)."""
        return min(self.model.num_hidden_layers, max(0, self.optim.resident_count - 1))

    @property
    def host_compute_copy(self) -> bool:
        """Whether the store keeps a compute-dtype copy in shared memory (``optim.compute_copy``)."""
        if self.train.compute_dtype == self.optim.master_dtype:
            return False
        if self.optim.compute_copy != "auto":
            return self.optim.compute_copy == "host"
        per_worker = self.train.tokens_per_step // self.worker.count
        return self.worker.node == "remote" or per_worker < AUTO_DEVICE_CAST_TOKENS

    def __post_init__(self):
        units = self.model.num_hidden_layers + 2
        if self.optim.num_shards > units:
            raise ConfigError(
                "optim.num_shards",
                f"{self.optim.num_shards} optimizer shards for {units} layer units "
                f"({self.model.num_hidden_layers} blocks + embedding + head): at most {units}",
            )
        if self.optim.master_dtype == "bfloat16" and self.train.compute_dtype != "bfloat16":
            raise ConfigError("optim.master_dtype", "a bfloat16 master needs train.compute_dtype: bfloat16 "
                                                    f"(got {self.train.compute_dtype})")
        n = self.optim.resident_count
        if n > self.model.num_hidden_layers + 1:
            raise ConfigError("optim.resident_units", f"{n} resident units, but the model has the embedding and "
                                                 f"{self.model.num_hidden_layers} blocks before the head "
                                                 f"(at most {self.model.num_hidden_layers + 1}; the head streams)")
        if n and self.optim.master_dtype != "float32":
            raise ConfigError("optim.resident_units", "resident units keep an fp32 master (their moments fp32 or "
                                                 f"bf16); got optim.master_dtype={self.optim.master_dtype}")
        if n and (self.worker.count > 1 or self.worker.node == "remote"):
            raise ConfigError("optim.resident_units", "resident units need one worker on the store's node "
                                                 f"(worker.count={self.worker.count}, "
                                                 f"worker.node={self.worker.node})")
        if self.train.grad_accum % self.worker.count:
            raise ConfigError("worker.count", f"{self.worker.count} workers cannot share train.grad_accum="
                                              f"{self.train.grad_accum} micro-batches evenly")
        sw = self.model.sliding_window
        if sw is not None and self.model.layer_types is None and self.train.seq_len > sw:
            raise ConfigError("model.from", f"sliding_window={sw} is shorter than train.seq_len={self.train.seq_len}; "
                                            "megaray computes full causal attention")
        if self.train.seq_len > self.model.max_position_embeddings:
            raise ConfigError(
                "train.seq_len",
                f"{self.train.seq_len} exceeds model.max_position_embeddings={self.model.max_position_embeddings}",
            )
        has_tokenizer = self.model.from_path and os.path.isfile(os.path.join(self.model.from_path, "tokenizer.json"))
        if self.data.source == "stdlib" and self.model.vocab_size < 256 and not has_tokenizer:
            raise ConfigError("model.vocab_size", "byte-level data needs vocab_size >= 256")
        if self.train.attention == "document" and self.data.source != "shards":
            raise ConfigError("train.attention", "document attention needs data.source: shards (prepared shards "
                                                 f"record where documents start; got data.source={self.data.source})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def checkpoint_dir(self) -> Path:
        if self.checkpoint.dir:
            return Path(self.checkpoint.dir)
        return Path(self.run.dir) / "checkpoints" / self.run.name


def replaced(cfg: RunConfig, section: str, **changes) -> RunConfig:
    """``cfg`` with some keys of one section changed (and every check run again)."""
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})
