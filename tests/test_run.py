"""End-to-end runs on a real local Ray cluster: the demo, injected crashes, cleanup."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml
from conftest import shm_files

from megaray.driver.runner import train
from megaray.driver.session import NAMESPACE, TrainingSession
from megaray.errors import ActorFailure
from megaray.loader import load_config
from megaray.shm import PREFIX, remove_stale


def _assert_gone(run_id: str, roles) -> None:
    for role in roles:
        with pytest.raises(ValueError):
            ray.get_actor(f"megaray:{run_id}:{role}", namespace=NAMESPACE)
    assert shm_files(run_id) == []


def test_demo_config_trains_end_to_end(ray_cluster, tmp_path):
    cfg = load_config("demo", ["train.steps=6", "train.log_every=2", "train.eval_batches=1",
                               "data.max_bytes=300000", f"run.dir={tmp_path}", "train.seq_len=64"])
    summary = train(cfg)
    run_dir = tmp_path / summary["run_id"]
    assert summary["status"] == "succeeded"
    assert summary["last_loss"] < summary["first_loss"]
    assert (run_dir / "config.yaml").is_file()
    assert load_config(run_dir / "config.yaml") == cfg           # the resolved config reloads as itself
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "succeeded"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 4, 6]                # steps counted from 1, as in the log
    assert "step 6/6" in (run_dir / "train.log").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tb"))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    from megaray.step import STEP_GAUGES

    for name in STEP_GAUGES:                                        # one name in metrics.jsonl, TB and Prometheus
        assert f"train/{name}" in tags and name in rows[0], name
    assert "eval/loss" in tags and [e.step for e in ea.Scalars("eval/loss")] == [6]
    losses = [(e.step, e.value) for e in ea.Scalars("train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    assert "config" in "".join(ea.Tags()["tensors"])
    _assert_gone(summary["run_id"], ["store", "scheduler", "worker", "optimizer-0", "optimizer-1"])


@pytest.mark.parametrize("actor, step", [("optimizer", 2), ("worker", 1)])
def test_crash_mid_run_ends_run_and_leaves_nothing(ray_cluster, actor, step):
    cfg = load_config("debug", [f"debug.crash_actor={actor}", f"debug.crash_step={step}"])
    s = TrainingSession(cfg)
    try:
        s.start()
        with pytest.raises(ActorFailure) as e:
            for i in range(cfg.train.steps):
                tokens = __import__("numpy").random.default_rng(i).integers(0, 256, (2, 2, 33))
                s.train_step(i, tokens)
        assert "injected crash" in str(e.value)
        assert actor in e.value.actor
        # The failure surfaced in the step that crashed or, for a deferred update, the next one.
        assert e.value.step == step
    finally:
        s.close()
    _assert_gone(s.run_id, ["store", "scheduler", "worker", "optimizer-0", "optimizer-1"])


def test_clipping_off_updates_during_backward(ray_cluster):
    """With clipping off, shards update as gradients land; results still train."""
    cfg = load_config("debug", ["optim.clip_grad_norm=null", "optim.num_shards=3"])
    import numpy as np

    with TrainingSession(cfg) as s:
        before = s.state_dict()
        ms = [s.train_step(i, np.random.default_rng(i).integers(0, 256, (2, 2, 33))) for i in range(3)]
        after = s.state_dict()
    assert all(m["clip_coefficient"] == 1.0 for m in ms)
    assert all(np.abs(after[k] - before[k]).max() > 0 for k in before)


def test_stale_shared_memory_of_dead_runs_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"{PREFIX}{dead_pid}_old-run_master"
    live = tmp_path / f"{PREFIX}{os.getpid()}_live-run_master"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    removed = remove_stale(str(tmp_path))
    assert removed == [str(stale)]
    assert live.exists() and not stale.exists()


def test_train_cli_runs_demo_in_a_fresh_process(tmp_path):
    """`megaray train` in a fresh process (its own local Ray), launched from the source
    checkout's root with a run folder relative to it: the workers do not import the
    checkout's megaray/ (no actors/ in it) in place of the installed package, and the run
    folder is where the user pointed, not under the workers' folder."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    p = subprocess.run([str(Path(sys.executable).parent / "megaray"), "train", "demo", "train.steps=3",
                        "data.max_bytes=100000", "train.seq_len=32", "train.eval_batches=1",
                        f"run.dir={os.path.relpath(tmp_path, root)}", "cluster.num_cpus=4", "worker.threads=1"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=root)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step 3/3" in p.stderr
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("demo-")]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "succeeded" and s["first_step"] == 1
    # the end says where everything is and what goes on from it (the demo starts fresh: its
    # checkpoints are in a folder of the run's own, which the command to train on names)
    said = p.stdout
    assert f"run {s['run_id']} finished: steps 1..3, loss " in said and "tokens/s" in said
    assert f"final checkpoint {s['checkpoint']}" in said and f"megaray export {s['checkpoint']} OUT_DIR" in said
    assert f"checkpoint.resume=auto checkpoint.dir={Path(s['checkpoint']).parent} train.steps=N" in said
    assert f"run.dir={tmp_path} " in said           # as it resolved: the command works from any folder
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["dir"] == str(tmp_path)


def test_the_store_shows_how_far_its_weights_have_come_while_it_starts(ray_cluster, monkeypatch, caplog):
    """While the store initialises, the driver logs the share of the values written, read
    from the store's counter in shared memory; the counter ends at the model's size. Then,
    while the worker and the shards start, it names those not ready yet."""
    import logging
    import re

    from megaray.actors.store import read_startup, startup_path
    from megaray.driver import session as session_mod

    monkeypatch.setattr(session_mod, "STARTUP_REPORT_S", 0.01)
    cfg = load_config("debug", ["model.hidden_size=1024", "model.intermediate_size=4096", "model.num_hidden_layers=4"])
    n = cfg.model.num_params()
    with caplog.at_level(logging.INFO, logger="megaray"), TrainingSession(cfg) as s:
        assert read_startup(startup_path(cfg.cluster.shm_dir, os.getpid(), s.run_id)) == (n, n)
    shares = [float(m[1]) for r in caplog.records
              if (m := re.fullmatch(rf"parameter store: (\d+)% of {n / 1e9:.2f} B values initialised at \d+ s",
                                    r.getMessage()))]
    assert shares and shares == sorted(shares) and 0 <= shares[0] and shares[-1] <= 100
    # then the actors still starting are named, the worker (its buffers) first
    starting = [m for r in caplog.records if (m := re.fullmatch(r"still starting at \d+ s: (.*)", r.getMessage()))]
    assert starting and starting[0][1] == "worker"
    assert {role for m in starting for role in m[1].split(", ")} <= {"worker", "scheduler", "data"} | {
        f"optimizer-{k}" for k in range(cfg.optim.num_shards)}
    assert shm_files(s.run_id) == []


def test_the_command_that_goes_on_works_from_any_folder(tmp_path, monkeypatch):
    """``resume_command``: a config file's path and every path the run read, absolute as they
    resolved where the command ran (a relative data.path and run.dir typed there), the
    checkpoint words appended; a shipped config's name stays a name."""
    from megaray.driver.runner import resume_command
    from megaray.loader import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("run:\n  name: mine\nmodel:\n  shape: debug\n")
    over = ["run.dir=runs", "data.path=shards", "data.source=shards", "train.steps=5"]
    cfg = load_config("mine.yaml", over)
    got = resume_command(cfg, ["megaray", "train"], "mine.yaml", over, tmp_path / "ck")
    assert got == ["megaray", "train", str(tmp_path / "mine.yaml"), "data.source=shards", "train.steps=5",
                   f"run.dir={tmp_path / 'runs'}", f"data.path={tmp_path / 'shards'}",
                   f"checkpoint.dir={tmp_path / 'ck'}"]
    demo = load_config("demo", [])
    assert resume_command(demo, ["megaray", "train"], "demo", [], tmp_path / "ck")[2] == "demo"
