"""The health verdict behind /healthz: the database answers, and beat's sweeps keep running.

Each sweep records when it finished (chat.models.SweepRun). One that has not finished for
HORDE_SWEEP_LATE_SECONDS (never, counted from this process's start) is late; a task scheduled less
often than the sweeps has three of its own intervals when that is longer. A late sweep makes the
answer unhealthy: a dead beat is otherwise invisible (the worker keeps reporting ready)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone

from chat.models import SweepRun
from hordesite import db_guard

PROCESS_STARTED = timezone.now()

_DATABASE_UNREACHABLE = {"status": "unhealthy", "database": "unreachable"}


def scheduled_sweeps() -> dict[str, float]:
    """Each scheduled task with its interval in seconds (the shortest, if scheduled twice)."""
    intervals: dict[str, float] = {}
    for entry in settings.CELERY_BEAT_SCHEDULE.values():
        schedule = entry["schedule"]
        seconds = float(schedule.total_seconds() if isinstance(schedule, timedelta) else schedule)
        intervals[entry["task"]] = min(seconds, intervals.get(entry["task"], seconds))
    return dict(sorted(intervals.items()))


def sweep_health() -> tuple[bool, dict]:
    """(healthy, body): when each scheduled sweep last finished and whether it is late; unhealthy
    at once while the database is unavailable or unreachable."""
    now = timezone.now()
    late_after = timedelta(seconds=settings.HORDE_SWEEP_LATE_SECONDS)
    if db_guard.unavailable_now():  # as the native routes: at once, not after the pool's timeout
        return False, dict(_DATABASE_UNREACHABLE)
    try:
        finished: dict[str, datetime] = dict(SweepRun.objects.values_list("task", "finished_at"))
    except DatabaseError as error:
        if db_guard.is_connection_failure(error):
            db_guard.on_connection_failure(error)  # probes; an unreachable server starts the window
        return False, dict(_DATABASE_UNREACHABLE)
    sweeps = {}
    for task, interval in scheduled_sweeps().items():
        last = finished.get(task)
        # A task scheduled less often than the sweeps (the hourly orphan sweep) has three of its
        # own intervals when that is longer.
        late = late_after
        if interval > settings.HORDE_SWEEP_INTERVAL_SECONDS:
            late = max(late_after, timedelta(seconds=3 * interval))
        sweeps[task] = {
            "last_finished_at": last.isoformat() if last else None,
            "late": now - (last or PROCESS_STARTED) > late,
        }
    healthy = not any(sweep["late"] for sweep in sweeps.values())
    return healthy, {"status": "ok" if healthy else "unhealthy", "sweeps": sweeps}
