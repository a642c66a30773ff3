"""Writes on requests and generations: create, pop, submit, cancel, and the periodic sweeps.

Every kudos movement commits in the transaction that stores what it pays for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from functools import partial
from uuid import UUID

from django.db import IntegrityError, transaction
from django.db.models import F, Sum
from django.utils import timezone

from accounts.models import HordeUser, KudosTransaction
from accounts.services import kudos_hold, kudos_release, kudos_transfer
from chat import metrics
from chat.gate_shadow import record_aborted_outcome
from chat.models import Generation, GenerationRequest, HordeModes, RequestModel, RequestWorker
from chat.pop_cache import queue_grew
from chat.pricing import text_request_quote
from chat.progress import end_progress_after_fault, settle_cancelled_streams
from chat.signals import publish_chat_signal
from chat.status_cache import status_changed
from contract.errors import HordeError
from contract.text import (
    FAULTED_GENERATIONS_LIMIT,
    QUEUE_PRIORITY_STEP,
    QUEUE_PRIORITY_STEP_SECONDS,
    TEXT_HORDE_TAX,
)
from workers.services import worker_record_aborted, worker_record_nonconformant

log = logging.getLogger(__name__)

HORDE_TAX = Decimal(TEXT_HORDE_TAX)
# The stored refusal rc that exempts a dropped job from aborted_jobs (spec: "Refusal record").
CHAT_SUBMIT_NONCONFORMANT = "ChatSubmitNonconformant"


# --- Creation -------------------------------------------------------------------------------


@dataclass
class TextRequestInput:
    """A validated text request body."""

    prompt: str
    params: dict
    n: int
    max_length: int
    max_context_length: int
    models: list[str] = field(default_factory=list)
    workers: list[UUID] = field(default_factory=list)
    worker_blacklist: bool = False
    trusted_workers: bool = False
    validated_backends: bool = False
    slow_workers: bool = True
    allow_downgrade: bool = False
    disable_batching: bool = False
    softprompt: str = ""
    dry_run: bool = False
    # The chat route's horde.operation_key, top-level as every text option (docs/adr/0020-front-lease.md).
    operation_key: UUID | None = None


@dataclass(frozen=True)
class CreatedRequest:
    request: GenerationRequest | None
    kudos: Decimal
    message: str | None = None
    # A repeated operation key: the claim's request, nothing queued or charged (200).
    repeated: bool = False


def text_operation_fingerprint(data: TextRequestInput) -> str:
    """SHA-256 of canonical JSON over what defines a text operation: every option but dry_run and
    operation_key; models and workers as sets (any listed model may serve, the list's order is not
    the request), as the chat fingerprint does."""
    defining = {
        "prompt": data.prompt,
        "params": data.params,
        "n": data.n,
        "max_length": data.max_length,
        "max_context_length": data.max_context_length,
        "models": sorted(data.models),
        "workers": sorted(str(w) for w in data.workers),
        "worker_blacklist": data.worker_blacklist,
        "trusted_workers": data.trusted_workers,
        "validated_backends": data.validated_backends,
        "slow_workers": data.slow_workers,
        "allow_downgrade": data.allow_downgrade,
        "disable_batching": data.disable_batching,
        "softprompt": data.softprompt,
    }
    canonical = json.dumps(defining, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def text_operation_claim(*, user: HordeUser, operation_key: UUID, fingerprint: str) -> CreatedRequest | None:
    """A repeated text operation key: the first request when it is the same operation, else
    OperationKeyConflict; None when the user has no claim on the key."""
    claim = (
        GenerationRequest.objects.filter(user=user, operation_key=operation_key, is_chat=False)
        .only("id", "kudos_quote", "operation_fingerprint")
        .first()
    )
    if claim is None:
        return None
    if claim.operation_fingerprint != fingerprint:
        raise HordeError(
            "OperationKeyConflict",
            "The operation_key was already used for a different request: a repeated submission has to "
            "send the same request.",
            status=400,
        )
    return CreatedRequest(request=claim, kudos=claim.kudos_quote, repeated=True)


def horde_in_maintenance() -> bool:
    from django.conf import settings

    if settings.HORDE_MAINTENANCE:
        return True
    return HordeModes.objects.filter(maintenance=True).exists()


def horde_modes_set(*, actor: HordeUser, maintenance: bool) -> None:
    """A moderator switches maintenance mode; switching it on aborts every waiting request."""
    if not actor.moderator:
        raise HordeError("NotModerator", "Only a moderator can change the horde's modes.")
    HordeModes.objects.update_or_create(pk=1, defaults={"maintenance": maintenance})
    if maintenance:
        abort_waiting_for_maintenance()


def abort_waiting_for_maintenance() -> int:
    """Maintenance mode aborts the waiting requests (spec: "Completion signal"): each is cancelled
    as the cancel route cancels it (no more jobs handed out, its hold released, `cancelled`
    published for a chat request), so its client learns at once instead of at expiry. Jobs in
    flight still settle; their stream leases are not flagged. Returns how many it aborted."""
    aborted = 0
    while True:
        batch = list(
            GenerationRequest.objects.filter(
                jobs_waiting__gt=0, faulted=False, cancelled=False, expires_at__gt=timezone.now()
            ).only("id", "is_chat")[:1000]
        )
        for request in batch:
            aborted += request_cancel(request=request, settle_streams=False)
        if len(batch) < 1000:
            break
    if aborted:
        log.warning("maintenance mode aborted %d waiting requests", aborted)
    return aborted


def sweep_maintenance() -> int:
    """The beat's pass in maintenance mode: aborts what is still waiting (a request that raced
    the switch, or a horde started with HORDE_MAINTENANCE). Nothing outside maintenance mode."""
    return abort_waiting_for_maintenance() if horde_in_maintenance() else 0


def queue_score(priority: int, created_epoch: float) -> int:
    """Priority grows by QUEUE_PRIORITY_STEP per horde-wide tick; subtracting the ticks before
    creation gives a score whose order never changes (see GenerationRequest.priority)."""
    return priority - QUEUE_PRIORITY_STEP * math.floor(created_epoch / QUEUE_PRIORITY_STEP_SECONDS)


def needs_upfront_kudos(*, max_length: int, slow_workers: bool, has_worker_list: bool) -> bool:
    """Above the free output allowance, without slow workers, or (when the setting says so) with a
    worker list, a request holds its kudos at admission."""
    from django.conf import settings

    return (
        max_length > settings.HORDE_TEXT_FREE_OUTPUT_FLOOR
        or not slow_workers
        or (settings.HORDE_UPFRONT_KUDOS_ON_WORKERLIST and has_worker_list)
    )


def kudos_upfront_error(*, allowance: int, kudos: Decimal) -> HordeError:
    """KudosUpfront, stating the allowance (the free output floor until the allowance issue)."""
    return HordeError(
        "KudosUpfront",
        f"Due to heavy demand, for requests over {allowance} tokens, the client needs to already "
        f"have the required kudos. This request requires {kudos} kudos to fulfil.",
    )


def ensure_not_in_maintenance() -> None:
    if horde_in_maintenance():
        raise HordeError("MaintenanceMode", "Horde is in maintenance mode. Please try again later.")


def check_concurrency(*, user: HordeUser, n: int) -> None:
    """TooManyPrompts when the user's waiting jobs plus n exceed its concurrency.

    Run unlocked as an early refusal, and again on the locked user row inside the creation.
    """
    waiting = (
        GenerationRequest.objects.filter(
            user=user, faulted=False, cancelled=False, expires_at__gt=timezone.now()
        ).aggregate(total=Sum("jobs_waiting"))["total"]
        or 0
    )
    if waiting + n > user.concurrency:
        raise HordeError(
            "TooManyPrompts",
            f"Parallel requests ({waiting + n}) exceeded user limit ({user.concurrency}).",
        )


def lock_requester(user: HordeUser) -> HordeUser:
    """The requester's row, locked: concurrency and the hold are checked and taken together."""
    return HordeUser.objects.select_for_update().get(pk=user.pk)


def request_rows_create(
    *,
    locked_user: HordeUser,
    fields: dict,
    models: list[str],
    workers: list[UUID],
    kudos: Decimal,
    hold: Decimal,
) -> GenerationRequest:
    """Insert an active request with its model and worker rows, take its hold and the horde tax.

    Runs inside the caller's transaction, on the locked requester.
    """
    from django.conf import settings

    now = timezone.now()
    priority = int(locked_user.kudos)
    request = GenerationRequest.objects.create(
        user=locked_user,
        requested_models=models,
        any_model=not models,
        priority=priority,
        queue_score=queue_score(priority, now.timestamp()),
        kudos_quote=kudos,
        kudos_held=hold,
        expires_at=now + timedelta(seconds=settings.HORDE_TEXT_REQUEST_TTL_SECONDS),
        **fields,
    )
    RequestModel.objects.bulk_create([RequestModel(request=request, name=m) for m in dict.fromkeys(models)])
    RequestWorker.objects.bulk_create([RequestWorker(request=request, worker_id=w) for w in dict.fromkeys(workers)])
    if hold:
        kudos_hold(user_id=locked_user.pk, amount=hold)
    kudos_transfer(
        user_id=locked_user.pk, amount=-HORDE_TAX, kind=KudosTransaction.Kind.HORDE_TAX, request_id=request.id
    )
    request.consumed_kudos = HORDE_TAX
    GenerationRequest.objects.filter(pk=request.pk).update(consumed_kudos=HORDE_TAX)
    queue_grew()
    return request


def text_request_create(
    *,
    user: HordeUser,
    data: TextRequestInput,
    client_agent: str = "",
    ip_address: str = "",
    front_lease_seconds: int | None = None,
    front_id: str | None = None,
) -> CreatedRequest:
    """Price, admit and queue a text request (or only quote it, on a dry run). A repeated operation
    key is answered first, before anything that could refuse or charge it, as on the chat route."""

    operation_key = None if data.dry_run else data.operation_key
    fingerprint = text_operation_fingerprint(data) if operation_key is not None else ""
    if operation_key is not None:
        repeated = text_operation_claim(user=user, operation_key=operation_key, fingerprint=fingerprint)
        if repeated is not None:
            return repeated
    ensure_not_in_maintenance()

    def quote() -> Decimal:
        return text_request_quote(
            models=data.models, prompt=data.prompt, max_length=data.max_length, n=data.n
        ) + HORDE_TAX

    kudos = quote()
    if data.dry_run:
        return CreatedRequest(request=None, kudos=kudos)

    try:
        request, kudos, message = _text_request_rows(
            user=user,
            data=data,
            kudos=kudos,
            quote=quote,
            extra_fields={
                "client_agent": client_agent[:255],
                "ip_address": ip_address[:64],
                "operation_key": operation_key,
                "operation_fingerprint": fingerprint,
                "front_lease_expires_at": (
                    timezone.now() + timedelta(seconds=front_lease_seconds) if front_lease_seconds else None
                ),
                "front_id": front_id if front_lease_seconds else None,
            },
        )
    except IntegrityError:
        # Two submits with one key: the unique index let the other commit; answer with it.
        repeated = None
        if operation_key is not None:
            repeated = text_operation_claim(user=user, operation_key=operation_key, fingerprint=fingerprint)
        if repeated is None:
            raise
        log.info("operation key %s: a concurrent text submit won; answering with %s", operation_key, repeated.request.id)
        return repeated
    return CreatedRequest(request=request, kudos=kudos, message=message)


def _text_request_rows(
    *, user: HordeUser, data: TextRequestInput, kudos: Decimal, quote, extra_fields: dict
) -> tuple[GenerationRequest, Decimal, str | None]:
    """The creation transaction of a text request: concurrency, the hold (or the downgrade), the rows."""
    from django.conf import settings

    floor = settings.HORDE_TEXT_FREE_OUTPUT_FLOOR
    message = None
    with transaction.atomic():
        locked_user = lock_requester(user)
        check_concurrency(user=locked_user, n=data.n)
        hold = Decimal("0")
        if needs_upfront_kudos(
            max_length=data.max_length, slow_workers=data.slow_workers, has_worker_list=bool(data.workers)
        ):
            if locked_user.kudos_available < kudos:
                downgradable = data.allow_downgrade and data.slow_workers and data.max_length > floor
                if not downgradable:
                    raise kudos_upfront_error(allowance=floor, kudos=kudos)
                data.max_length = floor
                kudos = quote()
                message = f"This request was downgraded to {floor} tokens: the requester lacks the kudos upfront."
            else:
                hold = kudos
        request = request_rows_create(
            locked_user=locked_user,
            fields={
                "prompt": data.prompt,
                "params": data.params,
                "softprompt": data.softprompt,
                "n": data.n,
                "jobs_waiting": data.n,
                "max_length": data.max_length,
                "max_context_length": data.max_context_length,
                "has_worker_list": bool(data.workers),
                "worker_blacklist": data.worker_blacklist,
                "trusted_workers": data.trusted_workers,
                "validated_backends": data.validated_backends,
                "slow_workers": data.slow_workers,
                "allow_downgrade": data.allow_downgrade,
                "disable_batching": data.disable_batching,
                **extra_fields,
            },
            models=data.models,
            workers=data.workers,
            kudos=kudos,
            hold=hold,
        )
    return request, kudos, message


# --- Faults ---------------------------------------------------------------------------------


def fault_request_if_over_limit(request_id: UUID) -> bool:
    """Fault a request whose faulted jobs exceed FAULTED_GENERATIONS_LIMIT; releases its hold.

    Runs in the transaction that stored the fault crossing the limit, so a chat request's faulted
    signal goes out when that commits, not at the next sweep.
    """
    faults = Generation.objects.filter(request_id=request_id, state=Generation.State.FAULTED).count()
    if faults <= FAULTED_GENERATIONS_LIMIT:
        return False
    request = (
        GenerationRequest.objects.select_for_update()
        .only("user_id", "kudos_held", "faulted", "is_chat", "chat_fault_reason", "chat_fault_rc")
        .get(pk=request_id)
    )
    if request.faulted:
        return True
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


def requeue_faulted(generation_ids: list[UUID], request_id: UUID) -> None:
    """Put faulted jobs back in the queue (not after a cancel), then apply the fault limit.

    Called in the transaction that faulted them, so a fault and its restart commit together.
    """
    GenerationRequest.objects.filter(pk=request_id, faulted=False, cancelled=False).update(
        jobs_waiting=F("jobs_waiting") + len(generation_ids)
    )
    queue_grew()
    # Before the fault limit's signal: on commit the cached status goes first, so a client woken
    # by the faulted signal reads the new state.
    status_changed(request_id)
    fault_request_if_over_limit(request_id)


def stored_result_count(request_id: UUID) -> int:
    """Generations with a stored result (a faulted or cancelled one is not a result)."""
    return Generation.objects.filter(request_id=request_id, state__in=Generation.FINISHED_STATES).count()


def request_completed(request_id: UUID) -> bool:
    """Whether a request is done: faulted, or nothing waiting or processing and either every
    requested result stored or the rest cancelled. Call it with the request row locked, so two
    submits finishing the last jobs cannot both miss each other's result."""
    request = GenerationRequest.objects.only("n", "jobs_waiting", "faulted", "cancelled").get(pk=request_id)
    if request.faulted:
        return True
    if request.jobs_waiting:
        return False
    if Generation.objects.filter(request_id=request_id, state=Generation.State.PROCESSING).exists():
        return False
    return request.cancelled or stored_result_count(request_id) >= request.n


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


# --- Cancel, expiry, stale leases -----------------------------------------------------------


def request_cancel(*, request: GenerationRequest, settle_streams: bool = True) -> bool:
    """Stop handing out jobs and release the hold. Jobs in flight still submit and are paid.

    The cancel route settles a streamed request's jobs in flight on what their workers posted and
    flags their leases; maintenance mode's abort (`settle_streams=False`) lets them settle by
    their submits instead (spec: "Streaming progress").

    Returns whether this call claimed the cancellation (False when it was already cancelled).
    """
    with transaction.atomic():
        locked = GenerationRequest.objects.select_for_update().only("user_id", "kudos_held", "cancelled").get(
            pk=request.pk
        )
        if locked.cancelled:
            return False
        GenerationRequest.objects.filter(pk=request.pk).update(cancelled=True, jobs_waiting=0, kudos_held=0)
        kudos_release(user_id=locked.user_id, amount=locked.kudos_held)
        status_changed(request.pk)
        if request.is_chat:
            if settle_streams:  # a streamed request's jobs in flight: on what their workers posted
                settle_cancelled_streams(request_id=request.pk, now=timezone.now())
            publish_chat_signal(request.pk, "cancelled", stored_result_count(request.pk))
    return True


def abort_stale_generations() -> int:
    """Fault jobs whose lease lapsed and put them back in the queue (the 60 s beat task)."""
    now = timezone.now()
    aborted = 0
    stale = list(
        Generation.objects.filter(state=Generation.State.PROCESSING, lease_expires_at__lt=now).values_list(
            "id", "request_id", "worker_id", "request__is_chat", "worker__owner__trusted",
            "request__max_length", "over_capacity_at_assignment",
        )[:1000]
    )
    for generation_id, request_id, worker_id, is_chat, owner_trusted, max_length, over_capacity in stale:
        with transaction.atomic():
            if not Generation.objects.filter(
                pk=generation_id, state=Generation.State.PROCESSING, lease_expires_at__lt=now
            ).update(state=Generation.State.FAULTED, finished_at=now):
                continue  # submitted meanwhile, or its lease renewed by a progress post
            # Read after the claim: a refusal is only recorded on a pending generation.
            refusal_rc = Generation.objects.filter(pk=generation_id).values_list("chat_refusal_rc", flat=True).get()
            worker_record_dropped_job(worker_id=worker_id, refusal_rc=refusal_rc)
            requeue_faulted([generation_id], request_id)
            if over_capacity:
                record_aborted_outcome(max_length=max_length, trusted=owner_trusted, is_chat=is_chat)
            if is_chat:
                transaction.on_commit(partial(end_progress_after_fault, generation_id, request_id), robust=True)
            aborted += 1
        # Counted once the abort committed: a submit that won the race is not an abort.
        metrics.text_stale_aborts.add(
            1, {"horde.worker_trusted": bool(owner_trusted), "horde.chat": bool(is_chat)}
        )
    if aborted:
        log.info("aborted %d stale generations", aborted)
    return aborted


def expire_requests() -> int:
    """Delete requests past their expiry and release their holds (the 60 s beat task).

    A chat request that was still open publishes faulted after its deletion commits, so a client
    woken by it reads the settled state (404); the message carries the stored fault details, since
    the row that held them is gone.
    """
    now = timezone.now()
    expired = 0
    for request_id in GenerationRequest.objects.filter(expires_at__lt=now).values_list("id", flat=True)[:1000]:
        with transaction.atomic():
            request = (
                GenerationRequest.objects.select_for_update()
                .filter(pk=request_id, expires_at__lt=now)
                .only("user_id", "kudos_held", "is_chat", "faulted", "chat_fault_reason", "chat_fault_rc")
                .first()
            )
            if request is None:
                continue
            # A done request already had its done (or faulted) message; only an open one is faulted here.
            signal = None
            if request.is_chat and not request_completed(request_id):
                signal = (stored_result_count(request_id), request.chat_fault_reason, request.chat_fault_rc)
            kudos_release(user_id=request.user_id, amount=request.kudos_held)
            request.delete()
            status_changed(request_id)
            expired += 1
            if signal is not None:
                generations, fault_reason, fault_rc = signal
                publish_chat_signal(
                    request_id, "faulted", generations, fault_reason=fault_reason, fault_rc=fault_rc
                )
    return expired
