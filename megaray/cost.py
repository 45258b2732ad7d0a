"""A step's predicted time from the machine's speeds: what ``megaray plan`` prints.

A step is four streams of work that overlap (ARCHITECTURE.md, the update schedule): the GPU's
compute, the weights crossing the link to it, the gradients crossing back, and the
optimizer's updates on the CPU cores (which run under the next step's compute). The step
takes about as long as the longest of them, plus one block's transfer before the first
compute can start. The terms:

- compute: the model's FLOPs (ARCHITECTURE.md's formula) and, for every block that is not
  kept, its forward again in the backward (a third of its share), at ``gpu_tflops``;
- copy-in: every unit's weights once in the forward, and the recomputed blocks' again in the
  backward, in the dtype they cross the link (the host's bf16 copy, or the fp32 master cast
  on the GPU), at ``link_gbps``;
- copy-out: every gradient once, in ``optim.grad_dtype``, at ``link_gbps``;
- updates: every streamed parameter once, at the cores' AdamW rate for the run's state.

The default speeds are megaray's own measurements on the reference machine (1x H200,
16 cores; BENCHMARKS.md, sessions 4-5): compute rate as reached by llama3b/llama8b steps,
the pinned link, and the AdamW rates summed over 16 processes divided by 16, measured alone.
While the worker streams, the shards reach less of it (``Speeds.update_share``): the copies
share host memory's bandwidth with them, and the shards wait on the ring. Measured (session
7, llama3b, 14 threads, fp32 gradients through the ring): 2.8-3.2 G params/s summed at 16k
tokens a step against 4.5 alone, 0.63-0.70 of it; at 64k 4.1-4.5 (0.9-1.0), where the updates
hide under the compute anyway. The share is the small-step figure, where it decides the step.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaray.config import RunConfig
from megaray.layout import build_layout
from megaray.model import flops_per_step

# G params/s per core of the update (16 processes x 1 thread, summed, / 16): by
# (master, moments, gradient) storage; the host's bf16 copy costs about 20% more.
ADAMW_PER_CORE = {("float32", "float32", "float32"): 6.2 / 16, ("float32", "float32", "bfloat16"): 6.1 / 16,
                  ("float32", "bfloat16", "float32"): 7.4 / 16, ("float32", "bfloat16", "bfloat16"): 7.9 / 16,
                  ("bfloat16", "bfloat16", "bfloat16"): 7.7 / 16}


@dataclass(frozen=True)
class Speeds:
    gpu_tflops: float = 380.0      # bf16 model TFLOP/s of a step's compute on an H200
    link_gbps: float = 53.7        # pinned host<->device GB/s, each direction
    cores: int = 16                # cores for the optimizer shards
    gpu_gbps: float = 4000.0       # the GPU's memory bandwidth reached by elementwise kernels
    update_share: float = 0.67     # of the AdamW rate measured alone, what the shards reach while the worker streams


def predict(cfg: RunConfig, speeds: Speeds, keep: int = 0) -> dict[str, float]:
    """Seconds of each term of a step and the predicted step time (``step_s``).

    The updates are not free to overlap anything: they start when the previous step's norm
    is known, in forward order, and the forward waits for each streamed unit's update before
    it computes it. So the forward is simulated unit by unit: the embedding's update first,
    then each block starts when the block before it has computed and (streamed) its own
    update is done; resident units (``optim.placement``: the embedding, then the first
    blocks) wait for nothing. The wait this adds to the forward (``wait_updates_s``) adds to
    the step; copy-in and copy-out still bound it from below."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    units = build_layout(m)
    n = m.num_params()
    L = m.num_hidden_layers
    block = units[1].numel if L else 0
    embed_res = o.resident_units >= 1
    res = cfg.resident_blocks
    res_numel = res * block + (units[0].numel if embed_res else 0)
    streamed = n - res_numel
    tflops = speeds.gpu_tflops * 1e12
    block_flops = 6.0 * block * t.tokens_per_step + 6.0 * m.hidden_size * t.seq_len * t.tokens_per_step
    recomputed = max(0, L - keep)
    flops = flops_per_step(m, t.tokens_per_step, t.seq_len)
    # resident updates on the device: 30 bytes a parameter (master, moments read and written,
    # the gradient read, the compute copy written) at the GPU's memory bandwidth
    resident_s = res_numel * 30 / (speeds.gpu_gbps * 1e9)
    compute = (flops + recomputed * block_flops / 3) / tflops + resident_s
    stream_bytes = 2 if cfg.host_compute_copy or o.master_dtype == "bfloat16" else 4
    copy_in = (streamed + max(0, L - keep - res) * block) * stream_bytes / (speeds.link_gbps * 1e9)
    copy_out = streamed * (2 if o.grad_dtype == "bfloat16" else 4) / (speeds.link_gbps * 1e9)
    rate = (ADAMW_PER_CORE.get((o.master_dtype, o.moment_dtype, o.grad_dtype), 6.0 / 16) * speeds.cores * 1e9
            * speeds.update_share)
    if cfg.host_compute_copy:
        rate /= 1.2
    updates = streamed / rate
    f = block_flops / 3 / tflops                    # one block's forward
    done = 0.0 if embed_res else units[0].numel / rate   # the embedding's update, first
    clock = done
    for i in range(L):
        if i >= res:
            done += block / rate
            clock = max(clock, done)
        clock += f
    wait = max(0.0, clock - L * f)
    # before the first block computes: the embedding's copy-in (streamed) and block 0's (streamed)
    first_numel = (0 if embed_res else units[0].numel) + (block if res == 0 else 0)
    first = first_numel * stream_bytes / (speeds.link_gbps * 1e9)
    return {"compute_s": compute, "copy_in_s": copy_in, "copy_out_s": copy_out, "updates_s": updates,
            "wait_updates_s": wait, "resident_updates_s": resident_s,
            "step_s": max(compute + wait, copy_in, copy_out) + first}
