"""A run directory a person can read, with the step progress line on the console:

    <run.dir>/<run id>/
        config.yaml      the resolved config (every default filled in)
        train.log        the log lines
        metrics.jsonl    one JSON object per logged step
        summary.json     status, first/last loss, held-out loss, wall time, tokens/s, where the
                         checkpoints are (written at the start, rewritten at the end)
        tb/              TensorBoard events: loss, lr, grad norm, tokens/s, step time, config
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from megaray.config import RunConfig
from megaray.errors import ConfigError
from megaray.loader import dump_config
from megaray.step import MOE_GAUGES, STEP_GAUGES

log = logging.getLogger("megaray")
LOG_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
TB_SCALARS = (*STEP_GAUGES, "data_wait_seconds")    # train/<name>: the names of metrics.jsonl and Prometheus


def log_to_console() -> logging.Handler | None:
    """megaray's log at INFO on stderr: the handler added, or None where the logger has a
    console handler already."""
    log.setLevel(logging.INFO)
    if any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in log.handlers):
        return None
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(LOG_FORMAT)
    log.addHandler(h)
    return h


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """A progress bar on a terminal; one plain log line per logged step otherwise."""

    def __init__(self, total: int, tty: bool | None = None, start: int = 0):
        self.total, self.start = total, start
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.t0 = time.perf_counter()

    def update(self, m: dict) -> None:
        done = m["step"]
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done - self.start, 1) * (self.total - done)
        gnorm = f"gnorm {m['grad_norm']:.3f}" if not m["skipped"] else "skipped"
        text = (f"step {done}/{self.total} loss {m['loss']:.4f} lr {m['learning_rate']:.2e} "
                f"{gnorm} {m['tokens_per_second']:.0f} tok/s "
                f"{m['step_time_seconds'] * 1000:.0f} ms/step eta {fmt_time(eta)}")
        if self.tty:
            width = 24
            fill = int(width * done / self.total)
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {text}\x1b[K")
            if done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
            for h in log.handlers:
                if isinstance(h, logging.FileHandler):
                    h.emit(logging.LogRecord("megaray", logging.INFO, "", 0, text, None, None))
        else:
            log.info(text)


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
        except OSError as e:
            raise ConfigError("run.dir", f"cannot write the run directory {self.dir}: {e.strerror or e}") from None
        self._handler = self._setup_logging()
        self.tb = SummaryWriter(str(self.dir / "tb"))
        self.tb.add_text("config", "```\n" + dump_config(cfg) + "\n```", 0)
        self.write_errors = 0
        self.summary: dict = {"run_id": run_id, "run_dir": str(self.dir), "status": "running"}
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
        self.progress.update(m)
        try:
            for key in TB_SCALARS:
                self.tb.add_scalar(f"train/{key}", m[key], m["step"])
            for key in MOE_GAUGES:          # a mixture of experts' rows only
                if key in m:
                    self.tb.add_scalar(f"train/{key}", m[key], m["step"])
            self.metrics.write(json.dumps(m) + "\n")
            self.metrics.flush()
        except OSError as e:          # a full or vanished run directory: the training goes on
            self.write_errors += 1
            if self.write_errors == 1:
                log.error("cannot write to the run directory %s (%s); training goes on, checkpoints are "
                          "written elsewhere as configured", self.dir, e.strerror or e)
            self.summary["run_dir_write_errors"] = self.write_errors

    def write_summary(self) -> None:
        try:
            tmp = self.dir / "summary.json.tmp"
            tmp.write_text(json.dumps(self.summary, indent=2) + "\n")
            os.replace(tmp, self.dir / "summary.json")
        except OSError as e:
            log.error("cannot write %s: %s", self.dir / "summary.json", e.strerror or e)

    def close(self) -> None:
        try:
            self.tb.close()
            self.metrics.close()
        except OSError:
            pass
        self.write_summary()
        log.removeHandler(self._handler)
        self._handler.close()
