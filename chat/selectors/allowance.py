"""The queue wait on a request's eligible workers (spec ADR 0040), read by the free output
allowance at creation (chat_requests.md, "Free output allowance") and by the status route.

The wait divides the queued output that at least one eligible worker could take by those workers'
throughput. At creation the queued requests are read as their shapes (models, kind, sizes) with
their waiting jobs, one grouped query kept for QUEUE_SNAPSHOT_SECONDS per process: a creation does
not walk the queue. A status poll reads the work ahead of its request in the queue snapshot, whose
running sums per set of eligible workers are made once per snapshot (QueueSnapshot.competing_ahead).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Sum

from chat.models import GenerationRequest
from chat.selectors.queue import capable_chat_worker_online, waiting_requests, worker_may_take
from chat.selectors.snapshots import (
    QUEUE_SNAPSHOT_SECONDS,
    EligibleSet,
    QueuedShape,
    QueueSnapshot,
    online_worker_facts,
)
from contract.process_cache import ProcessCache
from workers.models import Worker
from workers.selectors import worker_speed


@dataclass(frozen=True)
class QueueWait:
    """The estimated wait of the work ahead of a request on its eligible workers."""

    seconds: float
    eligible_threads: int


def _build_queued_shapes() -> tuple[QueuedShape, ...]:
    rows = (
        waiting_requests()
        .values("is_chat", "requested_models", "any_model", "max_length", "max_context_length")
        .annotate(jobs=Sum("jobs_waiting"))
        .order_by()
    )
    return tuple(
        QueuedShape(
            is_chat=row["is_chat"],
            models=frozenset(row["requested_models"] or ()),
            any_model=row["any_model"],
            max_length=row["max_length"],
            max_context_length=row["max_context_length"],
            jobs=row["jobs"] or 0,
        )
        for row in rows
    )


_queued_shapes: ProcessCache[None, tuple[QueuedShape, ...]] = ProcessCache(
    "queued request shapes", ttl=QUEUE_SNAPSHOT_SECONDS, max_entries=1
)


def queued_shapes() -> tuple[QueuedShape, ...]:
    return _queued_shapes.get_or_build(None, _build_queued_shapes)


def worker_could_take(worker: Worker, shape: QueuedShape, served: frozenset[str] | None = None) -> bool:
    """Whether a queued request competes for this worker: by its models, its chat opt-in and its
    length limits (the worker's chat limits for a chat request, its text limits otherwise).
    `served`: the worker's served models as a set, when the caller has it."""
    if shape.is_chat:
        return bool(
            worker.accepts_chat_jobs
            and worker.chat_model_id in shape.models
            and shape.max_length <= (worker.chat_max_length or 0)
            and shape.max_context_length <= (worker.chat_max_context_length or 0)
        )
    return bool(
        worker.accepts_prompt_jobs
        and (shape.any_model or shape.models & (served if served is not None else set(worker.served_models or ())))
        and shape.max_length <= worker.max_length
        and shape.max_context_length <= worker.max_context_length
    )


def eligible_workers(request: GenerationRequest, listed_worker_ids: Iterable) -> list[Worker]:
    """The online workers the pop would give the request to (worker_may_take over the snapshot)."""
    online = online_worker_facts()
    listed = set(listed_worker_ids)
    if request.is_chat:
        candidates = online.chat_candidates(request.requested_models or ())
    else:
        candidates = online.text_candidates(request.requested_models or (), any_model=request.any_model)
    capable = functools.cache(lambda: capable_chat_worker_online(request, listed))  # once per pass
    return [worker for worker in candidates if worker_may_take(worker, request, listed, capable_online=capable)]


def estimate_queue_wait_seconds(request: GenerationRequest, listed_worker_ids: Iterable = ()) -> QueueWait | None:
    """The wait of the queued work ahead of a request not yet queued, on its eligible workers:
    competing tokens / (their tokens per second, scaled to the threads the competing jobs occupy).
    None when no worker is eligible."""
    workers = eligible_workers(request, listed_worker_ids)
    threads = sum(max(w.threads, 1) for w in workers)
    if not threads:
        return None
    served = [(w, frozenset(w.served_models or ())) for w in workers]
    competing = [s for s in queued_shapes() if any(worker_could_take(w, s, models) for w, models in served)]
    competing_tokens = sum(s.tokens for s in competing)
    competing_jobs = sum(s.jobs for s in competing)
    throughput = _throughput(_tokens_per_second(workers), competing_jobs, threads) if competing_jobs else 0.0
    if not throughput:
        return QueueWait(seconds=0.0, eligible_threads=threads)
    return QueueWait(seconds=competing_tokens / throughput, eligible_threads=threads)


def _throughput(tokens_per_second: float, jobs: int, threads: int) -> float:
    """The eligible workers' tokens per second, scaled to the threads `jobs` occupy (a job runs on
    one thread)."""
    return tokens_per_second * min(jobs, threads) / threads


def _tokens_per_second(workers: Iterable[Worker]) -> float:
    return sum(worker_speed(w) * max(w.threads, 1) for w in workers)


def status_queue_estimate(
    request: GenerationRequest, *, position: int, snapshot: QueueSnapshot, eligible: EligibleSet
) -> tuple[int, int] | None:
    """(queue_position, wait_time seconds) of a waiting request at `position` of the queue
    snapshot, on its `eligible` workers (spec ADR 0040; the availability pass's): the competing
    requests ahead, and the competing output ahead plus the request's own over those workers'
    throughput. None when no thread is eligible or none of them has a speed (the route falls back
    to the horde-wide figures)."""
    if not eligible.threads or not eligible.tokens_per_second:
        return None
    ahead = snapshot.competing_ahead(position, eligible, worker_could_take)
    tokens = ahead.tokens + request.max_length * request.jobs_waiting
    throughput = _throughput(eligible.tokens_per_second, ahead.jobs + request.jobs_waiting, eligible.threads)
    return ahead.requests, math.ceil(tokens / throughput)


def free_output_allowance(wait: QueueWait | None) -> int:
    """The ceiling while the queue ahead clears within full_wait, the floor from floor_wait (and
    with no eligible worker), a straight line between."""
    ceiling = settings.HORDE_TEXT_FREE_OUTPUT_CEILING
    floor = settings.HORDE_TEXT_FREE_OUTPUT_FLOOR
    full_wait = settings.HORDE_TEXT_FREE_OUTPUT_WAIT_FULL_SECONDS
    floor_wait = settings.HORDE_TEXT_FREE_OUTPUT_WAIT_FLOOR_SECONDS
    if wait is None:
        return floor
    if wait.seconds <= full_wait:
        return ceiling
    if wait.seconds >= floor_wait:
        return floor
    return round(ceiling - (ceiling - floor) * (wait.seconds - full_wait) / (floor_wait - full_wait))


def reset_queued_shapes() -> None:
    _queued_shapes.clear()
