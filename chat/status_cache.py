"""The status body of a request, cached for a couple of seconds.

Clients poll a request's status every half second or so, and most polls find nothing changed.
Every write that changes what the status shows (pop, submit, fault, cancel, expiry) drops the
cached body when it commits, so a poll after a completion signal always reads the new state;
the short lifetime bounds what the writes do not announce (queue position, availability).

A poll costs at most two cache round trips: one read of the body with the keys a miss needs
(the request's availability), and, on a miss, one write of the body with what the build cached.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from django.core.cache import cache
from django.db import transaction

logger = logging.getLogger(__name__)

STATUS_CACHE_SECONDS = 2


def _key(request_id: UUID | str, *, is_chat: bool) -> str:
    return f"horde:status:{'chat' if is_chat else 'text'}:{request_id}"


@dataclass
class StatusRead:
    """What a status build finds already read (`prefetched`: the keys found among those asked
    for with the body) and the cache writes it leaves to be sent with the body's."""

    prefetched: dict[str, Any] = field(default_factory=dict)
    writes: list[tuple[str, Any, float]] = field(default_factory=list)

    def set_later(self, key: str, value: Any, timeout: float) -> None:
        self.writes.append((key, value, timeout))


def _set_together(writes: list[tuple[str, Any, float]]) -> None:
    """cache.set for each (key, value, timeout); in one round trip on django-redis."""
    if not writes:
        return
    client = getattr(cache, "client", None)
    if len(writes) == 1 or not hasattr(client, "get_client"):
        for key, value, timeout in writes:
            cache.set(key, value, timeout)
        return
    try:
        pipeline = client.get_client(write=True).pipeline(transaction=False)
        for key, value, timeout in writes:
            client.set(key, value, timeout, client=pipeline)
        pipeline.execute()
    except Exception:
        # As the cache's IGNORE_EXCEPTIONS does for single commands: the writes are best effort.
        if not getattr(cache, "_ignore_exceptions", False):
            raise
        logger.debug("status cache write failed", exc_info=True)


def cached_status(
    request_id: UUID,
    *,
    is_chat: bool,
    build: Callable[[StatusRead], dict | None],
    prefetch: Sequence[str] = (),
) -> dict | None:
    """The cached body, or `build(read)`'s (None when the request does not exist: not cached).
    The `prefetch` keys are read in the same round trip as the body; the writes the build leaves
    in `read` go out with the body's."""
    key = _key(request_id, is_chat=is_chat)
    if prefetch:
        prefetched = cache.get_many([key, *prefetch])
        body = prefetched.pop(key, None)
    else:
        prefetched = {}
        body = cache.get(key)
    if body is None:
        read = StatusRead(prefetched=prefetched)
        body = build(read)
        if body is not None:
            read.writes.insert(0, (key, body, STATUS_CACHE_SECONDS))
        _set_together(read.writes)
    return body


def status_changed(request_id: UUID | str) -> None:
    """Drop the cached bodies of a request now, and again when the surrounding transaction commits:
    a poll between the two may cache the state before the commit, which the second drop clears."""
    keys = [_key(request_id, is_chat=False), _key(request_id, is_chat=True)]
    cache.delete_many(keys)
    # Outside a transaction (a one-statement pop or submit) the write has committed already.
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: cache.delete_many(keys))
