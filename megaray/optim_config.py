"""The optim section of a run's configuration: AdamW's hyperparameters and schedule, and where
the optimizer's state and the step's gradients live (the shards, the resident units, the
gradient ring), apart from the run's other sections (``megaray.config``), as the model section
is (``megaray.model_config``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from megaray.errors import ConfigError

_DTYPES = ("float32", "bfloat16")
RING_SLABS_PER_SHARD = 8          # optim.grad_ring_slabs=null: the deepest ring, as host memory allows
MIN_RING_SLABS_PER_SHARD = 2      # ... and the shallowest


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    schedule: str = "cosine"
    """Decay after warmup: cosine, linear or constant."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr/warmup_steps up to lr."""
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices."""
    decay_norms_and_biases: bool = False
    """Also decay 1-D parameters (norm scales, biases)."""
    clip_grad_norm: float | None = 1.0
    """Exact global-norm clipping threshold; null turns clipping off."""
    num_shards: int = 2
    """Optimizer actors; the gradient pieces (see grad_slab_mib) are split among them."""
    threads_per_shard: int = 1
    """torch threads in each optimizer actor (also its Ray num_cpus)."""
    shard_layout: str = "interleaved"
    """How gradient pieces are split among shards: 'interleaved' (piece p to shard p mod N:
    every shard works on every layer, so the next step's first layers are ready soonest) or
    'contiguous' ranges of pieces."""
    grad_slab_mib: float = 64.0
    """Size of one gradient slab in MiB: each layer unit's fp32 gradient leaves the GPU in
    pieces of at most this size, and each piece is one optimizer update. Part of the
    optimizer state's layout: a checkpoint resumes only with the same value."""
    grad_ring_slabs: int | None = None
    """Pinned host slabs in the gradient ring (the only host memory gradients use with
    grad_placement 'device'); null: up to RING_SLABS_PER_SHARD (8) per optimizer shard, as
    host memory allows (``megaray.plan.resolve``; never fewer than 2 a shard: one piece to
    update and one arriving) and never more than the run has gradient pieces. Piece p waits
    for slab p mod R, so a deep ring lets the copy-out run ahead of a shard that is behind:
    llama8b on the H200, 7 shards, 14 / 28 / 56 slabs: 393.1 / 400.5 / 403.9 TFLOP/s
    (BENCHMARKS.md)."""
    moment_dtype: str = "float32"
    """Dtype of the Adam moments: float32 (8 bytes a parameter) or bfloat16 (4: the update
    still computes in fp32 and rounds the moments to nearest when it stores them)."""
    master_dtype: str = "float32"
    """Dtype of the master weights: float32, or bfloat16 (needs train.compute_dtype
    bfloat16; the worker then reads the master itself, saving the compute copy too: 6 bytes
    a parameter become 2). The update computes in fp32 and stores the weights with
    stochastic rounding, so updates smaller than a bf16 step still move them on average."""
    compute_copy: str = "auto"
    """Where the compute-dtype (bf16) copy of the weights is made: 'host' (the optimizer
    shards refresh a copy in shared memory after each update and the GPU reads 2 bytes a
    parameter), 'device' (no host copy: the worker streams the fp32 master and casts on the
    GPU, 4 bytes a parameter over the link, 2 bytes a parameter less host memory and no
    cast pass on the optimizer's cores), or 'auto': device when each worker's share of a
    step holds at least 32,768 tokens (then a block's compute outlasts its fp32 transfer by
    several times) and the workers share the store's node, else host. No effect when the
    master already has the compute dtype."""

    grad_placement: str = "auto"
    """Where a step's gradients wait for the global norm (exact clipping needs it): 'device'
    (on the GPU in grad_dtype, 4 or 2 bytes a parameter of GPU memory; they leave through the
    gradient ring while the next step starts), 'host' (each unit's gradient leaves the GPU
    as soon as its backward is done, into a host buffer of grad_dtype, and the shards apply
    the clip coefficient: the GPU needs no memory that grows with the model), or 'auto':
    device when the step fits the GPU that way, else host."""
    grad_dtype: str = "float32"
    """Dtype of the gradients that wait for the norm (on the GPU or in host memory) and cross
    the link: float32, or bfloat16 (half the copy-out, and half the waiting bytes: on the GPU
    room for larger micro-batches or kept blocks). Each unit's gradient is summed over the
    micro-batches in fp32 and its squared norm taken from those values before it is rounded;
    the shards apply the clip coefficient to the rounded gradient in fp32."""
    resident_units: str | int = "auto"
    """Where the units' training state lives (named ``optim.placement`` until megaray 0.2, a
    name still read in 0.3 with a warning): 'host' (every unit streams: master and moments
    in host memory, updated by the shards, weights in and gradients out every step), 'auto'
    (the default: the cost model's choice for the GPU at hand, ``megaray plan`` prints it and
    what each choice buys; 'host' without a GPU or where resident units are not possible), or
    N: the first N units in forward order are *resident* (1: the embedding; N > 1: the
    embedding and the first N - 1 blocks; the head always streams). A resident unit's fp32
    master, Adam moments and gradient stay on the worker's device, which updates them itself
    (the same AdamW, clipping, skipping, weight-decay groups and schedule, to the bit on the
    CPU) with nothing crossing the link; its master reaches shared memory only for
    checkpoints and ``state_dict``. The other units stream as with 'host'. Forward order,
    because the next step's forward waits for each streamed unit's update in that order: the
    embedding's gates the step's first compute. Needs fp32 master and moments and one worker
    on the store's node."""

    def __post_init__(self):
        if not self.lr > 0:
            raise ConfigError("optim.lr", f"must be > 0 (got {self.lr})")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("optim.min_lr", f"must be in [0, lr] (got {self.min_lr})")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ConfigError("optim.schedule", f"must be cosine, linear or constant (got {self.schedule!r})")
        if self.warmup_steps < 0:
            raise ConfigError("optim.warmup_steps", "must be >= 0")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ConfigError("optim.betas", f"must be two numbers in [0, 1) (got {self.betas})")
        if self.eps <= 0:
            raise ConfigError("optim.eps", "must be > 0")
        if self.weight_decay < 0:
            raise ConfigError("optim.weight_decay", "must be >= 0")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError("optim.clip_grad_norm", "must be > 0 or null")
        if self.num_shards < 1:
            raise ConfigError("optim.num_shards", "must be >= 1")
        if self.threads_per_shard < 1:
            raise ConfigError("optim.threads_per_shard", "must be >= 1")
        if not self.grad_slab_mib > 0:
            raise ConfigError("optim.grad_slab_mib", f"must be > 0 (got {self.grad_slab_mib})")
        if self.grad_ring_slabs is not None and self.grad_ring_slabs < 1:
            raise ConfigError("optim.grad_ring_slabs", "must be >= 1 or null")
        if self.shard_layout not in ("contiguous", "interleaved"):
            raise ConfigError("optim.shard_layout", f"must be contiguous or interleaved (got {self.shard_layout!r})")
        if self.grad_placement not in ("auto", "device", "host"):
            raise ConfigError("optim.grad_placement", f"must be auto, device or host (got {self.grad_placement!r})")
        if self.resident_units not in ("host", "auto") and (not isinstance(self.resident_units, int)
                                                            or self.resident_units < 0):
            raise ConfigError("optim.resident_units", f"must be host, auto or a number of resident units >= 0 "
                                                 f"(got {self.resident_units!r})")
        if self.grad_dtype not in _DTYPES:
            raise ConfigError("optim.grad_dtype", f"must be one of {_DTYPES} (got {self.grad_dtype!r})")
        if self.compute_copy not in ("auto", "host", "device"):
            raise ConfigError("optim.compute_copy", f"must be auto, host or device (got {self.compute_copy!r})")
        for key in ("moment_dtype", "master_dtype"):
            if getattr(self, key) not in _DTYPES:
                raise ConfigError(f"optim.{key}", f"must be one of {_DTYPES} (got {getattr(self, key)!r})")

    @property
    def slab_numel(self) -> int:
        """fp32 elements in one gradient slab (the largest gradient piece)."""
        return max(1, int(self.grad_slab_mib * 2**20) // 4)

    @property
    def ring_slabs(self) -> int:
        """The ring's slabs as set, else the shallowest (until ``plan.resolve`` deepens it)."""
        return self.grad_ring_slabs or MIN_RING_SLABS_PER_SHARD * self.num_shards

    @property
    def resident_count(self) -> int:
        """How many units, in forward order from the embedding, are resident on the worker's
        device (``resident_units``; 0 for 'auto' until a machine resolves it: ``megaray.plan.resolve``)."""
        return self.resident_units if isinstance(self.resident_units, int) else 0
