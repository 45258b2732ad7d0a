"""The driver side of a training run: Ray connection, run directory, loop, progress, logs.

``train(cfg)`` is what ``megaray train`` and the ``ray job submit`` entrypoint call. It
leaves a run directory a person can read:

    <run.dir>/<run id>/
        config.yaml      the resolved config (every default filled in)
        train.log        the log lines
        metrics.jsonl    one JSON object per logged step
        summary.json     first/last loss, held-out loss, wall time, tokens/s (written last)
        tb/              TensorBoard events: loss, lr, grad norm, tokens/s, step time, config
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from megaray.config import RunConfig, dump_config

log = logging.getLogger("megaray")

TB_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops", "copy_in_gbps",
              "copy_out_gbps", "exposed_optimizer_s", "host_memory_used_bytes", "gpu_memory_peak_bytes")


def connect_ray(cfg: RunConfig) -> bool:
    """Attach to the configured or RAY_ADDRESS cluster, else start a local one.

    Returns True when this call started Ray (so the caller shuts it down).
    """
    import ray

    if ray.is_initialized():
        return False
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace="megaray", log_to_driver=True)
        return True
    needed = cfg.optim.num_shards * cfg.optim.threads_per_shard + cfg.worker.threads
    ray.init(address="local", num_cpus=cfg.cluster.num_cpus or max(needed, os.cpu_count() or 1),
             object_store_memory=cfg.cluster.object_store_mb * 2**20, namespace="megaray")
    return True


def dashboard_url() -> str:
    try:
        from ray._private.worker import get_dashboard_url

        url = get_dashboard_url()
        return f"http://{url}" if url and not url.startswith("http") else (url or "not running")
    except Exception:
        return "not available"


def make_run_dir(cfg: RunConfig, run_id: str) -> Path:
    d = Path(cfg.run.dir) / run_id
    d.mkdir(parents=True, exist_ok=False)
    (d / "config.yaml").write_text(dump_config(cfg))
    return d


def setup_logging(run_dir: Path | None) -> None:
    root = logging.getLogger("megaray")
    root.setLevel(logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in root.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(fmt)
        root.addHandler(h)
    if run_dir is not None:
        fh = logging.FileHandler(run_dir / "train.log")
        fh.setFormatter(fmt)
        root.addHandler(fh)
    root.propagate = False


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """A progress bar on a terminal; one plain log line per logged step otherwise."""

    def __init__(self, total: int, tty: bool | None = None):
        self.total = total
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.t0 = time.perf_counter()

    def update(self, m: dict) -> None:
        done = m["step"] + 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - done)
        text = (f"step {done}/{self.total} loss {m['loss']:.4f} lr {m['lr']:.2e} "
                f"gnorm {m['grad_norm']:.3f} {m['tokens_per_s']:.0f} tok/s "
                f"{m['step_time_s'] * 1000:.0f} ms/step eta {_fmt_time(eta)}")
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


def train(cfg: RunConfig, run_id: str | None = None) -> dict:
    """Run a whole training job; returns the summary written to summary.json."""
    from torch.utils.tensorboard import SummaryWriter

    from megaray.actors.session import TrainingSession, new_run_id
    from megaray.data import ByteCorpus

    run_id = run_id or new_run_id(cfg.run.name)
    run_dir = make_run_dir(cfg, run_id)
    setup_logging(run_dir)
    log.info("run directory %s", run_dir.resolve())
    if "runtime_resources" in str(run_dir.resolve()):
        log.warning("the run directory is inside this job's temporary working_dir copy, which Ray "
                    "deletes; set run.dir to an absolute path to keep it")
    log.info("tensorboard --logdir %s", (run_dir / "tb").resolve())
    log.info("Ray dashboard: %s (actors are named megaray:%s:<role>)", dashboard_url(), run_id)
    t_start = time.perf_counter()
    corpus = ByteCorpus(cfg.data)
    log.info("data: %d train / %d held-out byte tokens from the standard library",
             len(corpus.train), len(corpus.heldout))
    tb = SummaryWriter(str(run_dir / "tb"))
    tb.add_text("config", "```\n" + dump_config(cfg) + "\n```", 0)
    metrics_file = open(run_dir / "metrics.jsonl", "w")
    summary: dict = {"run_id": run_id, "run_dir": str(run_dir), "status": "failed"}
    session = TrainingSession(cfg, run_id)
    try:
        session.start()
        log.info("model: %.2fM parameters, %d tokens per step, %d steps",
                 cfg.model.num_params() / 1e6, cfg.train.tokens_per_step, cfg.train.steps)
        progress = Progress(cfg.train.steps)
        losses = []
        for step in range(cfg.train.steps):
            m = session.train_step(step, corpus.batch(step, cfg.train, cfg.run.seed))
            losses.append(m["loss"])
            if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
                progress.update(m)
                for key in TB_SCALARS:
                    tb.add_scalar(f"train/{key}", m[key], step)
                metrics_file.write(json.dumps(m) + "\n")
                metrics_file.flush()
            ev = cfg.train.eval_every
            if ev and (step + 1) % ev == 0 and step + 1 < cfg.train.steps:
                tb.add_scalar("eval/loss", _evaluate(session, corpus, cfg, step + 1), step)
        eval_loss = _evaluate(session, corpus, cfg, cfg.train.steps)
        tb.add_scalar("eval/loss", eval_loss, cfg.train.steps - 1)
        wall = time.perf_counter() - t_start
        tail = losses[-min(10, len(losses)):]
        summary.update({
            "status": "succeeded", "steps": cfg.train.steps, "first_loss": losses[0],
            "last_loss": sum(tail) / len(tail), "heldout_loss": eval_loss, "wall_time_s": wall,
            "tokens_per_s": cfg.train.tokens_per_step * cfg.train.steps / wall,
        })
        log.info("done: loss %.4f -> %.4f (mean of last %d), held-out %.4f, %s",
                 losses[0], summary["last_loss"], len(tail), eval_loss, _fmt_time(wall))
        return summary
    except BaseException as e:
        summary["error"] = f"{type(e).__name__}: {e}"
        log.error("run failed: %s", summary["error"])
        raise
    finally:
        session.close()
        tb.close()
        metrics_file.close()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _evaluate(session, corpus, cfg: RunConfig, step: int) -> float:
    import dataclasses

    ev_train = dataclasses.replace(cfg.train, grad_accum=max(1, cfg.train.eval_batches))
    return session.evaluate(step, corpus.batch(0, ev_train, cfg.run.seed, split="heldout"))
