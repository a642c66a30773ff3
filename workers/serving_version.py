"""The workers' serving version: a value that changes whenever a check-in changes what a worker
serves (its first pop, a changed declaration, coming back online) or its owner switches its
maintenance or pause.

Every web process keeps snapshots derived from the online workers (chat.selectors.snapshots) and caches each
request's availability (chat.selectors.availability); both record the version they were built at and are
rebuilt as soon as the version they are read under differs, so such a check-in shows in every
process's answers at once. With Redis the version is a counter there, which the status route reads
in the round trip it already makes; without Redis it is the latest `serving_changed_at` of the
worker table (one indexed read), which the same check-in writes. An unchanged pop changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import Max

from workers.models import Worker

logger = logging.getLogger(__name__)

WORKERS_SERVING_VERSION_KEY = "horde:workers:serving-version"


def _on_redis() -> bool:
    """Whether the cache is django-redis on REDIS_URL (checked per call: tests switch settings)."""
    return bool(settings.REDIS_URL) and hasattr(getattr(cache, "client", None), "get_client")


def _redis():
    return cache.client.get_client(write=True) if _on_redis() else None


def serving_version_cache_key() -> str | None:
    """The cache key of the version, for a reader that fetches it with other keys (cache.get_many);
    None without Redis, where the version is read from the database (serving_version_in)."""
    return WORKERS_SERVING_VERSION_KEY if _on_redis() else None


def _database_version() -> Any:
    return Worker.objects.aggregate(version=Max("serving_changed_at"))["version"]


def serving_version_in(found: Mapping[str, Any]) -> Any:
    """The version from a cache.get_many that asked for serving_version_cache_key() (None when the
    counter was never bumped); read from the database without Redis."""
    if not _on_redis():
        return _database_version()
    return found.get(WORKERS_SERVING_VERSION_KEY)


def current_serving_version() -> Any:
    """The version now: one cache read with Redis (None when Redis fails, as the cache's
    IGNORE_EXCEPTIONS answers), one indexed database read without."""
    if not _on_redis():
        return _database_version()
    return cache.get(WORKERS_SERVING_VERSION_KEY)


def serving_changed() -> None:
    """A worker's serving changed: bump the counter now and, inside a transaction, again when it
    commits (a reader that took the first bump may have read the rows before the commit). Without
    Redis the check-in's write of serving_changed_at is the change."""
    if not _on_redis():
        return
    _bump()
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(_bump, robust=True)


def _bump() -> None:
    try:
        _redis().incr(cache.make_key(WORKERS_SERVING_VERSION_KEY))
    except Exception:
        # With Redis down readers see no version either, and fall back to the snapshots' lifetime.
        logger.warning("workers serving version bump failed", exc_info=True)
