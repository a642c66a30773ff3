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
from chat.matching import WorkerView, eligibility_filter, skipped_counts, waiting_requests
from chat.models import Generation, GenerationRequest, HordeModes, RequestModel, RequestWorker
from chat.pricing import text_generation_kudos, text_request_quote, things_count
from contract.errors import HordeError
from contract.text import (
    FAULTED_GENERATIONS_LIMIT,
    QUEUE_PRIORITY_STEP,
    QUEUE_PRIORITY_STEP_SECONDS,
    TEXT_HORDE_TAX,
    TEXT_JOB_LEASE_SECONDS,
    TEXT_REQUEST_TTL_SECONDS,
)
from workers.models import Worker
from workers.services import worker_record_aborted, worker_record_job

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


# --- Pop ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoppedJob:
    request: GenerationRequest | None
    generations: list[Generation]
    model: str | None
    skipped: dict[str, int]


def _priority_user_ids(worker: Worker) -> list[int]:
    """The owner, then each `priority_usernames` entry given as upstream's "alias#id"."""
    ids = [worker.owner_id]
    for alias in worker.priority_usernames or []:
        _, _, tail = str(alias).rpartition("#")
        if tail.isdigit():
            ids.append(int(tail))
    return ids


def _generation_model(request: GenerationRequest, worker: Worker) -> str:
    served = worker.served_models
    for model in request.requested_models:
        if model in served:
            return model
    return served[0] if served else ""


def worker_pop(*, worker: Worker, amount: int) -> PoppedJob:
    """Hand the first eligible request's jobs (up to `amount`) to the worker."""
    if worker.maintenance:
        raise HordeError(
            "WorkerMaintenance",
            f"Worker {worker.name} is in maintenance mode; it receives no jobs until its owner lifts it.",
        )
    view = WorkerView.of(worker)
    eligible = waiting_requests().filter(eligibility_filter(view)).only(
        "id", "prompt", "params", "softprompt", "max_length", "max_context_length", "requested_models",
        "jobs_waiting", "disable_batching", "n",
    )
    if worker.paused:
        return PoppedJob(request=None, generations=[], model=None, skipped={})
    with transaction.atomic():
        locking = eligible.select_for_update(skip_locked=True, of=("self",))
        request = None
        priority_ids = _priority_user_ids(worker)
        if GenerationRequest.objects.filter(user_id__in=priority_ids, jobs_waiting__gt=0).exists():
            request = locking.filter(user_id__in=priority_ids).order_by("-queue_score", "created").first()
        if request is None:
            request = locking.order_by("-queue_score", "created").first()
        if request is None:
            return PoppedJob(request=None, generations=[], model=None, skipped=skipped_counts(view))
        jobs = 1 if request.disable_batching else min(amount, request.jobs_waiting)
        now = timezone.now()
        model = _generation_model(request, worker)
        lease = now + timedelta(seconds=TEXT_JOB_LEASE_SECONDS)
        generations = Generation.objects.bulk_create(
            [Generation(request=request, worker=worker, model=model, lease_expires_at=lease) for _ in range(jobs)]
        )
        GenerationRequest.objects.filter(pk=request.pk).update(
            jobs_waiting=F("jobs_waiting") - jobs,
            expires_at=now + timedelta(seconds=TEXT_REQUEST_TTL_SECONDS),
        )
    return PoppedJob(request=request, generations=generations, model=model, skipped={})


# --- Submit ---------------------------------------------------------------------------------


def _fault_request_if_over_limit(request_id: UUID) -> bool:
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


def _requeue_faulted(generation_ids: list[UUID], request_id: UUID) -> None:
    GenerationRequest.objects.filter(pk=request_id, faulted=False, cancelled=False).update(
        jobs_waiting=F("jobs_waiting") + len(generation_ids)
    )
    _fault_request_if_over_limit(request_id)


def generation_submit(
    *, user: HordeUser, generation_id: UUID, text: str, state: str, seed: int, gen_metadata: list
) -> Decimal:
    """Store a worker's result (the first submit wins), charge the requester, reward the owner."""
    with transaction.atomic():
        generation = (
            Generation.objects.select_related("worker", "worker__owner", "request")
            .filter(pk=generation_id)
            .first()
        )
        if generation is None:
            raise HordeError("InvalidJobID", f"Processing Generation with ID {generation_id} does not exist.")
        worker = generation.worker
        if worker.owner_id != user.pk:
            raise HordeError("WrongCredentials", "Wrong credentials to submit as this worker.")
        now = timezone.now()
        new_state = state if state in ("ok", "censored", "csam", "faulted") else "ok"
        won = Generation.objects.filter(pk=generation_id, state=Generation.State.PROCESSING).update(
            state=new_state,
            text=None if new_state == "faulted" else text,
            seed=seed,
            gen_metadata=gen_metadata,
            finished_at=now,
        )
        if not won:
            current = Generation.objects.filter(pk=generation_id).values_list("state", flat=True).first()
            if current in (Generation.State.FAULTED, Generation.State.CANCELLED):
                raise HordeError(
                    "AbortedGen",
                    f"Processing Generation with ID {generation_id} took too long to process and has been "
                    "aborted! Please check your worker's speed and make sure it can finish within the lease.",
                )
            raise HordeError("DuplicateGen", f"Processing Generation with ID {generation_id} already submitted.")

        request = generation.request
        if new_state == "faulted":
            worker_record_aborted(worker_ids=[worker.pk])
            _requeue_faulted([generation.pk], request.pk)
            return Decimal("0")

        reward = text_generation_kudos(
            model=generation.model,
            prompt=request.prompt,
            generation=text,
            max_length=request.max_length,
            owner_trusted=worker.owner.trusted,
        )
        charge = Decimal("0") if new_state in ("censored", "csam") else reward
        Generation.objects.filter(pk=generation_id).update(kudos=reward)
        tokens = things_count(text, request.max_length)
        worker_record_job(
            worker_id=worker.pk, tokens=tokens, seconds=(now - generation.created).total_seconds(), kudos=reward
        )
        kudos_transfer(
            user_id=worker.owner_id,
            amount=reward,
            kind=KudosTransaction.Kind.GENERATION_REWARD,
            request_id=request.pk,
            generation_id=generation.pk,
        )
        # Each generation releases its share of the request's hold as it is charged.
        locked = GenerationRequest.objects.select_for_update().only("kudos_held", "n").get(pk=request.pk)
        release = min(locked.kudos_held, (request.kudos_quote / request.n).quantize(Decimal("0.01")))
        kudos_transfer(
            user_id=request.user_id,
            amount=-charge,
            kind=KudosTransaction.Kind.GENERATION_CHARGE,
            request_id=request.pk,
            generation_id=generation.pk,
            release_held=release,
        )
        GenerationRequest.objects.filter(pk=request.pk).update(
            consumed_kudos=F("consumed_kudos") + charge, kudos_held=F("kudos_held") - release
        )
    return reward


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
            _requeue_faulted([generation_id], request_id)
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

