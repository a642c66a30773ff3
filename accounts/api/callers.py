"""Who is calling: the user of the `apikey` header, or the anonymous user without one."""

from __future__ import annotations

from accounts.models import HordeUser
from accounts.selectors import anonymous_user_get
from contract.errors import HordeError


def requester(request) -> HordeUser:
    return request.user if isinstance(request.user, HordeUser) else anonymous_user_get()


def registered_caller(request, *, rc: str = "AnonForbidden") -> HordeUser:
    user = requester(request)
    if user.is_anonymous:
        message = (
            "Anonymous is not allowed to own workers"
            if rc == "AnonForbiddenWorker"
            else "Anonymous user is forbidden from performing this operation"
        )
        raise HordeError(rc, message)
    return user
