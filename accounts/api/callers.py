"""Who is calling: the user of the `apikey` header, or the anonymous user without one."""

from __future__ import annotations

from django.conf import settings

from accounts.models import HordeUser
from accounts.selectors import anonymous_user_get
from contract.errors import HordeError


def requester(request) -> HordeUser:
    """The caller; without a key (or with the anonymous key) the anonymous user, where allowed."""
    user = request.user if isinstance(request.user, HordeUser) else anonymous_user_get()
    if user.is_anonymous and not settings.HORDE_ALLOW_ANONYMOUS:
        raise HordeError("AnonForbidden", "This horde does not serve anonymous requests: send your API key.")
    return user


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
