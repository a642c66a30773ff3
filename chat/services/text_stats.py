"""The text statistics' store (ADR 0100): an expiring request's finished generations, folded into
per-model, per-minute counts in the transaction that deletes it; minutes past the month's window
compacted into one all-time row per model."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from chat.models import TextGenerationStat

# Past the 30-day window (and its minute of overlap) only the all-time figures read a minute: its
# counts move into the model's row at EARLIER, which no window reaches.
COMPACT_AFTER = timedelta(days=31)
EARLIER = datetime(1970, 1, 1, tzinfo=UTC)
COMPACT_BATCH = 10000


def fold_finished_generations(*, finished: list[tuple[str, datetime]], max_length: int) -> None:
    """Add each (model, finished_at) generation to its model's minute: one request and max_length
    tokens, as upstream counts them. Called inside the deleting transaction (the caller's atomic)."""
    buckets = Counter((model, at.replace(second=0, microsecond=0)) for model, at in finished)
    _add({key: (count, count * max_length) for key, count in buckets.items()})


def compact_text_stats() -> int:
    """Move the minutes older than COMPACT_AFTER into their model's all-time row (a beat pass, run
    with the expiry sweep); the number of minutes moved. The minutes are locked and deleted before
    their counts are added, so a concurrent pass finds them gone and adds nothing."""
    cutoff = timezone.now() - COMPACT_AFTER
    with transaction.atomic():
        old = list(
            TextGenerationStat.objects.select_for_update()
            .filter(minute__lt=cutoff, minute__gt=EARLIER)
            .order_by("model", "minute")
            .values_list("pk", "model", "requests", "tokens")[:COMPACT_BATCH]
        )
        if not old:
            return 0
        TextGenerationStat.objects.filter(pk__in=[row[0] for row in old]).delete()
        sums: dict[tuple[str, datetime], tuple[int, int]] = {}
        for _, model, requests, tokens in old:
            before = sums.get((model, EARLIER), (0, 0))
            sums[(model, EARLIER)] = (before[0] + requests, before[1] + tokens)
        _add(sums)
    return len(old)


def _add(counts: dict[tuple[str, datetime], tuple[int, int]]) -> None:
    """Add (requests, tokens) to each (model, minute) row, creating it if new: one statement, keys
    sorted, so two transactions adding to the same rows wait on each other in one order (no
    deadlock), and the unique (model, minute) makes a concurrent first insert an update."""
    if not counts:
        return
    table = TextGenerationStat._meta.db_table
    adapt = connection.ops.adapt_datetimefield_value
    rows = sorted(counts.items())
    params: list = []
    for (model, minute), (requests, tokens) in rows:
        params += [model, adapt(minute), requests, tokens]
    values = ", ".join(["(%s, %s, %s, %s)"] * len(rows))
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (model, minute, requests, tokens) VALUES {values} "  # noqa: S608 (our table)
            f"ON CONFLICT (model, minute) DO UPDATE SET requests = {table}.requests + excluded.requests, "
            f"tokens = {table}.tokens + excluded.tokens",
            params,
        )
