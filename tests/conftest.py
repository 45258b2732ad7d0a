"""Shared fixtures: one Ray cluster per test module, with CPUs set explicitly."""
from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=6, num_gpus=0, object_store_memory=128 * 2**20, include_dashboard=False,
             log_to_driver=False)
    yield ray
    ray.shutdown()


def shm_files(run_id: str | None = None, pid: int | None = None) -> list[str]:
    """megaray's shared-memory files of a run, or of runs driven by ``pid`` (default: this process)."""
    if run_id is not None:
        return [f for f in os.listdir("/dev/shm") if f.startswith("megaray_") and f"_{run_id}_" in f]
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"megaray_{pid or os.getpid()}_")]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its local Ray: GCS, raylet, workers), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.fixture
def train_cli(tmp_path):
    """Start ``python -m megaray.pipelines.train debug ...`` (its own local Ray) in a subprocess.

    The subprocess runs with faulthandler on. A test ends it with ``finish(proc)``: a run that
    has not exited by then gets SIGABRT, so its output shows every thread's stack, and then
    the whole process tree is killed. One hang therefore fails one test with its stacks; it
    does not leave a Ray instance that later tests' ``ray.init`` would find. Anything still
    running at teardown is killed the same way.
    """
    procs: list[subprocess.Popen] = []

    def start(*overrides: str) -> subprocess.Popen:
        env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONFAULTHANDLER="1")
        proc = subprocess.Popen([sys.executable, "-m", "megaray.pipelines.train", "debug", "data.max_bytes=50000",
                                 f"run.dir={tmp_path}", "cluster.num_cpus=4", *overrides],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                preexec_fn=_child_setup)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            _kill_tree(proc)


def _child_setup() -> None:
    """In the child before it runs: ctrl-c's default action, which a pytest started in the
    background of a script does not have (a shell starts background jobs with SIGINT ignored,
    and Python then leaves it ignored: the run would never see the test's SIGINTs), and no
    core file from the SIGABRT that shows a hung run's stacks."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_tree(proc: subprocess.Popen) -> str:
    tree = _descendants(proc.pid)
    proc.send_signal(signal.SIGABRT)                               # faulthandler: every thread's stack
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for name in shm_files(pid=proc.pid):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", name))
    return out or ""


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The output of a subprocess started by ``train_cli`` once it exits; if it does not within
    ``timeout`` seconds, fail with its threads' stacks after killing it and its Ray."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out
    except subprocess.TimeoutExpired:
        out = _kill_tree(proc)
        raise AssertionError(f"the run did not exit within {timeout:.0f} s; its output, ending with "
                             f"every thread's stack:\n{out[-20000:]}") from None


def wait_for_steps(proc: subprocess.Popen, logs: Callable[[], list[Path]], n: int, timeout: float = 180) -> None:
    """Wait until the first of ``logs()`` holds ``n`` step lines; fail if the run exits first."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        found = logs()
        if found and found[0].read_text().count(" INFO step ") >= n:
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    raise AssertionError(f"the run did not log {n} steps within {timeout:.0f} s")


def dead_pid() -> int:
    """The id of a process that has ended (what a killed writer's leftovers are named by)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid
