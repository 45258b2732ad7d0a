"""Never lose a run, never report success for one that was lost: the cases a careless or
hostile user met (issue 19), each with the exit status or error, the message, and what is on
disk afterwards. Disks that fill up or refuse writes are real small tmpfs mounts."""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import dead_pid, finish, shm_files, wait_for_steps

from megaray.checkpoint import Checkpoint, Checkpointer, complete_checkpoints
from megaray.dataset import ShardDataset
from megaray.driver.runner import train
from megaray.errors import CheckpointError, ConfigError, DataError
from megaray.leftovers import process_start
from megaray.loader import load_config
from megaray.prepare import PrepareOptions, prepare

BASE = ["train.steps=4", "train.log_every=1", "train.eval_batches=1", "data.max_bytes=50000", "checkpoint.every=2"]


def _cfg(tmp: Path, *extra: str):
    return load_config("debug", [*BASE, f"run.dir={tmp}", *extra])


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file of a checkpoint folder (the lock file only names who holds the folder now)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@contextlib.contextmanager
def _mount(path: Path, options: str):
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


# 1 -------------------------------------------------------------------------------------------
def test_a_checkpoint_folder_of_another_model_is_refused_and_left_alone(ray_cluster, tmp_path):
    train(_cfg(tmp_path, "run.name=x"))
    folder = tmp_path / "checkpoints" / "x"
    before = _tree(folder)
    with pytest.raises(CheckpointError, match=r"belongs to another model \(model.num_hidden_layers: 2 there, 3 here"):
        train(_cfg(tmp_path, "run.name=x", "model.num_hidden_layers=3", "train.steps=6"))
    assert _tree(folder) == before                              # nothing deleted, nothing overwritten
    # starting fresh is explicit, and lands in a folder of its own
    s = train(_cfg(tmp_path, "run.name=x", "model.num_hidden_layers=3", "checkpoint.resume=null"))
    assert Path(s["checkpoint"]).parent.name == s["run_id"] and _tree(folder) == before
    assert shm_files() == []


def test_resuming_from_an_older_checkpoint_of_the_same_folder_is_refused(ray_cluster, tmp_path):
    """Going on from step 2 in the folder that holds step 4 would write over it."""
    train(_cfg(tmp_path, "run.name=x"))
    folder = tmp_path / "checkpoints" / "x"
    before = _tree(folder)
    with pytest.raises(ConfigError, match=r"checkpoint.resume.*step-00000002 is older than step-00000004 in the "
                                          r"same folder"):
        train(_cfg(tmp_path, f"checkpoint.dir={folder}", f"checkpoint.resume={folder / 'step-00000002'}"))
    assert _tree(folder) == before
    with open(folder / ".lock") as f:                           # the refused run holds the folder no more
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    # from a folder of its own, it goes on from step 2
    s = train(_cfg(tmp_path, f"checkpoint.resume={folder / 'step-00000002'}"))
    assert s["first_step"] == 3 and Path(s["checkpoint"]).parent.name == s["run_id"] and _tree(folder) == before


def test_a_fresh_run_never_writes_into_another_runs_checkpoint_folder(ray_cluster, tmp_path):
    """Run A writes into checkpoint.dir X; run B (the same model, another seed) with the same X
    and checkpoint.resume: null is refused before any actor starts, naming the folder and what
    to do, and A's checkpoints stay as they were (issue 47, item 1); so is a run that starts
    from a checkpoint elsewhere. Continuing A there (resume: auto) is what the folder is for."""
    folder = tmp_path / "shared-ckpts"
    a = train(_cfg(tmp_path, f"checkpoint.dir={folder}", "checkpoint.resume=null"))
    before = _tree(folder)
    elsewhere = tmp_path / "elsewhere" / Path(a["checkpoint"]).name        # a checkpoint of another folder
    shutil.copytree(a["checkpoint"], elsewhere)
    for resume in ("null", elsewhere):
        with pytest.raises(ConfigError, match=r"checkpoint.dir.*holds another run's checkpoints \(newest "
                                              r"step-00000004\).*checkpoint.resume: auto"):
            train(_cfg(tmp_path, f"checkpoint.dir={folder}", f"checkpoint.resume={resume}", "run.seed=7"))
        assert _tree(folder) == before
    s = train(_cfg(tmp_path, f"checkpoint.dir={folder}", "checkpoint.resume=auto", "train.steps=6"))
    assert s["first_step"] == 5 and Path(s["checkpoint"]).parent == folder
    assert shm_files() == []


# 2 -------------------------------------------------------------------------------------------
def test_a_read_only_checkpoint_folder_fails_before_training(ray_cluster, tmp_path):
    with _mount(tmp_path / "ro", "size=1m,ro") as ro:
        t0 = time.perf_counter()
        with pytest.raises(CheckpointError, match="cannot use the checkpoint folder .*ro"):
            train(_cfg(tmp_path, f"checkpoint.dir={ro}"))
        (run,) = tmp_path.glob("debug-*")
        assert (run / "metrics.jsonl").read_text() == ""        # not one step trained for nothing
        assert json.loads((run / "summary.json").read_text())["status"] == "failed"
        assert time.perf_counter() - t0 < 60


# 3 -------------------------------------------------------------------------------------------
def test_data_without_held_out_rows_trains_saves_and_says_so(ray_cluster, tmp_path):
    (tmp_path / "in.txt").write_text("abcdefgh " * 4000)
    prepare([str(tmp_path / "in.txt")], str(tmp_path / "shards"), PrepareOptions(seq_len=32, holdout_fraction=0))
    s = train(_cfg(tmp_path, "data.source=shards", f"data.path={tmp_path / 'shards'}", "train.seq_len=32"))
    assert s["status"] == "succeeded" and s["heldout_loss"] is None
    assert Checkpoint(s["checkpoint"]).step == 4
    assert "no held-out loss is measured" in (Path(s["run_dir"]) / "train.log").read_text()


# 4 -------------------------------------------------------------------------------------------
def test_every_part_is_verified_with_fallback(ray_cluster, tmp_path):
    train(_cfg(tmp_path, "checkpoint.keep=3"))
    newest = complete_checkpoints(tmp_path / "checkpoints" / "debug")[0]
    data = bytearray((newest / "trainer.json").read_bytes())
    data[data.index(b'"next_step": 4')+13] = ord("3")               # the same size, one digit changed
    (newest / "trainer.json").write_bytes(bytes(data))
    s = train(_cfg(tmp_path, "train.steps=6"))
    assert s["first_step"] == 3                                   # fell back to step 2
    assert "trainer.json is corrupt" in (Path(s["run_dir"]) / "train.log").read_text()


# 5 -------------------------------------------------------------------------------------------
def test_a_gpu_run_without_a_gpu_fails_at_once(ray_cluster, tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="worker.device.*needs 1 GPU.*has 0"):
        train(_cfg(tmp_path, "worker.device=cuda"))
    assert time.perf_counter() - t0 < 60 and shm_files() == []


# 6 -------------------------------------------------------------------------------------------
def test_a_second_live_run_of_the_same_name_is_refused(ray_cluster, tmp_path):
    cfg = _cfg(tmp_path, "run.name=twin")
    holder = Checkpointer(cfg, "twin-live", logging.getLogger("test"))      # a live run holds the folder
    try:
        with pytest.raises(CheckpointError, match="in use by a live run \\(run twin-live"):
            train(cfg)
        assert complete_checkpoints(holder.root) == []
    finally:
        holder.close()
    assert train(cfg)["status"] == "succeeded"                   # once it is gone the folder is free


# 7 -------------------------------------------------------------------------------------------
def test_resuming_past_train_steps_is_refused(ray_cluster, tmp_path):
    train(_cfg(tmp_path, "run.name=y"))
    folder = tmp_path / "checkpoints" / "y"
    before = _tree(folder)
    with pytest.raises(ConfigError, match="train.steps.*2 is below the step of .*step-00000004"):
        train(_cfg(tmp_path, "run.name=y", "train.steps=2"))
    p = _cli("train", "debug", *BASE, f"run.dir={tmp_path}", "run.name=y", "train.steps=2")
    assert p.returncode == 2 and "2 is below the step of" in p.stderr, p.stderr
    assert "Started a local Ray" not in p.stderr                       # refused before Ray starts
    assert _tree(folder) == before


def test_resuming_into_narrower_moments_is_refused_unless_asked_and_logged(ray_cluster, tmp_path):
    """Issue 47 item 7: fp32 moments resumed as bf16 are refused (they would be rounded for
    good), resumed with checkpoint.narrow_moments and logged; bf16 into fp32 is logged, exact."""
    train(_cfg(tmp_path, "run.name=m"))
    folder = tmp_path / "checkpoints" / "m"
    before = _tree(folder)
    with pytest.raises(ConfigError, match="optim.moment_dtype.*float32.*bfloat16.*narrow_moments"):
        train(_cfg(tmp_path, "run.name=m", "train.steps=6", "optim.moment_dtype=bfloat16"))
    assert _tree(folder) == before
    s = train(_cfg(tmp_path, "run.name=m", "train.steps=6", "optim.moment_dtype=bfloat16",
                   "checkpoint.narrow_moments=true"))
    log = (Path(s["run_dir"]) / "train.log").read_text()
    assert "converted to bfloat16 (optim.moment_dtype), rounded" in log and s["first_step"] == 5
    s = train(_cfg(tmp_path, "run.name=m", "train.steps=8"))
    log = (Path(s["run_dir"]) / "train.log").read_text()
    assert "are bfloat16: converted to float32 (optim.moment_dtype), exactly" in log


# 8 -------------------------------------------------------------------------------------------
def _hf_dir(tmp: Path, cfg) -> str:
    d = tmp / "hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("hf, words", [
    ([1, 2], "holds a JSON list"),
    ({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 4}, "lacks the required key.*intermediate_size"),
    ({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 0, "intermediate_size": 64}, "num_attention_heads=0 must be positive"),
], ids=["list", "missing-key", "zero-heads"])
def test_bad_model_config_json_is_a_named_error(tmp_path, hf, words):
    with pytest.raises(ConfigError, match=f"model.from.*{words}"):
        load_config("debug", [f"model.from={_hf_dir(tmp_path, hf)}"])


@pytest.mark.parametrize("override, key", [
    ("cluster.num_cpus=-2", "cluster.num_cpus"), ("cluster.object_store_mb=-5", "cluster.object_store_mb"),
    ("run.seed=-1", "run.seed"), ("run.name=../../etc", "run.name"), ("train.eval_batches=-3", "train.eval_batches"),
    ("optim.lr=.inf", "optim.lr"),
])
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config("debug", [override])
    assert e.value.key == key
    if key == "optim.lr":
        assert "must be a finite number" in str(e.value)


def _shards(tmp: Path) -> Path:
    (tmp / "in.txt").write_text("the quick brown fox " * 2000)
    out = tmp / "shards"
    prepare([str(tmp / "in.txt")], str(out), PrepareOptions(seq_len=32, holdout_fraction=0.1))
    return out


@pytest.mark.parametrize("lie, words", [
    ({"heldout_rows": 10**6}, "'heldout_rows' .* leaves no training rows"),
    ({"shards": [{"file": "shard-99999.arrow", "rows": 3}]}, "names shard-99999.arrow, which is not in"),
    ({"shards": "all of them"}, "'shards' must be a non-empty list"),
    ({"rows": "+5"}, "'rows' says .*, the shards hold"),
], ids=["heldout", "missing-shard", "shards-not-a-list", "rows"])
def test_a_lying_shard_manifest_is_a_named_error(ray_cluster, tmp_path, lie, words):
    out = _shards(tmp_path)
    m = json.loads((out / "manifest.json").read_text())
    m.update({k: m[k] + int(v) if isinstance(v, str) and v.startswith("+") else v for k, v in lie.items()})
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match=words) as e:
        ShardDataset(str(out), 32, 256, 0)
    assert "manifest.json" in str(e.value)


def test_a_read_only_run_dir_is_a_named_error(ray_cluster, tmp_path):
    with _mount(tmp_path / "ro", "size=1m,ro") as ro:
        with pytest.raises(ConfigError, match="run.dir.*cannot write the run directory"):
            train(_cfg(ro))
    assert shm_files() == []


# 9 -------------------------------------------------------------------------------------------
def test_what_users_write_is_understood(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  eps: 1e-8\n  lr: 3e-4\n")               # YAML 1.1 reads both as strings
    cfg = load_config(str(p))
    assert cfg.optim.eps == 1e-8 and cfg.optim.lr == 3e-4
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="empty.yaml is empty"):
        load_config(str(tmp_path / "empty.yaml"))


def test_the_bad_row_hint_names_the_flag(ray_cluster, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(DataError, match="in.jsonl line 2.*--on-bad-row skip"):
        prepare([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), PrepareOptions(seq_len=32))


# 10 ------------------------------------------------------------------------------------------
def _cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaray.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, RAY_AUTH_MODE="disabled", **(env or {})))


def test_plan_on_the_cpu_counts_what_train_counts():
    p = _cli("plan", "debug", "worker.device=cpu")
    assert p.returncode == 0, p.stderr
    assert "step gradients held by the worker (CPU device)" in p.stdout
    deep = _cli("plan", "debug", "model.num_hidden_layers=100000", "worker.device=cpu")
    assert "host memory" in deep.stdout, deep.stderr        # a deep model's plan answers (not minutes of walk)


# 11 ------------------------------------------------------------------------------------------
def test_binary_text_is_refused_and_a_stray_byte_is_counted(ray_cluster, tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "noise.txt").write_bytes(rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    with pytest.raises(DataError, match="noise.txt: .* bytes are not valid UTF-8.*--on-bad-row skip"):
        prepare([str(tmp_path / "noise.txt")], str(tmp_path / "a"), PrepareOptions(seq_len=32))
    (tmp_path / "text.txt").write_bytes(("plain words " * 2000).encode() + b"\xff")
    m = prepare([str(tmp_path / "noise.txt"), str(tmp_path / "text.txt")], str(tmp_path / "b"),
                PrepareOptions(seq_len=32, on_bad_row="skip"))
    assert m["skipped"] == {"not UTF-8 text": 1} and m["undecodable_bytes"] == 1
    assert m["documents"] == 1


# 12 ------------------------------------------------------------------------------------------
def test_megaray_clean_removes_only_dead_runs_files(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"megaray_{dead}_r-1_master").write_bytes(b"x")
    (tmp_path / f"megaray_{os.getpid()}_r-2_master").write_bytes(b"x")
    p = _cli("clean", "--shm-dir", str(tmp_path))
    assert p.returncode == 0 and "removed 1 shared-memory file" in p.stdout
    assert sorted(f.name for f in tmp_path.iterdir()) == [f"megaray_{os.getpid()}_r-2_master"]


def test_ctrl_c_twice_still_cleans_up(tmp_path, train_cli):
    proc = train_cli("train.steps=100000")
    wait_for_steps(proc, lambda: list(tmp_path.glob("debug-*/train.log")), 3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)       # impatient: again, during the step, the save or the cleanup
    out = finish(proc)
    assert proc.returncode == 130, out
    assert shm_files(pid=proc.pid) == []
    (summary,) = [json.loads(p.read_text()) for p in tmp_path.glob("debug-*/summary.json")]
    assert summary["status"] in ("interrupted", "stopped"), summary   # stopped: the save came first


def test_ctrl_c_saves_and_prints_the_command_that_resumes(ray_cluster, tmp_path, train_cli):
    """Issue 47 item 3: one Ctrl-C ends the step, writes a checkpoint and exits 130 with the
    exact command that goes on; that command resumes from the checkpoint (the demo-like
    resume: null, whose checkpoints sit in a folder of the run's own)."""
    proc = train_cli("train.steps=100000", "checkpoint.resume=null")
    wait_for_steps(proc, lambda: list(tmp_path.glob("debug-*/train.log")), 3)
    proc.send_signal(signal.SIGINT)
    out = finish(proc)
    assert proc.returncode == 130, out
    (summary,) = [json.loads(p.read_text()) for p in tmp_path.glob("debug-*/summary.json")]
    stopped = summary["stopped_at_step"]
    assert summary["status"] == "stopped" and summary["stopped_by"] == "Ctrl-C (SIGINT)" and stopped >= 3
    assert Checkpoint(summary["checkpoint"]).step == stopped and shm_files(pid=proc.pid) == []
    command = out.split("resume with:\n", 1)[1].splitlines()[0].split()
    assert command[:3] == ["python", "-m", "megaray.pipelines.train"]
    cfg = load_config(command[3], [*command[4:], f"train.steps={stopped + 1}"])
    s = train(cfg)
    assert s["first_step"] == stopped + 1 and s["status"] == "succeeded"
    assert f"resumed from {summary['checkpoint']} (step {stopped})" in (Path(s["run_dir"]) / "train.log").read_text()


def test_a_killed_driver_is_marked_killed_by_clean_and_by_the_next_run(ray_cluster, tmp_path, train_cli):
    """Issue 47 item 4: kill -9 of the driver leaves summary.json at 'running'; `megaray clean
    --run-dir` marks it killed with its last step and checkpoint, and so does the next run
    that opens the run folder (here a summary of a driver that is gone, written as a run
    writes it)."""
    proc = train_cli("train.steps=100000", "checkpoint.every=2")
    wait_for_steps(proc, lambda: list(tmp_path.glob("debug-*/train.log")), 4)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    (path,) = tmp_path.glob("debug-*/summary.json")
    assert json.loads(path.read_text())["status"] == "running"
    p = _cli("clean", "--run-dir", str(tmp_path), "--shm-dir", str(tmp_path))
    assert p.returncode == 0 and "marked killed" in p.stdout, p.stdout + p.stderr
    s = json.loads(path.read_text())
    rows = (path.parent / "metrics.jsonl").read_text().splitlines()
    assert s["status"] == "killed" and s["last_step"] == json.loads(rows[-1])["step"] >= 4
    assert s["last_good_step"] == Checkpoint(s["last_good_checkpoint"]).step >= 2
    again = _cli("clean", "--run-dir", str(tmp_path), "--shm-dir", str(tmp_path))
    assert "marked killed" not in again.stdout                       # once
    subprocess.run(["pkill", "-9", "-f", f"run.dir={tmp_path}"], capture_output=True)

    gone = tmp_path / "other"
    (gone / "old-run").mkdir(parents=True)
    (gone / "old-run" / "summary.json").write_text(json.dumps({
        "run_id": "old-run", "run_dir": str(gone / "old-run"), "status": "running",
        "driver": {"host": socket.gethostname(), "pid": dead_pid(), "started": "1"}}))
    live = {**json.loads((gone / "old-run" / "summary.json").read_text()), "run_id": "live-run",
            "driver": {"host": socket.gethostname(), "pid": os.getpid(), "started": process_start(os.getpid())}}
    (gone / "live-run").mkdir()
    (gone / "live-run" / "summary.json").write_text(json.dumps(live))
    train(load_config("debug", [*BASE, f"run.dir={gone}", "train.steps=1", "checkpoint.every=0"]))
    assert json.loads((gone / "old-run" / "summary.json").read_text())["status"] == "killed"
    assert json.loads((gone / "live-run" / "summary.json").read_text())["status"] == "running"


def test_errors_before_ray_are_one_line_with_their_exit_status(tmp_path):
    """The CLI's last tracebacks (issue 47): a missing shm folder, a GPU asked for on a
    machine without one, a Ray cluster that cannot be reached; each one line, no traceback."""
    plan = _cli("plan", "debug", "cluster.shm_dir=/nonexistent")
    assert plan.returncode == 2 and "config key 'cluster.shm_dir'" in plan.stderr, plan.stderr
    train_args = ("train", "debug", f"run.dir={tmp_path}", "data.max_bytes=50000", "train.steps=2")
    if not _has_gpu():
        gpu = _cli(*train_args, "worker.device=cuda")
        assert gpu.returncode == 2 and "config key 'worker.device'" in gpu.stderr, gpu.stderr
        assert "Started a local Ray" not in gpu.stderr                      # refused before Ray starts
    ray_gone = _cli(*train_args, env={"RAY_ADDRESS": "localhost:notaport"})         # a typo of the address
    assert ray_gone.returncode == 1, ray_gone.stderr
    assert "cannot start or reach the Ray cluster at RAY_ADDRESS=localhost:notaport" in ray_gone.stderr
    for p in (plan, ray_gone):
        assert "Traceback" not in p.stderr, p.stderr


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def test_a_stop_checkpoint_survives_other_runs_of_the_same_name(ray_cluster, tmp_path, train_cli):
    """`ray job stop` of a second launch of a fresh-starting config (the demo's resume: null)
    keeps its stop checkpoint: each such launch has a checkpoint folder of its own, and pruning
    only ever touches the run's own folder (issue 21)."""
    first = train(_cfg(tmp_path, "run.name=demo", "checkpoint.resume=null", "train.steps=6", "checkpoint.keep=1"))
    before = _tree(Path(first["checkpoint"]).parent)
    proc = train_cli("run.name=demo", "checkpoint.resume=null", "checkpoint.keep=1", "train.steps=100000")
    wait_for_steps(proc, lambda: [p for p in tmp_path.glob("demo-*/train.log") if first["run_id"] not in str(p)], 2)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 143, out
    (second,) = [json.loads(p.read_text()) for p in tmp_path.glob("demo-*/summary.json")
                 if json.loads(p.read_text())["run_id"] != first["run_id"]]
    (stop,) = complete_checkpoints(Path(second["checkpoint_dir"]))
    assert Checkpoint(stop).step == second["stopped_at_step"]                # kept, whatever the first run holds
    assert _tree(Path(first["checkpoint"]).parent) == before


def test_a_dead_raylet_is_named_not_a_raw_ray_error(tmp_path):
    code = (
        "import os, signal, time, ray\n"
        "from megaray.loader import load_config\n"
        "from megaray.driver.session import TrainingSession\n"
        "from megaray.errors import MegarayError\n"
        "ray.init(address='local', num_cpus=4, include_dashboard=False, log_to_driver=False)\n"
        "raylet = ray._private.worker._global_node.all_processes['raylet'][0].process\n"
        "os.kill(raylet.pid, signal.SIGKILL)\n"
        "time.sleep(2)\n"
        "try:\n"
        "    TrainingSession(load_config('debug')).start()\n"
        "    print('STARTED')\n"
        "except MegarayError as e:\n"
        "    print('MEGARAY', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, RAY_AUTH_MODE="disabled"), cwd=tmp_path)
    out = r.stdout
    assert "MEGARAY" in out and "raylet" in out, out + r.stderr[-2000:]
