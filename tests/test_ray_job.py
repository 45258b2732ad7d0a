"""megaray as a Ray job on a real head started with `ray start --head`.

The module starts one head (dashboard, job server, Prometheus metrics export) from the
environment megaray is installed in, submits the train pipeline with `ray job submit
--working-dir` as a user does (a folder holding the user's YAML), scrapes the metrics endpoint
while the job runs, reads `ray job logs`, and stops the head with `ray stop`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
ENV = dict(os.environ, RAY_AUTH_MODE="disabled")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    gcs, dash, metrics = _free_port(), _free_port(), _free_port()
    p = _ray("start", "--head", f"--port={gcs}", f"--dashboard-port={dash}", f"--metrics-export-port={metrics}",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--num-cpus=6", "--num-gpus=0",
             "--object-store-memory=200000000", "--disable-usage-stats", timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    prom = None
    try:
        info = {"address": f"http://127.0.0.1:{dash}", "metrics": f"http://127.0.0.1:{metrics}/metrics",
                "prometheus": None, "gcs": f"127.0.0.1:{gcs}"}
        if shutil.which("prometheus"):     # Debian's prometheus, scraping the head as a user would set it up
            d = tmp_path_factory.mktemp("prometheus")
            port = _free_port()
            (d / "prometheus.yml").write_text(
                "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: ray\n    static_configs:\n"
                f"      - targets: ['127.0.0.1:{metrics}']\n")
            prom = subprocess.Popen(["prometheus", f"--config.file={d / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            info["prometheus"] = f"http://127.0.0.1:{port}"
            t0 = time.time()
            while time.time() - t0 < 60:
                try:
                    urllib.request.urlopen(f"{info['prometheus']}/-/ready", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)
        yield info
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        _ray("stop", "--force", timeout=120)


def _submit(head, sid: str, *args: str, workdir: Path) -> None:
    """Submit the train pipeline from ``workdir`` (the user's folder: ``my.yaml`` is the demo
    config as a user would copy it)."""
    workdir.mkdir(exist_ok=True)
    (workdir / "my.yaml").write_text((ROOT / "configs" / "demo.yaml").read_text())
    t0 = time.time()
    while True:   # right after `ray start` the job agent may not be up yet ("try again later")
        p = _ray("job", "submit", "--address", head["address"], "--working-dir", str(workdir), "--submission-id",
                 sid, "--metadata-json", json.dumps({"job_name": f"megaray {sid}"}), "--no-wait", "--",
                 sys.executable, "-m", "megaray.pipelines.train", *args)
        if p.returncode == 0 or "try again later" not in p.stderr + p.stdout or time.time() - t0 > 120:
            break
        time.sleep(3)
    assert p.returncode == 0, p.stdout + p.stderr


def _status(head, sid: str) -> str:
    out = _ray("job", "status", sid, "--address", head["address"]).stdout + ""
    m = re.findall(r"\b(PENDING|RUNNING|SUCCEEDED|FAILED|STOPPED|succeeded|failed|stopped)\b", out)
    return m[-1].upper() if m else "UNKNOWN"


def _wait(head, sid: str, timeout: float = 300) -> str:
    t0 = time.time()
    while time.time() - t0 < timeout:
        s = _status(head, sid)
        if s in ("SUCCEEDED", "FAILED", "STOPPED"):
            return s
        time.sleep(2)
    raise AssertionError(f"job {sid} still {s} after {timeout} s")


def _scrape(url: str) -> dict[tuple[str, str, str], float]:
    """{(metric, run, actor): value} for megaray's series."""
    out = {}
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        if not line.startswith("ray_megaray_"):
            continue
        name, rest = line.split("{", 1)
        labels, value = rest.rsplit("}", 1)
        tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[(name, tags.get("run", ""), tags.get("actor", ""))] = float(value)
    return out


def _prom_query(head, query: str) -> list:
    url = f"{head['prometheus']}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    return json.loads(urllib.request.urlopen(url, timeout=10).read())["data"]["result"]


def test_job_trains_and_exports_metrics(head, tmp_path):
    _submit(head, "megaray-ok", "my.yaml", "train.steps=80", "data.max_bytes=500000", "train.eval_batches=1",
            "checkpoint.every=0", f"run.dir={tmp_path}", workdir=tmp_path / "job")
    seen: dict = {}
    t0 = time.time()
    while time.time() - t0 < 240:
        seen.update(_scrape(head["metrics"]))
        reported = {(k[0], k[2]) for k in seen}
        want = {("ray_megaray_loss", "scheduler"), ("ray_megaray_optimizer_seconds", "optimizer-0"),
                ("ray_megaray_optimizer_seconds", "optimizer-1")}       # each shard exports on its own
        if want <= reported or _status(head, "megaray-ok") != "RUNNING" and time.time() - t0 > 60:
            break
        time.sleep(2)
    status = _wait(head, "megaray-ok")
    assert status == "SUCCEEDED", _ray("job", "logs", "--address", head["address"], "megaray-ok").stdout[-3000:]
    logs = _ray("job", "logs", "megaray-ok", "--address", head["address"]).stdout
    assert "step 80/80" in logs and "finished: steps 1..80" in logs
    runs = {k[1] for k in seen}
    assert len(runs) == 1 and next(iter(runs)).startswith("demo-")
    v = {(k[0], k[2]): val for k, val in seen.items()}
    assert 0 < v[("ray_megaray_loss", "scheduler")] < 6
    assert v[("ray_megaray_step_time_seconds", "scheduler")] > 0
    assert v[("ray_megaray_tokens_per_second", "scheduler")] > 0
    assert 0 < v[("ray_megaray_learning_rate", "scheduler")] <= 3e-3
    assert v[("ray_megaray_grad_norm", "scheduler")] > 0
    assert v[("ray_megaray_copy_in_gbps", "scheduler")] > 0
    assert v[("ray_megaray_node_memory_used_bytes", "scheduler")] > 2**20
    assert v[("ray_megaray_steps_total", "scheduler")] >= 1
    assert v[("ray_megaray_skipped_steps", "scheduler")] == 0            # exported before any step is skipped
    for shard in ("optimizer-0", "optimizer-1"):
        assert v[("ray_megaray_optimizer_seconds", shard)] > 0
        assert v[("ray_megaray_optimizer_params_per_second", shard)] > 0
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("demo-")]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "succeeded"
    run = next(iter(runs))

    # A clean run leaves no failed task or actor call behind (Ray's state API, as the dashboard reads it).
    from ray.util.state import list_actors, list_tasks

    failed = list_tasks(address=head["address"], filters=[("state", "=", "FAILED")], limit=100)
    assert failed == [], [(t.name, t.error_type) for t in failed]
    actors = {a.name.rsplit(":", 1)[-1]: a for a in list_actors(address=head["address"], detail=True, limit=100,
                                                                 filters=[("ray_namespace", "=", "megaray")])
              if a.name.startswith(f"megaray:{run}:")}
    assert {"store", "scheduler", "worker", "optimizer-0", "optimizer-1", "data"} <= set(actors)
    groups = {a.placement_group_id for a in actors.values()}
    assert len(groups) == 1 and None not in groups                      # the data feeder too: one group
    assert actors["store"].repr_name.startswith("ParameterStore(")

    # A real Prometheus scraping the head answers a query for every series the Grafana dashboard draws.
    if head["prometheus"] is None:
        pytest.skip("no prometheus binary here (Debian's package 'prometheus')")
    from importlib import resources

    dash = resources.files("megaray.grafana").joinpath("megaray_dashboard.json").read_text()
    series = sorted(set(re.findall(r"ray_megaray_\w+", dash)))
    assert len(series) >= 15
    for name in series:
        res = _prom_query(head, f'max_over_time({name}{{run="{run}"}}[30m])')
        assert res, f"Prometheus has no {name} for run {run}"
    (loss,) = _prom_query(head, f'max_over_time(ray_megaray_loss{{run="{run}"}}[30m])')
    assert 0 < float(loss["value"][1]) < 6


def test_job_with_bad_config_fails_with_the_error_in_its_logs(head, tmp_path):
    _submit(head, "megaray-bad", "debug", "optim.num_shards=99", workdir=tmp_path / "job")
    assert _wait(head, "megaray-bad", timeout=120) == "FAILED"
    logs = _ray("job", "logs", "megaray-bad", "--address", head["address"]).stdout
    assert "config key 'optim.num_shards'" in logs


def test_a_cluster_too_small_is_named_with_the_fix_by_plan_and_by_train(head, tmp_path):
    """Issue 47 item 8: the head offers 6 CPUs and the run asks for 10 (4 shards of 2 threads,
    the worker's 2): `megaray plan` with RAY_ADDRESS checks that cluster, and `megaray train`
    refuses before any actor starts, each naming the fix."""
    args = ["debug", "optim.num_shards=4", "optim.threads_per_shard=2", "worker.threads=2", f"run.dir={tmp_path}"]
    env = dict(ENV, RAY_ADDRESS=head["gcs"])
    cli = str(Path(sys.executable).with_name("megaray"))
    plan = subprocess.run([cli, "plan", *args], capture_output=True, text=True, env=env, timeout=300)
    assert plan.returncode == 1, plan.stdout + plan.stderr
    said = ("the Ray cluster cannot hold the run on one node: it needs 10 CPU (it offers 6); start it with more "
            "(ray start --head --num-cpus=10")
    assert f"DOES NOT FIT: {said}" in plan.stdout and "optim.num_shards=1" in plan.stdout
    assert plan.stdout.rstrip().endswith(f"DOES NOT FIT the Ray cluster at {head['gcs']}")
    train = subprocess.run([cli, "train", *args], capture_output=True, text=True, env=env, timeout=300)
    assert train.returncode == 2 and f"config key 'cluster': {said}" in train.stderr, train.stderr[-3000:]


def test_ray_job_stop_checkpoints_and_stops(head, tmp_path):
    _submit(head, "megaray-stop", "debug", "train.steps=100000", f"run.dir={tmp_path}", "checkpoint.every=0",
            workdir=tmp_path / "job")
    t0 = time.time()
    while time.time() - t0 < 180:
        logs = list(tmp_path.glob("debug-*/train.log"))
        if logs and logs[0].read_text().count(" INFO step ") >= 5:
            break
        time.sleep(1)
    p = _ray("job", "stop", "megaray-stop", "--address", head["address"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert _wait(head, "megaray-stop", timeout=120) == "STOPPED"
    t0 = time.time()
    def final_summaries():
        return [s for s in (json.loads(p.read_text()) for p in tmp_path.glob("debug-*/summary.json"))
                if s["status"] != "running"]

    while time.time() - t0 < 30 and not final_summaries():
        time.sleep(0.5)
    (summary,) = final_summaries()
    assert summary["status"] == "stopped"
    ckpts = [p for p in (tmp_path / "checkpoints" / "debug").iterdir() if (p / "manifest.json").is_file()]
    assert [json.loads((p / "manifest.json").read_text())["step"] for p in ckpts] == [summary["stopped_at_step"]]
