"""Hugging Face interop against transformers itself: Llama, Mistral, Qwen2, Qwen3.

Each model is a small random one built with transformers and saved with save_pretrained in
the test (no download). megaray loads it; logits, one step's loss and every gradient must
agree with transformers'; export must give a directory transformers loads with the same
logits and bit-identical weights.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megaray.checkpoint import Checkpointer  # noqa: E402
from megaray.driver.session import TrainingSession  # noqa: E402
from megaray.errors import ConfigError, ModelFileError  # noqa: E402
from megaray.hf.export import export_checkpoint  # noqa: E402
from megaray.loader import build_config  # noqa: E402
from megaray.step import Batch  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(tie_word_embeddings=True, rope_theta=10000.0,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=128, rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=10000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_theta=10000.0)),
}
REPORT = {}


def make_hf(tmp: Path, arch: str, dtype=torch.float32) -> tuple[Path, torch.nn.Module]:
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    model = getattr(transformers, model_cls)(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():    # non-trivial norms and biases
            if p.ndim == 1:
                p.copy_(torch.rand_like(p) + 0.5 if "norm" in n else torch.randn_like(p) * 0.1)
    model = model.to(dtype)
    path = tmp / f"{arch}-{str(dtype)[6:]}"
    model.save_pretrained(path)
    return path, model.float().eval()


def _cfg(path: Path, **train):
    return build_config({
        "model": {"from": str(path)},
        "train": {"steps": 1, "micro_batch_size": 2, "grad_accum": 1, "seq_len": 16, "compute_dtype": "float32",
                  **train},
        "optim": {"lr": 1e-3, "clip_grad_norm": None, "num_shards": 2, "warmup_steps": 0, "schedule": "constant"},
        "data": {"max_bytes": 20000},
        "debug": {"keep_gradients": True},
    })


@pytest.mark.parametrize("arch", list(ARCHS))
def test_load_logits_step_gradients_export(ray_cluster, tmp_path, arch):
    path, ref = make_hf(tmp_path, arch)
    cfg = _cfg(path)
    assert cfg.model.architecture == ARCHS[arch][1]
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, (2, 17))
    with TrainingSession(cfg) as s:
        ours = s.logits(tokens[:, :-1])
        theirs = ref(torch.from_numpy(tokens[:, :-1])).logits.detach().numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
        logit_diff = float(np.abs(ours - theirs).max())

        m = s.train_step(0, tokens[None])
        grads = s.gradients()
        out = ref(torch.from_numpy(tokens[:, :-1])).logits
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, 256), torch.from_numpy(tokens[:, 1:]).reshape(-1))
        loss.backward()
        assert abs(m["loss"] - loss.item()) < 1e-5 * loss.item()
        grad_diff = 0.0
        for name, p in ref.named_parameters():
            g = p.grad.numpy()
            np.testing.assert_allclose(grads[name], g, rtol=1e-4, atol=1e-6, err_msg=name)
            grad_diff = max(grad_diff, float(np.abs(grads[name] - g).max() / (np.abs(g).max() + 1e-12)))

        ck = Checkpointer(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                                  dir=str(tmp_path / "ckpt"))),
                          s.run_id, logging.getLogger("megaray"))
        folder = ck.save(s, 1, {})
        ck.close()
        after = s.logits(tokens[:, :-1])
        weights = s.state_dict()
    out_dir = tmp_path / "export"
    export_checkpoint(folder, out_dir, shard_bytes=20_000)        # force several shards
    assert (out_dir / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(back).__name__ == ARCHS[arch][1]
    for name, p in back.named_parameters():
        assert torch.equal(p.detach(), torch.from_numpy(weights[name])), name
    exported = back(torch.from_numpy(tokens[:, :-1])).logits.detach().numpy()
    np.testing.assert_allclose(exported, after, rtol=1e-5, atol=1e-5)
    REPORT[arch] = (logit_diff, grad_diff)
    print(f"{arch}: largest logit difference {logit_diff:.2e}, largest relative gradient difference {grad_diff:.2e}")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_packed_row_with_document_attention_equals_transformers_document_by_document(ray_cluster, tmp_path, arch):
    """Rows of several documents under document attention: megaray's logits, one step's loss
    and every gradient equal transformers' run on each document alone (the targets that
    begin a document are not predicted: alone, nothing comes before them)."""
    path, ref = make_hf(tmp_path, arch)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 256, (2, 17))
    doc = np.array([[0] * 4 + [1] * 7 + [2] * 6, [0] * 1 + [1] * 10 + [2] * 6], dtype=np.int32)

    def segments(row: int, upto: int):
        return [np.flatnonzero(doc[row, :upto] == d) for d in np.unique(doc[row, :upto])]

    with TrainingSession(_cfg(path)) as s:
        ours = s.logits(tokens[:, :-1], doc[:, :-1])
        for r in range(2):
            for idx in segments(r, 16):
                theirs = ref(torch.from_numpy(tokens[r, idx][None])).logits[0].detach().numpy()
                np.testing.assert_allclose(ours[r, idx], theirs, rtol=1e-5, atol=1e-5)

        m = s.train_step(0, Batch(tokens[None], loss_mask=np.ones((1, 2, 17), np.uint8), doc=doc[None]))
        grads = s.gradients()
    loss_sum, count = 0.0, 0
    for r in range(2):
        for idx in segments(r, 17):
            if len(idx) < 2:
                continue
            seg = torch.from_numpy(tokens[r, idx])
            out = ref(seg[None, :-1]).logits[0]
            loss_sum = loss_sum + torch.nn.functional.cross_entropy(out, seg[1:], reduction="sum")
            count += len(idx) - 1
    assert count == 2 * 16 - 4                        # two starts in each row are not targets
    loss = loss_sum / count
    loss.backward()
    assert abs(m["loss"] - loss.item()) < 1e-5 * loss.item()
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_bf16_source_is_upcast(ray_cluster, tmp_path):
    path, ref = make_hf(tmp_path, "qwen2", dtype=torch.bfloat16)
    tokens = np.random.default_rng(2).integers(0, 256, (2, 12))
    with TrainingSession(_cfg(path)) as s:
        assert s.weights_report["source_dtypes"] == ["bfloat16"]
        np.testing.assert_allclose(s.logits(tokens), ref(torch.from_numpy(tokens)).logits.detach().numpy(),
                                   rtol=1e-5, atol=1e-5)


def test_broken_model_directories_fail_clearly(ray_cluster, tmp_path):
    from conftest import shm_files

    path, _ = make_hf(tmp_path, "llama")
    # unsupported architecture: refused while loading the config
    bad = tmp_path / "gpt2"
    shutil.copytree(path, bad)
    c = json.loads((bad / "config.json").read_text())
    c["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        _cfg(bad)
    # an unsupported feature of a supported architecture
    c["architectures"] = ["LlamaForCausalLM"]
    c["mlp_bias"] = True
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError, match="mlp_bias"):
        _cfg(bad)
    # truncated safetensors
    trunc = tmp_path / "trunc"
    shutil.copytree(path, trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="model.safetensors"):
        TrainingSession(_cfg(trunc)).start()
    # corrupt: garbage where the header length should be
    (trunc / "model.safetensors").write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(ModelFileError, match="model.safetensors"):
        TrainingSession(_cfg(trunc)).start()
    # a missing shard
    torch.manual_seed(0)
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(ModelFileError, match=f"{shards[1].name}.*missing"):
        TrainingSession(_cfg(sharded)).start()
    assert shm_files() == []


def test_model_tokenizer_feeds_the_data(ray_cluster, tmp_path, capsys):
    """With a tokenizer.json beside the weights, the corpus is that tokenizer's ids; `megaray
    export` carries the tokenizer along, into a new or empty folder only."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megaray.corpus import ByteCorpus, stdlib_files
    from megaray.driver.runner import train
    from megaray.tokenizer import model_tokenizer

    path, _ = make_hf(tmp_path, "qwen3")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = Path(stdlib_files()[0]).read_text(errors="replace")
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    tok.save(str(path / "tokenizer.json"))
    cfg = build_config({"model": {"from": str(path)}, "data": {"max_bytes": 20000, "holdout_fraction": 0.1},
                        "train": {"steps": 2, "seq_len": 16, "micro_batch_size": 2, "compute_dtype": "float32",
                                  "eval_batches": 1},
                        "optim": {"num_shards": 2}, "run": {"dir": str(tmp_path / "runs")}})
    corpus = ByteCorpus(cfg.data, model_tokenizer(str(path)), cfg.model.vocab_size)
    first = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text.split("\n\n")[0],
                                                                     add_special_tokens=False).ids
    assert corpus.train[: len(first)].tolist() == first
    s = train(cfg)
    assert s["status"] == "succeeded"
    assert "tokenizer.json tokens" in (Path(s["run_dir"]) / "train.log").read_text()
    # and the export (the command, into an empty folder) carries the tokenizer along
    from conftest import dead_pid

    from megaray.pipelines.export import main as export_main

    out = tmp_path / "export"
    out.mkdir()
    left = tmp_path / f"export.tmp-{dead_pid()}"                 # what a killed export leaves: removed
    left.mkdir()
    (left / "config.json").write_text("{}")
    assert export_main([s["checkpoint"], str(out)]) == 0
    assert "shard 1/1 model.safetensors" in capsys.readouterr().err
    assert (out / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []
    # a folder with files in it, here the model the run started from, is refused and untouched
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    assert export_main([s["checkpoint"], str(path)]) == 1
    assert f"{path} already exists and is not an empty folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_resident_units_load_from_the_model_directory(ray_cluster, tmp_path):
    """The worker reads its resident units (the embedding and both blocks) from the model
    directory itself (the store only the head): the weights are the model's, as with every
    unit streamed."""
    path, ref = make_hf(tmp_path, "qwen2")
    cfg = _cfg(path)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, resident_units=3))
    with TrainingSession(cfg) as s:
        assert s.handles.resident == (0, 1, 2)
        state = s.state_dict()
    want = ref.state_dict()
    assert set(state) <= set(want)
    for k, v in state.items():
        np.testing.assert_array_equal(v, want[k].numpy(), err_msg=k)


@pytest.mark.parametrize("threads", [1, 4])
def test_loading_on_threads_gives_the_files_values(tmp_path, threads):
    """``load_into`` reads a tensor a thread: whatever the threads, every master region holds
    its tensor of the (sharded, bf16) files upcast, as transformers' own model has it, and the
    report counts what was read."""
    from megaray.hf.read import load_into
    from megaray.layout import build_layout

    path, ref = make_hf(tmp_path, "qwen2", dtype=torch.bfloat16)
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).save_pretrained(
        sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    units = build_layout(_cfg(sharded).model)
    masters = {u.index: torch.full((u.numel,), float("nan")) for u in units}
    report = load_into(units, masters.__getitem__, sharded, threads=threads)
    want = ref.state_dict()
    for u in units:
        for s in u.params:
            got = masters[u.index][s.offset:s.offset + s.numel].view(s.shape)
            assert torch.equal(got, want[s.name]), s.name
    assert report["tensors"] == sum(len(u.params) for u in units)
    assert report["source_dtypes"] == ["bfloat16"]
    assert report["source_bytes"] == 2 * sum(u.numel for u in units)
