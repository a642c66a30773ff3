"""The availability pass: which online workers could take a request, and, for a chat request no
worker can take, whether the workers' declarations are the cause (spec: "Impossible reason").

One pass serves text and chat requests alike; the status routes read it (is_possible,
eligible_worker_threads, impossible_reason). A chat request's pass is cached 60 seconds per request
(spec: "Impossible reason"); a text request's is made from the process's online workers snapshot,
which keeps it for every request of the same shape (OnlineWorkers.text_eligible) and costs less
than the cache's round trip would. Either holds only under the workers' serving version it was
made at (workers.serving_version): a worker's first pop, changed declaration or return online
makes every process pass again.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from django.core.cache import cache

from chat.models import Generation, GenerationRequest, RequestWorker
from chat.selectors.queue import (
    capable_chat_workers_online,
    chat_capacity_refusal,
    chat_declaration_gap,
    text_eligibility_shape,
    worker_may_take,
    worker_passes_restrictions,
    worker_serves_chat_model,
)
from chat.selectors.snapshots import NO_ELIGIBLE_WORKER, EligibleSet, OnlineWorkers, online_worker_facts
from contract.chat_policy import ChatServiceGap, merge_service_gaps
from contract.text import WORKER_ONLINE_SECONDS
from workers.serving_version import current_serving_version

if TYPE_CHECKING:
    from typing import TypedDict

    from django_stubs_ext import WithAnnotations

    class _ServingVersionAnnotation(TypedDict):
        """What chat.sql.request_with_counts annotates a request with."""

        serving_version: Any


AVAILABILITY_CACHE_SECONDS = 60


@dataclass(frozen=True)
class Availability:
    eligible_worker_threads: int
    is_possible: bool
    # {"kind": "declaration_gap", "missing_declarations": [...], "exceeded_limits": [...]} or None.
    impossible_reason: dict[str, Any] | None
    # The eligible workers themselves, which the status's queue estimate reads (spec ADR 0040).
    eligible: EligibleSet = NO_ELIGIBLE_WORKER


@dataclass(frozen=True)
class _Pass:
    """What the cached pass found; impossible_reason is settled at read time from `gap`."""

    eligible_worker_threads: int
    gap: ChatServiceGap | None  # the declarations gap, only when no worker is eligible
    # The eligible workers' ids (a chat pass is cached apart from the workers snapshot).
    eligible_ids: tuple = ()
    # The workers' serving version the pass was made under: a pass read under another is stale.
    serving_version: Any = None
    # When the first of the candidates it looked at leaves the online window unless it checks in
    # again (epoch seconds; None without candidates): going quiet is no check-in, so no version
    # announces it, and the pass is made again from then on.
    recheck_at: float | None = None


@dataclass(frozen=True)
class StatusRead:
    """What a status poll read before its body: the workers' serving version (read in the request's
    own statement, chat.sql) and, for a chat request, its cached pass."""

    serving_version: Any = None
    prefetched: dict[str, Any] = field(default_factory=dict)


def status_read(request: WithAnnotations[GenerationRequest, _ServingVersionAnnotation]) -> StatusRead:
    """What a status poll needs beside its request row (chat.sql.request_with_counts, which read the
    serving version with it): nothing more for a text request, one cache read of its pass for a
    chat request."""
    if not request.is_chat:
        return StatusRead(serving_version=request.serving_version)
    key = availability_cache_key(request.pk)
    found = cache.get(key)
    return StatusRead(serving_version=request.serving_version, prefetched={} if found is None else {key: found})


def _listed_worker_ids(request: GenerationRequest) -> set:
    if not request.has_worker_list:
        return set()
    return set(RequestWorker.objects.filter(request=request).values_list("worker_id", flat=True))


def _recheck_at(workers) -> float | None:
    """When the first of `workers` leaves the online window unless it checks in again."""
    if not workers:
        return None
    return min(w.last_check_in for w in workers).timestamp() + WORKER_ONLINE_SECONDS


def _text_eligible(request: GenerationRequest, online: OnlineWorkers) -> EligibleSet:
    # Only the workers serving one of the request's models (all text workers for any model) can
    # pass worker_may_take: the snapshot's per-model index spares testing the others.
    workers = online.text_candidates(request.requested_models or (), any_model=request.any_model)
    if not workers:
        return NO_ELIGIBLE_WORKER
    listed = _listed_worker_ids(request)
    return EligibleSet.of(w for w in workers if worker_may_take(w, request, listed))


def _owners_in_maintenance(request: GenerationRequest, online: OnlineWorkers) -> tuple:
    """The requester's own online workers in maintenance, which serve their owner's requests alone
    (docs/adr/0083): candidates for this request, never for another user's."""
    return online.in_maintenance.get(request.user_id, ()) if online.in_maintenance else ()


def _chat_pass(request: GenerationRequest, online: OnlineWorkers) -> _Pass:
    """Candidates pass the queue query's rules (1 and 4) without the size limits, so a worker
    below them reaches the declaration check and its refusal counts toward the gap."""
    # Rule 1 through the snapshot's index: only workers whose chat model_id is requested.
    workers = [*online.chat_candidates(request.requested_models or ()), *_owners_in_maintenance(request, online)]
    if not workers:
        return _Pass(eligible_worker_threads=0, gap=None)
    listed = _listed_worker_ids(request)
    capable = functools.cache(lambda: capable_chat_workers_online(request, listed))  # one query a pass
    threads = 0
    eligible: list[Any] = []
    gaps: list[ChatServiceGap] = []
    other_refusal = False
    for worker in workers:
        if not worker_serves_chat_model(worker, request) or not worker_passes_restrictions(worker, request, listed):
            continue
        gap = chat_declaration_gap(worker, request)
        if not gap.empty:
            gaps.append(gap)
        elif chat_capacity_refusal(worker, request, listed, capable_online=capable) is not None:
            other_refusal = True
        else:
            threads += max(worker.threads, 1)
            eligible.append(worker.pk)
    recheck_at = _recheck_at(workers)
    if threads or other_refusal or not gaps:
        # A gap is reported only when every candidate was refused for its declaration; no candidate
        # at all, or another refusal, can change while the request waits.
        return _Pass(eligible_worker_threads=threads, gap=None, recheck_at=recheck_at, eligible_ids=tuple(eligible))
    return _Pass(eligible_worker_threads=0, gap=merge_service_gaps(gaps), recheck_at=recheck_at)


def availability_cache_key(request_id) -> str:
    return f"horde:availability:{request_id}"


def _processing_count(request: GenerationRequest) -> int:
    return Generation.objects.filter(request=request, state=Generation.State.PROCESSING).count()


def chat_request_availability(
    request: GenerationRequest,
    *,
    processing: int | None = None,
    read: StatusRead | None = None,
    created: bool = False,
) -> Availability:
    """The availability of a text or chat request, from the pass over online workers (a chat
    request's cached AVAILABILITY_CACHE_SECONDS).

    impossible_reason is set only for a chat request no worker is eligible for, with nothing
    processing, whose candidates were all refused for their declarations; always None for text.
    `processing` is the request's processing generations when the caller has it (read otherwise,
    and only when the reason could apply). A status poll passes its `read` (status_read), which
    holds the serving version and the cached pass when there is one. The creation passes
    `created`: nothing is cached under an id made moments ago, so it makes the pass without asking.
    """
    serving_version = current_serving_version() if read is None else read.serving_version
    if not request.is_chat:
        online = online_worker_facts(serving_version)
        eligible = online.text_eligible(text_eligibility_shape(request), lambda: _text_eligible(request, online))
        owned = _owners_in_maintenance(request, online)
        if owned:  # after the shape's pass, which every requester shares
            listed = _listed_worker_ids(request)
            eligible = EligibleSet.of((*eligible.workers, *(w for w in owned if worker_may_take(w, request, listed))))
        return Availability(
            eligible_worker_threads=eligible.threads,
            is_possible=eligible.threads > 0,
            impossible_reason=None,
            eligible=eligible,
        )
    key = availability_cache_key(request.pk)
    if read is None:
        found = None if created else cache.get(key)
    else:
        found = read.prefetched.get(key)
    if (
        not isinstance(found, _Pass)
        or found.serving_version != serving_version
        or (found.recheck_at is not None and time.time() >= found.recheck_at)
    ):
        # None cached, made before a worker's check-in changed what it serves, or counting a
        # worker that may have gone quiet since.
        online = online_worker_facts(serving_version)
        found = replace(_chat_pass(request, online), serving_version=serving_version)
        cache.set(key, found, AVAILABILITY_CACHE_SECONDS)
    reason = None
    if found.gap is not None and found.eligible_worker_threads == 0:
        if processing is None:
            processing = _processing_count(request)
        if processing == 0:
            reason = found.gap.impossible_reason()
    return Availability(
        eligible_worker_threads=found.eligible_worker_threads,
        is_possible=found.eligible_worker_threads > 0,
        impossible_reason=reason,
        # The pass's workers as the snapshot has them now (one gone offline drops out).
        eligible=online_worker_facts(serving_version).eligible_of(found.eligible_ids)
        if found.eligible_worker_threads
        else NO_ELIGIBLE_WORKER,
    )
