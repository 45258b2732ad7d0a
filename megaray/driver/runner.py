"""The driver side of a training run: the training loop and its stop and restart rules.

``train(cfg)`` is what ``megaray train`` and the ``ray job submit`` entrypoint call. A run
goes through ``Trainer``'s stages, setup -> resume -> loop -> finish, and leaves a run
directory a person can read (``megaray.driver.runlog``); the Ray it runs on is ``megaray.driver.cluster``'s.

The loop asks each component whether it is due (``Checkpointer.due``, ``Evaluator.due``,
``RunLog.due``) rather than testing step numbers inline. Every actor failure goes through
one ``RestartPolicy`` (``checkpoint.max_restarts`` restarts in all): a dead data feeder is
replaced on its own (it holds nothing but its files), any other failure restarts the run's
actors from the last checkpoint.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megaray.checkpoint import Checkpointer, check_resume, checkpoint_folder, first_to_resume
from megaray.config import RunConfig
from megaray.driver.cluster import dashboard_url
from megaray.driver.runlog import Progress, RunLog, fmt_time, log, mark_killed_runs
from megaray.driver.session import TrainingSession, new_run_id
from megaray.errors import ActorFailure, CheckpointError, ConfigError, RunStopped, TrainingDiverged


class Evaluator:
    """The held-out loss, every ``train.eval_every`` steps (``eval_interval``) and at the end
    (none when the data holds nothing out)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.enabled = True

    def due(self, step: int) -> bool:
        ev = self.cfg.train.eval_interval
        return self.enabled and bool(ev) and step % ev == 0 and step < self.cfg.train.steps


class RestartPolicy:
    """One budget of restarts (``checkpoint.max_restarts``) for every actor failure of a run."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def allow(self) -> bool:
        if self.used >= self.limit:
            return False
        self.used += 1
        return True


SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class _StopFlag:
    """SIGTERM (``ray job stop``) and a first Ctrl-C ask the loop to stop after the current
    step, with a checkpoint; a second Ctrl-C, or one before the loop starts (``armed``),
    quits at once as KeyboardInterrupt: no checkpoint, the actors and shared memory still freed."""

    def __init__(self):
        self.signal: int | None = None
        self.armed = False
        self._old: dict = {}
        if threading.current_thread() is threading.main_thread():
            self._old = {n: signal.signal(n, self._handle) for n in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and (self.signal is not None or not self.armed):
            raise KeyboardInterrupt
        if self.signal is None:
            self.signal = signum
            again = " (Ctrl-C again quits at once, without it)" if signum == signal.SIGINT else ""
            log.warning("%s: stopping after the current step with a checkpoint%s", SIGNAL_NAMES.get(signum, signum),
                        again)

    def restore(self):
        for n, old in self._old.items():
            signal.signal(n, old)
        self._old = {}


def _cleaning_up(signum, frame) -> None:
    log.warning("stopping: the run's actors and shared memory are being freed, one moment")


@contextlib.contextmanager
def interrupts_held():
    """Ctrl-C is answered with a message instead of an exception while the body runs (the
    teardown of a run: cut short, it would leave actors and shared memory behind)."""
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGINT, _cleaning_up)
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)


@dataclass
class DataTimes:
    """The driver's wait for batches and the data actor's work, against the steps' time."""

    wait_s: float = 0.0
    build_s: float = 0.0
    steps_s: float = 0.0


class Trainer:
    """One training run: ``setup``, ``resume``, ``loop``, ``finish``; ``close`` however it ends."""

    def __init__(self, cfg: RunConfig, run_id: str, on_step=None):
        self.cfg, self.run_id, self.on_step = cfg, run_id, on_step
        self.session: TrainingSession | None = None
        self.ckpt: Checkpointer | None = None
        self.runlog: RunLog | None = None
        self.summary: dict = {}                  # the run log's summary.json, once setup made it
        self.stop: _StopFlag | None = None
        self.evaluator = Evaluator(cfg)
        self.restarts = RestartPolicy(cfg.checkpoint.max_restarts)
        self.data_restarts = 0
        self.t_start = time.perf_counter()
        self.t_loop = self.t_start                # when the first step of this launch started
        self.step = 0                            # steps done (the next step's index)
        self.position = 0                        # the data stream's position of the next batch
        self.consecutive = 0                     # non-finite steps in a row
        self.losses: list[float] = []
        self.data = DataTimes()

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        self.runlog = RunLog(cfg, self.run_id)
        self.summary = self.runlog.summary
        for k in mark_killed_runs(cfg.run.dir):
            log.warning("run %s was killed without ending (its driver is gone): marked killed in its summary.json; "
                        "last step %s, last complete checkpoint %s", k["run_id"], k.get("last_step"),
                        k.get("last_good_checkpoint", "none"))
        log.info("run directory %s", self.runlog.dir.resolve())
        if "runtime_resources" in str(self.runlog.dir.resolve()):
            log.warning("the run directory is inside this job's temporary working_dir copy, which Ray "
                        "deletes; set run.dir to an absolute path to keep it")
        log.info("tensorboard --logdir %s", (self.runlog.dir / "tb").resolve())
        log.info("Ray dashboard: %s (actors are named megaray:%s:<role>)", dashboard_url(), self.run_id)
        self.ckpt = Checkpointer(cfg, self.run_id, log)
        self.summary["checkpoint_dir"] = str(self.ckpt.root.resolve())
        self.runlog.write_summary()
        log.info("checkpoints: %s", self.ckpt.root.resolve())
        self.stop = _StopFlag()
        self.t_start = time.perf_counter()

    # ---------------------------------------------------------------- resume
    def resume(self, how: str | None) -> None:
        """Start the run's actors and load the newest loadable checkpoint (``how``: 'auto', a
        path, which must load, or None); sets the step, the data position and the skip count
        to continue from."""
        cfg = self.cfg
        self.session = TrainingSession(cfg, self.run_id).start()
        self.step, trainer, damaged = 0, {}, []
        for path in self.ckpt.candidates(how):
            try:
                self.step, trainer = self.ckpt.load(self.session, path)
                break
            except CheckpointError as e:
                if how not in (None, "auto"):
                    raise
                log.error("%s; trying the previous checkpoint", e)
                damaged.append(f"{Path(path).name}: {e}")
                # The previous checkpoint loads over the same actors: a load writes every
                # master, moment and resident unit (each actor's calls run in order), so
                # nothing of the half-loaded one survives it, and no actor is started again.
        else:
            if damaged and cfg.checkpoint.on_damaged != "start_over":
                raise CheckpointError(
                    f"every checkpoint in {self.ckpt.root} is damaged, and they are left as they are ("
                    + "; ".join(damaged) + "). To train from the start in that folder anyway, its checkpoints "
                    "replaced as the run reaches their steps, set checkpoint.on_damaged: start_over; or give the "
                    "run another checkpoint.dir")
            if damaged:
                log.warning("every checkpoint in %s is damaged: training from the initial weights "
                            "(checkpoint.on_damaged: start_over)", self.ckpt.root)
                self.session.close()           # the half-loaded state goes with its actors
                self.session = TrainingSession(cfg, self.run_id).start()
        self.position = trainer.get("data_position", self.step * self.session.rows_per_step)
        self.consecutive = trainer.get("consecutive_skipped", 0)

    # ---------------------------------------------------------------- loop
    def loop(self) -> None:
        cfg, s = self.cfg, self.summary
        log.info("data: %s", self.session.data_description)
        log.info("attention: %s (train.attention)", self.session.attention)
        if not self.session.has_heldout:
            self.evaluator.enabled = False
            log.warning("the data holds no rows out (data.holdout_fraction, or prepare --holdout-fraction): "
                        "no held-out loss is measured")
        s["first_step"] = self.step + 1               # steps count from 1: the first this launch runs
        weights = "read from the master"
        if cfg.host_compute_copy:
            weights = "from a copy in host memory (optim.compute_copy)"
        elif cfg.train.compute_dtype != cfg.optim.master_dtype:
            weights = "cast from the master on the device (optim.compute_copy)"
        log.info("model: %.2fM parameters, %d tokens per step, steps %d..%d; %s weights %s",
                 cfg.model.num_params() / 1e6, cfg.train.tokens_per_step, self.step + 1, cfg.train.steps,
                 cfg.train.compute_dtype, weights)
        self.runlog.progress = Progress(cfg.train.steps, start=self.step)
        self.t_loop = time.perf_counter()
        self.losses, self.data = [], DataTimes()
        self.stop.armed = True
        while self.step < cfg.train.steps:
            try:
                batch, data_wait, data_build = self.session.batch(self.position)
                m = self.session.train_step(self.step, batch)
                self.session.check_alive()
            except ActorFailure as e:
                self._recover(e)
                continue
            self._record(m, data_wait, data_build)
            self.step += 1
            if self.on_step is not None:
                self.on_step(self.step, self.session)
            if self.evaluator.due(self.step):
                self.runlog.tb.add_scalar("eval/loss", self._evaluate(self.step), self.step)
            if self.stop.signal is not None:
                self._stop(self.stop.signal)
            if self.ckpt.due(self.step):
                self.ckpt.save(self.session, self.step, self._trainer_state())

    def _stop(self, signum: int) -> None:
        """End the run at a signal: the checkpoint of the step done (unless
        checkpoint.on_sigterm is off), the summary's ``stopped``, then RunStopped."""
        saved = None
        if self.cfg.checkpoint.on_sigterm:
            saved = str(self.ckpt.save_final(self.session, self.step, self._trainer_state()))
        by = SIGNAL_NAMES.get(signum, f"signal {signum}")
        self.summary.update(status="stopped", stopped_at_step=self.step, stopped_by=by)
        if saved:
            self.summary["checkpoint"] = saved
        raise RunStopped(f"stopped by {by} after step {self.step}", signum, saved)

    def _trainer_state(self) -> dict:
        return {"consecutive_skipped": self.consecutive, "data_position": self.position}

    def _record(self, m: dict, data_wait: float, data_build: float) -> None:
        cfg = self.cfg
        self.position += self.session.rows_per_step
        m.update(data_wait_seconds=data_wait, data_build_seconds=data_build, data_position=self.position)
        self.data.wait_s += data_wait
        self.data.build_s += data_build
        self.data.steps_s += m["step_time_seconds"]
        self.losses.append(m["loss"])
        self.consecutive = self.consecutive + 1 if m["skipped"] else 0
        if m["skipped"]:
            log.warning("step %d skipped: non-finite loss or gradient (%d in a row, limit %d)",
                        m["step"], self.consecutive, cfg.train.max_skipped_steps)
            if self.consecutive >= cfg.train.max_skipped_steps:
                raise TrainingDiverged(f"{self.consecutive} consecutive steps with a non-finite loss or gradient "
                                       f"(train.max_skipped_steps={cfg.train.max_skipped_steps}), last at step "
                                       f"{m['step']}")
        logged = self.runlog.due(m)
        self.runlog.progress.update(m, logged)
        if logged:
            self.runlog.record(m)

    def _recover(self, e: ActorFailure) -> None:
        """Spend one restart on an actor failure, or raise it when none is left."""
        is_data = e.actor == self.session.actor_name("data")
        if is_data and self.session.data_actor_alive():
            raise e                                         # alive: the request itself failed
        if not self.restarts.allow():
            raise e
        n = f"restart {self.restarts.used} of {self.restarts.limit}"
        if is_data:
            self.data_restarts += 1
            log.warning("%s; started a new data actor (%s)", e, n)
            self.session.replace_data_actor()
            return
        at = self.step
        self.session.close()
        self.resume("auto")
        self.runlog.rewind(self.step)
        del self.losses[max(0, self.step - (self.summary["first_step"] - 1)):]     # the replay records them again
        log.warning("%s; restarted the run's actors (%s) from %s; redoing %d steps", e, n,
                    f"the checkpoint of step {self.step}" if self.step else "the initial weights", at - self.step)
        self.summary.setdefault("restarts", []).append({"error": str(e), "at_step": at, "resumed_from": self.step})

    def _evaluate(self, step: int) -> float:
        while True:
            try:
                return self.session.evaluate(step, self.session.heldout())
            except ActorFailure as e:
                if e.actor != self.session.actor_name("data"):
                    raise
                self._recover(e)

    # ---------------------------------------------------------------- finish
    def finish(self) -> dict:
        """The final checkpoint first (nothing after the last step can lose it), then the
        held-out loss and the summary."""
        cfg, s = self.cfg, self.summary
        final = self.ckpt.save_final(self.session, cfg.train.steps, self._trainer_state())
        eval_loss = None
        if self.evaluator.enabled:
            eval_loss = self._evaluate(cfg.train.steps)
            self.runlog.tb.add_scalar("eval/loss", eval_loss, cfg.train.steps)
        wall = time.perf_counter() - self.t_start
        loop = time.perf_counter() - self.t_loop
        tail = self.losses[-min(10, len(self.losses)):] or [float("nan")]
        d = self.data
        s.update({
            "status": "succeeded", "steps": cfg.train.steps,
            "first_loss": self.losses[0] if self.losses else None, "last_loss": sum(tail) / len(tail),
            "heldout_loss": eval_loss, "wall_time_s": wall, "checkpoint": str(final),
            # over this launch's steps, their checkpoints and evaluations (not the start-up)
            "tokens_per_second": cfg.train.tokens_per_step * (cfg.train.steps - s["first_step"] + 1) / loop,
            "train_time_s": loop,
            # the driver's wait for batches, and the data actor's work, against the steps' time
            "data_wait_share": d.wait_s / max(d.steps_s, 1e-9), "data_build_share": d.build_s / max(d.steps_s, 1e-9),
            "data_restarts": self.data_restarts,
        })
        if self.ckpt.failed:
            s["failed_checkpoints"] = self.ckpt.failed
        if self.losses:
            held = f"held-out {eval_loss:.4f}" if eval_loss is not None else "no held-out loss"
            log.info("done: loss %.4f -> %.4f (mean of last %d), %s, %s",
                     self.losses[0], s["last_loss"], len(tail), held, fmt_time(wall))
        return s

    def close(self) -> None:
        """Tear everything down; a second Ctrl-C meanwhile cannot cut the cleanup short."""
        with interrupts_held():
            self._close()

    def _close(self) -> None:
        if self.stop is not None:
            self.stop.restore()
        if self.session is not None:
            self.session.close()
        if self.ckpt is not None:
            self.ckpt.close()
        if self.runlog is not None:
            self.runlog.close()


def check_before_start(cfg: RunConfig) -> None:
    """What refuses a run before Ray or any actor starts (ConfigError): GPUs asked for that a
    local cluster would not have; the checkpoint it would resume first, where train.steps or
    optim.moment_dtype cannot continue it."""
    local = not (cfg.cluster.address or os.environ.get("RAY_ADDRESS")) and cfg.worker.node == "local"
    if local and cfg.worker.device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if have < cfg.worker.count:
            raise ConfigError("worker.device", f"cuda: the run needs {cfg.worker.count} GPU(s) and this machine "
                                               f"has {have} (set worker.device: cpu, or cluster.address)")
    ck = first_to_resume(cfg)
    if ck is not None:
        check_resume(cfg, ck)


# the path keys a command's words may set, by their words (checkpoint.dir and .resume apart)
_PATH_WORDS = {"run.dir": ("run", "dir"), "data.path": ("data", "path"), "model.from": ("model", "from_path")}


def resume_command(cfg: RunConfig, prog: list[str], config: str, overrides: list[str], folder: Path) -> list[str]:
    """The command (``prog``, ``config``, ``overrides``: the words that ran ``cfg``) made to go
    on from the checkpoints in ``folder`` from any folder: ``checkpoint.resume=auto`` and
    ``checkpoint.dir=`` appended (later overrides win) where the config does not lead there
    already, a config file's path and every path the run read (run.dir, data.path, model.from)
    absolute, as they resolved where the command ran."""
    folder = Path(folder).resolve()
    words = [w for w in overrides if w.split("=", 1)[0] not in _PATH_WORDS]
    for word, (section, key) in _PATH_WORDS.items():
        value = getattr(getattr(cfg, section), key)
        if value is not None:
            words.append(f"{word}={value}")
    out = [*prog, os.path.abspath(config) if os.path.isfile(config) else config, *words]
    if cfg.checkpoint.resume != "auto":
        out.append("checkpoint.resume=auto")
    if cfg.checkpoint.resume != "auto" or checkpoint_folder(cfg, "").resolve() != folder:
        out.append(f"checkpoint.dir={folder}")
    return out


def train(cfg: RunConfig, run_id: str | None = None, on_step=None) -> dict:
    """Run a whole training job; returns the summary written to summary.json.

    ``on_step(step, session)`` (tests) is called after each completed step.
    """
    t = Trainer(cfg, run_id or new_run_id(cfg.run.name), on_step)
    try:
        t.setup()
        t.resume(cfg.checkpoint.resume)
        t.loop()
        return t.finish()
    except BaseException as e:
        if t.runlog is not None:
            s = t.summary
            s["error"] = f"{type(e).__name__}: {e}"
            if s["status"] == "running":
                s["status"] = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            if s["status"] == "failed":
                log.error("run failed: %s", s["error"])
            if t.ckpt is not None and t.ckpt.last_good is not None:
                s["last_good_checkpoint"] = str(t.ckpt.last_good)
        raise
    finally:
        t.close()
