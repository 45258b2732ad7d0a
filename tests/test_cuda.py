"""The CUDA path (pinned shared memory, copy streams, events): skipped without a GPU.

The same tiny model trained on the GPU and on the CPU from the same weights and data must
agree to fp32 rounding with fp32 compute, and closely with bf16 compute.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpu_ray():
    import ray

    ray.init(address="local", num_cpus=8, num_gpus=1, object_store_memory=256 * 2**20, include_dashboard=False)
    yield
    ray.shutdown()


def _train(device: str, dtype: str, steps: int = 4, extra: tuple = (), metrics: bool = False):
    from megaray.driver.session import TrainingSession
    from megaray.loader import load_config

    cfg = load_config("debug", [f"worker.device={device}", f"train.compute_dtype={dtype}",
                                f"train.steps={steps}", "train.grad_accum=3", "optim.grad_slab_mib=0.015625",
                                "optim.resident_units=host", *extra])      # every unit streamed unless a case says
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (3, 2, 33)) for _ in range(steps)]
    with TrainingSession(cfg) as s:
        steps_out = [s.train_step(i, b) for i, b in enumerate(batches)]
        return [m["loss"] for m in steps_out], (steps_out if metrics else s.state_dict())


def test_gpu_matches_cpu(gpu_ray):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_l, cpu_w = _train("cpu", "float32")
    gpu_l, gpu_w = _train("cuda", "float32")
    np.testing.assert_allclose(gpu_l, cpu_l, rtol=1e-5)
    for k in cpu_w:
        err = np.linalg.norm(gpu_w[k] - cpu_w[k]) / np.linalg.norm(cpu_w[k])
        assert err < 1e-5, (k, err)
    bf_l, _ = _train("cuda", "bfloat16")
    np.testing.assert_allclose(bf_l, cpu_l, rtol=2e-2)


def test_fused_and_eager_elementwise_passes_agree_on_the_gpu(gpu_ray):
    """worker.fuse_elementwise: the passes compiled (the default, which each step reports)
    and run eagerly give the same run, to fp32 rounding in fp32 and closely in bf16."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 5e-3)):
        eager_l, eager_m = _train("cuda", dtype, extra=("worker.fuse_elementwise=false",), metrics=True)
        fused_l, fused_m = _train("cuda", dtype, metrics=True)
        assert [m["worker/fused_elementwise"] for m in eager_m + fused_m] == [0.0] * 4 + [1.0] * 4
        np.testing.assert_allclose(fused_l, eager_l, rtol=tol)


def test_offloaded_inputs_and_chunked_mlp_on_the_gpu(gpu_ray):
    """Block inputs through pinned host memory on the offload stream, and the MLP in chunks,
    on the GPU: the CPU's losses and weights to fp32 rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_l, cpu_w = _train("cpu", "float32")
    gpu_l, gpu_w = _train("cuda", "float32", extra=("worker.offload_inputs=2", "worker.keep_activations=0",
                                                    "train.mlp_chunk_tokens=16"))
    np.testing.assert_allclose(gpu_l, cpu_l, rtol=1e-5)
    for k in cpu_w:
        err = np.linalg.norm(gpu_w[k] - cpu_w[k]) / np.linalg.norm(cpu_w[k])
        assert err < 1e-5, (k, err)


def test_input_stride_on_the_gpu(gpu_ray):
    """``worker.input_stride`` 2 on the GPU: the unsaved inputs rebuilt in the backward (a
    block run forward again keeping its slot for its backward), the saved ones among the
    first three blocks through pinned host memory: the losses and weights of every input
    saved, to fp32 rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    deep = ("model.num_hidden_layers=5", "worker.keep_activations=0")
    ref_l, ref_w = _train("cuda", "float32", extra=deep)
    two_l, two_w = _train("cuda", "float32", extra=(*deep, "worker.input_stride=2", "worker.offload_inputs=3"))
    np.testing.assert_allclose(two_l, ref_l, rtol=1e-6)
    for k in ref_w:
        err = np.linalg.norm(two_w[k] - ref_w[k]) / np.linalg.norm(ref_w[k])
        assert err < 1e-6, (k, err)


def test_cast_on_the_device_equals_the_host_copy_on_the_gpu(gpu_ray):
    """bf16 weights cast by the optimizer shards on the host, or streamed as fp32 (in
    staging slabs smaller than a unit here) and cast on the GPU: both round to nearest, so
    the losses and the final master weights are the same bit for bit."""
    host_l, host_w = _train("cuda", "bfloat16", extra=("optim.compute_copy=host",))
    dev_l, dev_w = _train("cuda", "bfloat16", extra=("optim.compute_copy=device",))
    assert host_l == dev_l
    for k in host_w:
        np.testing.assert_array_equal(dev_w[k], host_w[k], err_msg=k)


def test_gradients_in_host_memory_equal_gradients_on_the_gpu(gpu_ray):
    """optim.grad_placement host on the GPU: each unit's gradient leaves as soon as its
    backward is done and the shards apply the clip coefficient; the same losses and weights
    as gradients held on the GPU, bit for bit (both scale in fp32, once)."""
    extra = ("optim.clip_grad_norm=0.05", "train.compute_dtype=bfloat16")
    dev_l, dev_w = _train("cuda", "bfloat16", extra=(*extra, "optim.grad_placement=device"))
    host_l, host_w = _train("cuda", "bfloat16", extra=(*extra, "optim.grad_placement=host"))
    assert host_l == dev_l
    for k in dev_w:
        np.testing.assert_array_equal(host_w[k], dev_w[k], err_msg=k)


def test_a_gpu_budget_caps_the_peak(gpu_ray):
    """worker.gpu_memory_gib: the worker's peak stays under the cap (the allocator enforces it)."""
    from megaray.driver.session import TrainingSession
    from megaray.loader import load_config

    cfg = load_config("debug", ["worker.device=cuda", "worker.gpu_memory_gib=3.5", "train.steps=2"])
    rng = np.random.default_rng(0)
    with TrainingSession(cfg) as s:
        ms = [s.train_step(i, rng.integers(0, 256, (2, 2, 33))) for i in range(2)]
    assert all(0 < m["gpu_memory_peak_bytes"] <= 3.5 * 2**30 for m in ms)


def test_the_allocator_enforces_the_cap():
    """A capped Device: an allocation past the cap is out of memory, one under it is not."""
    from megaray.actors.device import Device

    Device("cuda", cap_bytes=2 * 2**30)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")
        assert torch.empty(2**30, dtype=torch.uint8, device="cuda").numel() == 2**30
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_the_squared_norm_sums_in_float64_a_chunk_at_a_time():
    """schedule.square_norm on a 40M-element fp32 gradient (three chunks): equal to numpy's
    float64 sum of squares, with at most one chunk of float64 workspace."""
    from megaray.clipping import NORM_CHUNK, square_norm

    g = torch.randn(40_000_000, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = float(square_norm(g))
    assert torch.cuda.max_memory_allocated() - base <= 8 * NORM_CHUNK + 2**20
    ref = float(np.sum(g.cpu().numpy().astype(np.float64) ** 2))
    assert abs(got - ref) <= 1e-12 * ref


def test_pinned_host_buffers_are_exactly_their_size():
    """The offloaded inputs' host buffer: page-locked, exactly its bytes (torch's pin_memory
    would round 10 GiB up to 16), a round trip through the GPU intact, and given back."""
    from megaray.actors.device import Device

    dev = Device("cuda")
    t, mapping = dev.pinned_empty((3, 5, 7), torch.bfloat16)
    assert t.is_pinned() and t.shape == (3, 5, 7) and len(mapping) == 3 * 5 * 7 * 2
    x = torch.randn(3, 5, 7, device="cuda").to(torch.bfloat16)
    t.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t.to("cuda"), x)
    dev.unpin(t)
    assert not t.is_pinned()


def test_loading_into_gpu_masters_on_threads(tmp_path):
    """Resident units load from the model directory on several threads straight into fp32
    masters on the GPU (bf16 files, copied and upcast by each thread): every region equals its
    tensor of the files, upcast on the CPU, once load_into returns."""
    from safetensors.torch import save_file

    from megaray.config import ModelConfig
    from megaray.hf.read import load_into
    from megaray.layout import build_layout

    units = build_layout(ModelConfig.from_shape("debug", tie_word_embeddings=False))
    torch.manual_seed(0)
    tensors = {s.name: torch.randn(s.shape).to(torch.bfloat16) for u in units for s in u.params}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    masters = {u.index: torch.full((u.numel,), float("nan"), device="cuda") for u in units}
    load_into(units, masters.__getitem__, tmp_path, threads=4)
    for u in units:
        got = masters[u.index].cpu()
        for s in u.params:
            assert torch.equal(got[s.offset:s.offset + s.numel].view(s.shape), tensors[s.name].float()), s.name


@pytest.mark.parametrize("grads,moments", [("device", "float32"), ("host", "float32"), ("device", "bfloat16")])
def test_resident_units_on_the_gpu_equal_streamed_ones(gpu_ray, grads, moments):
    """optim.resident_units 2 on the GPU (the embedding and block 0; torch's fused AdamW on the
    device, per weight-decay group, or with bf16 moments the shards' arithmetic compiled)
    against every unit streamed and updated by the shards: equal to fp32 rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    extra = (f"optim.grad_placement={grads}", "optim.clip_grad_norm=0.05", "optim.weight_decay=0.1",
             f"optim.moment_dtype={moments}")
    ref_l, ref_w = _train("cuda", "float32", extra=(*extra, "optim.resident_units=host"))
    res_l, res_w = _train("cuda", "float32", extra=(*extra, "optim.resident_units=2"))
    np.testing.assert_allclose(res_l, ref_l, rtol=1e-6)
    # a bf16 moment one rounding step apart (2^-8 of it; the compiled pass fuses a multiply and
    # an add, rarely crossing a rounding boundary) moves its element's update by as much: the
    # weights agreed to 2.8e-6 on an H100 (session 31), not to fp32's 1e-6
    tol = 1e-5 if moments == "bfloat16" else 1e-6
    for k in ref_w:
        err = np.linalg.norm(res_w[k] - ref_w[k]) / np.linalg.norm(ref_w[k])
        assert err < tol, (k, err)


@pytest.mark.parametrize("fuse", [True, False])
def test_the_device_adamw_is_the_shards_arithmetic(fuse):
    """adamw.device_step (resident units with bf16 moments) against the CPU's C kernel (or its
    torch fallback) on the same values, clipped, decayed, at step 3: eagerly bit for bit; compiled
    (the compiler may fuse a multiply and an add, and Triton divides to within two ulp) the
    master to fp32 rounding and the bf16 moments to bf16 rounding, norm-wise, with few moments
    moved across a rounding boundary."""
    from megaray import fused
    from megaray.adamw import AdamW, device_step, hyper

    g = torch.Generator().manual_seed(0)
    n = 3 * 2**20 + 17
    master = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 1e-2
    m = (torch.randn(n, generator=g) * 1e-3).bfloat16()
    v = (torch.rand(n, generator=g) * 1e-5).bfloat16()
    h = hyper(1e-3, (0.9, 0.95), 1e-8, 0.1, 3, grad_scale=0.37)
    want = [t.clone() for t in (master, m, v)]
    AdamW(1).step(want[0], grad, want[1], want[2], h)
    got = [t.cuda() for t in (master, m, v)]
    fused.configure(enabled=fuse)
    try:
        device_step(*got[:1], grad.cuda(), *got[1:], h)
    finally:
        fused.configure()
    got = [t.cpu() for t in got]
    if not fuse:
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        return
    # measured on an H100 (session 31): the master differed in 25% of its elements, by 4.8e-7 at
    # most (one rounding step of a value near 4); m in 2.5e-5 of its elements (4 of them by more
    # than one bf16 step: moments that nearly cancel), v in 5.1e-6 (none by more than one)
    for a, b, tol in zip(got, want, (2**-22, 2**-8, 2**-8)):
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < tol, err
    for a, b in zip(got[1:], want[1:]):
        assert (a != b).float().mean() < 1e-3


def test_document_attention_on_the_gpu_equals_documents_alone():
    """FlexAttention's block mask on CUDA (rows of 1024 tokens, documents across its
    128-token blocks): output and gradients equal each document run alone with causal SDPA,
    in fp32 (TF32 off)."""
    from test_documents import documents_alone

    from megaray.attention import packing
    from megaray.config import ModelConfig
    from megaray.layout import bind, build_layout
    from megaray.model import block_forward, init_unit, rope_tables

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig.from_shape("debug", qk_norm=True, hidden_size=128, intermediate_size=256)   # heads of 32
    unit = build_layout(cfg)[1]
    lengths = [[300, 5, 519, 200], [1024], [1, 127, 129, 767]]
    doc = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(ls)]) for ls in lengths]).cuda()
    pk = packing(doc, cfg.head_dim)
    assert pk.flex and not packing(doc, 8).flex          # toy heads take the dense mask
    flat = init_unit(unit, cfg, seed=0).cuda()
    rope = rope_tables(cfg, 1024, device="cuda")
    x = torch.randn(3, 1024, cfg.hidden_size, device="cuda")
    dy = torch.randn_like(x)
    w = flat.clone().requires_grad_()
    xp = x.clone().requires_grad_()
    y = block_forward(bind(w, unit), xp, rope, cfg, pk=pk)
    gw, gx = torch.autograd.grad(y, [w, xp], dy)
    y_ref, gx_ref, gw_ref = documents_alone(flat, unit, x, dy, lengths, rope, cfg)
    torch.testing.assert_close(y.detach(), y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("head_dim,window", [(128, 100), (256, 100), (256, 8)])
def test_flash_windows_equal_the_window_masks_on_the_gpu(head_dim, window):
    """Sliding windows through flash attention's own window (``window_attention``, what the
    windowed blocks run in bf16 on CUDA), rows as they are and rows of documents, against
    SDPA under the dense window-and-document mask in fp32 from the same bf16 inputs: output
    and q, k, v gradients to bf16 rounding, and the output farther from a window one token
    wider. Rows of 300 tokens (documents of 150 + 30 + 120 and 300 tokens: windows inside
    and across documents)."""
    from megaray.attention import dense_mask, flash_windows, packing, window_attention

    assert flash_windows("cuda", head_dim)
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, s, nh, nkv, scale = 2, 300, 8, 2, 0.07
    q = torch.randn(b, nh, s, head_dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn(b, nkv, s, head_dim, device="cuda", generator=gen).bfloat16()
    v = torch.randn(b, nkv, s, head_dim, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(b, nh, s, head_dim, device="cuda", generator=gen).bfloat16()
    lengths = [[150, 30, 120], [300]]
    doc = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(ls)]) for ls in lengths]).cuda()
    for ids in (torch.zeros_like(doc), doc):
        pk = packing(ids, head_dim, window)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = window_attention(*leaves, window, scale, pk.cu if ids is doc else None)
        grads = torch.autograd.grad(y, leaves, dy)
        ref = [t.float().clone().requires_grad_() for t in (q, k, v)]
        y_ref = torch.nn.functional.scaled_dot_product_attention(
            ref[0], ref[1].repeat_interleave(nh // nkv, 1), ref[2].repeat_interleave(nh // nkv, 1),
            attn_mask=dense_mask(ids.to(torch.int32), window), scale=scale)
        grads_ref = torch.autograd.grad(y_ref, ref, dy.float())
        torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)
        wider = torch.nn.functional.scaled_dot_product_attention(
            *(t.detach() for t in (ref[0], ref[1].repeat_interleave(nh // nkv, 1),
                                   ref[2].repeat_interleave(nh // nkv, 1))),
            attn_mask=dense_mask(ids.to(torch.int32), window + 1), scale=scale)
        assert (y.float() - y_ref).abs().max() < (y.float() - wider).abs().max() / 4
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g.float(), g_ref, rtol=2e-2, atol=2e-2)


def test_the_attention_bench_times_every_kernel():
    """``megaray bench --attention-alone``: each kernel timed; the share of pairs kept by
    documents of mean 64 in rows of 512 is well under causal's."""
    from megaray.attention import varlen_kernel
    from megaray.bench.attention import run

    (row,) = run([(512, 2)], 64, reps=1)
    assert row["causal_s"] > 0 and row["flex_document_s"] > 0 and row["sdpa_dense_mask_s"] > 0
    if varlen_kernel() is not None:      # torch >= 2.10: flash varlen is a candidate too
        assert row.get("varlen_document_s", 0) > 0, row.get("varlen_document_error")
    assert 0 < row["pairs_kept"] < 0.5
    (row,) = run([(512, 2)], 64, reps=1, shape="gemma3_12b")       # its heads, and its window of 1024
    assert row["flex_window_s"] > 0 and row["flex_document_window_s"] > 0
    if varlen_kernel() is not None:
        assert row.get("varlen_window_s", 0) > 0, row.get("varlen_window_error")


def test_the_block_bench_times_fused_and_eager_passes():
    """``megaray bench --block-alone``: every case timed both ways; the block's products and
    attention alone take less than the whole block."""
    from megaray.bench.block import run

    (row,) = run("llama1b", [(1024, 1)], reps=2)
    assert "fused_error" not in row, row.get("fused_error")
    for mode in ("eager", "fused"):
        assert set(row[mode]) == {"forward_s", "lean_s", "plain_s"} and min(row[mode].values()) > 0
    assert row["products"]["backward_s"] < row["eager"]["plain_s"]


def test_experts_as_grouped_products_equal_the_loop_on_the_gpu(monkeypatch):
    """A mixture's block on the GPU in bf16: the experts through torch._grouped_mm (where this
    GPU runs it) against the loop over the experts, forward and every gradient, to bf16
    rounding; in fp32 the loop on the GPU against the CPU's to fp32 rounding."""
    from megaray import moe
    from megaray.config import ModelConfig
    from megaray.layout import bind, build_layout
    from megaray.model import block_forward, init_unit, rope_tables

    cfg = ModelConfig.from_shape("debug_moe", num_experts=8, num_experts_per_tok=2, hidden_size=64,
                                 moe_intermediate_size=32, head_dim=16)
    unit = build_layout(cfg)[1]
    base = init_unit(unit, cfg, seed=1) + 0.05 * torch.randn(unit.numel, generator=torch.Generator().manual_seed(2))
    x0 = torch.randn(2, 128, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    dy0 = torch.randn(2, 128, cfg.hidden_size, generator=torch.Generator().manual_seed(4))

    def run(device, dtype, grouped: bool | None):
        monkeypatch.setattr(moe, "_GROUPED", {} if grouped is None else {(device, dtype): grouped})
        flat = base.to(device, dtype).requires_grad_()
        x = x0.to(device, dtype).requires_grad_()
        routed = []
        y = block_forward(bind(flat, unit), x, rope_tables(cfg, 128, device), cfg, routed=routed)
        gf, gx = torch.autograd.grad(y, [flat, x], dy0.to(device, dtype))
        return [t.float().cpu() for t in (y, gf, gx, routed[0].counts)]

    loop = run("cuda", torch.bfloat16, False)
    if moe._grouped_runs(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        grouped = run("cuda", torch.bfloat16, True)
        assert torch.equal(grouped[3], loop[3])                       # the same routing
        for a, b in zip(grouped[:3], loop[:3]):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))
    cpu = run("cpu", torch.float32, False)
    gpu = run("cuda", torch.float32, False)
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_mixture_of_experts_trains_on_the_gpu_as_on_the_cpu(gpu_ray):
    """debug_moe (4 experts, top 2, the load-balancing loss on) through the actors: the GPU's
    fp32 steps equal the CPU's to fp32 rounding, bf16 closely; the router's metrics agree."""
    torch.backends.cuda.matmul.allow_tf32 = False
    extra = ("model.shape=debug_moe",)
    cpu_l, cpu_m = _train("cpu", "float32", extra=extra, metrics=True)
    gpu_l, gpu_m = _train("cuda", "float32", extra=extra, metrics=True)
    np.testing.assert_allclose(gpu_l, cpu_l, rtol=1e-5)
    np.testing.assert_allclose([m["router_loss"] for m in gpu_m], [m["router_loss"] for m in cpu_m], rtol=1e-5)
    bf_l, _ = _train("cuda", "bfloat16", extra=extra)
    np.testing.assert_allclose(bf_l, cpu_l, rtol=2e-2)

