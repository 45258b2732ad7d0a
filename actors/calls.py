"""Turning a Ray call's failure into megaray's own error types (shared by the driver's
session and actors that call other actors)."""
from __future__ import annotations

import ray

from megaray.errors import ActorFailure, MegarayError


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
