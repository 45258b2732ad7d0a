"""The bench on the CPU: its baseline model and training loop against the independent
reference (tests/reference.py), and a whole bench run (megaray and baseline from the same
weights and tokens) on a tiny model, whose losses must agree and whose time parts add up."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import RefLlama

from megaray.bench.baseline import BaselineLlama, run_baseline
from megaray.bench.run import bench, bench_config, breakdown, document_ids, print_table
from megaray.config import ModelConfig
from megaray.layout import build_layout
from megaray.model import flops_per_step, init_unit

SET = {"worker.device": "cpu", "worker.threads": 1, "train.compute_dtype": "float32", "train.loss_chunk_tokens": 50,
       "optim.grad_slab_mib": 0.015625, "cluster.num_cpus": 6}


def _cfg(steps=3):
    return bench_config("debug", seq_len=16, tokens_per_step=96, micro_batch=2, steps=steps, shards=2, threads=1,
                        extra=SET)


def _state(cfg):
    return {s.name: init_unit(u, cfg.model, 0)[s.offset:s.offset + s.numel].view(s.shape).numpy()
            for u in build_layout(cfg.model) for s in u.params}


def test_baseline_trains_like_the_reference():
    cfg = _cfg()
    state = _state(cfg)
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, cfg.model.vocab_size, (3, 2, 17)) for _ in range(3)]
    out = run_baseline(cfg, state, batches, "cpu")
    c = {k: getattr(cfg.model, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                             "rope_theta", "tie_word_embeddings", "attention_bias", "qk_norm")}
    ref = RefLlama(c)
    ref.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    o = cfg.optim
    opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in ref.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    losses = []
    for b in batches:   # the whole step's batch at once
        tok = torch.from_numpy(b).reshape(6, 17)
        loss = torch.nn.functional.cross_entropy(ref(tok[:, :-1]).reshape(-1, c["vocab_size"]), tok[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), o.clip_grad_norm)
        opt.step()
        losses.append(loss.item())
    np.testing.assert_allclose(out["losses"], losses, rtol=1e-5)
    model = BaselineLlama(cfg.model, state, "cpu")
    assert sum(p.numel() for p in model.parameters()) == cfg.model.num_params()


def test_breakdown_adds_up():
    m = {"step_time_seconds": 2.0, "worker/compute_s": 1.5, "worker/gap_optimizer_s": 0.2, "worker/gap_other_s": 0.1,
         "worker/copy_in_s": 0.4}
    d = breakdown(m)
    assert d["compute_s"] + d["idle_optimizer_s"] + d["idle_copy_in_s"] + d["outside_s"] == pytest.approx(2.0)
    assert (d["outside_s"], d["gpu_idle_fraction"]) == pytest.approx((0.2, 0.25))


def test_bench_runs_megaray_and_baseline_from_the_same_weights(ray_cluster):
    cfg = _cfg()
    r = bench(cfg)
    m = r["megaray"]
    assert r["first_loss_diff"] < 1e-4 * abs(m["losses"][0])              # fp32 on both sides
    np.testing.assert_allclose(m["losses"], r["baseline"]["losses"], rtol=1e-4)
    assert m["tflops"] == pytest.approx(flops_per_step(cfg.model, 96, 16) / m["step_s"] / 1e12)
    assert r["ratio"] == pytest.approx(m["tflops"] / r["baseline"]["tflops"])
    d = m["breakdown"]
    assert d["compute_s"] + d["idle_optimizer_s"] + d["idle_copy_in_s"] + d["outside_s"] == pytest.approx(m["step_s"])
    assert 0 < d["compute_s"] < m["step_s"] and d["outside_s"] >= 0
    assert m["optimizer_gparams_per_s"] > 0 and r["link_alone"]["copy_in_gbps"] > 0
    o = d["overlapped"]     # after the verdict: the slowest shard's span holds its updates and its waits
    assert 0 < o["optimizer_update_s"] <= o["optimizer_span_s"]
    assert 0 <= o["optimizer_gradient_wait_s"] < o["optimizer_span_s"]
    pl = r["planner"]        # what the allocator's peak can be compared with: the plan less the 1 GiB context
    assert pl["gpu_predicted_allocated_gib"] == pytest.approx(pl["gpu_predicted_gib"] - 1.0)


def test_bench_with_gradients_in_host_memory_measures_both_links(ray_cluster, capsys):
    """The link measurement copies out into the host gradient buffer when there is no ring,
    and each step is printed as it ends, with its prediction (a long step is not lost to a
    later failure)."""
    cfg = bench_config("debug", seq_len=16, tokens_per_step=96, micro_batch=2, steps=2, shards=2, threads=1,
                       extra={**SET, "optim.grad_placement": "host", "optim.grad_dtype": "bfloat16"})
    r = bench(cfg, baseline=False)
    assert r["link_alone"]["copy_in_gbps"] > 0 and r["link_alone"]["copy_out_gbps"] > 0
    printed = capsys.readouterr().out
    assert [f"megaray step {i}:" in printed for i in range(2)] == [True, True]
    assert f"loss {r['megaray']['losses'][1]:.4f}" in printed
    # the plan's step for the blocks each step kept, printed with it (a run cut short keeps it)
    pl = r["planner"]
    assert f"{pl['kept_blocks']} blocks kept, step {pl['step_predicted_s']:.3f} s predicted" in printed


def test_bench_with_packed_documents_runs_document_attention(ray_cluster, capsys):
    """--documents: rows cut into documents (exponential lengths, each token's document id
    non-decreasing along its row), megaray under document attention; its first loss differs
    from the causal baseline's on the same tokens (other attention), and says so."""
    rng = np.random.default_rng(0)
    d = document_ids(rng, (3, 2, 17), 5)
    assert d.dtype == np.int32 and (np.diff(d, axis=-1) >= 0).all() and d[..., -1].min() >= 1
    cfg = _cfg()
    r = bench(cfg, documents=4)
    assert r["attention"] == "document (mean length 4)"
    assert r["first_loss_diff"] > 1e-6
    assert r["ratio"] == pytest.approx(r["baseline"]["step_s"] / r["megaray"]["step_s"])
    # TFLOP/s counts each document's own attention: less work than the causal baseline's
    assert 0 < r["attention_work_of_causal"] < 1
    assert r["megaray"]["tflops"] < flops_per_step(cfg.model, 96, 16) / r["megaray"]["step_s"] / 1e12
    print_table(r)
    assert "document (mean length 4) attention (" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_the_block_bench_says_it_needs_a_gpu(capsys):
    from megaray.pipelines.bench import main

    assert main(["--block-alone", "512x1"]) == 2
    assert "--block-alone times a block on a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["debug", "debug_moe"])
def test_the_block_bench_runs_every_case_on_the_cpu(shape):
    """The block bench's cases on the CPU (the passes eager both ways): each one runs its
    forward and its backward, the products' alone with just the weights they use; a
    mixture's block with its router and experts, its FLOPs counting k experts a token."""
    from megaray.bench.block import print_rows, run

    (row,) = run(shape, [(16, 2)], reps=1, device="cpu")
    m = ModelConfig.from_shape(shape)
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    mlp = (m.num_experts_per_tok * 3 * m.moe_intermediate_size + m.num_experts if m.moe
           else 3 * m.intermediate_size) * m.hidden_size
    norms = 2 * m.hidden_size + (0 if not m.qk_norm else 2 * m.head_dim if m.qk_norm_scope == "head" else q + kv)
    active = (2 * q + 2 * kv) * m.hidden_size + mlp + norms
    assert row["forward_flops"] == pytest.approx(2 * 32 * (active + m.hidden_size * 16), rel=1e-3)
    for mode in ("eager", "fused"):
        assert set(row[mode]) == {"forward_s", "lean_s", "plain_s"} and min(row[mode].values()) > 0
    assert min(row["products"].values()) > 0
    print_rows([row])


def test_the_block_bench_times_a_local_and_a_global_block_over_documents():
    """A model with windows: the block bench times block 0 (a window of 4) and its first
    global block over the same rows of documents, each block's FLOPs counting what its
    attention computes: by hand, rows of 16 as documents of 10 + 6 and 16 tokens, the local
    block's pairs (10^2 - 6^2) + (6^2 - 2^2) + (16^2 - 12^2) = 208, the global one's
    10^2 + 6^2 + 16^2 = 392."""
    from megaray.bench.block import block_flops, print_rows, run, timed_layers
    from megaray.cost import active_block_params

    m = ModelConfig.from_shape("debug_gemma3")
    assert timed_layers(m) == [0, 1] and (m.window(0), m.window(1)) == (4, None)
    doc = np.array([[0] * 10 + [1] * 6, [0] * 16])
    for layer, pairs in ((0, 208), (1, 392)):
        assert block_flops(m, 16, 2, layer, doc) == 2 * (32 * active_block_params(m) + m.hidden_size * pairs)
    rows = run("debug_gemma3", [(16, 2)], reps=1, device="cpu", documents=5)
    assert [(r["layer"], r["window"]) for r in rows] == [(0, 4), (1, None)]
    assert rows[0]["forward_flops"] < rows[1]["forward_flops"] and rows[0]["mean_doc_len"] < 16
    print_rows(rows)


def test_bench_with_sliding_windows_counts_what_the_windows_compute(ray_cluster):
    """Gemma 3's windows in the bench: megaray and the resident baseline run the same windowed
    blocks from the same weights (their first losses equal), and the attention's work is what
    the windows compute: rows of 16 tokens under a window of 4 on 2 of 3 blocks,
    (2 x (16^2 - 12^2) + 16^2) / (3 x 16^2) of causal attention's, by hand."""
    cfg = bench_config("debug_gemma3", seq_len=16, tokens_per_step=96, micro_batch=2, steps=3, shards=2, threads=1,
                       extra=SET)
    r = bench(cfg)
    assert r["attention"] == "causal, windows of 4 tokens on 2 of 3 blocks"
    assert r["attention_work_of_causal"] == pytest.approx((2 * (256 - 144) + 256) / (3 * 256))
    assert r["first_loss_diff"] < 1e-4
