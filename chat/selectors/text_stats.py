"""GET /stats/text/totals and /stats/text/models (ADR 0100): the finished text generations of the
past minute, hour, day, 30 days and all time, counted from the generations still stored and the
per-minute counts the expiry sweep folded the deleted ones into, in one statement (one snapshot:
a generation is in one or the other, never both, never neither)."""

from __future__ import annotations

from datetime import timedelta

from django.core.cache import cache
from django.db import connection
from django.utils import timezone

from chat.model_reference import is_known_text_model
from chat.models import Generation, GenerationRequest, TextGenerationStat

# Upstream answers both routes from a 50 s cache over statistics compiled each minute.
TEXT_STATS_CACHE_SECONDS = 50
TOTALS_CACHE_KEY = "horde:stats-text-totals"
MODELS_CACHE_KEY = "horde:stats-text-models"
TOTALS_WINDOWS = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1),
                  "month": timedelta(days=30)}


def _counted_sql(windows: list[timedelta]) -> tuple[str, list]:
    """Rows (model, n, k, w0, w1...): the stored minutes and each finished generation still stored,
    with their requests (n), tokens (k) and, per window, 1 when in it. A stored minute is in a window
    it overlaps, so a window's oldest edge is within a minute for the deleted generations."""
    generation, request = Generation._meta.db_table, GenerationRequest._meta.db_table
    states = [str(state) for state in Generation.FINISHED_STATES]
    now = timezone.now()
    adapt = connection.ops.adapt_datetimefield_value
    stored_flags = ", ".join(f"CASE WHEN minute > %s THEN 1 ELSE 0 END AS w{i}" for i in range(len(windows)))
    live_flags = ", ".join(f"CASE WHEN g.finished_at >= %s THEN 1 ELSE 0 END AS w{i}" for i in range(len(windows)))
    sql = (
        f"SELECT model, requests AS n, tokens AS k, {stored_flags} FROM {TextGenerationStat._meta.db_table} "
        f"UNION ALL SELECT g.model, 1, r.max_length, {live_flags} FROM {generation} g "
        f"JOIN {request} r ON r.id = g.request_id "
        f"WHERE g.state IN ({', '.join(['%s'] * len(states))}) AND g.finished_at IS NOT NULL"
    )
    params: list = [adapt(now - window - timedelta(minutes=1)) for window in windows]
    params += [adapt(now - window) for window in windows] + states
    return sql, params


def text_stats_totals() -> dict[str, dict[str, int]]:
    """{minute|hour|day|month|total: {requests, tokens}}, as upstream's StatsTxtTotals."""
    body = cache.get(TOTALS_CACHE_KEY)
    if body is not None:
        return body
    counted, params = _counted_sql(list(TOTALS_WINDOWS.values()))
    columns = [f"SUM(n * w{i}), SUM(k * w{i})" for i in range(len(TOTALS_WINDOWS))]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(columns)}, SUM(n), SUM(k) FROM ({counted}) counted", params)  # noqa: S608
        sums = [int(value or 0) for value in cursor.fetchone()]
    periods = [*TOTALS_WINDOWS, "total"]
    body = {period: {"requests": sums[2 * i], "tokens": sums[2 * i + 1]} for i, period in enumerate(periods)}
    cache.set(TOTALS_CACHE_KEY, body, TEXT_STATS_CACHE_SECONDS)
    return body


def text_stats_models(*, model_state: str = "all") -> dict[str, dict[str, int]]:
    """{day|month|total: {model: requests}}, as upstream's TxtModelStats; model_state keeps the models
    in the text model reference (known), out of it (custom) or either (all), as the image route's."""
    body = cache.get(MODELS_CACHE_KEY)
    if body is None:
        counted, params = _counted_sql([TOTALS_WINDOWS["day"], TOTALS_WINDOWS["month"]])
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT model, SUM(n * w0), SUM(n * w1), SUM(n) FROM ({counted}) counted "  # noqa: S608
                "GROUP BY model ORDER BY model",
                params,
            )
            rows = cursor.fetchall()
        body = {period: {row[0]: int(row[i + 1] or 0) for row in rows} for i, period in enumerate(("day", "month", "total"))}
        cache.set(MODELS_CACHE_KEY, body, TEXT_STATS_CACHE_SECONDS)
    if model_state == "all":
        return body
    known = model_state == "known"
    return {period: {m: n for m, n in counts.items() if is_known_text_model(m) == known} for period, counts in body.items()}
