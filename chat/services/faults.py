"""A faulted job: the fault limit, the restart, and the worker's counter of dropped jobs."""

from __future__ import annotations

import logging
from uuid import UUID

from django.db.models import F

from accounts.services import kudos_release
from chat.models import Generation, GenerationRequest
from chat.selectors.queue import request_queue_lists
from chat.selectors.status import stored_result_count
from chat.services.pop_cache import queue_grew
from chat.signals import publish_chat_signal
from contract.text import FAULTED_GENERATIONS_LIMIT
from workers.services import worker_record_aborted, worker_record_nonconformant

log = logging.getLogger(__name__)

# The stored refusal rc that exempts a dropped job from aborted_jobs (spec: "Refusal record").
CHAT_SUBMIT_NONCONFORMANT = "ChatSubmitNonconformant"


def fault_request_if_over_limit(request_id: UUID) -> bool:
    """Fault a request whose faulted jobs exceed FAULTED_GENERATIONS_LIMIT, unless it was cancelled;
    releases its hold.

    Runs in the transaction that stored the fault crossing the limit, so a chat request's faulted
    signal goes out when that commits, not at the next sweep.
    """
    faults = Generation.objects.filter(request_id=request_id, state=Generation.State.FAULTED).count()
    if faults <= FAULTED_GENERATIONS_LIMIT:
        return False
    request = (
        GenerationRequest.objects.select_for_update(no_key=True)
        .only("user_id", "kudos_held", "faulted", "cancelled", "is_chat", "chat_fault_reason", "chat_fault_rc")
        .get(pk=request_id)
    )
    if request.faulted:
        return True
    if request.cancelled:
        # Already final: nothing is handed out after a cancel, so the limit has nothing to stop,
        # and its `cancelled` message stands (ADR 0064's rule, from the other side).
        return False
    GenerationRequest.objects.filter(pk=request_id).update(faulted=True, jobs_waiting=0, kudos_held=0)
    kudos_release(user_id=request.user_id, amount=request.kudos_held)
    log.warning("request %s faulted after %d faulted jobs", request_id, faults)
    if request.is_chat:
        # The row is kept until it expires; the signal carries why, when the horde knows.
        publish_chat_signal(
            request_id,
            "faulted",
            stored_result_count(request_id),
            fault_reason=request.chat_fault_reason,
            fault_rc=request.chat_fault_rc,
        )
    return True


def requeue_jobs(request_id: UUID, count: int) -> bool:
    """Put `count` jobs of a request back in the queue, unless it was faulted or cancelled meanwhile,
    and tell the pops of its queue lists. Called in the transaction that took the jobs back."""
    requeued = GenerationRequest.objects.filter(pk=request_id, faulted=False, cancelled=False)
    if not requeued.update(jobs_waiting=F("jobs_waiting") + count):
        return False
    is_chat, models = requeued.values_list("is_chat", "requested_models").get()
    queue_grew(request_queue_lists(is_chat=is_chat, models=models or ()))
    return True


def requeue_faulted(generation_ids: list[UUID], request_id: UUID) -> None:
    """Put faulted jobs back in the queue (not after a cancel), then apply the fault limit.

    Called in the transaction that faulted them, so a fault and its restart commit together.
    """
    requeue_jobs(request_id, len(generation_ids))
    fault_request_if_over_limit(request_id)


def requeue_dropped_job(*, generation_id: UUID, request_id: UUID, worker_id: UUID) -> None:
    """A job its worker dropped (a fault submit or a lapsed lease), claimed as faulted in the
    caller's transaction: counted against the worker and put back in the queue. The rows are locked
    in the horde's one order (docs/adr/0068-one-lock-order.md): the request, the worker, then the
    requester's balance, which a request crossing the fault limit releases its hold to."""
    list(GenerationRequest.objects.select_for_update(no_key=True).filter(pk=request_id).values_list("pk", flat=True))
    # Read after the claim: a refusal is only recorded on a pending generation.
    refusal_rc = Generation.objects.filter(pk=generation_id).values_list("chat_refusal_rc", flat=True).get()
    worker_record_dropped_job(worker_id=worker_id, refusal_rc=refusal_rc)
    requeue_faulted([generation_id], request_id)


def worker_record_dropped_job(*, worker_id: UUID, refusal_rc: str | None) -> None:
    """Count a job the worker dropped (its fault submit, or a lapsed lease).

    A reply the horde refused as nonconformant counts as nonconformant_replies, not aborted_jobs:
    the worker generated and the model broke a strict contract, so it must not push the worker
    towards the aborted-job maintenance threshold. The rc is the stored one, never the worker's word.
    """
    if refusal_rc == CHAT_SUBMIT_NONCONFORMANT:
        worker_record_nonconformant(worker_id=worker_id)
    else:
        worker_record_aborted(worker_ids=[worker_id])

