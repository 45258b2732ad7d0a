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

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from megaray.config import RunConfig, dump_config
from megaray.errors import ActorFailure, CheckpointError, RunStopped, TrainingDiverged

log = logging.getLogger("megaray")

TB_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops", "copy_in_gbps",
              "copy_out_gbps", "exposed_optimizer_s", "host_memory_used_bytes", "gpu_memory_peak_bytes", "data_wait_s")


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
    needed = cfg.optim.num_shards * cfg.optim.threads_per_shard + cfg.worker.count * cfg.worker.threads
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

    def __init__(self, total: int, tty: bool | None = None, start: int = 0):
        self.total, self.start = total, start
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.t0 = time.perf_counter()

    def update(self, m: dict) -> None:
        done = m["step"] + 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done - self.start, 1) * (self.total - done)
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


class Checkpointer:
    """Writes, finds and loads a run's checkpoints (``megaray.checkpoint`` has the format)."""

    def __init__(self, cfg: RunConfig, run_id: str):
        self.cfg, self.run_id = cfg, run_id
        self.root = cfg.checkpoint_dir

    def save(self, session, step: int, extra: dict) -> Path | None:
        """Write a checkpoint of the state after ``step`` steps; on failure keep the old ones."""
        from megaray import checkpoint as ck

        t0 = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = ck.tmp_dir(self.root, step)
        try:
            tmp.mkdir()
            parts = session.save_parts(str(tmp))
            trainer = {"next_step": step, "counters": session.counters(), "seed": self.cfg.run.seed,
                       "lr_schedule": dataclasses.asdict(self.cfg.optim), "total_steps": self.cfg.train.steps,
                       **extra}
            parts["trainer.json"] = ck.write_bytes(tmp / "trainer.json", memoryview(json.dumps(trainer).encode()))
            final = ck.commit(tmp, ck.step_dir(self.root, step), step, parts,
                              {"run_id": self.run_id, "model": dataclasses.asdict(self.cfg.model)})
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            log.error("checkpoint at step %d failed (%s: %s); the previous checkpoint stays valid",
                      step, type(e).__name__, e)
            return None
        ck.prune(self.root, self.cfg.checkpoint.keep)
        size = sum(p["bytes"] for p in parts.values())
        dt = time.perf_counter() - t0
        log.info("checkpoint %s: %.1f MB in %.2f s (%.2f GB/s)", final, size / 1e6, dt, size / dt / 1e9)
        return final

    def candidates(self, resume: str | None) -> list[Path]:
        from megaray.checkpoint import complete_checkpoints

        if resume is None:
            return []
        if resume == "auto":
            return complete_checkpoints(self.root)
        return [Path(resume)]

    def load(self, session, path: Path) -> tuple[int, dict]:
        from megaray.checkpoint import read_manifest

        t0 = time.perf_counter()
        m = read_manifest(path)
        if m.get("model") != dataclasses.asdict(self.cfg.model):
            raise CheckpointError(f"{path} holds a different model than model: in this config")
        trainer = json.loads((path / "trainer.json").read_text())
        session.load_parts(str(path), m["parts"], m["step"], trainer["counters"])
        size = sum(p["bytes"] for p in m["parts"].values())
        dt = time.perf_counter() - t0
        log.info("resumed from %s (step %d): %.1f MB in %.2f s (%.2f GB/s)", path, m["step"], size / 1e6, dt,
                 size / dt / 1e9)
        return m["step"], trainer


class DataFeed:
    """The run's DataFeeder actor, and the batches asked for ahead of the step that trains.

    Batches are addressed by stream position (rows consumed so far), which checkpoints
    store: a resumed run asks for exactly the rows that come next. The feeder holds no
    state beyond its data files, so when it dies a new one takes over and the request is
    asked again (at most ``checkpoint.max_restarts`` times), with nothing lost or repeated."""

    def __init__(self, cfg: RunConfig, run_id: str):
        self.cfg, self.name = cfg, f"megaray:{run_id}:data"
        self.rows_per_step = cfg.train.grad_accum * cfg.train.micro_batch_size
        self.restarts = 0
        self.ahead: dict = {}
        self._spawn()
        self.description = self._get(lambda: self.actor.describe.remote())

    def _spawn(self) -> None:
        import ray

        from megaray.actors.data import DataFeeder
        from megaray.actors.session import NAMESPACE

        self.actor = ray.remote(DataFeeder).options(name=self.name, namespace=NAMESPACE, num_cpus=0,
                                                    max_restarts=0).remote(self.cfg)

    def _get(self, request, ref=None):
        """The result of ``request()`` (or of ``ref``, a request made before); a dead feeder
        is replaced and the request asked again."""
        import ray

        from megaray.actors.session import get_or_raise

        try:
            return get_or_raise(ref if ref is not None else request(), self.name)
        except ActorFailure as e:
            try:
                ray.get(self.actor.describe.remote(), timeout=60)
                raise                                   # alive: the request itself failed
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            if self.restarts >= self.cfg.checkpoint.max_restarts:
                raise
            self.restarts += 1
            log.warning("%s; started a new data actor (restart %d of %d)", e, self.restarts,
                        self.cfg.checkpoint.max_restarts)
            self.close()
            self._spawn()
            self.ahead.clear()
            return get_or_raise(request(), self.name)

    def batch(self, position: int) -> tuple[dict, float, float]:
        """The step batch at ``position``; also the seconds the driver waited for it and the
        seconds the feeder took to build it."""
        for k in range(self.cfg.data.prefetch + 1):
            p = position + k * self.rows_per_step
            if p not in self.ahead:
                self.ahead[p] = self.actor.step_batch.remote(p)
        ref = self.ahead.pop(position)
        for p in [p for p in self.ahead if p < position]:
            del self.ahead[p]
        t0 = time.perf_counter()
        r = self._get(lambda: self.actor.step_batch.remote(position), ref)
        return r["batch"], time.perf_counter() - t0, r["seconds"]

    def heldout(self, micro_batches: int) -> dict:
        return self._get(lambda: self.actor.step_batch.remote(0, micro_batches, "heldout"))["batch"]

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass



def open_session(cfg: RunConfig, run_id: str, ckpt: Checkpointer, resume: str | None):
    """Start the actors and load the newest loadable checkpoint; returns (session, step, trainer)."""
    from megaray.actors.session import TrainingSession

    session = TrainingSession(cfg, run_id).start()
    explicit = resume not in (None, "auto")
    for path in ckpt.candidates(resume):
        try:
            step, trainer = ckpt.load(session, path)
            return session, step, trainer
        except CheckpointError as e:
            if explicit:
                session.close()
                raise
            log.error("%s; trying the previous checkpoint", e)
            session.close()           # a half-loaded state is discarded with its actors
            session = TrainingSession(cfg, run_id).start()
        except BaseException:
            session.close()
            raise
    return session, 0, {}


class _StopFlag:
    """SIGTERM (``ray job stop``) sets a flag; the loop stops after the current step."""

    def __init__(self):
        self.signal: int | None = None
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum
        log.warning("received signal %d: stopping after the current step", signum)

    def restore(self):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def train(cfg: RunConfig, run_id: str | None = None, on_step=None) -> dict:
    """Run a whole training job; returns the summary written to summary.json.

    ``on_step(step, session)`` (tests) is called after each completed step.
    """
    from torch.utils.tensorboard import SummaryWriter

    from megaray.actors.session import new_run_id

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
    tb = SummaryWriter(str(run_dir / "tb"))
    tb.add_text("config", "```\n" + dump_config(cfg) + "\n```", 0)
    metrics_file = open(run_dir / "metrics.jsonl", "w")
    summary: dict = {"run_id": run_id, "run_dir": str(run_dir), "status": "failed"}
    ckpt = Checkpointer(cfg, run_id)
    stop = _StopFlag()
    session = feed = None
    try:
        feed = DataFeed(cfg, run_id)
        log.info("data: %s", feed.description)
        session, step, trainer = open_session(cfg, run_id, ckpt, cfg.checkpoint.resume)
        R = feed.rows_per_step
        position = trainer.get("data_position", step * R)
        first_step = step
        weights = "read from the master"
        if cfg.host_compute_copy:
            weights = "from a copy in host memory (optim.compute_copy)"
        elif cfg.train.compute_dtype != cfg.optim.master_dtype:
            weights = "cast from the master on the device (optim.compute_copy)"
        log.info("model: %.2fM parameters, %d tokens per step, steps %d..%d; %s weights %s",
                 cfg.model.num_params() / 1e6, cfg.train.tokens_per_step, step, cfg.train.steps,
                 cfg.train.compute_dtype, weights)
        progress = Progress(cfg.train.steps, start=step)
        losses, restarts, data_t = [], 0, [0.0, 0.0, 0.0]     # data wait, data build, step time
        consecutive = trainer.get("consecutive_skipped", 0)
        while step < cfg.train.steps:
            try:
                batch, data_wait, data_build = feed.batch(position)
                m = session.train_step(step, batch)
                session.check_alive()
            except ActorFailure as e:
                if restarts >= cfg.checkpoint.max_restarts:
                    raise
                restarts += 1
                session.close()
                session, resumed, trainer = open_session(cfg, run_id, ckpt, "auto")
                consecutive = trainer.get("consecutive_skipped", 0)
                position = trainer.get("data_position", resumed * R)
                log.warning("%s; restarted the run's actors (restart %d of %d) from %s; redoing %d steps",
                            e, restarts, cfg.checkpoint.max_restarts,
                            f"the checkpoint of step {resumed}" if resumed else "the initial weights",
                            step - resumed)
                summary.setdefault("restarts", []).append({"error": str(e), "at_step": step, "resumed_from": resumed})
                step = resumed
                continue
            position += R
            m.update(data_wait_s=data_wait, data_build_s=data_build, data_position=position)
            data_t = [data_t[0] + data_wait, data_t[1] + data_build, data_t[2] + m["step_time_s"]]
            losses.append(m["loss"])
            consecutive = consecutive + 1 if m["skipped"] else 0
            if m["skipped"]:
                log.warning("step %d skipped: non-finite loss or gradient (%d in a row, limit %d)",
                            step, consecutive, cfg.train.max_skipped_steps)
                if consecutive >= cfg.train.max_skipped_steps:
                    raise TrainingDiverged(f"{consecutive} consecutive steps with a non-finite loss or gradient "
                                           f"(train.max_skipped_steps={cfg.train.max_skipped_steps}), last at step {step}")
            if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1 or m["skipped"]:
                progress.update(m)
                for key in TB_SCALARS:
                    tb.add_scalar(f"train/{key}", m[key], step)
                metrics_file.write(json.dumps(m) + "\n")
                metrics_file.flush()
            step += 1
            if on_step is not None:
                on_step(step, session)
            ev = cfg.train.eval_every
            if ev and step % ev == 0 and step < cfg.train.steps:
                tb.add_scalar("eval/loss", _evaluate(session, feed, cfg, step), step - 1)
            if stop.signal is not None:
                if cfg.checkpoint.on_sigterm:
                    ckpt.save(session, step, {"consecutive_skipped": consecutive, "data_position": position})
                summary.update(status="stopped", stopped_at_step=step)
                raise RunStopped(f"stopped by signal {stop.signal} after step {step}")
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.train.steps:
                ckpt.save(session, step, {"consecutive_skipped": consecutive, "data_position": position})
        eval_loss = _evaluate(session, feed, cfg, cfg.train.steps)
        tb.add_scalar("eval/loss", eval_loss, cfg.train.steps - 1)
        final = ckpt.save(session, cfg.train.steps, {"consecutive_skipped": consecutive, "data_position": position})
        wall = time.perf_counter() - t_start
        tail = losses[-min(10, len(losses)):] or [float("nan")]
        summary.update({
            "status": "succeeded", "steps": cfg.train.steps, "first_step": first_step,
            "first_loss": losses[0] if losses else None, "last_loss": sum(tail) / len(tail),
            "heldout_loss": eval_loss, "wall_time_s": wall, "checkpoint": str(final) if final else None,
            "tokens_per_s": cfg.train.tokens_per_step * max(1, cfg.train.steps - first_step) / wall,
            # the driver's wait for batches, and the data actor's work, against the steps' time
            "data_wait_share": data_t[0] / max(data_t[2], 1e-9), "data_build_share": data_t[1] / max(data_t[2], 1e-9),
            "data_restarts": feed.restarts,
        })
        if losses:
            log.info("done: loss %.4f -> %.4f (mean of last %d), held-out %.4f, %s",
                     losses[0], summary["last_loss"], len(tail), eval_loss, _fmt_time(wall))
        return summary
    except BaseException as e:
        summary["error"] = f"{type(e).__name__}: {e}"
        if summary["status"] != "stopped":
            log.error("run failed: %s", summary["error"])
        raise
    finally:
        stop.restore()
        if session is not None:
            session.close()
        if feed is not None:
            feed.close()
        tb.close()
        metrics_file.close()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _evaluate(session, feed: DataFeed, cfg: RunConfig, step: int) -> float:
    return session.evaluate(step, feed.heldout(max(1, cfg.train.eval_batches)))
