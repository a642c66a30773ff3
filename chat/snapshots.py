"""Process-local snapshots that the status route reads on every poll.

Status is polled every half second by some clients, so it must not walk the queue or load the
worker table per poll. Each web process keeps, for a couple of seconds, the online workers and
the queue order with each request's position and the tokens ahead of it; a request newer than
the snapshot is answered by one live query. Snapshots are derivable, so they never need Redis.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar
from uuid import UUID

from django.db.models import F

from chat.matching import waiting_requests
from workers.models import Worker
from workers.selectors import workers_online

ONLINE_WORKERS_SNAPSHOT_SECONDS = 5
QUEUE_SNAPSHOT_SECONDS = 2

T = TypeVar("T")


class _Snapshot(Generic[T]):
    """A value rebuilt at most every `seconds`, shared by the threads of one process."""

    def __init__(self, build: Callable[[], T], seconds: float):
        self._build = build
        self._seconds = seconds
        self._lock = threading.Lock()
        self._value: T | None = None
        self._taken = 0.0

    def get(self) -> T:
        if self._value is not None and time.monotonic() - self._taken <= self._seconds:
            return self._value
        # One thread rebuilds; the others keep reading the previous snapshot meanwhile, and wait
        # only when there is none yet.
        if self._lock.acquire(blocking=self._value is None):
            try:
                if self._value is None or time.monotonic() - self._taken > self._seconds:
                    self._value = self._build()
                    self._taken = time.monotonic()
            finally:
                self._lock.release()
        return self._value  # type: ignore[return-value]

    def reset(self) -> None:
        with self._lock:
            self._value = None


@dataclass(frozen=True)
class QueuePlace:
    position: int  # requests ahead in queue order
    tokens_ahead: int  # their outstanding tokens (max_length * jobs waiting)


def _build_online_workers() -> list[Worker]:
    return list(workers_online().filter(maintenance=False, paused=False))


def _build_queue() -> dict[UUID, QueuePlace]:
    places: dict[UUID, QueuePlace] = {}
    tokens = 0
    rows = (
        waiting_requests()
        .order_by("-queue_score", "created")
        .annotate(tokens=F("max_length") * F("jobs_waiting"))
        .values_list("id", "tokens")
    )
    for position, (request_id, request_tokens) in enumerate(rows):
        places[request_id] = QueuePlace(position=position, tokens_ahead=tokens)
        tokens += request_tokens
    return places


_online_workers = _Snapshot(_build_online_workers, ONLINE_WORKERS_SNAPSHOT_SECONDS)
_queue = _Snapshot(_build_queue, QUEUE_SNAPSHOT_SECONDS)


def online_workers() -> list[Worker]:
    """Online workers (checked in within WORKER_ONLINE_SECONDS), not in maintenance or paused."""
    return _online_workers.get()


def queue_place(request_id: UUID) -> QueuePlace | None:
    """The request's place in the last queue snapshot; None when it is newer than the snapshot."""
    return _queue.get().get(request_id)


def reset_snapshots() -> None:
    """Forget both snapshots (tests, and after a change that must show at once)."""
    _online_workers.reset()
    _queue.reset()
