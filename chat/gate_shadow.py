"""The speed gate's shadow (chat_requests.md "Job lease", spec ADR 0041): jobs assigned over their
worker's lease capacity are marked at assignment and counted, with how they end, so the cost of
enforcing the gate for legacy text can be read from production.

Recorded at assignment because the worker's measured speed moves between pop and submit. The mark
is a second write only for an over-capacity assignment (rare: unmeasured workers count at 1200
tokens), so the pop's one statement is unchanged.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from chat.metrics import (
    gate_shadow_assignments,
    gate_shadow_outcomes,
    gate_shadow_service_seconds,
    size_bucket,
)
from chat.models import Generation, GenerationRequest
from chat.selectors.queue import text_worker_lease_capacity

log = logging.getLogger(__name__)


def _attributes(*, max_length: int, trusted: bool, is_chat: bool) -> dict[str, Any]:
    return {"horde.worker_trusted": bool(trusted), "horde.size_bucket": size_bucket(max_length), "horde.chat": bool(is_chat)}


def record_over_capacity_assignment(*, request: GenerationRequest, generations: list[Generation], worker: Any) -> None:
    """Mark and count the pop's jobs when the request's max_length is over the worker's capacity."""
    capacity = text_worker_lease_capacity(worker.speed)
    if request.max_length <= capacity or not generations:
        return
    ids = [g.pk for g in generations]
    Generation.objects.filter(pk__in=ids).update(over_capacity_at_assignment=True)
    attributes = _attributes(max_length=request.max_length, trusted=worker.owner.trusted, is_chat=request.is_chat)
    for generation in generations:
        generation.over_capacity_at_assignment = True
        gate_shadow_assignments.add(1, attributes)
        log.info(
            "horde.gate_shadow.assignment generation=%s request=%s worker=%s max_length=%d capacity=%d speed=%s",
            generation.pk, request.pk, worker.pk, request.max_length, capacity, worker.speed,
        )


def record_gate_shadow_outcome(
    generation: Generation, outcome: str, *, now: datetime | None = None
) -> None:
    """A marked job ended: completed (a stored submit, with its pop to submit time), faulted (the
    submit that faulted it) or aborted (its lease lapsed)."""
    if not generation.over_capacity_at_assignment:
        return
    request = generation.request
    seconds = (now - generation.created).total_seconds() if outcome == "completed" and now is not None else None
    record_outcome(
        outcome,
        max_length=request.max_length,
        trusted=generation.worker.owner.trusted,
        is_chat=request.is_chat,
        service_seconds=seconds,
    )


def record_outcome(
    outcome: str, *, max_length: int, trusted: bool, is_chat: bool, service_seconds: float | None = None
) -> None:
    """A marked job's end, from the values at hand (the priced submit's row, the stale sweep's query)."""
    attributes = _attributes(max_length=max_length, trusted=trusted, is_chat=is_chat)
    gate_shadow_outcomes.add(1, {**attributes, "horde.outcome": outcome})
    if service_seconds is not None:
        gate_shadow_service_seconds.record(service_seconds, attributes)


def record_aborted_outcome(*, max_length: int, trusted: bool, is_chat: bool) -> None:
    """The stale sweep's abort of a marked job (from the values its query read)."""
    record_outcome("aborted", max_length=max_length, trusted=trusted, is_chat=is_chat)
