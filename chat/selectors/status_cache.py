"""The status body of a request, cached for a couple of seconds.

Clients poll a request's status every half second or so, and most polls find nothing changed.
Every write that changes what the status shows (pop, submit, fault, cancel, expiry) bumps the
request's status version when it commits, and a body is served only under the version it was
built at (read before the build's database read). So a poll after a completion signal always
reads the new state, even when a poll that read the database before the commit stores its body
after it; the short lifetime bounds what the writes do not announce (queue position). A body is
also served only under the workers' serving version it was built at (workers.serving_version), read
in the same round trip, so a worker's check-in that changes what it serves shows at once.

A poll costs at most two cache round trips: one read of the body with the keys a miss needs
(the request's availability), and, on a miss, one write of the body with what the build cached.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from django.core.cache import cache
from django.db import transaction

from workers.serving_version import serving_version_cache_key, serving_version_in

logger = logging.getLogger(__name__)

STATUS_CACHE_SECONDS = 2
# A request lives 20 minutes from its last pop; its version key a little longer.
STATUS_VERSION_SECONDS = 30 * 60


def _key(request_id: UUID | str, *, is_chat: bool) -> str:
    return f"horde:status:{'chat' if is_chat else 'text'}:{request_id}"


def _version_key(request_id: UUID | str) -> str:
    return f"horde:status:version:{request_id}"


@dataclass
class StatusRead:
    """What a status build finds already read (`prefetched`: the keys found among those asked
    for with the body; `serving_version`: the workers' serving version, read with them) and the
    cache writes it leaves to be sent with the body's."""

    prefetched: dict[str, Any] = field(default_factory=dict)
    writes: list[tuple[str, Any, float]] = field(default_factory=list)
    serving_version: Any = None

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
    version_key = _version_key(request_id)
    serving_key = serving_version_cache_key()
    found = cache.get_many([key, version_key, *((serving_key,) if serving_key else ()), *prefetch])
    entry = found.pop(key, None)
    version = found.pop(version_key, None) or 0
    # A body also holds only under the workers' serving version it was built at: availability
    # (is_possible, eligible_worker_threads, impossible_reason) follows a worker's check-in at once.
    serving = found.pop(serving_key, None) if serving_key else serving_version_in(found)
    if isinstance(entry, tuple) and len(entry) == 3 and entry[0] == version and entry[1] == serving:
        return entry[2]
    read = StatusRead(prefetched=found, serving_version=serving)
    body = build(read)
    if body is not None:
        read.writes.insert(0, (key, (version, serving, body), STATUS_CACHE_SECONDS))
    _set_together(read.writes)
    return body


def status_changed(request_id: UUID | str) -> None:
    """Make the request's cached bodies stale now and, inside a transaction, again when it commits:
    a body built from an earlier read no longer matches the version."""
    _bump_version(request_id)
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: _bump_version(request_id), robust=True)


def _bump_version(request_id: UUID | str) -> None:
    key = _version_key(request_id)
    client = getattr(cache, "client", None)
    try:
        if hasattr(client, "get_client"):
            # django-redis: one SET of a fresh random version with its expiry (a version is only
            # compared for equality); stored as a plain integer, which django-redis reads back as one.
            client.get_client(write=True).set(
                cache.make_key(key), secrets.randbits(62) + 1, ex=STATUS_VERSION_SECONDS
            )
        else:
            cache.add(key, 0, STATUS_VERSION_SECONDS)
            cache.incr(key)
    except Exception:
        # As the cache's IGNORE_EXCEPTIONS does: with Redis down no body is served from it either.
        if not getattr(cache, "_ignore_exceptions", False):
            raise
        logger.warning("status version bump failed for %s", request_id, exc_info=True)
