"""The queue wait on a request's eligible workers (spec ADR 0040), read by the free output
allowance at creation (chat_requests.md, "Free output allowance") and by the status route.

The wait divides the queued output ahead that at least one eligible worker could take by those
workers' throughput. Both read the work ahead in the process's queue snapshot
(QueueSnapshot.competing_ahead): a status poll at its request's position, a creation where its
score places it. Neither walks the queue.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings

from chat.models import GenerationRequest
from chat.selectors.queue import capable_chat_workers_online, worker_may_take
from chat.selectors.snapshots import (
    EligibleSet,
    QueuedShape,
    QueueSnapshot,
    online_worker_facts,
    queue_snapshot,
)
from workers.models import Worker


@dataclass(frozen=True)
class QueueWait:
    """The estimated wait of the work ahead of a request on its eligible workers."""

    seconds: float
    eligible_threads: int


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
    """The online workers the pop would give the request to (worker_may_take over the snapshot):
    the requester's own workers in maintenance among them, which take their owner's requests
    (docs/adr/0083, 0089)."""
    online = online_worker_facts()
    listed = set(listed_worker_ids)
    if request.is_chat:
        candidates = online.chat_candidates(request.requested_models or ())
    else:
        candidates = online.text_candidates(request.requested_models or (), any_model=request.any_model)
    if online.in_maintenance and request.user_id in online.in_maintenance:
        candidates = [*candidates, *online.in_maintenance[request.user_id]]
    capable = functools.cache(lambda: capable_chat_workers_online(request, listed))  # once per pass
    return [worker for worker in candidates if worker_may_take(worker, request, listed, capable_online=capable)]


def estimate_queue_wait_seconds(
    request: GenerationRequest, listed_worker_ids: Iterable = (), *, queue_score: int
) -> QueueWait | None:
    """The wait of the queued work ahead of a request not yet queued (placed by its `queue_score`
    in the queue snapshot, as the status places a request newer than it), on its eligible workers:
    competing tokens / (their tokens per second, scaled to the threads the competing jobs occupy).
    None when no worker is eligible."""
    eligible = EligibleSet.of(eligible_workers(request, listed_worker_ids))
    if not eligible.threads:
        return None
    snapshot = queue_snapshot()
    ahead = snapshot.competing_ahead(snapshot.position_of_newer(queue_score), eligible, worker_could_take)
    throughput = _throughput(eligible.tokens_per_second, ahead.jobs, eligible.threads) if ahead.jobs else 0.0
    if not throughput:
        return QueueWait(seconds=0.0, eligible_threads=eligible.threads)
    return QueueWait(seconds=ahead.tokens / throughput, eligible_threads=eligible.threads)


def _throughput(tokens_per_second: float, jobs: int, threads: int) -> float:
    """The eligible workers' tokens per second, scaled to the threads `jobs` occupy (a job runs on
    one thread)."""
    return tokens_per_second * min(jobs, threads) / threads


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


