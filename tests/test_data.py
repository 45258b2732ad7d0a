"""``megaray prepare`` and the shard reader: token streams, SFT masks, shuffling, resume,
bad data, and the memory of a prepare task. Expected streams are built here from the
input texts directly (UTF-8 bytes, NUL between documents), shards are read back with
pyarrow itself."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import dead_pid, shm_files

from megaray.dataset import ShardDataset
from megaray.errors import DataError
from megaray.loader import load_config
from megaray.prepare import PrepareOptions, prepare
from megaray.step import Batch

S = 32          # seq_len of these tests: rows of 33 tokens


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "ünïcödé", "λ", "token", "shard", "\n"]
    return [f"doc{i} " + " ".join(rng.choice(words, rng.integers(1, 40))) for i in range(n)]


def _jsonl(path: Path, recs: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return path


def _read_all(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """Every row of every shard, in order, read with pyarrow's own IPC reader."""
    m = json.loads((out / "manifest.json").read_text())
    ts, ms = [], []
    for sh in m["shards"]:
        table = pa.ipc.open_file(pa.memory_map(str(out / sh["file"]))).read_all()
        ts += table.column("tokens").to_pylist()
        ms += table.column("mask").to_pylist()
    return np.array(ts, dtype=np.int64).reshape(-1, S + 1), np.array(ms, dtype=np.uint8).reshape(-1, S + 1)


def _expected_stream(docs: list[str]) -> list[int]:
    out = []
    for d in docs:
        out += list(d.encode("utf-8")) + [0]
    return out


def test_text_to_shards_to_batches_reproduces_the_stream(ray_cluster, tmp_path):
    docs = _docs(300)
    _jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs[:150]])
    _jsonl(tmp_path / "b.jsonl", [{"text": d, "other": 1} for d in docs[150:]])
    out = tmp_path / "shards"
    m = prepare([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], str(out),
                PrepareOptions(seq_len=S, holdout_fraction=0.0, split_mb=0.004), log=lambda s: None)
    assert len(m["shards"]) > 2                                    # several Ray tasks
    assert m["documents"] == 300 and m["skipped"] == {}
    toks, mask = _read_all(out)
    # each task packs its own documents: the rows of the tasks, stripped of final padding,
    # concatenate to the documents in order
    stream, k = [], 0
    for sh in m["shards"]:
        rows_t, rows_m = toks[k:k + sh["rows"]].reshape(-1), mask[k:k + sh["rows"]].reshape(-1)
        k += sh["rows"]
        stream += rows_t[: len(rows_m) - int(np.argmax(rows_m[::-1] == 1))].tolist()
    assert stream == _expected_stream(docs)
    assert m["tokens"] == len(stream)
    # the reader gives the same rows, unshuffled, as the training batches
    ds = ShardDataset(str(out), S, 256, seed=0, shuffle=False)
    b = ds.rows_at(0, len(toks))
    np.testing.assert_array_equal(b["tokens"], toks)
    np.testing.assert_array_equal(b["loss_mask"], mask)
    # the same documents from parquet and from a folder of text files pack the same way
    pq.write_table(pa.table({"text": docs[:150]}), tmp_path / "a.parquet")
    p2 = prepare([str(tmp_path / "a.parquet")], str(tmp_path / "pq"), PrepareOptions(seq_len=S, holdout_fraction=0.0),
                 log=lambda s: None)
    t2, _ = _read_all(tmp_path / "pq")
    assert t2.reshape(-1)[: len(_expected_stream(docs[:150]))].tolist() == _expected_stream(docs[:150])
    assert p2["documents"] == 150
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, d in enumerate(docs[:5]):
        (folder / f"{i:02d}.txt").write_text(d)
    # what a killed prepare of the same output left (it writes txt.tmp-<pid>, renamed last) goes;
    # a live writer's folder stays
    dead, live = tmp_path / f"txt.tmp-{dead_pid()}", tmp_path / f"txt.tmp-{os.getppid()}"
    for d in (dead, live):
        d.mkdir()
        (d / "shard-00000.arrow").write_bytes(b"half a shard")
    said: list[str] = []
    prepare([str(folder)], str(tmp_path / "txt"), PrepareOptions(seq_len=S, holdout_fraction=0.0), log=said.append)
    assert not dead.exists() and (live / "shard-00000.arrow").read_bytes() == b"half a shard"
    assert f"prepare: removed {dead}, what a killed prepare left unfinished" in said
    t3, _ = _read_all(tmp_path / "txt")
    assert t3.reshape(-1)[: len(_expected_stream(docs[:5]))].tolist() == _expected_stream(docs[:5])


def test_sft_masks_only_the_assistant_tokens(ray_cluster, tmp_path):
    recs = [{"prompt": "2+2?", "response": "4"},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"},
                          {"role": "assistant", "content": "yo yo"}]}]
    _jsonl(tmp_path / "sft.jsonl", recs)
    out = tmp_path / "sft"
    prepare([str(tmp_path / "sft.jsonl")], str(out), PrepareOptions(seq_len=S, kind="sft", holdout_fraction=0.0),
            log=lambda s: None)
    toks, mask = _read_all(out)
    t, mk = toks.reshape(-1), mask.reshape(-1)
    targets = bytes(int(x) for x, keep in zip(t, mk) if keep)
    # the documented template: "<|role|>\n" + content (+ NUL after an assistant's) + "\n"
    assert targets == b"4\x00\n" + b"yo\x00\n" + b"yo yo\x00\n"
    text = bytes(int(x) for x in t[: len(mk) - int(np.argmax(mk[::-1] == 1))])
    assert text.startswith(b"<|user|>\n2+2?\n<|assistant|>\n4\x00\n\x00<|system|>\nbe brief\n<|user|>\nhi\n")


def _strip_document_starts(src: Path, dst: Path) -> None:
    """A copy of a shard folder as megaray prepare wrote it before it recorded document starts."""
    dst.mkdir()
    m = json.loads((src / "manifest.json").read_text())
    del m["document_starts"]
    for sh in m["shards"]:
        table = pa.ipc.open_file(pa.memory_map(str(src / sh["file"]))).read_all().drop_columns(["starts"])
        with pa.OSFile(str(dst / sh["file"]), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table)
    (dst / "manifest.json").write_text(json.dumps(m))


def test_document_starts_are_recorded_and_old_shards_still_train(ray_cluster, tmp_path):
    """Every document's first token is listed in its row's ``starts`` (the padding's too),
    read back with pyarrow; the reader's document ids follow them; 'auto' attention is
    'document' for SFT shards and 'causal' for pretraining ones; shards written before the
    starts existed load, say so, and train with causal attention, and refuse 'document'
    naming the folder; an SFT run states its attention at start."""
    from megaray.driver.runner import train

    docs = _docs(60)
    _jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    out = tmp_path / "pre"
    m = prepare([str(tmp_path / "d.jsonl")], str(out), PrepareOptions(seq_len=S, holdout_fraction=0.0),
                log=lambda s: None)
    assert m["document_starts"] is True
    table = pa.ipc.open_file(pa.memory_map(str(out / m["shards"][0]["file"]))).read_all()
    starts = table.column("starts").to_pylist()
    offsets = np.cumsum([0] + [len(d.encode()) + 1 for d in docs])       # each document, then NUL
    pad_at = offsets[-1]                                                    # the last row's padding
    want = [[] for _ in starts]
    for o in [*offsets[:-1], pad_at]:
        if o < len(starts) * (S + 1):
            want[o // (S + 1)].append(int(o % (S + 1)))
    assert starts == want
    ds = ShardDataset(str(out), S, 256, seed=0, shuffle=False)
    doc = ds.rows_at(0, len(starts), documents=True)["doc"]
    for r, st in enumerate(starts):
        assert doc[r].tolist() == [sum(1 for x in st if x <= j) for j in range(S + 1)]
    assert ds.attention("auto")[0] == "causal" and ds.attention("document")[0] == "document"

    old = tmp_path / "old"
    _strip_document_starts(out, old)
    ds_old = ShardDataset(str(old), S, 256, seed=0, shuffle=False)
    assert "no document starts recorded" in ds_old.describe()
    assert ds_old.attention("auto")[0] == "causal"
    with pytest.raises(DataError, match=f"{old}: train.attention is document, but these shards record no"):
        ds_old.attention("document")
    np.testing.assert_array_equal(ds_old.rows_at(0, 4)["tokens"], ds.rows_at(0, 4)["tokens"])
    base = ["data.source=shards", f"train.seq_len={S}", "train.steps=2", "train.eval_batches=1",
            "optim.num_shards=1", "checkpoint.every=0"]
    run = train(load_config("debug", base + [f"data.path={old}", f"run.dir={tmp_path / 'r-old'}"]))
    assert "attention: causal (auto: pretrain shards without document starts)" in (
        Path(run["run_dir"]) / "train.log").read_text()

    _jsonl(tmp_path / "sft.jsonl", [{"prompt": f"q{i}", "response": d} for i, d in enumerate(docs)])
    prepare([str(tmp_path / "sft.jsonl")], str(tmp_path / "sft"), PrepareOptions(seq_len=S, kind="sft"),
            log=lambda s: None)
    # SFT loss masks are unchanged by document attention: a document's first token is never a target
    sft = ShardDataset(str(tmp_path / "sft"), S, 256, seed=0, shuffle=False)
    b = sft.rows_at(0, sft.train_rows, documents=True)
    np.testing.assert_array_equal(Batch(**b).targets_kept(), b["loss_mask"][:, 1:] != 0)
    assert (np.diff(b["doc"], axis=1) > 0).sum() >= 50                    # many documents start inside rows
    run = train(load_config("debug", base + [f"data.path={tmp_path / 'sft'}", f"run.dir={tmp_path / 'r-sft'}"]))
    assert "attention: document (auto: sft shards)" in (Path(run["run_dir"]) / "train.log").read_text()
    losses = [x["loss"] for x in map(json.loads, (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines())
              if "loss" in x]
    assert len(losses) == 2 and all(np.isfinite(losses))
    # the long-context path under document attention: inputs offloaded to host memory, only
    # block 0's saved (block 1's rebuilt in the backward, its documents' mask read again), the
    # MLP in chunks of a quarter of a micro-batch; the same losses to fp32 rounding
    run = train(load_config("debug", base + [f"data.path={tmp_path / 'sft'}", f"run.dir={tmp_path / 'r-long'}",
                                             "worker.offload_inputs=1", f"train.mlp_chunk_tokens={S // 2}",
                                             "worker.input_stride=2"]))
    long = [x["loss"] for x in map(json.loads, (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines())
            if "loss" in x]
    np.testing.assert_allclose(long, losses, rtol=1e-5)


def test_shuffle_is_seeded_and_each_epoch_a_permutation(ray_cluster, tmp_path):
    _jsonl(tmp_path / "d.jsonl", [{"text": d} for d in _docs(200)])
    prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "s"), PrepareOptions(seq_len=S, holdout_fraction=0.1),
            log=lambda s: None)
    a = ShardDataset(str(tmp_path / "s"), S, 256, seed=1)
    n = a.train_rows
    assert a.heldout_rows >= 1 and n + a.heldout_rows == a.rows
    order = [a._train_row(p) for p in range(2 * n)]
    assert sorted(order[:n]) == list(range(n)) and sorted(order[n:]) == list(range(n))
    assert order[:n] != order[n:] and order[:n] != list(range(n))
    b = ShardDataset(str(tmp_path / "s"), S, 256, seed=1)
    np.testing.assert_array_equal(a.rows_at(5, 7)["tokens"], b.rows_at(5, 7)["tokens"])
    c = ShardDataset(str(tmp_path / "s"), S, 256, seed=2)
    assert not np.array_equal(a.rows_at(0, 7)["tokens"], c.rows_at(0, 7)["tokens"])
    held = a.rows_at(0, a.heldout_rows, split="heldout")["tokens"]
    train_rows = a.rows_at(0, n)["tokens"]
    assert not any((train_rows == h).all(axis=1).any() for h in held) or a.heldout_rows == 0


def test_resume_continues_with_the_next_samples(ray_cluster, tmp_path):
    from megaray.driver.runner import train

    _jsonl(tmp_path / "d.jsonl", [{"text": d} for d in _docs(400)])
    prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "s"), PrepareOptions(seq_len=S, holdout_fraction=0.05),
            log=lambda s: None)
    base = ["data.source=shards", f"data.path={tmp_path / 's'}", f"train.seq_len={S}", "train.steps=4",
            "train.eval_batches=1", "train.log_every=1", "optim.num_shards=1"]

    def losses(run):
        return [json.loads(x)["loss"] for x in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]

    whole = train(load_config("debug", base + [f"run.dir={tmp_path / 'a'}", "checkpoint.every=0"]))
    first = train(load_config("debug", base + [f"run.dir={tmp_path / 'b'}", "train.steps=2"]))
    trainer = json.loads((Path(first["checkpoint"]) / "trainer.json").read_text())
    cfg = load_config("debug")
    assert trainer["data_position"] == 2 * cfg.train.grad_accum * cfg.train.micro_batch_size
    resumed = train(load_config("debug", base + [f"run.dir={tmp_path / 'b'}", "checkpoint.resume=auto"]))
    assert resumed["first_step"] == 3
    assert losses(first) + losses(resumed) == losses(whole)           # the same rows, bit for bit
    assert whole["data_wait_share"] < 0.5


def test_bad_rows_name_file_and_line_or_are_counted(ray_cluster, tmp_path):
    good = [{"text": d} for d in _docs(20)]
    cases = {
        "malformed json": (['{"text": "ok"}', '{"text": "broken"', '{"text": "fine"}'], "line 2: malformed JSON"),
        "missing column": ([{"text": "ok"}, {"body": "no text here"}], "line 2: no column 'text'"),
        "empty text": ([{"text": "ok"}, {"text": "ok"}, {"text": "   "}], "line 3: empty text"),
    }
    for reason, (recs, msg) in cases.items():
        f = _jsonl(tmp_path / f"{reason.replace(' ', '_')}.jsonl", recs)
        with pytest.raises(DataError, match=msg) as e:
            prepare([str(f)], str(tmp_path / f"out-{reason}"), PrepareOptions(seq_len=S), log=lambda s: None)
        assert str(f) in str(e.value)
        assert not list(tmp_path.glob(f"out-{reason}*"))             # nothing half-written is left
    mixed = _jsonl(tmp_path / "mixed.jsonl", good + ['{"text": ', {"body": 1}, {"text": ""}, {"text": 5}])
    m = prepare([str(mixed)], str(tmp_path / "skipped"), PrepareOptions(seq_len=S, on_bad_row="skip"),
                log=lambda s: None)
    assert m["skipped"] == {"malformed json": 1, "missing column": 1, "empty text": 1, "not text": 1}
    assert m["documents"] == 20
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    with pytest.raises(DataError, match="nocol.parquet: no column 'text'"):
        prepare([str(tmp_path / "nocol.parquet")], str(tmp_path / "o2"), PrepareOptions(seq_len=S), log=lambda s: None)


def test_token_ids_outside_the_vocabulary_stop_the_run_naming_the_row(ray_cluster, tmp_path):
    from megaray.driver.runner import train

    _jsonl(tmp_path / "d.jsonl", [{"text": d} for d in _docs(100)])
    out = tmp_path / "s"
    prepare([str(tmp_path / "d.jsonl")], str(out), PrepareOptions(seq_len=S, holdout_fraction=0.0),
            log=lambda s: None)
    # a model with a smaller vocabulary than the shards' is refused before training
    with pytest.raises(DataError, match="vocabulary of 256, larger than the model's vocab_size 100"):
        ShardDataset(str(out), S, 100, seed=0)
    # a shard corrupted after prepare: row 3 of shard 0 holds id 999
    shard = out / "shard-00000.arrow"
    with pa.OSFile(str(shard)) as f:                              # read into memory, not mapped
        table = pa.ipc.open_file(f).read_all()
    t = np.array(table.column("tokens").to_pylist(), dtype=np.int32)
    t[3, 5] = 999
    schema = table.schema
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        w.write_table(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(t.reshape(-1)), S + 1),
                                "mask": table.column("mask"), "starts": table.column("starts")}, schema=schema))
    cfg = load_config("debug", ["data.source=shards", f"data.path={out}", f"train.seq_len={S}", "train.steps=40",
                                "data.shuffle=false", f"run.dir={tmp_path / 'runs'}", "optim.num_shards=1"])
    with pytest.raises(DataError, match=r"shard-00000.arrow row 3: token id 999 is outside the model's vocabulary"):
        train(cfg)
    assert shm_files() == []
    assert ray_cluster.util.list_named_actors(all_namespaces=True) == [] or not [
        a for a in ray_cluster.util.list_named_actors(all_namespaces=True) if a["name"].startswith("megaray:")]


def test_prepare_task_memory_stays_bounded(ray_cluster, tmp_path):
    """One task streams a file: its memory does not grow with the file (5 MB vs 20 MB input)."""
    docs = _docs(3000, seed=5)
    growth = {}
    for mult in (10, 40):
        f = _jsonl(tmp_path / f"big{mult}.jsonl", [{"text": d * mult} for d in docs])
        m = prepare([str(f)], str(tmp_path / f"big{mult}"), PrepareOptions(seq_len=512, batch_mb=0.5, split_mb=1024,
                                                                           holdout_fraction=0.0), log=lambda s: None)
        assert len(m["shards"]) == 1 and m["documents"] == 3000      # one task took the whole file
        growth[f.stat().st_size] = m["task_rss_growth_bytes"]
    print("prepare task RSS growth by input size (MB): "
          + ", ".join(f"{k / 1e6:.1f} -> {v / 1e6:.1f}" for k, v in growth.items()))
    small, big = growth.values()
    assert big < small + 4 * 2**20 and big < 64 * 2**20


def test_the_demo_holds_out_whole_files_from_across_the_corpus():
    """The held-out text is every 50th file of the corpus (data.holdout_fraction 0.02; of a
    corpus under 100 files, every (n/2)th), read
    here from the files themselves: disjoint from the training text and spread over the whole
    library, not its alphabetical tail."""
    from megaray.corpus import ByteCorpus, stdlib_files

    cfg = load_config("demo", ["data.max_bytes=400000"])
    c = ByteCorpus(cfg.data, seq_len=128)
    files, total = [], 0
    for p in stdlib_files():
        b = Path(p).read_bytes()[: 400000 - total]
        files.append(b + b"\n")
        total += len(b) + 1
        if total >= 400000:
            break
    k = min(50, max(2, len(files) // 2))                 # one in 50, or two files of a small corpus
    held = [i for i in range(len(files)) if i % k == k - 1]
    assert bytes(c.heldout) == b"".join(files[i] for i in held)
    assert bytes(c.train) == b"".join(f for i, f in enumerate(files) if i not in held)
    assert len(held) >= 2 and held[-1] - held[0] >= len(files) // 2


def test_megaray_prepare_runs_its_tasks_on_the_cluster_at_ray_address(ray_cluster, tmp_path):
    """Issue 47 item 13: `megaray prepare` attaches to RAY_ADDRESS as `megaray train` does (Ray's
    own line says it connected, none that it started one), and an address it cannot reach is
    one line."""
    import subprocess
    import sys

    import ray

    (tmp_path / "a.txt").write_text("hello megaray\n" * 200)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    p = subprocess.run([sys.executable, "-m", "megaray.cli", "prepare", str(tmp_path / "a.txt"), "--out",
                        str(tmp_path / "shards"), "--seq-len", "16"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"prepare: attached to the Ray cluster at {env['RAY_ADDRESS']}" in p.stdout
    assert "Connecting to existing Ray cluster" in p.stderr and "Started a local Ray" not in p.stderr
    assert ShardDataset(str(tmp_path / "shards"), 16, 256, 0).rows_at(0, 1)["tokens"].shape[-1] == 17
    bad = subprocess.run([sys.executable, "-m", "megaray.cli", "prepare", str(tmp_path / "a.txt"), "--out",
                          str(tmp_path / "more"), "--seq-len", "16", "--address", "localhost:notaport"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1 and "cannot reach the Ray cluster at localhost:notaport" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "more").exists()
