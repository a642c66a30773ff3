"""Who is calling: the user of the `apikey` header, or the anonymous user without one."""

from __future__ import annotations

from django.conf import settings

from accounts.api.authentication import INVALID_API_KEY_MESSAGE
from accounts.models import HordeUser, SharedKey
from accounts.selectors import anonymous_user_get
from contract.errors import HordeError


def requester(request) -> HordeUser:
    """The caller; without a key (or with the anonymous key) the anonymous user, where allowed. A
    shared key's caller is its owner (see shared_key_of)."""
    user = request.user if isinstance(request.user, HordeUser) else anonymous_user_get()
    if user.is_anonymous and not settings.HORDE_ALLOW_ANONYMOUS:
        raise HordeError("AnonForbidden", "This horde does not serve anonymous requests: send your API key.")
    return user


def shared_key_of(request) -> SharedKey | None:
    """The shared key the caller sent in place of a user's key, if it did."""
    return request.auth if isinstance(request.auth, SharedKey) else None


def registered_caller(request, *, rc: str = "AnonForbidden") -> HordeUser:
    """The caller acting as itself (a worker's owner, a moderator, a key's owner): a shared key only
    lends its owner's kudos to requests, so here it is no key at all, as upstream's."""
    if shared_key_of(request) is not None:
        raise HordeError("InvalidAPIKey", INVALID_API_KEY_MESSAGE)
    user = requester(request)
    if user.is_anonymous:
        message = (
            "Anonymous is not allowed to own workers"
            if rc == "AnonForbiddenWorker"
            else "Anonymous user is forbidden from performing this operation"
        )
        raise HordeError(rc, message)
    return user
