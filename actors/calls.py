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


def get_or_raise(ref, actor: str):
    """ray.get that turns an actor's failure into megaray's own error type: the actor's
    MegarayError itself (also one its constructor raised), else ActorFailure naming it."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, MegarayError):
            raise cause from None
        raise ActorFailure(actor, str(cause)) from None
    except ray.exceptions.RayActorError as e:
        if isinstance(getattr(e, "cause", None), MegarayError):
            raise e.cause from None
        raise ActorFailure(actor, f"actor died: {e}") from None
