"""The status body of a request, cached for a couple of seconds.

Clients poll a request's status every half second or so, and most polls find nothing changed.
Every write that changes what the status shows (pop, submit, fault, cancel, expiry) drops the
cached body when it commits, so a poll after a completion signal always reads the new state;
the short lifetime bounds what the writes do not announce (queue position, availability).
"""

from __future__ import annotations

from collections.abc import Callable
from uuid import UUID

from django.core.cache import cache
from django.db import transaction

STATUS_CACHE_SECONDS = 2


def _key(request_id: UUID | str, *, is_chat: bool) -> str:
    return f"horde:status:{'chat' if is_chat else 'text'}:{request_id}"


def cached_status(request_id: UUID, *, is_chat: bool, build: Callable[[], dict | None]) -> dict | None:
    """The cached body, or `build()`'s (None when the request does not exist: not cached)."""
    key = _key(request_id, is_chat=is_chat)
    body = cache.get(key)
    if body is None:
        body = build()
        if body is not None:
            cache.set(key, body, STATUS_CACHE_SECONDS)
    return body


def status_changed(request_id: UUID | str) -> None:
    """Drop the cached bodies of a request now, and again when the surrounding transaction commits:
    a poll between the two may cache the state before the commit, which the second drop clears."""
    keys = [_key(request_id, is_chat=False), _key(request_id, is_chat=True)]
    cache.delete_many(keys)
    transaction.on_commit(lambda: cache.delete_many(keys))
