"""A run directory a person can read, with the step progress line on the console:

    <run.dir>/<run id>/
        config.yaml      the resolved config (every default filled in)
        train.log        the log lines
        metrics.jsonl    one JSON object per logged step: loss, learning rate, norm, speed, memory
        worker.jsonl     the same steps' worker internals (stage timings, bytes copied, what
                         it kept on the GPU), for reading a step's time apart
        summary.json     status, first/last loss, held-out loss, wall time, tokens/s, where the
                         checkpoints are (written at the start, rewritten at the end)
        tb/              TensorBoard events: loss, lr, grad norm, tokens/s, step time, config
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from megaray.config import RunConfig
from megaray.errors import CheckpointError, ConfigError
from megaray.leftovers import process_start
from megaray.loader import dump_config
from megaray.step import MOE_GAUGES, STEP_GAUGES

log = logging.getLogger("megaray")
LOG_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
INTERNAL = "worker/"        # the worker's own timings and choices: worker.jsonl, not metrics.jsonl
TB_SCALARS = (*STEP_GAUGES, "data_wait_seconds")    # train/<name>: the names of metrics.jsonl and Prometheus


class ConsoleHandler(logging.StreamHandler):
    """megaray's log lines on stderr; while a progress line is drawn at the bottom of a
    terminal, each log line goes above it and the progress line is drawn again below."""

    progress: Progress | None = None

    def emit(self, record: logging.LogRecord) -> None:
        p = self.progress
        if p is None or not p.drawn:
            return super().emit(record)
        p.erase()
        super().emit(record)
        p.draw()


def log_to_console() -> logging.Handler | None:
    """megaray's log at INFO on stderr: the handler added, or None where the logger has a
    console handler already."""
    log.setLevel(logging.INFO)
    if any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in log.handlers):
        return None
    h = ConsoleHandler(sys.stderr)
    h.setFormatter(LOG_FORMAT)
    log.addHandler(h)
    return h


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """The steps' progress. On a terminal: one line at the bottom, redrawn at most every
    ``every_s`` seconds (and at each logged step), with the elapsed time, tokens/s and the
    time left; log lines go above it (``ConsoleHandler``), and each logged step's line goes
    into train.log. Elsewhere: a log line per logged step."""

    def __init__(self, total: int, tty: bool | None = None, start: int = 0, every_s: float = 1.0,
                 out=None):
        self.total, self.start, self.every_s = total, start, every_s
        self.out = sys.stderr if out is None else out
        self.tty = self.out.isatty() if tty is None else tty
        self.t0 = time.perf_counter()
        self.line, self.drawn, self.last_draw = "", False, float("-inf")
        for h in log.handlers:
            if isinstance(h, ConsoleHandler):
                h.progress = self

    def update(self, m: dict, logged: bool = True) -> None:
        """Step ``m`` done; ``logged``: a step of the log (RunLog.due)."""
        done = m["step"]
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done - self.start, 1) * (self.total - done)
        gnorm = f"gnorm {m['grad_norm']:.3f}" if not m["skipped"] else "skipped"
        text = (f"step {done}/{self.total} loss {m['loss']:.4f} lr {m['learning_rate']:.2e} "
                f"{gnorm} {m['tokens_per_second']:,.0f} tok/s {m['step_time_seconds'] * 1000:.0f} ms/step "
                f"elapsed {fmt_time(elapsed)} eta {fmt_time(eta)}")
        if not self.tty:
            if logged:
                log.info(text)
            return
        width = 24
        fill = int(width * done / self.total)
        self.line = f"[{'#' * fill}{'.' * (width - fill)}] {text}"
        now = time.perf_counter()
        if logged or done == self.total or now - self.last_draw >= self.every_s:
            self.draw()
            self.last_draw = now
        if logged:
            for h in log.handlers:
                if isinstance(h, logging.FileHandler):
                    h.emit(logging.LogRecord("megaray", logging.INFO, "", 0, text, None, None))

    def draw(self) -> None:
        self.out.write(f"\r{self.line}\x1b[K")
        self.out.flush()
        self.drawn = True

    def erase(self) -> None:
        self.out.write("\r\x1b[K")
        self.drawn = False

    def close(self) -> None:
        """The last line drawn stays on the terminal; what follows starts below it."""
        if self.drawn:
            self.out.write("\n")
            self.out.flush()
            self.drawn = False
        for h in log.handlers:
            if isinstance(h, ConsoleHandler) and h.progress is self:
                h.progress = None


class RunLog:
    """The run directory's files: config, log, metrics, TensorBoard and the summary."""

    def __init__(self, cfg: RunConfig, run_id: str):
        from torch.utils.tensorboard import SummaryWriter

        self.cfg = cfg
        self.dir = Path(cfg.run.dir) / run_id
        try:
            self.dir.mkdir(parents=True, exist_ok=False)
            (self.dir / "config.yaml").write_text(dump_config(cfg))
            self.metrics = open(self.dir / "metrics.jsonl", "w")
            self.internals = open(self.dir / "worker.jsonl", "w")
        except OSError as e:
            raise ConfigError("run.dir", f"cannot write the run directory {self.dir}: {e.strerror or e}") from None
        self._handler = self._setup_logging()
        self.tb = SummaryWriter(str(self.dir / "tb"))
        self.tb.add_text("config", "```\n" + dump_config(cfg) + "\n```", 0)
        self.write_errors = 0
        self.summary: dict = {"run_id": run_id, "run_dir": str(self.dir), "status": "running",
                              "driver": {"host": socket.gethostname(), "pid": os.getpid(),
                                         "started": process_start(os.getpid())}}
        self.progress: Progress | None = None

    def _setup_logging(self) -> logging.Handler:
        log_to_console()
        fh = logging.FileHandler(self.dir / "train.log")
        fh.setFormatter(LOG_FORMAT)
        log.addHandler(fh)
        log.propagate = False
        return fh

    def due(self, m: dict) -> bool:
        """A log line and TensorBoard point for this step: the first, every train.log_every-th,
        the last, and any skipped one."""
        n = m["step"]
        return n == 1 or n % self.cfg.train.log_every == 0 or n == self.cfg.train.steps or m["skipped"]

    def record(self, m: dict) -> None:
        try:
            for key in TB_SCALARS:
                self.tb.add_scalar(f"train/{key}", m[key], m["step"])
            for key in MOE_GAUGES:          # a mixture of experts' rows only
                if key in m:
                    self.tb.add_scalar(f"train/{key}", m[key], m["step"])
            row = {k: v for k, v in m.items() if not k.startswith(INTERNAL)}
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
            self.internals.write(json.dumps({"step": m["step"], **{k[len(INTERNAL):]: v for k, v in m.items()
                                                                    if k.startswith(INTERNAL)}}) + "\n")
            self.internals.flush()
        except OSError as e:          # a full or vanished run directory: the training goes on
            self.write_errors += 1
            if self.write_errors == 1:
                log.error("cannot write to the run directory %s (%s); training goes on, checkpoints are "
                          "written elsewhere as configured", self.dir, e.strerror or e)
            self.summary["run_dir_write_errors"] = self.write_errors

    def rewind(self, step: int) -> None:
        """The run goes on from ``step`` again (a restart from its checkpoint): metrics.jsonl
        keeps its rows up to ``step``, the replay writing the rest again, and TensorBoard's
        later points are dropped (a new event file that purges from ``step + 1``)."""
        from torch.utils.tensorboard import SummaryWriter

        self.metrics = self._cut(self.metrics, self.dir / "metrics.jsonl", step)
        self.internals = self._cut(self.internals, self.dir / "worker.jsonl", step)
        self.tb.close()
        self.tb = SummaryWriter(str(self.dir / "tb"), purge_step=step + 1)

    @staticmethod
    def _cut(f, path: Path, step: int):
        """``f`` (``path``, open for writing) reopened with only its rows up to ``step``."""
        try:
            f.close()
            rows = path.read_text().splitlines(keepends=True)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(r for r in rows if (_row_step(r) or step + 1) <= step))   # cut-short rows too
            os.replace(tmp, path)
        except OSError as e:
            log.error("cannot rewrite %s for the replayed steps (%s): it may hold them twice", path, e.strerror or e)
        return open(path, "a")

    def write_summary(self) -> None:
        try:
            tmp = self.dir / "summary.json.tmp"
            tmp.write_text(json.dumps(self.summary, indent=2) + "\n")
            os.replace(tmp, self.dir / "summary.json")
        except OSError as e:
            log.error("cannot write %s: %s", self.dir / "summary.json", e.strerror or e)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        try:
            self.tb.close()
            self.metrics.close()
            self.internals.close()
        except OSError:
            pass
        self.write_summary()
        log.removeHandler(self._handler)
        self._handler.close()


def mark_killed_runs(runs_dir: str | os.PathLike) -> list[dict]:
    """The runs under ``runs_dir`` whose driver died without ending them (``kill -9``, a lost
    terminal): summary.json says ``running`` but its driver, a process of this host, is gone
    (or its id now names a later process). Each is marked ``killed``, with the last step its
    metrics.jsonl recorded and the newest complete checkpoint in its checkpoint folder; the
    summaries marked are returned. Summaries of other hosts are left as they are."""
    from megaray.checkpoint import Checkpoint, complete_checkpoints

    marked = []
    for path in sorted(Path(runs_dir).glob("*/summary.json")):
        try:
            s = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        d = s.get("driver") if isinstance(s, dict) else None
        if s.get("status") != "running" or not isinstance(d, dict) or d.get("host") != socket.gethostname():
            continue
        now = process_start(int(d.get("pid", 0)))
        if now is not None and now == d.get("started"):
            continue                                            # its driver still runs
        s.update(status="killed", last_step=_last_step(path.parent / "metrics.jsonl"))
        for ck in complete_checkpoints(Path(s.get("checkpoint_dir", path.parent / "none"))):
            try:
                s.update(last_good_checkpoint=str(ck), last_good_step=Checkpoint(ck).step)
                break
            except (CheckpointError, OSError):                 # a damaged one: the one before it
                continue
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(s, indent=2) + "\n")
            os.replace(tmp, path)
        except OSError:
            continue
        marked.append(s)
    return marked


def _last_step(metrics: Path) -> int | None:
    """The step of metrics.jsonl's last whole row (a row cut short by the kill is skipped)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    return next((n for n in map(_row_step, reversed(lines)) if n is not None), None)


def _row_step(line: str) -> int | None:
    """A metrics.jsonl row's step; None for a row cut short."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
