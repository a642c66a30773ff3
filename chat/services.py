"""Writes on requests and generations: create, pop, submit, cancel, and the periodic sweeps.

Every kudos movement commits in the transaction that stores what it pays for.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from uuid import UUID

from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone

from accounts.models import HordeUser, KudosTransaction
from accounts.services import kudos_hold, kudos_release, kudos_transfer
from chat.models import Generation, GenerationRequest, HordeModes, RequestModel, RequestWorker
from chat.pricing import text_request_quote
from contract.errors import HordeError
from contract.text import (
    FAULTED_GENERATIONS_LIMIT,
    QUEUE_PRIORITY_STEP,
    QUEUE_PRIORITY_STEP_SECONDS,
    TEXT_HORDE_TAX,
    TEXT_REQUEST_TTL_SECONDS,
)
from workers.services import worker_record_aborted

log = logging.getLogger(__name__)

HORDE_TAX = Decimal(TEXT_HORDE_TAX)


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
    validated_backends: bool = True
    slow_workers: bool = True
    allow_downgrade: bool = False
    disable_batching: bool = False
    softprompt: str = ""
    dry_run: bool = False


@dataclass(frozen=True)
class CreatedRequest:
    request: GenerationRequest | None
    kudos: Decimal
    message: str | None = None


def horde_in_maintenance() -> bool:
    from django.conf import settings

    if settings.HORDE_MAINTENANCE:
        return True
    return HordeModes.objects.filter(maintenance=True).exists()


def horde_modes_set(*, actor: HordeUser, maintenance: bool) -> None:
    if not actor.moderator:
        raise HordeError("NotModerator", "Only a moderator can change the horde's modes.")
    HordeModes.objects.update_or_create(pk=1, defaults={"maintenance": maintenance})


def queue_score(priority: int, created_epoch: float) -> int:
    """Priority grows by QUEUE_PRIORITY_STEP per horde-wide tick; subtracting the ticks before
    creation gives a score whose order never changes (see GenerationRequest.priority)."""
    return priority - QUEUE_PRIORITY_STEP * math.floor(created_epoch / QUEUE_PRIORITY_STEP_SECONDS)


def _needs_upfront_kudos(data: TextRequestInput, free_output_floor: int, on_worker_list: bool) -> bool:
    return data.max_length > free_output_floor or not data.slow_workers or (on_worker_list and bool(data.workers))


def text_request_create(
    *, user: HordeUser, data: TextRequestInput, client_agent: str = "", ip_address: str = ""
) -> CreatedRequest:
    """Price, admit and queue a text request (or only quote it, on a dry run)."""
    from django.conf import settings

    if horde_in_maintenance():
        raise HordeError("MaintenanceMode", "Horde is in maintenance mode. Please try again later.")
    floor = settings.HORDE_TEXT_FREE_OUTPUT_FLOOR
    message = None

    def quote() -> Decimal:
        return text_request_quote(
            models=data.models, prompt=data.prompt, max_length=data.max_length, n=data.n
        ) + HORDE_TAX

    kudos = quote()
    if data.dry_run:
        return CreatedRequest(request=None, kudos=kudos)

    with transaction.atomic():
        # Lock the requester: concurrency and the hold are checked and taken together.
        locked_user = HordeUser.objects.select_for_update().get(pk=user.pk)
        waiting = (
            GenerationRequest.objects.filter(
                user=locked_user, faulted=False, cancelled=False, expires_at__gt=timezone.now()
            ).aggregate(total=Sum("jobs_waiting"))["total"]
            or 0
        )
        if waiting + data.n > locked_user.concurrency:
            raise HordeError(
                "TooManyPrompts",
                f"Parallel requests ({waiting + data.n}) exceeded user limit ({locked_user.concurrency}).",
            )
        hold = Decimal("0")
        if _needs_upfront_kudos(data, floor, settings.HORDE_UPFRONT_KUDOS_ON_WORKERLIST):
            if locked_user.kudos_available < kudos:
                downgradable = data.allow_downgrade and data.slow_workers and data.max_length > floor
                if not downgradable:
                    raise HordeError(
                        "KudosUpfront",
                        f"Due to heavy demand, for requests over {floor} tokens, the client needs to already "
                        f"have the required kudos. This request requires {kudos} kudos to fulfil.",
                    )
                data.max_length = floor
                kudos = quote()
                message = f"This request was downgraded to {floor} tokens: the requester lacks the kudos upfront."
            else:
                hold = kudos
        now = timezone.now()
        priority = int(locked_user.kudos)
        request = GenerationRequest.objects.create(
            user=locked_user,
            prompt=data.prompt,
            params=data.params,
            softprompt=data.softprompt,
            n=data.n,
            jobs_waiting=data.n,
            max_length=data.max_length,
            max_context_length=data.max_context_length,
            requested_models=data.models,
            any_model=not data.models,
            has_worker_list=bool(data.workers),
            worker_blacklist=data.worker_blacklist,
            trusted_workers=data.trusted_workers,
            validated_backends=data.validated_backends,
            slow_workers=data.slow_workers,
            allow_downgrade=data.allow_downgrade,
            disable_batching=data.disable_batching,
            priority=priority,
            queue_score=queue_score(priority, now.timestamp()),
            kudos_quote=kudos,
            kudos_held=hold,
            client_agent=client_agent[:255],
            ip_address=ip_address[:64],
            expires_at=now + timedelta(seconds=TEXT_REQUEST_TTL_SECONDS),
        )
        RequestModel.objects.bulk_create([RequestModel(request=request, name=m) for m in dict.fromkeys(data.models)])
        RequestWorker.objects.bulk_create(
            [RequestWorker(request=request, worker_id=w) for w in dict.fromkeys(data.workers)]
        )
        if hold:
            kudos_hold(user_id=locked_user.pk, amount=hold)
        kudos_transfer(
            user_id=locked_user.pk, amount=-HORDE_TAX, kind=KudosTransaction.Kind.HORDE_TAX, request_id=request.id
        )
        request.consumed_kudos = HORDE_TAX
        GenerationRequest.objects.filter(pk=request.pk).update(consumed_kudos=HORDE_TAX)
    return CreatedRequest(request=request, kudos=kudos, message=message)


# --- Faults ---------------------------------------------------------------------------------


def fault_request_if_over_limit(request_id: UUID) -> bool:
    """Fault a request whose faulted jobs exceed FAULTED_GENERATIONS_LIMIT; releases its hold."""
    faults = Generation.objects.filter(request_id=request_id, state=Generation.State.FAULTED).count()
    if faults <= FAULTED_GENERATIONS_LIMIT:
        return False
    request = GenerationRequest.objects.select_for_update().only("user_id", "kudos_held", "faulted").get(pk=request_id)
    if request.faulted:
        return True
    GenerationRequest.objects.filter(pk=request_id).update(faulted=True, jobs_waiting=0, kudos_held=0)
    kudos_release(user_id=request.user_id, amount=request.kudos_held)
    log.warning("request %s faulted after %d faulted jobs", request_id, faults)
    return True


def requeue_faulted(generation_ids: list[UUID], request_id: UUID) -> None:
    GenerationRequest.objects.filter(pk=request_id, faulted=False, cancelled=False).update(
        jobs_waiting=F("jobs_waiting") + len(generation_ids)
    )
    fault_request_if_over_limit(request_id)


# --- Cancel, expiry, stale leases -----------------------------------------------------------


def request_cancel(*, request: GenerationRequest) -> None:
    """Stop handing out jobs and release the hold. Jobs in flight still submit and are paid."""
    with transaction.atomic():
        locked = GenerationRequest.objects.select_for_update().only("user_id", "kudos_held", "cancelled").get(
            pk=request.pk
        )
        if locked.cancelled:
            return
        GenerationRequest.objects.filter(pk=request.pk).update(cancelled=True, jobs_waiting=0, kudos_held=0)
        kudos_release(user_id=locked.user_id, amount=locked.kudos_held)


def abort_stale_generations() -> int:
    """Fault jobs whose lease lapsed and put them back in the queue (the 60 s beat task)."""
    now = timezone.now()
    aborted = 0
    stale = list(
        Generation.objects.filter(state=Generation.State.PROCESSING, lease_expires_at__lt=now).values_list(
            "id", "request_id", "worker_id"
        )[:1000]
    )
    for generation_id, request_id, worker_id in stale:
        with transaction.atomic():
            if not Generation.objects.filter(pk=generation_id, state=Generation.State.PROCESSING).update(
                state=Generation.State.FAULTED, finished_at=now
            ):
                continue  # submitted meanwhile
            worker_record_aborted(worker_ids=[worker_id])
            requeue_faulted([generation_id], request_id)
            aborted += 1
    if aborted:
        log.info("aborted %d stale generations", aborted)
    return aborted


def expire_requests() -> int:
    """Delete requests past their expiry and release their holds (the 60 s beat task)."""
    now = timezone.now()
    expired = 0
    for request_id in GenerationRequest.objects.filter(expires_at__lt=now).values_list("id", flat=True)[:1000]:
        with transaction.atomic():
            request = (
                GenerationRequest.objects.select_for_update()
                .filter(pk=request_id, expires_at__lt=now)
                .only("user_id", "kudos_held")
                .first()
            )
            if request is None:
                continue
            kudos_release(user_id=request.user_id, amount=request.kudos_held)
            request.delete()
            expired += 1
    return expired

