"""The periodic sweeps (beat tasks, chat/tasks.py): lapsed leases, expired requests,
maintenance mode's waiting requests."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from functools import partial
from uuid import UUID

from django.conf import settings
from django.db import DatabaseError, transaction
from django.utils import timezone

from accounts.services import kudos_release
from chat import metrics
from chat.gate_shadow import record_aborted_outcome
from chat.models import Generation, GenerationRequest
from chat.object_store import chat_objects_delete, listed_chat_objects, retry_chat_object_deletes
from chat.selectors.modes import horde_in_maintenance
from chat.selectors.status import request_completed, stored_result_count
from chat.services.faults import requeue_dropped_job
from chat.services.maintenance import abort_waiting_for_maintenance
from chat.services.progress import (
    JOB_LEASE_WRITE_STEP_SECONDS,
    end_progress_after_fault,
    leased_deadlines,
    progress_redis,
    write_job_lease,
)
from chat.services.text_stats import compact_text_stats, fold_finished_generations
from chat.signals import publish_chat_signal
from contract.chat_progress import streams_progress
from contract.errors import is_transaction_conflict

log = logging.getLogger(__name__)

# Expired requests read per statement; the sweep reads batches until one comes back short.
EXPIRE_BATCH = 1000


def abort_stale_generations() -> int:
    """Fault jobs whose lease lapsed and put them back in the queue (the 60 s beat task).

    A streamed job's row holds its lease in steps (ADR 0040): before aborting one, the sweep reads
    its stream lease, writes a later deadline it finds to the row and leaves the job be. Without
    the lease (Redis unreadable, or lost) the row may lag it by up to a step, so such a job is
    aborted only once the row's deadline is a step behind.
    """
    now = timezone.now()
    aborted = 0
    stale = list(
        Generation.objects.filter(state=Generation.State.PROCESSING, lease_expires_at__lt=now).values_list(
            "id", "request_id", "worker_id", "request__is_chat", "worker__owner__trusted",
            "request__max_length", "over_capacity_at_assignment", "lease_expires_at", "request__chat_extras",
        )[:1000]
    )
    # Without Redis no job has a stream lease and the row is the lease.
    leases = progress_redis() is not None
    streamed = [row[0] for row in stale if leases and row[3] and streams_progress(row[8])]
    leased = leased_deadlines(streamed) if streamed else {}
    streamed_ids = set(streamed)
    for generation_id, request_id, worker_id, is_chat, owner_trusted, max_length, over_capacity, row_deadline, _ in stale:
        cutoff = now
        if generation_id in streamed_ids:
            deadline = leased.get(generation_id) if leased is not None else None
            if deadline is not None and deadline >= now:
                write_job_lease(generation_id, deadline)
                continue
            if deadline is None:
                cutoff = now - timedelta(seconds=JOB_LEASE_WRITE_STEP_SECONDS)
                if row_deadline >= cutoff:
                    continue
        try:
            with transaction.atomic():
                if not Generation.objects.filter(
                    pk=generation_id, state=Generation.State.PROCESSING, lease_expires_at__lt=cutoff
                ).update(state=Generation.State.FAULTED, finished_at=now):
                    continue  # submitted meanwhile, or its lease renewed by a progress post
                requeue_dropped_job(generation_id=generation_id, request_id=request_id, worker_id=worker_id)
                if over_capacity:
                    record_aborted_outcome(max_length=max_length, trusted=owner_trusted, is_chat=is_chat)
                if is_chat:
                    transaction.on_commit(partial(end_progress_after_fault, generation_id, request_id), robust=True)
        except DatabaseError as error:
            if not is_transaction_conflict(error):
                raise
            log.warning("stale generation %s left to the next sweep: %s", generation_id, error)
            continue
        aborted += 1
        # Counted once the abort committed: a submit that won the race is not an abort.
        metrics.text_stale_aborts.add(
            1, {"horde.worker_trusted": bool(owner_trusted), "horde.chat": bool(is_chat)}
        )
    if aborted:
        log.info("aborted %d stale generations", aborted)
    return aborted


def expire_requests() -> int:
    """Delete requests past their expiry, release their holds and delete their images (the 60 s
    beat task), after a retry of the image deletes that failed before and the text statistics'
    compaction (ADR 0100).

    A chat request that was still open publishes faulted after its deletion commits, so a client
    woken by it reads the settled state (404); the message carries the stored fault details, since
    the row that held them is gone.
    """
    now = timezone.now()
    expired = 0
    retry_chat_object_deletes()
    compact_text_stats()
    # Batch after batch while a batch comes back full: a horde that creates more requests an
    # interval than one batch holds would otherwise keep more rows each interval than it deletes,
    # and its tables would grow for as long as it runs (ADR 0082). Past the first batch, within
    # half the sweep's interval: the rest goes at the next sweep, as the worker's other tasks wait.
    stop_at = time.monotonic() + settings.HORDE_SWEEP_INTERVAL_SECONDS / 2
    left: set[UUID] = set()  # conflicts, left to the next sweep: not read again in this one
    read = 0
    while True:
        batch = list(
            GenerationRequest.objects.filter(expires_at__lt=now)
            .exclude(pk__in=left)
            .values_list("id", flat=True)[:EXPIRE_BATCH]
        )
        for request_id in batch:
            if read >= EXPIRE_BATCH and time.monotonic() >= stop_at:
                return expired
            read += 1
            try:
                expired += _expire_request(request_id, now)
            except DatabaseError as error:
                if not is_transaction_conflict(error):
                    raise
                log.warning("expired request %s left to the next sweep: %s", request_id, error)
                left.add(request_id)
        if len(batch) < EXPIRE_BATCH:
            return expired


def _expire_request(request_id: UUID, now: datetime) -> int:
    """expire_requests for one request: 1 when it was deleted."""
    with transaction.atomic():
        # The horde's one lock order (docs/adr/0068-one-lock-order.md): the request's jobs, by id,
        # before the request, as a submit holds its job when it locks the request.
        jobs = list(
            Generation.objects.select_for_update().filter(request_id=request_id).order_by("pk")
            .values_list("model", "state", "finished_at")
        )
        request = (
            GenerationRequest.objects.select_for_update()
            .filter(pk=request_id, expires_at__lt=now)
            .only("user_id", "kudos_held", "is_chat", "faulted", "chat_fault_reason", "chat_fault_rc", "chat_has_images",
                  "chat_messages_offloaded", "max_length")
            .first()
        )
        if request is None:
            return 0
        # Its finished generations stay counted in the text statistics once deleted (ADR 0100).
        fold_finished_generations(
            finished=[(model, at) for model, state, at in jobs if state in Generation.FINISHED_STATES and at],
            max_length=request.max_length,
        )
        # A done request already had its done (or faulted) message; only an open one is faulted here.
        signal = None
        if request.is_chat and not request_completed(request_id, is_chat=True):
            signal = (stored_result_count(request_id), request.chat_fault_reason, request.chat_fault_rc)
        kudos_release(user_id=request.user_id, amount=request.kudos_held)
        request.delete()  # its stored objects go after the commit (chat.object_store, pre_delete)
        if signal is not None:
            generations, fault_reason, fault_rc = signal
            publish_chat_signal(request_id, "faulted", generations, fault_reason=fault_reason, fault_rc=fault_rc)
    return 1


def delete_orphaned_chat_objects() -> int:
    """Delete the stored chat objects whose request row is gone (the hourly beat task): those a
    process died holding between the row's deletion and theirs, or whose delete failed without a
    retry set (no Redis, or a full one). A row is written before its objects are stored, so an
    object without its row is never a request's that is still being created."""
    deleted = 0
    for listed in listed_chat_objects():
        live = {
            str(request_id)
            for request_id in GenerationRequest.objects.filter(pk__in=list(listed)).values_list("id", flat=True)
        }
        orphans = [key for request_id, keys in listed.items() if request_id not in live for key in keys]
        if orphans:
            log.info("deleting %d stored chat objects whose request is gone", len(orphans))
            deleted += chat_objects_delete(orphans)
    return deleted


def sweep_maintenance() -> int:
    """The beat's pass in maintenance mode: aborts what is still waiting (a request that raced
    the switch, or a horde started with HORDE_MAINTENANCE). Nothing outside maintenance mode."""
    return abort_waiting_for_maintenance() if horde_in_maintenance() else 0

