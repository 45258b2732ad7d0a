"""Checkpoints, exact resume and surviving failures, on a real local Ray cluster.

Kills are real (ray.kill, os.kill); the full disk is a real 1 MB-scale tmpfs where the
machine lets the test mount one.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import zlib
from pathlib import Path

import conftest
import numpy as np
import pytest
import ray
import torch
from conftest import dead_pid, finish, shm_files, wait_for_steps

from megaray.checkpoint import Checkpoint, complete_checkpoints
from megaray.driver.runner import train
from megaray.driver.session import NAMESPACE
from megaray.errors import CheckpointError, TrainingDiverged
from megaray.loader import load_config
from megaray.shm import remove_stale

BASE = ["train.steps=6", "train.log_every=1", "train.eval_batches=1", "data.max_bytes=50000"]


def _cfg(tmp: Path, *extra: str):
    return load_config("debug", [*BASE, f"run.dir={tmp}", *extra])


def _losses(summary) -> dict[int, float]:
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _master(ckpt: Path) -> bytes:
    return (ckpt / "master.bin").read_bytes()


@pytest.fixture(scope="module")
def reference_run(ray_cluster, tmp_path_factory):
    """Six uninterrupted steps; its final checkpoint holds the reference weights."""
    tmp = tmp_path_factory.mktemp("ref")
    s = train(_cfg(tmp, "checkpoint.resume=null"))
    return s, _losses(s), Path(s["checkpoint"])


def test_periodic_and_final_checkpoints_keep_the_last_n(ray_cluster, tmp_path):
    s = train(_cfg(tmp_path, "checkpoint.every=2", "checkpoint.keep=2"))
    ckpts = complete_checkpoints(tmp_path / "checkpoints" / "debug")
    assert [p.name for p in ckpts] == ["step-00000006", "step-00000004"]
    m = Checkpoint(ckpts[0]).manifest
    assert set(m["parts"]) == {"master.bin", "optim-0.bin", "optim-1.bin", "trainer.json"}
    for name, part in m["parts"].items():                   # checksums, computed independently (one block each)
        data = (ckpts[0] / name).read_bytes()
        assert len(data) == part["bytes"] and [zlib.crc32(data)] == part["crc32"]
    # the debug model's moments by position: the embedding, each block's matrices and its 1-D
    # tensors, the final norm, split between the shards, each range at Adam step 6
    ranges = sorted(tuple(e[:4]) for k in (0, 1) for e in m["parts"][f"optim-{k}.bin"]["moments"])
    assert ranges == [(0, 0, 8192, 6), (1, 0, 9216, 6), (1, 9216, 9280, 6), (2, 0, 9216, 6), (2, 9216, 9280, 6),
                      (3, 0, 32, 6)]
    assert [e[:3] for e in m["parts"]["master.bin"]["master"]] == [[0, 0, 8192], [1, 0, 9280], [2, 0, 9280], [3, 0, 32]]
    assert json.loads((ckpts[0] / "trainer.json").read_text())["next_step"] == 6
    assert not list((tmp_path / "checkpoints" / "debug").glob("*.tmp-*"))
    assert s["checkpoint"] == str(ckpts[0])


def _cut_at_4_and_resume(tmp: Path, *opts: str, resume: tuple = ()) -> dict:
    """A run with a checkpoint every 3 steps, cut off by an exception after its 4th step, then
    launched again (resume: auto, ``resume`` overrides added); returns the second's summary."""
    def interrupt(step, session):
        if step == 4:
            raise KeyError("interrupt")

    with pytest.raises(KeyError):
        train(_cfg(tmp, "checkpoint.every=3", *opts), on_step=interrupt)
    return train(_cfg(tmp, *opts, *resume))


def test_resume_continues_bit_for_bit(reference_run, tmp_path):
    _, ref_losses, ref_ckpt = reference_run
    s = _cut_at_4_and_resume(tmp_path)
    assert s["first_step"] == 4
    resumed = _losses(s)
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == ref_losses[step]                        # bit for bit
    assert _master(Path(s["checkpoint"])) == _master(ref_ckpt)


@pytest.mark.parametrize("changed", [["optim.num_shards=3", "optim.grad_slab_mib=0.01"],
                                     ["optim.num_shards=1", "optim.shard_layout=contiguous"]],
                         ids=["3-shards-small-slabs", "1-shard"])
def test_resume_with_other_shards_and_slabs_is_bit_for_bit(reference_run, tmp_path, changed):
    """Moments are saved by position in the model, so the checkpoint of a 2-shard run with
    64 MiB slabs resumes under another cut (here ~2.6k-element pieces over 3 shards, or one
    shard) and ends where the uninterrupted run ended, bit for bit."""
    _, ref_losses, ref_ckpt = reference_run
    s = _cut_at_4_and_resume(tmp_path, resume=tuple(changed))
    assert s["first_step"] == 4
    assert {k: v for k, v in _losses(s).items()} == {k: ref_losses[k] for k in (4, 5, 6)}
    assert _master(Path(s["checkpoint"])) == _master(ref_ckpt)
    m = Checkpoint(s["checkpoint"]).manifest
    n_shards = 3 if "optim.num_shards=3" in changed else 1
    assert sorted(k for k in m["parts"] if k.startswith("optim-")) == [f"optim-{k}.bin" for k in range(n_shards)]


@pytest.mark.parametrize("opts", [["optim.moment_dtype=bfloat16"],
                                  ["optim.moment_dtype=bfloat16", "train.compute_dtype=bfloat16",
                                   "optim.compute_copy=host"]],
                         ids=["bf16-moments", "bf16-moments-and-copy-on-the-host"])
def test_each_state_dtype_resumes_bit_for_bit(ray_cluster, tmp_path, opts):
    """The C kernel's state combinations (bf16 moments rounded to nearest; the host's bf16
    compute copy written in the same pass) resume exactly as they would have continued."""
    ref = train(_cfg(tmp_path / "ref", "checkpoint.resume=null", *opts))
    s = _cut_at_4_and_resume(tmp_path, *opts)
    assert s["first_step"] == 4 and _losses(s) == {k: v for k, v in _losses(ref).items() if k >= 4}
    assert _master(Path(s["checkpoint"])) == _master(Path(ref["checkpoint"]))
    assert "AdamW: the fused C kernel" in (Path(s["run_dir"]) / "train.log").read_text()


def test_a_mixture_of_experts_resumes_bit_for_bit_under_another_cut(ray_cluster, tmp_path):
    """debug_moe (its load-balancing loss trained) cut after step 4 and resumed from step 3's
    checkpoint with three shards and small slabs: the steps after and the final weights are
    the uninterrupted run's, bit for bit, the router's metrics too."""
    opts = ("model.shape=debug_moe",)
    ref = train(_cfg(tmp_path / "ref", "checkpoint.resume=null", *opts))
    s = _cut_at_4_and_resume(tmp_path, *opts, resume=("optim.num_shards=3", "optim.grad_slab_mib=0.01"))
    def rows(summary) -> dict[int, dict]:
        lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    got, want = rows(s), rows(ref)
    assert s["first_step"] == 4
    for step in (4, 5, 6):
        for key in ("loss", "router_loss", "expert_load_max", "expert_load_mean"):
            assert got[step][key] == want[step][key], (step, key)
    assert _master(Path(s["checkpoint"])) == _master(Path(ref["checkpoint"]))


def test_bf16_master_and_moments_train_resume_and_export(ray_cluster, tmp_path):
    """The reduced-precision options end to end: a run learns, resumes bit for bit from its
    own checkpoint, refuses a checkpoint of the other master dtype, and exports fp32."""
    opts = ["train.compute_dtype=bfloat16", "optim.master_dtype=bfloat16", "optim.moment_dtype=bfloat16"]
    ref = train(_cfg(tmp_path / "ref", "checkpoint.resume=null", *opts))
    ref_losses = _losses(ref)
    assert ref_losses[6] < ref_losses[1]
    ck = Path(ref["checkpoint"])
    m = Checkpoint(ck).manifest
    assert m["master_dtype"] == "bfloat16" and m["moment_dtype"] == "bfloat16"
    n = load_config("debug").model.num_params()
    assert os.path.getsize(ck / "master.bin") == 2 * n                  # 2 bytes a parameter
    moments = sum(e[2] - e[1] for k in (0, 1) for e in m["parts"][f"optim-{k}.bin"]["moments"])
    assert moments == n and os.path.getsize(ck / "optim-0.bin") + os.path.getsize(ck / "optim-1.bin") == 2 * 2 * n

    s = _cut_at_4_and_resume(tmp_path, *opts)
    assert s["first_step"] == 4 and all(_losses(s)[k] == ref_losses[k] for k in (4, 5, 6))
    assert _master(Path(s["checkpoint"])) == _master(ck)
    with pytest.raises(CheckpointError, match="optim.master_dtype"):
        train(_cfg(tmp_path / "other", f"checkpoint.resume={ck}", "train.compute_dtype=bfloat16"))
    from safetensors.torch import load_file

    from megaray.hf.export import export_checkpoint

    export_checkpoint(ck, tmp_path / "hf")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    raw = torch.frombuffer(bytearray(_master(ck)[:2 * 256 * 32]), dtype=torch.bfloat16).float()
    assert torch.equal(exported["model.embed_tokens.weight"].reshape(-1), raw)
    assert shm_files() == []


@pytest.mark.parametrize("role", ["optimizer-1", "store"])
def test_killed_actor_restarts_from_last_checkpoint(reference_run, tmp_path, role, caplog):
    _, ref_losses, ref_ckpt = reference_run
    killed = []

    def kill(step, session):
        if step == 3 and not killed:
            ray.kill(ray.get_actor(f"megaray:{session.run_id}:{role}", namespace=NAMESPACE), no_restart=True)
            killed.append(step)

    s = train(_cfg(tmp_path, "checkpoint.every=2", "checkpoint.resume=null"), on_step=kill)
    assert killed == [3]
    (restart,) = s["restarts"]
    assert restart["resumed_from"] == 2 and role in restart["error"]
    log = (Path(s["run_dir"]) / "train.log").read_text()
    assert "restarted the run's actors" in log and "redoing" in log
    assert _master(Path(s["checkpoint"])) == _master(ref_ckpt)   # nothing lost, nothing doubled
    # steps 3 and 4 ran twice: metrics.jsonl and TensorBoard hold one row a step, the replay's
    rows = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert {r["step"]: r["loss"] for r in rows} == ref_losses
    internals = [json.loads(x) for x in (Path(s["run_dir"]) / "worker.jsonl").read_text().splitlines()]
    assert [r["step"] for r in internals] == [1, 2, 3, 4, 5, 6] and "forward_s" in internals[0]
    assert not any(k.startswith("worker/") for r in rows for k in r)     # the internals apart
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(Path(s["run_dir"]) / "tb"))
    tb.Reload()
    points = tb.Scalars("train/loss")
    assert [p.step for p in points] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([p.value for p in points], [ref_losses[k] for k in range(1, 7)], rtol=1e-6)
    assert shm_files() == []


def test_a_killed_data_actor_is_replaced_without_losing_a_batch(reference_run, tmp_path):
    _, ref_losses, ref_ckpt = reference_run

    def kill(step, session):
        if step == 3:
            ray.kill(ray.get_actor(f"megaray:{session.run_id}:data", namespace=NAMESPACE), no_restart=True)

    s = train(_cfg(tmp_path, "checkpoint.resume=null"), on_step=kill)
    # the batches it had prefetched still arrive; at the latest the held-out batch finds it dead
    assert s["data_restarts"] == 1 and "restarts" not in s
    assert "started a new data actor" in (Path(s["run_dir"]) / "train.log").read_text()
    assert _losses(s) == ref_losses                             # the same rows, in the same order
    assert _master(Path(s["checkpoint"])) == _master(ref_ckpt)
    assert shm_files() == []


def test_corrupt_or_incomplete_checkpoint_falls_back_to_the_previous(reference_run, tmp_path):
    """resume: auto past a corrupt master (step 6) and a missing optimizer part (step 4) to step 2,
    each loaded over the same actors (the store's load of step 6 stops part way, shard 1's of
    step 4 fails, the others load those checkpoints whole): step 2's load leaves nothing of them,
    so steps 3..6 train bit for bit as the uninterrupted run did, to its very master bytes."""
    _, ref_losses, ref_ckpt = reference_run
    train(_cfg(tmp_path, "checkpoint.every=2", "checkpoint.keep=3"))
    root = tmp_path / "checkpoints" / "debug"
    newest, older = complete_checkpoints(root)[:2]
    data = bytearray((newest / "master.bin").read_bytes())
    data[100] ^= 0xFF
    (newest / "master.bin").write_bytes(bytes(data))
    (older / "optim-1.bin").unlink()
    s = train(_cfg(tmp_path))
    assert s["first_step"] == 3
    log = (Path(s["run_dir"]) / "train.log").read_text()
    assert "step-00000006/master.bin is corrupt" in log and "step-00000004/optim-1.bin is missing" in log
    assert {k: v for k, v in _losses(s).items() if k >= 3} == {k: v for k, v in ref_losses.items() if k >= 3}
    assert _master(Path(s["checkpoint"])) == _master(ref_ckpt)
    # an explicit path to a bad checkpoint is refused, naming the part
    data = bytearray((newest / "master.bin").read_bytes())
    data[100] ^= 0xFF
    (newest / "master.bin").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="master.bin"):
        train(_cfg(tmp_path, f"checkpoint.resume={newest}"))
    assert shm_files() == []


def test_every_checkpoint_damaged_is_refused_and_left_as_it_is(ray_cluster, tmp_path):
    """resume: auto with every checkpoint damaged (one bad block in each master.bin): the run
    fails before training, naming each checkpoint and its bad part, and the files stay byte for
    byte (issue 47, item 2); asked to (checkpoint.on_damaged: start_over), it trains from the
    initial weights in that folder."""
    train(_cfg(tmp_path, "checkpoint.every=2", "checkpoint.keep=3"))
    root = tmp_path / "checkpoints" / "debug"
    ckpts = complete_checkpoints(root)
    assert [p.name for p in ckpts] == ["step-00000006", "step-00000004", "step-00000002"]
    for p in ckpts:
        data = bytearray((p / "master.bin").read_bytes())
        data[100] ^= 0xFF
        (p / "master.bin").write_bytes(bytes(data))
    before = {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()
              and f.name != ".lock"}
    with pytest.raises(CheckpointError) as e:
        train(_cfg(tmp_path, "train.steps=8"))
    for p in ckpts:
        assert f"{p.name}: " in str(e.value) and f"{p.name}/master.bin is corrupt" in str(e.value)
    assert "checkpoint.on_damaged: start_over" in str(e.value)
    assert {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()
            and f.name != ".lock"} == before
    s = train(_cfg(tmp_path, "train.steps=8", "checkpoint.on_damaged=start_over"))
    assert s["first_step"] == 1 and s["status"] == "succeeded"
    assert shm_files() == []


def test_a_checkpoint_being_replaced_is_never_lost(reference_run, tmp_path):
    """A run that writes a step its folder already holds renames the old checkpoint aside and
    removes it only once the new one is in place; a crash between the two leaves the aside,
    which the next run puts back. A run resumed at its last step trains and writes nothing."""
    _, ref_losses, ref_ckpt = reference_run
    root = tmp_path / "checkpoints" / "debug"
    shutil.copytree(ref_ckpt.parent, root, ignore=shutil.ignore_patterns(".lock"))
    step6 = root / ref_ckpt.name
    manifest = (step6 / "manifest.json").read_bytes()
    # the moment between commit's two renames: the old one aside, the new one (here its master
    # altered, so taking it would show) still temporary, and the writer dead
    pid = dead_pid()
    shutil.copytree(step6, root / f"{step6.name}.tmp-{pid}")
    data = bytearray((root / f"{step6.name}.tmp-{pid}" / "master.bin").read_bytes())
    data[100] ^= 0xFF
    (root / f"{step6.name}.tmp-{pid}" / "master.bin").write_bytes(bytes(data))
    step6.rename(root / f"{step6.name}.old-{pid}")
    s = train(_cfg(tmp_path, "train.steps=6"))
    assert "put back" in (Path(s["run_dir"]) / "train.log").read_text()
    assert s["first_step"] == 7 and s["checkpoint"] == str(step6)
    assert (step6 / "manifest.json").read_bytes() == manifest          # loaded, not written again
    assert _master(step6) == _master(ref_ckpt)
    assert sorted(p.name for p in root.iterdir()) == [".lock", "lineage.json", step6.name]
    # a real replacement: step 6 corrupt, so the run starts over, as asked, and writes step 6 anew
    data = bytearray(_master(step6))
    data[100] ^= 0xFF
    (step6 / "master.bin").write_bytes(bytes(data))
    s = train(_cfg(tmp_path, "train.steps=6", "checkpoint.on_damaged=start_over"))
    assert s["first_step"] == 1 and _losses(s) == ref_losses
    assert _master(step6) == _master(ref_ckpt) and Checkpoint(step6).manifest["run_id"] == s["run_id"]
    assert sorted(p.name for p in root.iterdir()) == [".lock", "lineage.json", step6.name]


def test_full_disk_keeps_the_previous_checkpoint_and_fails_the_run(ray_cluster, tmp_path):
    """A checkpoint that does not fit fails cleanly and the older one stays; the run whose
    final state could not be saved does not report success, and says what is left."""
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=560k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        with pytest.raises(CheckpointError, match="last good checkpoint is .*step-00000002") as e:
            train(_cfg(tmp_path, "train.steps=4", "checkpoint.every=2", "checkpoint.keep=5",
                       f"checkpoint.dir={disk}"))
        assert "step 4 could not be written" in str(e.value)
        (summary,) = [json.loads(p.read_text()) for p in tmp_path.glob("debug-*/summary.json")]
        assert summary["status"] == "failed" and summary["last_good_checkpoint"].endswith("step-00000002")
        (only,) = complete_checkpoints(disk)
        assert only.name == "step-00000002"
        for name, part in Checkpoint(only).manifest["parts"].items():
            assert [zlib.crc32((only / name).read_bytes())] == part["crc32"]
        assert not list(disk.glob("*.tmp-*"))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_nonfinite_step_is_skipped_without_touching_weights_or_moments(ray_cluster, tmp_path):
    seen = {}

    def grab(step, session):
        if step in (2, 3):
            seen[step] = session.state_dict()
            shards = [a for k, a in session.actors.items() if k.startswith("optimizer-")]
            seen[f"opt{step}"] = ray.get([a.optimizer_state.remote() for a in shards])

    s = train(_cfg(tmp_path, "debug.nonfinite_steps=[2]"), on_step=grab)
    rows = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [False, False, True, False, False, False]
    for k, v in seen[2].items():
        np.testing.assert_array_equal(seen[3][k], v)           # step 2 changed no weight
    for a, b in zip(seen["opt2"], seen["opt3"]):
        assert a and set(a) == set(b)
        for i in a:
            for key in a[i]:
                assert np.array_equal(np.asarray(a[i][key]), np.asarray(b[i][key])), key
    assert "step 3 skipped" in (Path(s["run_dir"]) / "train.log").read_text()      # debug.nonfinite_steps is 0-based


def test_too_many_nonfinite_steps_in_a_row_stop_the_run(ray_cluster, tmp_path):
    with pytest.raises(TrainingDiverged, match="3 consecutive"):
        train(_cfg(tmp_path, "debug.nonfinite_steps=[1, 2, 3]", "train.max_skipped_steps=3"))
    assert shm_files() == []


def _wait_for_steps(tmp_path, proc):
    wait_for_steps(proc, lambda: list(tmp_path.glob("debug-*/train.log")), 5)


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(tmp_path, train_cli):
    proc = train_cli("train.steps=100000", "checkpoint.every=0")
    _wait_for_steps(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 143, out
    (summary,) = [json.loads(p.read_text()) for p in tmp_path.glob("debug-*/summary.json")]
    assert summary["status"] == "stopped"
    (ck,) = complete_checkpoints(tmp_path / "checkpoints" / "debug")
    assert Checkpoint(ck).step == summary["stopped_at_step"]
    assert shm_files(pid=proc.pid) == []


def test_sigkilled_driver_leaves_files_a_later_run_removes(tmp_path, train_cli):
    proc = train_cli("train.steps=100000")
    _wait_for_steps(tmp_path, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    left = shm_files(pid=proc.pid)
    assert left, "expected the killed run's shared-memory files"
    removed = remove_stale("/dev/shm")
    assert {os.path.basename(p) for p in removed} >= set(left)
    assert shm_files(pid=proc.pid) == []
    subprocess.run(["pkill", "-9", "-f", "megaray.pipelines.train debug train.steps=100000"], capture_output=True)


def test_a_run_that_does_not_exit_is_shown_and_killed_with_its_ray(tmp_path, train_cli):
    """The guard the signal tests rely on: a run still going at ``finish``'s deadline fails the
    test with its threads' stacks, and neither it nor any process of its local Ray is left."""
    proc = train_cli("train.steps=100000")
    _wait_for_steps(tmp_path, proc)
    tree = conftest._descendants(proc.pid)
    assert any("raylet" in _cmdline(pid) for pid in tree)
    with pytest.raises(AssertionError, match="did not exit within 1 s") as failed:
        finish(proc, timeout=1)
    assert "Thread 0x" in str(failed.value) and "megaray" in str(failed.value)   # faulthandler's dump
    deadline = time.monotonic() + 60                                 # SIGKILLed: gone once reaped
    while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in tree if _alive(pid)] == []
    assert shm_files(pid=proc.pid) == []


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that is already gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
