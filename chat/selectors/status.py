"""Reads on requests: the request row, the rule for done, queue position and wait, and the one
status body builder, for text and chat requests alike (spec: chat_requests.md, Routes, Pricing,
Impossible reason). Every read filters on is_chat, so text and chat ids never cross route families."""

from __future__ import annotations

import math
from typing import Any
from uuid import UUID

from django.db.models import Count, F, Q, Sum

from chat.models import Generation, GenerationRequest
from chat.selectors.allowance import status_queue_estimate
from chat.selectors.availability import Availability, StatusRead, chat_request_availability, status_read
from chat.selectors.queue import waiting_requests
from chat.selectors.snapshots import EligibleSet, online_worker_facts, queue_place, queue_snapshot
from chat.sql import finished_generations, request_with_counts

# What a text request's status body reads of its row (request_status, the availability pass and the
# queue place): the status poll reads only these, as converting the row's other columns costs more
# than the statement. Reading any other is one more query (tests pin a poll at one).
TEXT_STATUS_FIELDS = (
    "id", "is_chat", "n", "jobs_waiting", "faulted", "cancelled", "consumed_kudos",
    "queue_score", "created", "max_length", "max_context_length",
    "requested_models", "any_model", "has_worker_list", "worker_blacklist",
    "trusted_workers", "validated_backends", "slow_workers",
)


def request_get(request_id: UUID | str, *, is_chat: bool = False) -> GenerationRequest | None:
    """Every read filters on is_chat: a chat id is not found on the text routes, and vice versa.

    The row comes without the prompt, messages or tool settings (deferred), with the generation
    counts by state (see generation_state_counts), in one query compiled once per process."""
    return request_with_counts(request_id, is_chat=is_chat)


def chat_request_get(request_id: UUID) -> GenerationRequest | None:
    return request_get(request_id, is_chat=True)


# (state, the count's attribute on a request read by request_with_counts), once: Choices.values
# builds its list on every read.
_STATE_COUNT_ATTNAMES = tuple((state, f"gen_{state}") for state in Generation.State.values)


def generation_state_counts(request: GenerationRequest) -> dict[str, int]:
    """How many of the request's generations are in each state: read with the request by
    request_get, else one grouped query."""
    if hasattr(request, "gen_processing"):
        return {state: getattr(request, attname) for state, attname in _STATE_COUNT_ATTNAMES}
    return dict(
        Generation.objects.filter(request=request).values_list("state").annotate(c=Count("pk")).values_list("state", "c")
    )


def stored_result_count(request_id: UUID) -> int:
    """Generations with a stored result (a faulted or cancelled one is not a result)."""
    return Generation.objects.filter(request_id=request_id, state__in=Generation.FINISHED_STATES).count()


# --- done -------------------------------------------------------------------------------------


def request_is_done(*, faulted: bool, cancelled: bool, n: int, waiting: int, processing: int, finished: int) -> bool:
    """The one rule for done: faulted, or nothing waiting or processing and either every requested
    result stored or the rest cancelled (docs/adr/0003-text-cancel-and-done.md), for text and chat
    alike, as upstream's is_completed() (docs/adr/0006, amended)."""
    return faulted or (waiting == 0 and processing == 0 and (finished >= n or cancelled))


def request_completed(request_id: UUID, *, is_chat: bool) -> bool:
    """request_is_done read from the database (stored_results_and_done's one read). Call it with
    the request row locked, so two submits finishing the last jobs cannot both miss each other's
    result."""
    return stored_results_and_done(request_id, is_chat=is_chat)[1]


_DONE_FIELDS = ("n", "jobs_waiting", "faulted", "cancelled")


def stored_results_and_done(request_id: UUID, *, is_chat: bool = True) -> tuple[int, bool]:
    """(stored_result_count, request_completed) of a request in one read, the request with its
    generations counted by state. Call it with the request row locked, as request_completed."""
    request = request_with_counts(request_id, is_chat=is_chat, only=_DONE_FIELDS)
    counts = generation_state_counts(request)
    finished = sum(counts.get(s, 0) for s in Generation.FINISHED_STATES)
    done = request_is_done(
        faulted=request.faulted,
        cancelled=request.cancelled,
        n=request.n,
        waiting=request.jobs_waiting,
        processing=counts.get(Generation.State.PROCESSING, 0),
        finished=finished,
    )
    return finished, done


# --- queue position and wait ------------------------------------------------------------------


def _horde_tokens_per_second(read: StatusRead | None) -> float:
    if read is None:
        return online_worker_facts().tokens_per_second
    return online_worker_facts(read.serving_version).tokens_per_second


def request_queue_stats(
    request: GenerationRequest, *, read: StatusRead | None = None, eligible: EligibleSet | None = None
) -> tuple[int, int]:
    """(queue_position, wait_time seconds): on the request's `eligible` workers (spec ADR 0040), the
    competing requests ahead in queue order and the time those workers need for the competing
    output ahead plus this request's own; with none eligible, every request ahead and the online
    workers' throughput (`read`: the status poll's, whose serving version the workers snapshot is
    taken under)."""
    if request.jobs_waiting == 0 or request.faulted or request.cancelled:
        return 0, 0
    snapshot = queue_snapshot()
    place = queue_place(request.pk, snapshot)
    if eligible is not None:
        # A request newer than the snapshot is placed by its score among the snapshot's.
        position = place.position if place is not None else snapshot.position_of_newer(request.queue_score)
        estimate = status_queue_estimate(request, position=position, snapshot=snapshot, eligible=eligible)
        if estimate is not None:
            return estimate
    if place is not None:
        ahead = {"count": place.position, "tokens": place.tokens_ahead}
    else:  # newer than the snapshot: one live count
        ahead = waiting_requests().filter(
            Q(queue_score__gt=request.queue_score) | Q(queue_score=request.queue_score, created__lt=request.created)
        ).aggregate(count=Count("pk"), tokens=Sum(F("max_length") * F("jobs_waiting")))
    tokens = (ahead["tokens"] or 0) + request.max_length * request.jobs_waiting
    speed = _horde_tokens_per_second(read)
    wait = math.ceil(tokens / speed) if speed else 0
    return ahead["count"], wait


# --- the status body --------------------------------------------------------------------------


def _generation_entry(generation: Generation, request: GenerationRequest) -> dict[str, Any]:
    """A finished generation as the status lists it; a chat one with its structured reply. It reads
    only chat.sql.FINISHED_GENERATION_FIELDS and the worker's name (what finished_generations loads)."""
    entry = {
        "text": generation.text,
        "seed": generation.seed,
        "gen_metadata": generation.gen_metadata or [],
        "worker_id": str(generation.worker_id),
        "worker_name": generation.worker.name,
        "model": generation.model,
        "state": generation.state,
    }
    if request.is_chat:
        wait = (generation.created - request.created).total_seconds()
        entry.update(
            {
                "message": generation.message,
                "finish_reason": generation.finish_reason,
                "native_finish_reason": generation.native_finish_reason,
                "prompt_tokens": generation.prompt_tokens,
                "completion_tokens": generation.completion_tokens,
                "reasoning_tokens": generation.reasoning_tokens,
                "charge_basis": generation.charge_basis,
                # Creation to assignment: a generation row is created at its pop.
                "queue_wait_seconds": round(max(wait, 0.0), 3),
            }
        )
    return entry


_DONE = Availability(eligible_worker_threads=0, is_possible=True, impossible_reason=None)


def request_status(
    request: GenerationRequest, *, include_generations: bool = True, read: StatusRead | None = None
) -> dict[str, Any]:
    """The status body of a text request (upstream's keys, exactly) or of a chat request (those
    plus the chat keys, and each finished generation with its structured reply). `read`: the
    status poll's cache read, see chat_request_availability."""
    counts = generation_state_counts(request)
    finished = sum(counts.get(s, 0) for s in Generation.FINISHED_STATES)
    processing = counts.get(Generation.State.PROCESSING, 0)
    done = request_is_done(
        faulted=request.faulted,
        cancelled=request.cancelled,
        n=request.n,
        waiting=request.jobs_waiting,
        processing=processing,
        finished=finished,
    )
    availability = _DONE if done else chat_request_availability(request, processing=processing, read=read)
    queue_position, wait_time = request_queue_stats(request, read=read, eligible=availability.eligible)
    generations = []
    if include_generations and finished:  # most polls find nothing finished: no second query
        generations = [_generation_entry(generation, request) for generation in finished_generations(request.pk)]
    body = {
        "generations": generations,
        "finished": finished,
        "processing": processing,
        "restarted": counts.get(Generation.State.FAULTED, 0),
        "waiting": request.jobs_waiting,
        "done": done,
        "faulted": request.faulted,
        "wait_time": wait_time,
        "queue_position": queue_position,
        "kudos": float(request.consumed_kudos),
        # A generation in flight is being served whatever its worker does meanwhile (maintenance,
        # a changed declaration, offline): upstream's status reads it as possible, and KoboldAI
        # Lite and SillyTavern give up on a request at the first is_possible false.
        "is_possible": availability.is_possible or processing > 0,
    }
    if request.is_chat:
        body.update(
            {
                "eligible_worker_threads": availability.eligible_worker_threads,
                # Only when nothing is eligible and nothing is processing.
                "impossible_reason": availability.impossible_reason
                if not availability.is_possible and processing == 0
                else None,
                "context_adjustments": request.context_adjustments,
                "fault_reason": request.chat_fault_reason if request.faulted else None,
                "fault_rc": request.chat_fault_rc if request.faulted else None,
            }
        )
    return body


# The chat routes' name for the same body.
chat_request_status = request_status


def _status_body(request_id: UUID, *, is_chat: bool) -> dict[str, Any] | None:
    """GET /generate/{text,chat}/status/<id>: the status body, None when not found. One database
    read (the request with its counts and the workers' serving version) and, for a chat request,
    one cache read of its pass: the body is built on every poll, so it shows each write the moment
    it commits."""
    request = request_with_counts(request_id, is_chat=is_chat, only=None if is_chat else TEXT_STATUS_FIELDS)
    if request is None:
        return None
    return request_status(request, read=status_read(request))


def text_status_body(request_id: UUID) -> dict[str, Any] | None:
    return _status_body(request_id, is_chat=False)


def chat_status_body(request_id: UUID) -> dict[str, Any] | None:
    return _status_body(request_id, is_chat=True)
