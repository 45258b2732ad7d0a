"""Exception types of megaray.

Every error a user can cause or meet is one of these. They pickle cleanly (Ray carries them
between processes) and an error raised inside an actor says which actor it was.
"""
from __future__ import annotations


class MegarayError(Exception):
    """Base class of every megaray error."""


class ConfigError(MegarayError, ValueError):
    """A config key is unknown, has the wrong type or an impossible value.

    ``key`` is the dotted YAML key (``optim.num_shards``), so the message names it.
    Raised while loading, before any Ray actor starts.
    """

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"config key '{key}': {message}")

    def __reduce__(self):
        return (type(self), (self.key, self.message))


class DataError(MegarayError, ValueError):
    """Training data is missing or malformed; the message names the file (and row)."""


class PlanError(MegarayError):
    """The run does not fit the machine (host memory, shared memory or GPU); the message is
    the whole memory plan with the shortfall. Raised before anything is allocated."""


class ClusterError(MegarayError):
    """Ray could not be started or reached (``cluster.address``, ``RAY_ADDRESS``, or the local
    cluster megaray starts); the message says which and what Ray answered."""


class ModelFileError(MegarayError, ValueError):
    """A model directory's weight files are missing, truncated, corrupt or do not match its
    config.json; the message names the file (and tensor)."""


class ActorFailure(MegarayError, RuntimeError):
    """An actor of a run failed; ``actor`` is its name (``megaray:<run>:optimizer-1``).
    ``aborted`` is True when it only stopped because another actor failed first."""

    def __init__(self, actor: str, message: str, step: int | None = None, aborted: bool = False):
        self.actor = actor
        self.message = message
        self.step = step
        self.aborted = aborted
        where = f" at step {step}" if step is not None else ""
        super().__init__(f"{actor} failed{where}: {message}")

    def __reduce__(self):
        return (type(self), (self.actor, self.message, self.step, self.aborted))


class CheckpointError(MegarayError):
    """A checkpoint is missing, incomplete or corrupt; the message names the part."""


class RunDirError(MegarayError, ValueError):
    """A run directory given to a command (``megaray compare``) lacks a file it should hold,
    or holds a malformed one; the message names the file (and line)."""


class ExportError(MegarayError):
    """``megaray export`` cannot write its output folder: it exists and holds files (nothing
    there is touched), or writing failed (nothing is left); the message names the folder."""


class TrainingDiverged(MegarayError, RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient (train.max_skipped_steps)."""


class RunStopped(MegarayError):
    """The run was stopped by a signal (SIGTERM from ``ray job stop``, or Ctrl-C) after the
    step it was in, with a checkpoint (``checkpoint.on_sigterm``), and shut down cleanly.
    ``signum`` is the signal's number (the command exits 128 + signum); ``checkpoint`` the
    checkpoint written at the stop, or None."""

    def __init__(self, message: str, signum: int, checkpoint: str | None = None):
        self.signum, self.checkpoint = signum, checkpoint
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.signum, self.checkpoint))


class RunAborted(MegarayError, RuntimeError):
    """Raised in an actor that was waiting on shared memory when the run was aborted."""


class InjectedFault(MegarayError, RuntimeError):
    """The failure that ``debug.crash_actor``/``debug.crash_step`` asks for (tests only)."""
