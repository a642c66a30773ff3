"""Reads on chat requests: the chat status body (spec: chat_requests.md, Routes, Pricing, Impossible
reason). Every read filters on is_chat, so text and chat ids never cross route families."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from chat.models import Generation, GenerationRequest
from chat.selectors.availability import availability_cache_key, chat_request_availability
from chat.selectors.status import generation_state_counts, request_get, request_queue_stats
from chat.selectors.status_cache import StatusRead, cached_status


@dataclass(frozen=True)
class ChatAvailability:
    eligible_worker_threads: int
    is_possible: bool
    impossible_reason: dict[str, Any] | None = None


def chat_request_get(request_id: UUID) -> GenerationRequest | None:
    return request_get(request_id, is_chat=True)


def chat_availability(
    request: GenerationRequest, *, processing: int | None = None, read: StatusRead | None = None
) -> ChatAvailability:
    """Eligible worker threads, is_possible and impossible_reason, from the availability pass
    (chat.availability, cached 60 s per request there; `read`: see chat_request_availability)."""
    result = chat_request_availability(request, processing=processing, read=read)
    return ChatAvailability(
        eligible_worker_threads=result.eligible_worker_threads,
        is_possible=result.is_possible,
        impossible_reason=result.impossible_reason,
    )


def _chat_generation(generation: Generation, request: GenerationRequest) -> dict[str, Any]:
    """A finished generation with its structured reply (the text status keys plus the chat ones)."""
    wait = (generation.created - request.created).total_seconds()
    return {
        "text": generation.text,
        "seed": generation.seed,
        "gen_metadata": generation.gen_metadata or [],
        "worker_id": str(generation.worker_id),
        "worker_name": generation.worker.name,
        "model": generation.model,
        "state": generation.state,
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


def chat_status_body(request_id: UUID) -> dict[str, Any] | None:
    """GET /generate/chat/status/<id>: the status body (cached briefly), None when not found.
    The availability cache is read with the body's, in one round trip."""

    def build(read: StatusRead) -> dict[str, Any] | None:
        request = chat_request_get(request_id)
        return chat_request_status(request, read=read) if request is not None else None

    return cached_status(request_id, is_chat=True, build=build, prefetch=(availability_cache_key(request_id),))


def chat_request_status(request: GenerationRequest, *, read: StatusRead | None = None) -> dict[str, Any]:
    """The chat status body: the text status keys, the chat request's own, and each finished
    generation with its structured reply (`read`: see chat_request_availability)."""
    counts = generation_state_counts(request)
    finished = sum(counts.get(s, 0) for s in Generation.FINISHED_STATES)
    processing = counts.get(Generation.State.PROCESSING, 0)
    restarted = counts.get(Generation.State.FAULTED, 0)
    waiting = request.jobs_waiting
    # Done: faulted, or nothing waiting or processing with every result stored or the rest cancelled.
    done = request.faulted or (
        waiting == 0 and processing == 0 and (finished >= request.n or request.cancelled)
    )
    queue_position, wait_time = request_queue_stats(request, read=read)
    if done:
        availability = ChatAvailability(eligible_worker_threads=0, is_possible=True)
    else:
        availability = chat_availability(request, processing=processing, read=read)
    generations = (
        [
            _chat_generation(generation, request)
            for generation in Generation.objects.filter(request=request, state__in=Generation.FINISHED_STATES)
            .select_related("worker")
            .order_by("finished_at")
        ]
        if finished  # most polls find nothing finished: no second query
        else []
    )
    # impossible_reason only when nothing is eligible and nothing is processing.
    impossible_reason = (
        availability.impossible_reason
        if not done and not availability.is_possible and processing == 0
        else None
    )
    return {
        "generations": generations,
        "finished": finished,
        "processing": processing,
        "restarted": restarted,
        "waiting": waiting,
        "done": done,
        "faulted": request.faulted,
        "wait_time": wait_time,
        "queue_position": queue_position,
        "kudos": float(request.consumed_kudos),
        "is_possible": availability.is_possible,
        "eligible_worker_threads": availability.eligible_worker_threads,
        "impossible_reason": impossible_reason,
        "context_adjustments": request.context_adjustments,
        "fault_reason": request.chat_fault_reason if request.faulted else None,
        "fault_rc": request.chat_fault_rc if request.faulted else None,
    }
