"""A step's predicted time from the machine's speeds: what ``megaray plan`` prints.

A step is four streams of work that overlap (ARCHITECTURE.md, the update schedule): the GPU's
compute, the weights crossing the link to it, the gradients crossing back, and the
optimizer's updates on the CPU cores (which run under the next step's compute). The step
takes about as long as the longest of them, plus one block's transfer before the first
compute can start. The terms:

- compute: the model's FLOPs (ARCHITECTURE.md's formula) and, for every block that is not
  kept, its forward again in the backward (a third of its share), and once more for each
  block whose input was not saved (``worker.input_stride``): the matrix products
  (6 x parameters x tokens) at the rate measured for the model's hidden size, the
  attention (6 x layers x hidden x sequence x tokens) at flash attention's rate for the
  sequence length (``compute_seconds``), or all of it at one ``gpu_tflops`` when given;
- copy-in: every unit's weights once in the forward, and the recomputed blocks' again in the
  backward (with ``worker.input_stride`` S > 2, S-2 blocks of each segment twice: the two
  slots keep only the rebuilding pass's last block for the backward), in the dtype they
  cross the link (the host's bf16 copy, or the fp32 master cast on the GPU), at ``link_gbps``;
- copy-out: every gradient once, in ``optim.grad_dtype``, at ``link_gbps``;
- updates: every streamed parameter once, at the cores' AdamW rate for the run's state.

The default speeds are megaray's own measurements on the reference machine (1x H200,
16 cores; BENCHMARKS.md): compute rates as reached by llama1b/3b/8b steps,
the pinned link, and the AdamW rates summed over 16 processes divided by 16, measured alone.
While the worker streams, the shards reach less of it (``Speeds.update_share``): the copies
share host memory's bandwidth with them, and the shards wait on the ring.
Measured (llama3b, 14 threads, fp32 gradients through the ring): 2.8-3.2 G params/s summed at 16k
tokens a step against 4.5 alone, 0.63-0.70 of it; at 64k 4.1-4.5 (0.9-1.0), where the updates
hide under the compute anyway. The share is the small-step figure, where it decides the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megaray.adamw import writes_clipped_gradient
from megaray.config import RunConfig
from megaray.layout import DTYPES, build_layout
from megaray.memory import anchors
from megaray.model import flops_per_step

# G params/s per core of the update (16 processes x 1 thread, summed, / 16): by
# (master, moments, gradient) storage; the host's bf16 copy costs about 20% more.
ADAMW_PER_CORE = {("float32", "float32", "float32"): 6.2 / 16, ("float32", "float32", "bfloat16"): 6.1 / 16,
                  ("float32", "bfloat16", "float32"): 7.4 / 16, ("float32", "bfloat16", "bfloat16"): 7.9 / 16,
                  ("bfloat16", "bfloat16", "bfloat16"): 7.7 / 16}


# bf16 TFLOP/s of the matrix products in a step's compute, by hidden size: the measured
# compute seconds of llama3b (seq 2048) and llama8b (seq 4096) steps at 64k tokens with the
# elementwise passes compiled (``megaray.fused``), less their attention at ATTENTION_TFLOPS
# (BENCHMARKS.md: 514 and 573, on an H100, whose bf16 tensor cores are the H200's).
# The eager steps ran at 343, 394 and 474; llama1b's point (hidden 2048) is its
# eager rate scaled as llama3b's was (x1.30) until a fused llama1b step is measured. Larger
# matrices run faster; beyond the measured sizes the nearest is taken, never extrapolated.
MATMUL_TFLOPS = ((2048, 446.0), (3072, 514.0), (4096, 573.0))
# flash attention's forward and backward, bf16 TFLOP/s by sequence length (llama3b's heads,
# `megaray bench --attention-alone`: 281 at 2048, 495 at 16,384, 462 at 131,072),
# interpolated in log2 of the length, the mean of the long ones beyond.
ATTENTION_TFLOPS = ((2048, 281.0), (16384, 470.0))
# A mixture's experts (their grouped products with the routing's gathers, the router weights
# and the sums: ``moe.moe_mlp``), bf16 TFLOP/s by the work of one expert's group in one
# micro-batch: rows (tokens x k / experts) x ``moe_intermediate_size``. Small groups run the
# tensor cores far below a dense product's rate. Measured as one block alone (`megaray bench
# --block-alone`, forward and backward, on an H100): the block's seconds less its attention and
# projections at the rates above; qwen3moe30b at 4096 x 1 and 4096 x 2 tokens (256 and 512
# rows of width 768), olmoe7b at 4096 x 1 (512 of width 1024) (BENCHMARKS.md, session 27).
EXPERT_TFLOPS = ((196608, 175.0), (393216, 226.0), (524288, 245.0))
# The forward alone runs faster than the step's average the two tables describe (no backward
# products' fp32 accumulation, no recomputation's extra passes): llama8b's forward at seq 4096
# (15 blocks kept, 17 recomputed) took 1.429 s for 32 blocks on the H200 where the tables give
# 1.80 (BENCHMARKS.md). It decides when the forward catches up with the updates
# (``predict``'s schedule); the step's total compute stays the tables'.
FORWARD_SPEEDUP = 1.25


def _interpolate(table, x: float, log: bool = False) -> float:
    """Linear in x (or in log2 x) between the table's points, the end values beyond them."""
    f = math.log2 if log else float
    if x <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (f(x) - f(x0)) / (f(x1) - f(x0))
    return table[-1][1]


@dataclass(frozen=True)
class Speeds:
    gpu_tflops: float | None = None   # one bf16 TFLOP/s for all compute; None: the H200's rates by shape
    link_gbps: float = 53.7        # pinned host<->device GB/s, each direction
    cores: int = 16                # cores for the optimizer shards
    gpu_gbps: float = 4000.0       # the GPU's memory bandwidth reached by elementwise kernels
    update_share: float = 0.67     # of the AdamW rate measured alone, what the shards reach while the worker streams
    update_scale: float = 1.0      # this host's AdamW rate alone against the reference machine's (measured at start)


def rates(cfg: RunConfig, speeds: Speeds) -> tuple[float, float]:
    """FLOP/s of the matrix products and of the attention for this model and sequence length:
    MATMUL_TFLOPS by hidden size and ATTENTION_TFLOPS by sequence length, or both
    ``speeds.gpu_tflops`` when given."""
    if speeds.gpu_tflops:
        return speeds.gpu_tflops * 1e12, speeds.gpu_tflops * 1e12
    return (_interpolate(MATMUL_TFLOPS, cfg.model.hidden_size) * 1e12,
            _interpolate(ATTENTION_TFLOPS, cfg.train.seq_len, log=True) * 1e12)


def expert_rate(cfg: RunConfig, speeds: Speeds) -> float:
    """FLOP/s of a mixture's experts: EXPERT_TFLOPS by one group's work in a micro-batch
    (log-interpolated, the nearest end beyond the measured sizes), or ``speeds.gpu_tflops``."""
    if speeds.gpu_tflops:
        return speeds.gpu_tflops * 1e12
    m, t = cfg.model, cfg.train
    rows = t.micro_batch_size * t.seq_len * m.num_experts_per_tok / m.num_experts
    return _interpolate(EXPERT_TFLOPS, rows * m.moe_intermediate_size, log=True) * 1e12


def expert_params(m) -> int:
    """One block's expert parameters a token's compute reads (k experts' three matrices); 0 for
    a dense block."""
    return m.num_experts_per_tok * 3 * m.hidden_size * m.moe_intermediate_size if m.moe else 0


def _product_seconds(cfg: RunConfig, speeds: Speeds, params: float, experts: float, tokens: float) -> float:
    """2 x ``tokens`` x parameters at their rates: ``experts`` of ``params`` at the experts'."""
    mm = rates(cfg, speeds)[0]
    return 2.0 * tokens * ((params - experts) / mm + (experts / expert_rate(cfg, speeds) if experts else 0.0))


def block_forward_seconds(cfg: RunConfig, speeds: Speeds) -> float:
    """One block's forward over a step's tokens at the step-average rates (``rates``,
    ``expert_rate``): its matrix products (2 x the block's active parameters x tokens) and its
    attention (2 x hidden x sequence x tokens)."""
    m, t = cfg.model, cfg.train
    attn = rates(cfg, speeds)[1]
    per_block = attention_flops(cfg) / 3.0 / max(1, m.num_hidden_layers)
    return (_product_seconds(cfg, speeds, active_block_params(m), expert_params(m), t.tokens_per_step)
            + per_block / attn)


def attention_flops(cfg: RunConfig) -> float:
    """A step's attention FLOPs (forward and backward, every block): 6 x hidden x seq x tokens a
    block, a sliding-window block's what its window computes (``model.flops_per_step``)."""
    m, t = cfg.model, cfg.train
    return flops_per_step(m, t.tokens_per_step, t.seq_len) - 6.0 * m.active_params() * t.tokens_per_step


def active_block_params(m) -> int:
    """One block's parameters a token's compute reads: all of a dense block's; a mixture's with
    k of its experts (and its whole router)."""
    if not m.num_hidden_layers:
        return 0
    block = build_layout(m)[1].numel
    if m.moe:
        block -= (m.num_experts - m.num_experts_per_tok) * 3 * m.hidden_size * m.moe_intermediate_size
    return block


def compute_seconds(cfg: RunConfig, speeds: Speeds, recomputed: int = 0) -> float:
    """The GPU's seconds for a step's FLOPs (ARCHITECTURE.md's formula, causal attention's
    work: document masking does less, which the plan cannot know in advance) and for
    ``recomputed`` blocks' forwards again (``block_forward_seconds`` each): the matrix
    products (6 x active parameters x tokens; a mixture's experts at ``expert_rate``) and the
    attention (6 x layers x hidden x sequence x tokens, a sliding-window block's what its
    window computes), each at its rate (``rates``)."""
    m, t = cfg.model, cfg.train
    tokens = t.tokens_per_step
    attn = rates(cfg, speeds)[1]
    L = m.num_hidden_layers
    return (3.0 * _product_seconds(cfg, speeds, m.active_params(), L * expert_params(m), tokens)
            + attention_flops(cfg) / attn + recomputed * block_forward_seconds(cfg, speeds))


def reference_update_rate(cfg: RunConfig, cores: int | None = None) -> float:
    """The AdamW rate alone, parameters a second summed over ``cores`` (the shards' by
    default), that the reference machine reached for the run's state; the host's bf16 copy
    costs about 20% more."""
    o = cfg.optim
    cores = cores or o.num_shards * o.threads_per_shard
    rate = ADAMW_PER_CORE.get((o.master_dtype, o.moment_dtype, o.grad_dtype), 6.0 / 16) * cores * 1e9
    return rate / 1.2 if cfg.host_compute_copy else rate


def predict(cfg: RunConfig, speeds: Speeds, keep: int = 0) -> dict[str, float]:
    """Seconds of each term of a step and the predicted step time (``step_s``).

    The updates are not free to overlap anything: they start when the previous step's norm
    is known, in forward order, and the forward waits for each streamed unit's update before
    it computes it. So the forward is simulated unit by unit: the embedding's update first,
    then each block starts when the block before it has computed and (streamed) its own
    update is done, and the head (never resident) when its update, the last, is done;
    resident units (``optim.resident_units``: the embedding, then the first blocks) wait for
    nothing. The wait this adds to the forward (``wait_updates_s``) adds to the step; copy-in
    and copy-out still bound it from below. With the gradients in host memory and clipping,
    torch's fused AdamW on fp32 state first writes the clipped gradient (``megaray.adamw``):
    36 bytes a parameter moved instead of 28."""
    m, o = cfg.model, cfg.optim
    units = build_layout(m)
    n = m.num_params()
    L = m.num_hidden_layers
    block = units[1].numel if L else 0
    embed_res = o.resident_count >= 1
    res = cfg.resident_blocks
    res_numel = res * block + (units[0].numel if embed_res else 0)
    streamed = n - res_numel
    recomputed = max(0, L - keep)
    S = cfg.worker.stride
    rebuilt = recomputed - anchors(recomputed, S)       # blocks run forward a third time
    reloaded = (recomputed // S) * max(0, S - 2) + max(0, recomputed % S - 2)
    # resident updates on the device: 30 bytes a parameter with fp32 moments, 22 with bf16 ones
    # (master and moments read and written, an fp32 gradient read, the compute copy written)
    # at the GPU's memory bandwidth
    resident_s = res_numel * (14 + 4 * DTYPES[o.moment_dtype].itemsize) / (speeds.gpu_gbps * 1e9)
    compute = compute_seconds(cfg, speeds, recomputed + rebuilt) + resident_s
    stream_bytes = 2 if cfg.host_compute_copy or o.master_dtype == "bfloat16" else 4
    copy_in = (streamed + (max(0, L - keep - res) + reloaded) * block) * stream_bytes / (speeds.link_gbps * 1e9)
    copy_out = streamed * (2 if o.grad_dtype == "bfloat16" else 4) / (speeds.link_gbps * 1e9)
    rate = reference_update_rate(cfg, speeds.cores) * speeds.update_share * speeds.update_scale
    if writes_clipped_gradient(o, o.grad_placement, o.grad_dtype):
        rate *= 28 / 36                             # the clipped gradient is a pass of its own
    updates = streamed / rate
    f = block_forward_seconds(cfg, speeds)          # one block's forward; at the measured rates, its own speed
    if not speeds.gpu_tflops:
        f /= FORWARD_SPEEDUP
    done = 0.0 if embed_res else units[0].numel / rate   # the embedding's update, first
    clock = done
    for i in range(L):
        if i >= res:
            done += block / rate
            clock = max(clock, done)
        clock += f
    if L:                                           # the head's update, last, before the head computes
        clock = max(clock, done + units[-1].numel / rate)
    wait = max(0.0, clock - L * f)
    # before the first block computes: the embedding's copy-in (streamed) and block 0's (streamed)
    first_numel = (0 if embed_res else units[0].numel) + (block if res == 0 else 0)
    first = first_numel * stream_bytes / (speeds.link_gbps * 1e9)
    return {"compute_s": compute, "copy_in_s": copy_in, "copy_out_s": copy_out, "updates_s": updates,
            "wait_updates_s": wait, "resident_updates_s": resident_s,
            "step_s": max(compute + wait, copy_in, copy_out) + first}
