"""Process-local snapshots that the status route reads on every poll.

Status is polled every half second by some clients, so it must not walk the queue or load the
worker table per poll. Each web process keeps, for a couple of seconds, the online workers (with
the facts the status derives from them: the horde's throughput, and which workers serve each
model) and the queue order with each request's position and the tokens ahead of it; a request
newer than the snapshot is answered by one live query. Snapshots are derivable, so they never
need Redis. The online workers snapshot is also taken under the workers' serving version
(workers.serving_version) and rebuilt at once when it is read under another one: a worker's first
pop, changed declaration or return online shows in the next answer of every process, not after
the snapshot's lifetime.

Other process-local memos of the status path (compiled reads) register with `on_reset`, so
`reset_snapshots()` forgets every one of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from uuid import UUID

from django.db import connections, router
from django.db.models import F

from chat.models import GenerationRequest
from chat.selectors.queue import waiting_requests
from workers.models import Worker
from workers.selectors import worker_chat_declaration, worker_speed, workers_online
from workers.serving_version import current_serving_version

ONLINE_WORKERS_SNAPSHOT_SECONDS = 5
QUEUE_SNAPSHOT_SECONDS = 2

T = TypeVar("T")


_ANY_VERSION = object()


class _Snapshot(Generic[T]):
    """A value rebuilt at most every `seconds`, shared by the threads of one process, and at once
    when it is read under another `version` than it was built at (see workers.serving_version)."""

    def __init__(self, build: Callable[[], T], seconds: float):
        self._build = build
        self._seconds = seconds
        self._lock = threading.Lock()
        self._value: T | None = None
        self._version: Any = None
        self._taken = 0.0

    def _holds(self, version: Any) -> bool:
        return self._value is not None and (version is _ANY_VERSION or version == self._version)

    def get(self, version: Any = _ANY_VERSION) -> T:
        if self._holds(version) and time.monotonic() - self._taken <= self._seconds:
            return self._value  # type: ignore[return-value]
        # One thread rebuilds; while only the lifetime ran out the others keep reading the previous
        # snapshot meanwhile. Under a new version (a worker changed what it serves) they wait: the
        # previous one no longer holds.
        if self._lock.acquire(blocking=not self._holds(version)):
            try:
                if not self._holds(version) or time.monotonic() - self._taken > self._seconds:
                    # The version was read before this build's database read: a change committed
                    # after that read bumps it again, and the next read rebuilds.
                    self._value = self._build()
                    self._taken = time.monotonic()
                    if version is not _ANY_VERSION:
                        self._version = version
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


@dataclass(frozen=True)
class OnlineWorkers:
    """The online workers and what the status derives from them, once per snapshot."""

    workers: tuple[Worker, ...]
    # Sum of speed (tokens/s, unmeasured workers at the assumption) times threads.
    tokens_per_second: float
    # Positions in `workers` of those taking prompt (text) jobs: all of them, and per served model.
    text_workers: tuple[int, ...] = ()
    text_by_model: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Positions of the workers whose chat declaration serves a model_id (chat jobs with limits).
    chat_by_model: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def _union(self, index: dict[str, tuple[int, ...]], models: Iterable[str]) -> list[Worker]:
        positions: set[int] = set()
        for name in models:
            positions.update(index.get(name, ()))
        return [self.workers[i] for i in sorted(positions)]

    def text_candidates(self, models: Iterable[str], *, any_model: bool) -> list[Worker]:
        """The only workers that may take a text request for `models` (a superset of those that
        pass every rule: the models and the prompt-jobs flag alone), in snapshot order."""
        if any_model:
            return [self.workers[i] for i in self.text_workers]
        return self._union(self.text_by_model, models)

    def chat_candidates(self, models: Iterable[str]) -> list[Worker]:
        """The workers whose chat declaration serves one of `models` (eligibility rule 1), in
        snapshot order."""
        return self._union(self.chat_by_model, models)


def online_workers_of(workers: Iterable[Worker]) -> OnlineWorkers:
    workers = tuple(workers)
    text_by_model: dict[str, list[int]] = {}
    chat_by_model: dict[str, list[int]] = {}
    for position, worker in enumerate(workers):
        if worker.accepts_prompt_jobs:
            for name in dict.fromkeys(worker.served_models or ()):
                text_by_model.setdefault(name, []).append(position)
        declaration = worker_chat_declaration(worker)
        if declaration.chat_jobs and declaration.model_id is not None and declaration.chat_limits is not None:
            chat_by_model.setdefault(declaration.model_id, []).append(position)
    return OnlineWorkers(
        workers=workers,
        tokens_per_second=sum(worker_speed(w) * max(w.threads, 1) for w in workers),
        text_workers=tuple(i for i, w in enumerate(workers) if w.accepts_prompt_jobs),
        text_by_model={name: tuple(ps) for name, ps in text_by_model.items()},
        chat_by_model={name: tuple(ps) for name, ps in chat_by_model.items()},
    )


def _build_online_workers() -> OnlineWorkers:
    return online_workers_of(workers_online().filter(maintenance=False, paused=False))


class QueueSnapshot:
    """The waiting requests in queue order: each one's position and the tokens ahead of it."""

    __slots__ = ("_index", "_tokens_ahead")

    def __init__(self, rows: Iterable[tuple[UUID, int]]):
        index: dict[UUID, int] = {}
        tokens_ahead: list[int] = []
        tokens = 0
        for request_id, request_tokens in rows:
            index[request_id] = len(tokens_ahead)
            tokens_ahead.append(tokens)
            tokens += request_tokens or 0
        self._index = index
        self._tokens_ahead = tokens_ahead

    def get(self, request_id: UUID) -> QueuePlace | None:
        position = self._index.get(request_id)
        if position is None:
            return None
        return QueuePlace(position=position, tokens_ahead=self._tokens_ahead[position])

    def __len__(self) -> int:
        return len(self._tokens_ahead)


def _build_queue() -> QueueSnapshot:
    """One read of the waiting requests' (id, tokens) in queue order, straight off the cursor:
    the ORM's per-row conversions cost more than the query on a deep queue."""
    queryset = (
        waiting_requests()
        .order_by("-queue_score", "created")
        .annotate(tokens=F("max_length") * F("jobs_waiting"))
        .values_list("id", "tokens")
    )
    alias = router.db_for_read(GenerationRequest)
    compiler = queryset.query.get_compiler(using=alias)
    sql, params = compiler.as_sql()
    connection = connections[alias]
    id_expression = compiler.select[0][0]
    id_converters = compiler.get_converters([id_expression]).get(0, ((), None))[0]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    if id_converters:  # e.g. SQLite stores UUIDs as text; PostgreSQL returns them as UUIDs
        converted = []
        for request_id, tokens in rows:
            for converter in id_converters:
                request_id = converter(request_id, id_expression, connection)
            converted.append((request_id, tokens))
        rows = converted
    return QueueSnapshot(rows)


_online_workers = _Snapshot(_build_online_workers, ONLINE_WORKERS_SNAPSHOT_SECONDS)
_queue = _Snapshot(_build_queue, QUEUE_SNAPSHOT_SECONDS)
_reset_hooks: list[Callable[[], None]] = []


def online_workers(serving_version: Any = _ANY_VERSION) -> list[Worker]:
    """Online workers (checked in within WORKER_ONLINE_SECONDS), not in maintenance or paused."""
    return list(online_worker_facts(serving_version).workers)


def online_worker_facts(serving_version: Any = _ANY_VERSION) -> OnlineWorkers:
    """The online workers snapshot with its derived facts (read-only: shared by threads), as of
    the workers' serving version: the caller's (read with its other keys), else read now."""
    if serving_version is _ANY_VERSION:
        serving_version = current_serving_version()
    return _online_workers.get(serving_version)


def queue_place(request_id: UUID) -> QueuePlace | None:
    """The request's place in the last queue snapshot; None when it is newer than the snapshot."""
    return _queue.get().get(request_id)


def on_reset(hook: Callable[[], None]) -> Callable[[], None]:
    """Register a process-local memo to forget in reset_snapshots()."""
    _reset_hooks.append(hook)
    return hook


def reset_snapshots() -> None:
    """Forget both snapshots and every registered memo (tests, and after a change that must show
    at once)."""
    _online_workers.reset()
    _queue.reset()
    for hook in _reset_hooks:
        hook()
