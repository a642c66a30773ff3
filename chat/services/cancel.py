"""The cancel: no more jobs handed out, the hold released, a chat request's streams settled."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from accounts.services import kudos_release
from chat.models import Generation, GenerationRequest
from chat.selectors.status import request_completed, stored_result_count
from chat.services.progress import settle_cancelled_streams
from chat.signals import publish_chat_signal


def lock_jobs_in_flight(request_id) -> None:
    """The request's jobs still processing, locked by id before the request, in the horde's one lock
    order (docs/adr/0068-one-lock-order.md). Taken before the request, the cancel waits out a write
    that holds a job without settling it (a progress post renewing the job lease, a refused reply
    being recorded) and then settles that job; a submit or fault holding one settles it first, and
    the lock's recheck of the state drops it. Skipping such a job instead left it processing under
    a cancelled request, its lease unflagged, and its worker's later submit was paid in full."""
    list(
        Generation.objects.select_for_update(no_key=True)
        .filter(request_id=request_id, state=Generation.State.PROCESSING)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


def request_cancel(*, request: GenerationRequest, settle_streams: bool = True, jobs_locked: bool = False) -> bool:
    """Stop handing out jobs and release the hold. Jobs in flight still submit and are paid.

    The cancel route settles a streamed request's jobs in flight on what their workers posted and
    flags their leases; maintenance mode's abort (`settle_streams=False`) lets them settle by
    their submits instead (spec: "Streaming progress"). `jobs_locked`: the caller's transaction
    locked the jobs in flight (lock_jobs_in_flight) before it locked the request, as a caller that
    holds the request must: waiting on a job then could deadlock with its submit.

    Returns whether this call claimed the cancellation: False when it was already cancelled, done
    or faulted (the route answers the status as it is), or expired since the caller read it (the
    route then answers RequestNotFound).
    """
    with transaction.atomic():
        if request.is_chat and settle_streams and not jobs_locked:
            lock_jobs_in_flight(request.pk)
        locked = (
            GenerationRequest.objects.select_for_update()
            .only("user_id", "kudos_held", "cancelled", "faulted")
            .filter(pk=request.pk)
            .first()
        )
        if locked is None or locked.cancelled:
            return False
        if locked.faulted or request_completed(request.pk, is_chat=request.is_chat):
            # Already settled: nothing is left to stop, and its done or faulted message stands.
            return False
        GenerationRequest.objects.filter(pk=request.pk).update(cancelled=True, jobs_waiting=0, kudos_held=0)
        if request.is_chat and settle_streams:
            # A streamed request's jobs in flight, on what their workers posted. Before the hold's
            # release: it locks their workers, which come before any balance in the horde's one
            # lock order (docs/adr/0068-one-lock-order.md).
            settle_cancelled_streams(request_id=request.pk, now=timezone.now())
        kudos_release(user_id=locked.user_id, amount=locked.kudos_held)
        if request.is_chat:
            publish_chat_signal(request.pk, "cancelled", stored_result_count(request.pk))
    return True

