"""The one model of a step's GPU memory, used by ``megaray plan``, by ``megaray train``'s check
and by the worker at run time (how many blocks keep their activations, how many blocks'
inputs wait in host memory).

What one GPU holds during a step (each GPU's share, with ``worker.count`` data-parallel
workers): the four weight slots (embedding, head, two blocks); the saved block inputs of
every micro-batch (less those offloaded to pinned host memory, ``worker.offload_inputs``);
the kept blocks' internals and their private weight copy (``worker.keep_activations``: the
last K blocks are not recomputed in the backward); the step's gradients, held until the
global norm is known (fp32; or, with ``optim.grad_dtype`` bfloat16, rounded as each block's
backward ends, beside the one block's fp32 sum being made); the gradient of the step's
activations; the recomputation workspace of one micro-batch (one MLP chunk's, or the
attention backward's, for long sequences); the loss chunk's logits; the fp32 staging slab
of the on-device cast; and the CUDA context.

The peak is found by walking the backward: block j's input and (if kept) internals are
freed as its fp32 gradient appears, so the peak is the largest of (inputs still saved + kept
internals still alive + gradients so far) over the backward's positions, and the head
(every input, the last block's output too). Offloaded inputs (the first blocks') come back
one block ahead, so at most two of them are on the GPU at once.

``block_internal_bytes_per_token`` counts what autograd saves in ``megaray.model``'s lean
block per token: one fp32 scale per norm, the second norm's input (the first's is the block
input, held anyway; the norms' outputs are rebuilt in the backward), q, k and v (kv heads as
they are where SDPA takes them grouped, else repeated), attention's output (also o_proj's
input) and log-sum-exp, and the MLP's gate and up projections. When the MLP runs in chunks
(``train.mlp_chunk_tokens``) it keeps neither, but the second norm's output instead.

At run time the worker plans against ``budget(free)``: the GPU memory free to it less one
reserve (``RESERVE_FRACTION`` of it plus ``RESERVE_BYTES``) for the allocator's fragmentation
and what the model does not count. After each step it corrects the model by measurement
(``adapt_keep``: the step's measured peak and one kept block's measured cost), against the
same budget.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megaray.attention import SDPA_GQA, create_block_mask, packing_mask_bytes
from megaray.clipping import NORM_CHUNK
from megaray.config import ModelConfig, RunConfig
from megaray.layout import DTYPES, build_layout
from megaray.model import LOSS_ROWS

GiB = 2**30
CUDA_CONTEXT_BYTES = 1 * GiB
RESERVE_FRACTION = 0.06
RESERVE_BYTES = 2 * GiB
# [tokens, intermediate] tensors alive at once in the MLP's backward beside what the block
# saved: the lean block's (the product's gradient, the up projection's and the gate's; gate and
# up are saved: ``model._swiglu_grads``) and a chunk's of the chunked MLP (gate, up, silu(gate)
# and one of their product or gradients, ``model._ChunkedMLP``)
MLP_LIVE = 3
MLP_CHUNK_LIVE = 4


def block_internal_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, mlp_chunked: bool = False,
                                    lean: bool = True, fused: bool = False) -> int:
    """Bytes one block saves per token for its backward (module docstring); ``lean`` False:
    plain autograd's (``block_forward(lean=False)``), which keeps the first norm's output and,
    unless the MLP is chunked, the second's, silu(gate) and the product too. ``fused``: the
    elementwise passes compiled (``megaray.fused``): the compiler's SwiGLU saves the gate and
    the up projection, which are saved anyway, and rebuilds silu(gate) in its backward, so a
    plain block keeps one [tokens, intermediate] tensor fewer (measured on the H200: llama1b's
    16 plain blocks at 64k tokens peaked 16 GiB under the eager count, BENCHMARKS.md)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    s = dtype_bytes
    if cfg.norm_placement == "post":    # OLMo 2's block runs as plain autograd: attention's and the MLP's
        lean = False                    # outputs saved for their norms in place of the norms' outputs
    kv_saved = kv if SDPA_GQA or kv == q else q
    attn = s * (2 * q + 2 * kv_saved) + 4 * cfg.num_attention_heads   # q, k, v, output (= o_proj input), lse
    if cfg.qk_norm:       # the norms' inputs and fp32 scales (one a head, or one a projection)
        scales = cfg.num_attention_heads + cfg.num_key_value_heads if cfg.qk_norm_scope == "head" else 2
        attn += s * (q + kv) + 4 * scales
    if cfg.moe:           # the first norm as in the dense block; the MLP is moe_bytes_per_token's
        return 4 + attn + (0 if lean else s * h) + moe_bytes_per_token(cfg, s, fused)
    if cfg.norm_placement == "sandwich":   # Gemma 3, plain autograd: the inputs of the norms after the
        # first (attention's output, the residual, the MLP's output) and the outputs of the two
        # before attention and the MLP, four fp32 scales; gate, up and the product (and GELU's
        # output, run eagerly), or with the MLP chunked nothing beyond its input
        mlp = 0 if mlp_chunked else (3 if fused else 4) * s * i
        return attn + 5 * s * h + 4 * 4 + mlp
    norms = 2 * 4 + s * h * (2 if mlp_chunked else 1)     # two scales; norm 2's input (and output, chunked)
    mlp = 0 if mlp_chunked else 2 * s * i       # gate and up
    plain = 0 if lean else s * h + (0 if mlp_chunked else s * h + (1 if fused else 2) * s * i)
    return norms + attn + mlp + plain


def moe_bytes_per_token(cfg: ModelConfig, s: int, fused: bool = False) -> int:
    """What a mixture's MLP (``moe.moe_mlp``, plain autograd) saves per token: the norm's input,
    scale and output; the router's fp32 softmax and its top k (values, int64 indices, and the
    renormalised weights); for each of the k rows the token sends to its experts (sorted): the
    gathered input, the gate and up projections, the row's router weight, the down
    projection's input, the two int64 permutations the rows move by, and, run eagerly,
    silu(gate) and its product with up (the compiled ``moe._swiglu`` rebuilds them)."""
    h, e, k, i = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    norm = 2 * s * h + 4
    router = 4 * e + k * (4 + 8 + 4)
    rows = k * (s * h + (3 if fused else 5) * s * i + s + 2 * 8)
    return norm + router + rows


def mlp_backward_bytes_per_token(cfg: ModelConfig, s: int) -> int:
    """The MLP backward's transient tensors per token beside what it saved: the dense block's
    MLP_LIVE [tokens, intermediate] tensors, or a mixture's gradients of its k rows' gate, up
    and product (and of the gathered input)."""
    if cfg.moe:
        return cfg.num_experts_per_tok * (MLP_LIVE * s * cfg.moe_intermediate_size + s * cfg.hidden_size)
    return MLP_LIVE * s * cfg.intermediate_size


def attention_backward_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """One block's attention backward at its peak, per token (the MLP's backward has run and
    freed its part): the saved q, k, v, output and log-sum-exp, the output's gradient, the
    gradients of q, k and v, flash attention's fp32 accumulator for dq, and, with grouped
    kv heads, k's and v's gradients per query head before they are summed per group. At
    524,288 tokens (llama3b) this is 28 GiB, twice a chunked block's internals: a step the
    model had planned at 118.7 GiB held 125.4, and one with fewer inputs offloaded ran out
    allocating the 6 GiB accumulator."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    s = dtype_bytes
    kv_saved = kv if SDPA_GQA or kv == q else q
    saved = s * (2 * q + 2 * kv_saved) + 4 * cfg.num_attention_heads
    grads = s * q + s * (q + 2 * kv_saved) + 4 * q     # d(output); dq, dk, dv; dq's fp32 accumulator
    expanded = 2 * s * q if kv_saved != q else 0
    return saved + grads + expanded


@dataclass(frozen=True)
class StepShape:
    """The sizes the GPU model is made of, for one config (one GPU's share of a step)."""
    layers: int
    dtype_bytes: int
    tokens: int                 # one GPU's tokens in a step
    micro_tokens: int
    embed_numel: int
    head_numel: int
    block_numel: int
    one_input: int              # bytes of one block's saved inputs, all micro-batches
    internal_per_token: int
    plain_per_token: int        # plain autograd's internals (a recomputed block's, unless the MLP is chunked)
    mlp_chunked: bool

    @classmethod
    def of(cls, cfg: RunConfig) -> StepShape:
        m, t = cfg.model, cfg.train
        units = build_layout(m)
        s = DTYPES[t.compute_dtype].itemsize
        tokens = t.tokens_per_step // cfg.worker.count
        micro = t.micro_batch_size * t.seq_len
        chunked = micro > t.mlp_chunk_tokens
        per_token = block_internal_bytes_per_token(m, s, chunked)
        # the GPU's passes are compiled unless worker.fuse_elementwise is off
        plain = block_internal_bytes_per_token(m, s, chunked, lean=False, fused=cfg.worker.fuse_elementwise)
        block = units[1].numel if m.num_hidden_layers else 0
        return cls(m.num_hidden_layers, s, tokens, micro, units[0].numel, units[-1].numel, block,
                   s * tokens * m.hidden_size, per_token, plain, chunked)

    def kept_block_bytes(self, lean: bool = True) -> int:
        """One kept block: its internals over the step's tokens and its weights."""
        per_token = self.internal_per_token if lean else self.plain_per_token
        return per_token * self.tokens + self.dtype_bytes * self.block_numel

    @property
    def recompute_lean(self) -> bool:
        """Whether a recomputed block runs lean: only with its MLP in chunks, where memory is
        what counts. Otherwise it runs as plain autograd (3-6% faster on the H200: one block,
        llama1b 8.02 ms against 8.48, BENCHMARKS.md) for a workspace of one
        micro-batch's plain internals."""
        return self.mlp_chunked


def anchors(n: int, stride: int) -> int:
    """The saved inputs among the first n blocks when every ``stride``-th is saved (blocks 0,
    S, 2S, ...: ``worker.input_stride``)."""
    return -(-n // stride)


def recompute_order(keep_from: int, stride: int) -> list[tuple[int, bool, bool]]:
    """The backward's passes over the recomputed blocks 0..keep_from-1, in order, as (block,
    with gradients, first to read its segment's saved input). Segment by segment from the
    top: a segment is an anchor a (a block whose input was saved) and the blocks above it up to
    the next anchor, a..b-1; blocks a..b-2 run forward again without gradients, rebuilding the
    inputs of a+1..b-1, then b-1..a run backward (each recomputed from its input). With
    stride 1 every block is an anchor: the plain backward, L-1..0."""
    order = []
    for a in reversed(range(0, keep_from, stride)):
        b = min(a + stride, keep_from)
        order += [(j, False, j == a) for j in range(a, b - 1)]
        order += [(j, True, j == a == b - 1) for j in reversed(range(a, b))]
    return order


def grads_on_device(cfg: RunConfig) -> bool:
    """Whether the step's gradients wait on the GPU for the norm (``optim.grad_placement``;
    'auto' counts as the device until a machine resolves it: ``megaray.plan.resolve``)."""
    return cfg.optim.grad_placement != "host"


def gpu_items(cfg: RunConfig, keep: int = 0, offload: int = 0, cast_slab_bytes: int = 0,
              lean: bool = True) -> dict[str, int]:
    """The step's GPU memory at its peak, item by item, keeping the last ``keep`` blocks'
    activations (lean ones, or plain autograd's with ``lean`` False: ``kept_plain``) and
    offloading the first ``offload`` blocks' inputs.

    With the gradients in host memory (``optim.grad_placement`` host) the device holds, at
    any time, the tied embedding's gradient and two other units' (the one being computed,
    the one leaving): nothing that grows with depth. With every input offloaded and nothing
    kept, the whole need is then independent of the number of blocks: two block slots and the
    embedding's and head's, one block's inputs (two while they come back), the activation
    gradient, one micro-batch's recomputation workspace, the loss chunk, those gradients, the
    cast's staging slab and the CUDA context."""
    m, t = cfg.model, cfg.train
    sh = StepShape.of(cfg)
    L, s = sh.layers, sh.dtype_bytes
    keep = max(0, min(L, keep))
    n_off = max(0, min(L - keep, offload))
    kept_one = sh.kept_block_bytes(lean)
    summing = 0     # rounded gradients: the fp32 sum of the block whose backward is under way
    if grads_on_device(cfg):
        g = DTYPES[cfg.optim.grad_dtype].itemsize              # each waits in grad_dtype, summed in fp32
        grads_ends = 4 * sh.embed_numel + g * sh.head_numel     # embedding's (summed to the end) and head's
        grads_per_block = g * sh.block_numel                   # each block's, until the norm is known
        summing = 4 * sh.block_numel if g < 4 else 0
    else:
        tied = sh.embed_numel if m.tie_word_embeddings else 0
        grads_ends = 4 * (tied + 2 * max(sh.block_numel, sh.head_numel, 0 if tied else sh.embed_numel))
        grads_per_block = 0
    S = cfg.worker.stride
    keep_from = L - keep
    off = anchors(n_off, S)                                     # saved inputs in host memory
    saved = anchors(keep_from, S) - off                         # saved inputs on the GPU
    ahead = min(1, off)                                         # one offloaded input coming back early
    # the forward's end: the saved inputs, the kept blocks' and the last output (or, with nothing
    # kept, the last recomputed block's unsaved input beside its output)
    forward = saved + max(L - keep_from + 1, 2 if keep_from and (keep_from - 1) % S else 1)
    best = (forward * sh.one_input + keep * kept_one + grads_ends, forward, keep, L)
    for j in range(L, -1, -1):                                  # blocks 0..j-1 not yet backwarded
        if j == 0:
            on_gpu_inputs = 0
        elif j > keep_from:                                     # a kept block: the kept ones' inputs alive
            on_gpu_inputs = saved + j - keep_from + ahead
        else:   # block i = j-1, in the segment from anchor a: a's input, rebuilt inputs a+1..i
            i = j - 1
            a = i - i % S
            back = 1 + (a > 0) if a < n_off else ahead          # a's own, back from host, and the next
            on_gpu_inputs = max(0, anchors(a + 1, S) - off) + (i - a) + back
        alive_kept = max(0, j - keep_from)
        grads = grads_ends + grads_per_block * (L - j) + (summing if j else 0)
        total = on_gpu_inputs * sh.one_input + alive_kept * kept_one + grads
        if total > best[0]:
            best = (total, on_gpu_inputs, alive_kept, j)
    _, n_inputs, n_kept, j = best
    mlp_chunk = 0
    if sh.mlp_chunked:      # one chunk's tensors and the three weights' fp32 gradient sums (and their cast)
        h, i = m.hidden_size, m.intermediate_size
        mlp_chunk = min(t.mlp_chunk_tokens, sh.micro_tokens) * MLP_CHUNK_LIVE * s * i + 3 * (4 + s) * h * i
    embed_res = cfg.optim.resident_count >= 1        # a resident embedding is read where it lives: no slot
    items = {
        ("weight slots (head, 2 blocks)" if embed_res else "weight slots (embed, head, 2 blocks)"):
            s * ((0 if embed_res else sh.embed_numel) + sh.head_numel + 2 * sh.block_numel),
        "saved block inputs (at the peak)": n_inputs * sh.one_input,
        "gradient of the step's activations": sh.one_input,
        ("gradients, bf16 (one block's summed in fp32; at the peak)" if summing else "fp32 gradients (at the peak)"):
            grads_ends + grads_per_block * (L - j) + (summing if j else 0),
        # a recomputed block's internals with its MLP backward's rebuilt silu(gate), the
        # product's gradient and the gate's and up's gradients; or, later, its attention's
        # backward, whichever is larger (the attention's, for long chunked micro-batches)
        "recomputation workspace (1 micro-batch)": max(
            (sh.internal_per_token if sh.recompute_lean else sh.plain_per_token) * sh.micro_tokens
            + (mlp_chunk or mlp_backward_bytes_per_token(m, s) * sh.micro_tokens),
            attention_backward_bytes_per_token(m, s) * sh.micro_tokens),
        "loss chunk (logits, gradients)": loss_chunk_bytes(cfg),
        ("kept blocks (internals + weights, at the peak)" if lean else
         "kept blocks (plain autograd's internals + weights, at the peak)"): n_kept * kept_one,
        "CUDA context and allocator slack": CUDA_CONTEXT_BYTES,
        "gradient norm workspace (float64 chunk)": 8 * min(NORM_CHUNK, max(sh.block_numel, sh.head_numel,
                                                                             sh.embed_numel)),
    }
    if embed_res:   # fp32 master, two moments (fp32 or bf16), the compute copy (in place of a slot)
        n_res = cfg.resident_blocks
        state = 4 + 2 * DTYPES[cfg.optim.moment_dtype].itemsize + s
        # the embedding's gradient is among the ends' already; a block's, in host mode, waits for the update
        per_block = state + (0 if grads_on_device(cfg) else 4)
        items[f"resident units (embedding + {n_res} blocks: master, moments, copy)"] = (
            sh.embed_numel * state + n_res * sh.block_numel * per_block)
    if cast_slab_bytes:
        items["fp32 staging of the on-device cast"] = cast_slab_bytes
    flex = create_block_mask is not None
    mb, seq = t.micro_batch_size, t.seq_len
    windows = 2 if cfg.model.local_window else 1     # sliding-window blocks: a windowed mask beside each
    if document_attention_possible(cfg):    # every micro-batch's masks, positions and document ids, for the step
        items["document attention (masks, positions)"] = (sh.tokens // sh.micro_tokens) * (
            windows * packing_mask_bytes(mb, seq, flex=flex) + 12 * mb * seq)
    elif cfg.model.local_window:            # causal rows: one windowed mask, built once
        items["sliding-window mask"] = packing_mask_bytes(mb, seq, flex=flex)
    return items


def document_attention_possible(cfg: RunConfig) -> bool:
    """Whether a run may attend by document: 'document', or 'auto' with shards (SFT shards
    that record document starts resolve to it)."""
    a = cfg.train.attention
    return a == "document" or (a == "auto" and cfg.data.source == "shards")


def loss_chunk_bytes(cfg: RunConfig) -> int:
    """The head's transient memory for one loss chunk of C tokens over a vocabulary of V
    (``model.head_loss_and_grads``), at the larger of its two peaks: while the logits'
    gradient is formed, the logits and their gradient in the compute dtype (s bytes) and two
    fp32 blocks of ``LOSS_ROWS`` rows (2sCV + 8RV); in the projection's backward, the
    logits' gradient, the projection weight's gradient and the flat unit gradient it is
    scattered into (sCV + 2sVH). Measured on the H200 (BENCHMARKS.md): autograd's
    own log-softmax held three fp32 [C, V] tensors, which a 12 GiB run could not hold."""
    m, t = cfg.model, cfg.train
    s = DTYPES[t.compute_dtype].itemsize
    c = min(t.loss_chunk_tokens, t.micro_batch_size * t.seq_len)
    v = m.vocab_size
    return max(2 * s * c * v + 2 * 4 * min(c, LOSS_ROWS) * v, s * c * v + 2 * s * v * m.hidden_size)


def gpu_total(cfg: RunConfig, keep: int = 0, offload: int = 0, cast_slab_bytes: int = 0,
              lean: bool = True) -> int:
    return sum(gpu_items(cfg, keep, offload, cast_slab_bytes, lean).values())


def budget(free_bytes: int) -> int:
    """What the worker plans to use of ``free_bytes`` of GPU memory: less the reserve."""
    return max(0, int(free_bytes * (1 - RESERVE_FRACTION)) - RESERVE_BYTES)


def gpu_budget(free_bytes: int, cap_gib: float | None) -> int:
    """What a run plans to use of a GPU with ``free_bytes`` free to it: at most
    ``worker.gpu_memory_gib`` (``cap_gib``), less the allocator's reserve (``budget``). The one
    rule of both the plan, before the run, and the worker, at every step."""
    if cap_gib is not None:
        free_bytes = min(free_bytes, int(cap_gib * GiB))
    return budget(free_bytes)


def _largest(ok, lo: int, hi: int) -> int:
    """The largest k in [lo, hi] with ok(k), for ok true up to some k and false after; lo - 1 if none."""
    if not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def offload_count(cfg: RunConfig, gpu_bytes: int, keep: int = 0, cast_slab_bytes: int = 0) -> int:
    """The fewest first blocks whose inputs must wait in host memory for the step to fit
    ``gpu_bytes`` (every block's, when nothing fits)."""
    L = cfg.model.num_hidden_layers

    def too_big(n: int) -> bool:          # true for the first few n, false once enough are offloaded
        return gpu_total(cfg, keep, n, cast_slab_bytes) > gpu_bytes

    return min(L, _largest(too_big, 0, L) + 1)


def keep_count(cfg: RunConfig, gpu_bytes: int, offload: int = 0, cast_slab_bytes: int = 0) -> int:
    """The most last blocks that can keep their activations within ``gpu_bytes``."""
    L = cfg.model.num_hidden_layers
    k = _largest(lambda k: gpu_total(cfg, k, offload, cast_slab_bytes) <= gpu_bytes, 0, L)
    return max(0, k)


def kept_plain(cfg: RunConfig, gpu_bytes: int, offload: int = 0, cast_slab_bytes: int = 0) -> bool:
    """Whether every block can keep plain autograd's internals within ``gpu_bytes`` (nothing
    offloaded, the MLP not chunked). A plain block runs 3-6% faster than a lean one but saves
    about twice the bytes, while a kept lean block saves its whole recomputation (a third of
    its time): memory goes to keeping more blocks lean first, and only when all of them fit
    plain do they keep plain autograd's activations.

    They must fit as the eager passes save them (silu(gate) too): the choice is made before
    the first step compiles the passes, and a compile that fails runs them eagerly from then
    on (``megaray.fused``), which must not take the step past the budget. The plan's figure
    for kept plain blocks is what the compiled passes save."""
    sh = StepShape.of(cfg)
    eager = replace(cfg, worker=replace(cfg.worker, fuse_elementwise=False))
    return (sh.layers > 0 and not sh.mlp_chunked and offload == 0
            and gpu_total(eager, sh.layers, 0, cast_slab_bytes, lean=False) <= gpu_bytes)


def keep_choice(cfg: RunConfig, gpu_bytes: int, offload: int = 0, cast_slab_bytes: int = 0) -> tuple[int, bool]:
    """The worker's kept blocks for a budget: (how many, whether lean): every block plain
    where they all fit that way (``kept_plain``), else the most lean ones that fit."""
    if kept_plain(cfg, gpu_bytes, offload, cast_slab_bytes):
        return cfg.model.num_hidden_layers, False
    return keep_count(cfg, gpu_bytes, offload, cast_slab_bytes), True


def adapt_keep(keep: int, layers: int, measured_peak: int, kept_block_bytes: int, budget_bytes: int) -> int:
    """The kept-block count for the next step, from this step's measured peak with ``keep``
    blocks kept and one kept block's measured cost: as many more (or fewer) as the
    budget's headroom holds."""
    if kept_block_bytes <= 0:
        return keep
    headroom = budget_bytes - measured_peak
    change = headroom // kept_block_bytes if headroom > 0 else -(-headroom // kept_block_bytes) - 1
    return max(0, min(layers, keep + change))
