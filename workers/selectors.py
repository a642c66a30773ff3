"""Reads on the worker registry."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import QuerySet
from django.utils import timezone

from contract.text import (
    SLOW_TEXT_WORKER_TOKENS_PER_SECOND,
    UNMEASURED_TEXT_WORKER_TOKENS_PER_SECOND,
    WORKER_ONLINE_SECONDS,
    is_validated_bridge,
)
from workers.models import Worker


def online_cutoff(now: datetime | None = None) -> datetime:
    return (now or timezone.now()) - timedelta(seconds=WORKER_ONLINE_SECONDS)


def workers_online() -> QuerySet[Worker]:
    return Worker.objects.filter(last_check_in__gte=online_cutoff()).select_related("owner")


def worker_speed(worker: Worker) -> float:
    """Tokens per second; a worker without samples runs at the unmeasured assumption."""
    return worker.speed if worker.speed is not None else UNMEASURED_TEXT_WORKER_TOKENS_PER_SECOND


def worker_is_slow(worker: Worker) -> bool:
    return worker_speed(worker) < SLOW_TEXT_WORKER_TOKENS_PER_SECOND


def worker_is_validated(worker: Worker) -> bool:
    return is_validated_bridge(worker.bridge_agent)
