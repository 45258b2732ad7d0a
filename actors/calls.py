"""Failures as megaray's own error types: a Ray call's failure, read by the caller
(``get_or_raise``: the driver's session and actors that call other actors), and an actor's
own, raised from its methods (``actor_guard``: the worker, its evaluation, the optimizer
shards and the relay)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import ray

from megaray.errors import ActorFailure, MegarayError, RunAborted


@contextmanager
def actor_guard(name: str, step: int, abort: Callable[[], None],
                cause: Callable[[], str | None] = lambda: None) -> Iterator[None]:
    """Whatever the body raises leaves as an ``ActorFailure`` naming actor ``name`` and
    ``step``. A ``RunAborted`` (another actor aborted the run) is marked ``aborted``, unless
    ``cause()`` names a failure of this actor's own that aborted it; any other exception first
    aborts the run (``abort()``: every waiter on the shared control words is released)."""
    try:
        yield
    except RunAborted as e:
        why = cause()
        raise ActorFailure(name, why or str(e), step, aborted=why is None) from None
    except Exception as e:
        abort()
        raise ActorFailure(name, f"{type(e).__name__}: {e}", step) from e


def failure_of(actor: str, exc: BaseException) -> MegarayError:
    """The megaray error a failed call of ``actor`` stands for: the actor's own MegarayError
    (an ActorFailure it raised, or an error its constructor raised), else an ActorFailure
    naming ``actor``: its exception's type and message, or that it died."""
    cause = getattr(exc, "cause", None)
    cause = exc if cause is None else cause
    if isinstance(cause, MegarayError):
        return cause
    if isinstance(exc, ray.exceptions.RayActorError):
        return ActorFailure(actor, f"actor died: {exc}")
    return ActorFailure(actor, f"{type(cause).__name__}: {cause}")


def get_or_raise(ref, actor: str):
    """ray.get that raises a failed call as megaray's own error type (``failure_of``)."""
    try:
        return ray.get(ref)
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
        raise failure_of(actor, e) from None
