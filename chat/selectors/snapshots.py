"""Process-local snapshots that the status route reads on every poll.

Status is polled every half second by some clients, so it must not walk the queue or load the
worker table per poll. Each web process keeps, for a couple of seconds, the online workers (with
the facts the status derives from them: the horde's throughput, and which workers serve each
model) and the queue order with each request's position and the tokens ahead of it; a request
newer than the snapshot is answered by one live query. Snapshots are derivable, so they never
need Redis. The online workers snapshot is also taken under the workers' serving version
(workers.serving_version) and rebuilt at once when it is read under another one: a worker's first
pop, changed declaration or return online shows in the next answer of every process, not after
the snapshot's lifetime. Both are process caches (contract.process_cache) of one entry: the online
workers keyed by the serving version, the queue by nothing.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any
from uuid import UUID

from django.db import connections, router
from django.db.models import F, TextField
from django.db.models.functions import Cast

from chat.models import GenerationRequest
from chat.selectors.queue import waiting_requests
from contract.process_cache import ProcessCache
from workers.models import Worker
from workers.selectors import worker_chat_declaration, worker_speed, workers_online
from workers.serving_version import current_serving_version

ONLINE_WORKERS_SNAPSHOT_SECONDS = 5
QUEUE_SNAPSHOT_SECONDS = 2
# Text passes one snapshot keeps (OnlineWorkers.text_eligible); past it, passes are made per poll.
TEXT_SHAPES_PER_SNAPSHOT = 4096

# Read when the caller has no serving version of its own.
_ANY_VERSION = object()


@dataclass(frozen=True)
class QueuePlace:
    position: int  # requests ahead in queue order
    tokens_ahead: int  # their outstanding tokens (max_length * jobs waiting)


@dataclass(frozen=True)
class QueuedShape:
    """Queued requests alike in what decides which workers could take them."""

    is_chat: bool
    models: frozenset[str]
    any_model: bool
    max_length: int
    max_context_length: int


# Sets of eligible workers whose combined positions one queue snapshot keeps (a mask each).
SETS_PER_QUEUE_SNAPSHOT = 4096


@dataclass(frozen=True)
class CompetingAhead:
    """The queued work ahead of a request that one of its eligible workers could take."""

    requests: int
    tokens: int
    jobs: int


@dataclass(frozen=True)
class EligibleSet:
    """The online workers eligible for a request, with what the status reads of them."""

    workers: tuple[Worker, ...]
    threads: int
    # Their speed (tokens/s, unmeasured workers at the assumption) times threads.
    tokens_per_second: float
    # The set as a key (its workers' ids) of its queue positions (QueueSnapshot.competing_ahead).
    key: frozenset

    @classmethod
    def of(cls, workers: Iterable[Worker]) -> EligibleSet:
        workers = tuple(workers)
        return cls(
            workers=workers,
            threads=sum(max(w.threads, 1) for w in workers),
            tokens_per_second=sum(worker_speed(w) * max(w.threads, 1) for w in workers),
            key=frozenset(w.pk for w in workers),
        )


NO_ELIGIBLE_WORKER = EligibleSet(workers=(), threads=0, tokens_per_second=0.0, key=frozenset())


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
    # Eligible workers by text request shape (chat.selectors.queue.text_eligibility_shape), found
    # from this snapshot and dropped with it: the polls of a queue ask about a few shapes.
    _text_eligible: dict[tuple, EligibleSet] = field(default_factory=dict, compare=False, repr=False)
    _by_id: dict[Any, Worker] = field(default_factory=dict, compare=False, repr=False)
    # The online workers in maintenance (not paused), by their owner's id: each serves its owner's
    # requests alone (docs/adr/0083), so it counts only in the availability of those.
    in_maintenance: dict[int, tuple[Worker, ...]] = field(default_factory=dict)

    def text_eligible(self, shape: tuple | None, find: Callable[[], EligibleSet]) -> EligibleSet:
        """The eligible workers of a text request of `shape`: `find()` once per shape (every
        time for None, a request with its own worker list)."""
        if shape is None:
            return find()
        eligible = self._text_eligible.get(shape)
        if eligible is None:
            eligible = find()
            if len(self._text_eligible) < TEXT_SHAPES_PER_SNAPSHOT:
                self._text_eligible[shape] = eligible
        return eligible

    def eligible_of(self, worker_ids: Iterable[Any]) -> EligibleSet:
        """The set of those of `worker_ids` still in this snapshot (a cached pass's ids)."""
        if not self._by_id and (self.workers or self.in_maintenance):
            self._by_id.update((w.pk, w) for w in self.workers)
            for owned in self.in_maintenance.values():
                self._by_id.update((w.pk, w) for w in owned)
        return EligibleSet.of(w for w in map(self._by_id.get, worker_ids) if w is not None)

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
    """The snapshot of `workers`: those in maintenance are kept apart, by owner (ADR 0083)."""
    online = tuple(workers)
    workers = tuple(w for w in online if not w.maintenance)
    in_maintenance: dict[int, tuple[Worker, ...]] = {}
    for worker in online:
        if worker.maintenance:
            in_maintenance[worker.owner_id] = (*in_maintenance.get(worker.owner_id, ()), worker)
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
        in_maintenance=in_maintenance,
    )


def _build_online_workers() -> OnlineWorkers:
    return online_workers_of(workers_online().filter(paused=False))


class _PositionMasks:
    """Bitmasks over a queue snapshot's positions (bit i: position i), made with it: each shape's
    positions, and bit planes of the positions' jobs and tokens (plane b: the positions
    whose value has bit b set), so the competing work ahead of a position is a few AND and popcount
    operations on integers, whatever the queue's depth. Shapes are also indexed by model, so a
    worker's competing shapes are found among those that share one of its models."""

    __slots__ = ("by_shape", "job_planes", "token_planes", "text_by_model", "text_any_model", "chat_by_model",
                 "by_worker", "by_set", "by_owner")

    def __init__(self, shape_at: Sequence[int], jobs: Sequence[int], shapes: Sequence[QueuedShape]):
        # Positions grouped by shape, jobs and tokens, then each group's mask from its bytes: linear
        # in the queue's depth, where OR-ing one bit at a time into a growing integer is quadratic.
        by_shape_positions: list[list[int]] = [[] for _ in shapes]
        by_jobs_positions: dict[int, list[int]] = {}
        by_tokens_positions: dict[int, list[int]] = {}
        for position, (shape_index, waiting) in enumerate(zip(shape_at, jobs, strict=True)):
            by_shape_positions[shape_index].append(position)
            by_jobs_positions.setdefault(waiting, []).append(position)
            by_tokens_positions.setdefault(shapes[shape_index].max_length * waiting, []).append(position)
        by_shape = [_mask_of(positions) for positions in by_shape_positions]
        by_jobs = {value: _mask_of(positions) for value, positions in by_jobs_positions.items()}
        by_tokens = {value: _mask_of(positions) for value, positions in by_tokens_positions.items()}
        self.by_shape = by_shape
        self.job_planes = _bit_planes(by_jobs)
        self.token_planes = _bit_planes(by_tokens)
        text_by_model: dict[str, list[int]] = {}
        chat_by_model: dict[str, list[int]] = {}
        text_any_model: list[int] = []
        for shape_index, shape in enumerate(shapes):
            if not shape.is_chat and shape.any_model:
                text_any_model.append(shape_index)
                continue
            for model in shape.models:
                (chat_by_model if shape.is_chat else text_by_model).setdefault(model, []).append(shape_index)
        self.text_by_model = text_by_model
        self.text_any_model = text_any_model
        self.chat_by_model = chat_by_model
        # Each asked worker's positions, by its id, and each asked set's (the OR of its workers').
        self.by_worker: dict[Any, int] = {}
        self.by_set: dict[frozenset, int] = {}
        # The positions of each asked owner's requests: a worker in maintenance competes for its
        # owner's alone (docs/adr/0083, 0089). Made on the first ask, for the owners of such workers.
        self.by_owner: dict[int, int] = {}


def _mask_of(positions: list[int]) -> int:
    """The integer with the bits of `positions` (ascending) set."""
    if not positions:
        return 0
    bits = bytearray(positions[-1] // 8 + 1)
    for position in positions:
        bits[position >> 3] |= 1 << (position & 7)
    return int.from_bytes(bits, "little")


def _bit_planes(by_value: dict[int, int]) -> tuple[int, ...]:
    planes = [0] * max(by_value, default=0).bit_length()
    for value, mask in by_value.items():
        for bit in range(value.bit_length()):
            if value >> bit & 1:
                planes[bit] |= mask
    return tuple(planes)


def _weighted_count(mask: int, planes: tuple[int, ...]) -> int:
    """The sum of the values (as bit planes) at the positions in `mask`."""
    return sum((mask & plane).bit_count() << bit for bit, plane in enumerate(planes))


class QueueSnapshot:
    """The waiting requests in queue order: each one's position and the tokens ahead of it, keyed by
    the id's text as the database writes it (`_id_text`): strings, not UUID objects, so a rebuild of a
    deep queue is a few C loops over the rows and leaves nothing for the garbage collector to walk.

    It also keeps each position's queue score, to place a request newer than the snapshot, and the
    position masks (_PositionMasks) from which competing_ahead counts the work a set of workers
    could take (spec ADR 0040). Both are made with the snapshot, while the other threads still
    answer from the last one."""

    __slots__ = ("_index", "_tokens_ahead", "_neg_scores", "shapes", "_masks", "_users")

    def __init__(
        self,
        ids: Sequence[str],
        tokens: Iterable[int | None],
        *,
        scores: Sequence[int] = (),
        jobs: Sequence[int] = (),
        shape_at: Sequence[int] = (),
        shapes: Sequence[QueuedShape] = (),
        users: Sequence[int] = (),
    ):
        self._index = dict(zip(ids, range(len(ids)), strict=True))
        # tokens_ahead[i]: the outstanding tokens of the requests before position i.
        self._tokens_ahead = list(accumulate((t or 0 for t in tokens), initial=0))
        # Queue order is by descending score: negated, the scores ascend, for bisect.
        self._neg_scores = [-score for score in scores]
        self.shapes = tuple(shapes)
        self._masks = _PositionMasks(shape_at, jobs, self.shapes)
        # Each position's requester (its user id), read only for the owner of a worker in maintenance.
        self._users = users

    def get(self, id_text: str) -> QueuePlace | None:
        position = self._index.get(id_text)
        if position is None:
            return None
        return QueuePlace(position=position, tokens_ahead=self._tokens_ahead[position])

    def position_of_newer(self, queue_score: int) -> int:
        """The position of a request newer than the snapshot: after every request whose score is at
        least its own (those of an equal score were created before it)."""
        return bisect_right(self._neg_scores, -queue_score)

    def _worker_mask(self, worker: Worker, could_take: Callable[[Worker, QueuedShape], bool]) -> int:
        """The positions whose request `worker` could take."""
        masks = self._masks
        mask = masks.by_worker.get(worker.pk)
        if mask is None:
            candidates: set[int] = set()
            if worker.accepts_prompt_jobs:
                candidates.update(masks.text_any_model)
                for model in worker.served_models or ():
                    candidates.update(masks.text_by_model.get(model, ()))
            if worker.accepts_chat_jobs and worker.chat_model_id:
                candidates.update(masks.chat_by_model.get(worker.chat_model_id, ()))
            mask = 0
            for shape_index in candidates:
                if could_take(worker, self.shapes[shape_index]):
                    mask |= masks.by_shape[shape_index]
            masks.by_worker[worker.pk] = mask
        return mask

    def _owner_mask(self, owner_id: int) -> int:
        """The positions of `owner_id`'s requests."""
        masks = self._masks
        mask = masks.by_owner.get(owner_id)
        if mask is None:
            mask = masks.by_owner[owner_id] = _mask_of([i for i, user in enumerate(self._users) if user == owner_id])
        return mask

    def competing_ahead(
        self, position: int, eligible: EligibleSet, could_take: Callable[[Worker, QueuedShape], bool]
    ) -> CompetingAhead:
        """The requests, tokens and jobs before `position` that one of the `eligible` workers
        `could_take`. Each worker's positions, and each set's, are kept with the snapshot: a
        worker's declarations change with the serving version, and the snapshot is dropped within
        QUEUE_SNAPSHOT_SECONDS."""
        masks = self._masks
        competing = masks.by_set.get(eligible.key)
        if competing is None:
            competing = 0
            for worker in eligible.workers:
                if worker.maintenance:
                    # Only its owner's requests: in their eligible sets alone (chat.selectors.availability).
                    competing |= self._worker_mask(worker, could_take) & self._owner_mask(worker.owner_id)
                else:
                    competing |= self._worker_mask(worker, could_take)
            if len(masks.by_set) < SETS_PER_QUEUE_SNAPSHOT:
                masks.by_set[eligible.key] = competing
        ahead = competing & ((1 << position) - 1)
        return CompetingAhead(
            requests=ahead.bit_count(),
            tokens=_weighted_count(ahead, masks.token_planes),
            jobs=_weighted_count(ahead, masks.job_planes),
        )

    def __len__(self) -> int:
        return len(self._index)


def _id_text(request_id: UUID, alias: str) -> str:
    """The request id as the database writes it as text: PostgreSQL's uuid type prints the dashed
    form; a database without one stores the 32 hex digits (Django's UUIDField)."""
    return str(GenerationRequest._meta.pk.get_db_prep_value(request_id, connections[alias]))


def _build_queue() -> QueueSnapshot:
    """One read of the waiting requests (id as text, tokens, jobs and shape) in queue order,
    straight off the cursor: on a deep queue the ORM's per-row conversions, and even one UUID object
    per row, cost more than the query (ten thousand rows every QUEUE_SNAPSHOT_SECONDS, on a serving
    thread). The model list is read as its JSON text, parsed once per distinct shape."""
    queryset = (
        waiting_requests()
        .order_by("-queue_score", "created")
        .annotate(
            id_text=Cast("id", TextField()),
            tokens=F("max_length") * F("jobs_waiting"),
            models_text=Cast("requested_models", TextField()),
        )
        .values_list(
            "id_text", "tokens", "queue_score", "jobs_waiting", "user_id", "is_chat", "any_model", "max_length",
            "max_context_length", "models_text",
        )
    )
    alias = router.db_for_read(GenerationRequest)
    sql, params = queryset.query.get_compiler(using=alias).as_sql()
    with connections[alias].cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    shape_index: dict[tuple, int] = {}
    shapes: list[QueuedShape] = []
    shape_at: list[int] = []
    for row in rows:
        key = row[5:]
        index = shape_index.get(key)
        if index is None:
            index = shape_index[key] = len(shapes)
            is_chat, any_model, max_length, max_context_length, models_text = key
            shapes.append(
                QueuedShape(
                    is_chat=bool(is_chat),
                    models=frozenset(json.loads(models_text) if models_text else ()),
                    any_model=bool(any_model),
                    max_length=max_length,
                    max_context_length=max_context_length,
                )
            )
        shape_at.append(index)
    return QueueSnapshot(
        [row[0] for row in rows],
        [row[1] for row in rows],
        scores=[row[2] for row in rows],
        jobs=[row[3] for row in rows],
        shape_at=shape_at,
        shapes=shapes,
        users=[row[4] for row in rows],
    )


# One entry each: a new version's snapshot replaces the last one. Readers keep the expired
# snapshot while one thread rebuilds it, and wait under a new version (get_or_build).
_online_workers: ProcessCache[Any, OnlineWorkers] = ProcessCache(
    "online workers snapshot", ttl=ONLINE_WORKERS_SNAPSHOT_SECONDS, max_entries=1
)
_queue: ProcessCache[None, QueueSnapshot] = ProcessCache("queue snapshot", ttl=QUEUE_SNAPSHOT_SECONDS, max_entries=1)


def online_workers(serving_version: Any = _ANY_VERSION) -> list[Worker]:
    """Online workers (checked in within WORKER_ONLINE_SECONDS), not in maintenance or paused."""
    return list(online_worker_facts(serving_version).workers)


def online_worker_facts(serving_version: Any = _ANY_VERSION) -> OnlineWorkers:
    """The online workers snapshot with its derived facts (read-only: shared by threads), as of
    the workers' serving version: the caller's (read with its other keys), else read now."""
    if serving_version is _ANY_VERSION:
        serving_version = current_serving_version()
    # The version was read before this build's database read: a change committed after that read
    # bumps it again, and the next read rebuilds.
    return _online_workers.get_or_build(serving_version, _build_online_workers)


def queue_snapshot() -> QueueSnapshot:
    return _queue.get_or_build(None, _build_queue)


def queue_place(request_id: UUID, snapshot: QueueSnapshot | None = None) -> QueuePlace | None:
    """The request's place in the last queue snapshot (or `snapshot`); None when it is newer."""
    snapshot = queue_snapshot() if snapshot is None else snapshot
    return snapshot.get(_id_text(request_id, router.db_for_read(GenerationRequest)))


def reset_snapshots() -> None:
    """Forget both snapshots (as when they expire; contract.process_cache.reset_process_caches
    forgets every process cache)."""
    _online_workers.clear()
    _queue.clear()
