"""The workers' serving version: a value that changes whenever a check-in changes what a worker
serves (its first pop, a changed declaration, coming back online) or its owner switches its
maintenance or pause.

Every web process keeps snapshots derived from the online workers (chat.selectors.snapshots) and
caches each chat request's availability (chat.selectors.availability); both record the version
they were built at and are rebuilt as soon as the version they are read under differs, so such a
check-in shows in every process's answers at once.

The version is a counter in one database row (workers.models.ServingVersion, ADR 0044), on every
backend: the status poll reads it in its request's own statement (chat.sql), so a poll is one round
trip. The change is written first and the counter after it (both commit on their own, or together
in the caller's transaction), so a reader that sees the new count finds the change in the rows it
reads next. An unchanged pop changes nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import DatabaseError, connection
from django.db.models import Subquery

from workers.models import ServingVersion

logger = logging.getLogger(__name__)

SERVING_VERSION_ROW = 1


def serving_version_subquery() -> Subquery:
    """The version as an expression, for a statement that reads it beside its own rows."""
    return Subquery(ServingVersion.objects.filter(pk=SERVING_VERSION_ROW).values("version")[:1])


def current_serving_version() -> Any:
    """The version now (None before the first change): one primary-key read."""
    return ServingVersion.objects.filter(pk=SERVING_VERSION_ROW).values_list("version", flat=True).first()


def serving_changed() -> None:
    """A worker's serving changed: count it, after the change's own write. The row is made by the
    first change (a flushed test database has none)."""
    table = connection.ops.quote_name(ServingVersion._meta.db_table)
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (id, version) VALUES (%s, 1)"
                f" ON CONFLICT (id) DO UPDATE SET version = {table}.version + 1",
                [SERVING_VERSION_ROW],
            )
    except DatabaseError:
        if connection.in_atomic_block:  # the caller's transaction failed with it: theirs to handle
            raise
        # The change itself is committed: readers catch up within the snapshots' lifetime.
        logger.warning("workers serving version bump failed", exc_info=True)
