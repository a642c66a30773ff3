"""Admission, shared by the text and the chat creation: maintenance, concurrency, the
upfront kudos, and the rows of an active request with its hold and the horde tax."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from decimal import ROUND_UP, Decimal
from typing import Any, Literal
from uuid import UUID

from django.db.models import DecimalField, Exists, F, OuterRef, Subquery, Sum, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from accounts.models import HordeUser, KudosTransaction, SharedKey
from accounts.services import kudos_hold, kudos_transfer, shared_key_consume
from chat.metrics import free_allowance_decisions, free_allowance_estimated_wait, size_bucket
from chat.models import Generation, GenerationRequest, RequestModel, RequestWorker
from chat.pricing import context_multiplier
from chat.selectors.allowance import QueueWait, estimate_queue_wait_seconds, free_output_allowance
from chat.selectors.modes import horde_in_maintenance
from chat.selectors.queue import request_queue_lists
from chat.services.pop_cache import queue_grew
from contract.errors import HordeError
from contract.text import QUEUE_PRIORITY_STEP, QUEUE_PRIORITY_STEP_SECONDS, TEXT_HORDE_TAX

HORDE_TAX = Decimal(TEXT_HORDE_TAX)
# Upstream's priority for a request admitted on a shared key without the kudos it needs
# (allow_downgrade): the anonymous level, whatever its owner's kudos.
SHARED_KEY_DOWNGRADED_PRIORITY = -50


def queue_score(priority: int, created_epoch: float) -> int:
    """Priority grows by QUEUE_PRIORITY_STEP per horde-wide tick; subtracting the ticks before
    creation gives a score whose order never changes (see GenerationRequest.priority)."""
    return priority - QUEUE_PRIORITY_STEP * math.floor(created_epoch / QUEUE_PRIORITY_STEP_SECONDS)


@dataclass(frozen=True)
class FreeOutputAllowance:
    """The free output a request is allowed, and the wait it was sized by (None: no eligible worker)."""

    tokens: int
    wait: QueueWait | None


def free_output_allowance_for(
    *, user: HordeUser, fields: dict[str, Any], models: list[str], workers: list[UUID]
) -> FreeOutputAllowance:
    """The request's allowance, from its estimated wait on the workers eligible for it at its
    requested max_length (spec: Free output allowance). `fields` are the row's; the request is not
    written yet."""
    probe = GenerationRequest(user=user, requested_models=models, any_model=not models, **fields)
    # Placed as its activation will place it: at the requester's kudos, from now.
    score = queue_score(int(user.kudos), timezone.now().timestamp())
    wait = estimate_queue_wait_seconds(probe, workers, queue_score=score)
    return FreeOutputAllowance(tokens=free_output_allowance(wait), wait=wait)


def _requester_kind(user: HordeUser, shared_key: SharedKey | None) -> str:
    if shared_key is not None:
        return "shared_key"
    return "anonymous" if user.is_anonymous else "registered"


# --- shared keys (upstream's checks of a request made with one) -----------------------------------


def _kudos_figure(value: Decimal) -> str:
    return str(int(value)) if value == value.to_integral_value() else str(value)


def shared_key_unusable(key: SharedKey) -> HordeError | None:
    """403 SharedKeyEmpty or SharedKeyExpired for a key that cannot be spent from now."""
    if key.is_spent:
        return HordeError("SharedKeyEmpty", "This shared key has run out of kudos.", status=403)
    if key.is_expired(timezone.now()):
        return HordeError("SharedKeyExpired", "This shared key has expired", status=403)
    return None


def check_shared_key_limits(key: SharedKey, *, max_length: int, field: str | None = None) -> None:
    """400 BadRequest for a job over the key's max_text_tokens (`field`: the request path a chat
    refusal is prefixed with, quoted as every chat refusal's, which the front reads as its param)."""
    limit = key.max_text_tokens
    if limit != -1 and max_length > limit:
        message = f"This shared key is limited to {limit} tokens per job. You requested {max_length} tokens."
        raise HordeError("BadRequest", f"'{field}': {message}" if field else message, status=400)


@dataclass(frozen=True)
class SharedKeyFunds:
    """A limited key's kudos and what its unsettled requests reserve of them (docs/adr/0089)."""

    kudos: Decimal
    reserved: Decimal

    @property
    def available(self) -> Decimal:
        return self.kudos - self.reserved


def shared_key_funds(key: SharedKey) -> SharedKeyFunds | None:
    """The key's kudos and the reserve of its requests' jobs not yet settled (each waiting or
    processing job its request's shared_key_reserve), read in one statement, so a settlement
    committed meanwhile is either in both or in neither. None for an unlimited key. The creations
    on a key are its owner's: they run one at a time under the owner's locked row. The waiting
    jobs are found among the owner's requests (their user indexes), the processing ones among the
    generations in flight (the partial index on processing), each joined to its request by id."""
    if not key.has_kudos_limit:
        return None
    waiting = (
        GenerationRequest.objects.filter(
            user_id=key.user_id, jobs_waiting__gt=0, shared_key_id=OuterRef("pk"), faulted=False, cancelled=False
        )
        .order_by()
        .values("shared_key_id")
        .annotate(total=Sum(F("shared_key_reserve") * F("jobs_waiting")))
        .values("total")
    )
    processing = (
        Generation.objects.filter(
            state=Generation.State.PROCESSING, request__shared_key_id=OuterRef("pk")
        )
        .order_by()
        .values("request__shared_key_id")
        .annotate(total=Sum("request__shared_key_reserve"))
        .values("total")
    )
    money = DecimalField(max_digits=18, decimal_places=2)
    zero = Value(Decimal("0"), output_field=money)
    row = (
        SharedKey.objects.filter(pk=key.pk)
        .annotate(
            waiting_reserve=Coalesce(Subquery(waiting, output_field=money), zero),
            processing_reserve=Coalesce(Subquery(processing, output_field=money), zero),
        )
        .values_list("kudos", "waiting_reserve", "processing_reserve")
        .first()
    )
    if row is None:  # deleted meanwhile: nothing left to spend through it
        return SharedKeyFunds(kudos=Decimal("0"), reserved=Decimal("0"))
    kudos, waiting_reserve, processing_reserve = row
    cent = Decimal("0.01")  # SQLite's arithmetic comes back with more places
    return SharedKeyFunds(
        kudos=Decimal(kudos).quantize(cent),
        reserved=(Decimal(waiting_reserve) + Decimal(processing_reserve)).quantize(cent),
    )


def shared_key_lacks(key: SharedKey | None, required: Decimal) -> SharedKeyFunds | None:
    """The funds of a limited key whose kudos, less what its unsettled requests reserve, are
    under the request's upfront kudos (at its dearest model); None when the key covers it."""
    if key is None:
        return None
    funds = shared_key_funds(key)
    return funds if funds is not None and required > funds.available else None


def shared_key_reserve_per_job(key: SharedKey | None, *, dearest: Decimal, tax: Decimal, n: int) -> Decimal:
    """What a request reserves of a limited key per job: its dearest quote per job, the tax
    (charged at creation) aside; 0 without a limited key."""
    if key is None or not key.has_kudos_limit:
        return Decimal("0")
    return ((dearest - tax) / n).quantize(Decimal("0.01"), rounding=ROUND_UP)


def shared_key_insufficient_error(key: SharedKey, required: Decimal, funds: SharedKeyFunds | None = None) -> HordeError:
    """Upstream's refusal; when the key's requests reserve part of its kudos, the message says so."""
    if funds is None or not funds.reserved:
        remaining = _kudos_figure(funds.kudos if funds is not None else key.kudos)
    else:
        remaining = (
            f"{_kudos_figure(max(funds.available, Decimal('0')))} once its queued requests' "
            f"{_kudos_figure(funds.reserved)} are set aside"
        )
    return HordeError(
        "SharedKeyInsufficientKudos",
        f"This shared key does not have enough remaining kudos ({remaining}) "
        f"to fulfill this request ({_kudos_figure(required)}).",
        status=403,
    )


def needs_upfront_kudos(*, max_length: int, slow_workers: bool, has_worker_list: bool, allowance: int) -> bool:
    """Above the free output allowance, without slow workers, or (when the setting says so) with a
    worker list, a request holds its kudos at admission."""
    from django.conf import settings

    return (
        max_length > allowance
        or not slow_workers
        or (settings.HORDE_UPFRONT_KUDOS_ON_WORKERLIST and has_worker_list)
    )


def kudos_upfront_error(*, allowance: int, kudos: Decimal, max_length: int, slow_workers: bool = True) -> HordeError:
    """KudosUpfront, with why the request holds its kudos: over the allowance (the message states
    it), excluding slow workers, or listing workers under HORDE_UPFRONT_KUDOS_ON_WORKERLIST."""
    if max_length > allowance:
        reason = f"Due to heavy demand, for requests over {allowance} tokens, the client needs to already have"
    elif not slow_workers:
        reason = "A request that excludes slow workers needs its client to already have"
    else:
        reason = "A request that lists workers needs its client to already have"
    return HordeError("KudosUpfront", f"{reason} the required kudos. This request requires {kudos} kudos to fulfil.")


def no_eligible_worker_refusal(request: GenerationRequest) -> HordeError | None:
    """NoEligibleWorker in place of a kudos refusal when no online worker can serve the request
    (spec: Free output allowance): kudos do not help it until such a worker comes online. A chat
    request's declaration gap is stated, with its impossible_reason."""
    from chat.selectors.availability import chat_request_availability

    availability = chat_request_availability(request, created=True)
    if availability.is_possible:
        return None
    message = "No online worker can serve this request"
    extra: dict[str, Any] = {}
    reason = availability.impossible_reason
    if reason:
        gaps = []
        if reason.get("missing_declarations"):
            gaps.append(f"no online worker serving the model declares {', '.join(reason['missing_declarations'])}")
        for limit in reason.get("exceeded_limits") or []:
            gaps.append(f"the request exceeds the {limit} limit of every online worker serving the model")
        if gaps:
            message = f"{message}: {'; '.join(gaps)}"
        extra["impossible_reason"] = reason
    return HordeError("NoEligibleWorker", f"{message}.", status=403, extra=extra)


AllowanceOutcome = Literal["free", "funded", "refused", "downgraded"]


def record_allowance_decision(
    *, user: HordeUser, outcome: AllowanceOutcome, requested_max_length: int, is_chat: bool,
    allowance: FreeOutputAllowance, shared_key: SharedKey | None = None,
) -> None:
    """horde.text.free_allowance.decisions for one creation, and the wait the allowance was sized by
    when a worker was eligible (a dry run records neither)."""
    if allowance.wait is not None:
        free_allowance_estimated_wait.record(
            allowance.wait.seconds, {"horde.chat": is_chat, "horde.requester": _requester_kind(user, shared_key)}
        )
    free_allowance_decisions.add(
        1,
        {
            "horde.requester": _requester_kind(user, shared_key),
            "horde.outcome": outcome,
            "horde.requested_bucket": size_bucket(requested_max_length),
            "horde.allowance_bucket": size_bucket(allowance.tokens),
            "horde.chat": is_chat,
        },
    )


def ensure_not_in_maintenance() -> None:
    if horde_in_maintenance():
        raise HordeError("MaintenanceMode", "Horde is in maintenance mode. Please try again later.")


def check_concurrency(*, user: HordeUser, n: int, models: list[str] | None = None) -> None:
    """TooManyPrompts when the user's waiting jobs plus n exceed its concurrency.

    The anonymous account is everyone without a key: as upstream's, its jobs are counted among
    the requests that ask for any of `models` (all of them for a request naming none), so one
    model's crowd does not refuse anonymous requests for every other model.

    Run unlocked as an early refusal, and again on the locked user row inside the creation.
    """
    # jobs_waiting > 0 adds nothing to the sum: it lets the (user, jobs_waiting) index skip the
    # user's finished requests, which a busy user (the shared anonymous one) has by the 100,000
    # within a request's time to live (docs/adr/0082).
    waiting_requests = GenerationRequest.objects.filter(
        user=user, jobs_waiting__gt=0, faulted=False, cancelled=False, expires_at__gt=timezone.now()
    )
    if user.is_anonymous and models:
        waiting_requests = waiting_requests.filter(
            Exists(RequestModel.objects.filter(request=OuterRef("pk"), name__in=models))
        )
    waiting = waiting_requests.aggregate(total=Sum("jobs_waiting"))["total"] or 0
    if waiting + n > user.concurrency:
        if user.is_anonymous:
            raise HordeError(
                "TooManyPrompts",
                f"Too many anonymous requests on using the horde currently ({waiting + n}/{user.concurrency}). "
                "Please consider getting a personal API key, which will also provide higher priority.",
            )
        raise HordeError(
            "TooManyPrompts",
            f"Parallel requests ({waiting + n}) exceeded user limit ({user.concurrency}).",
        )


def lock_requester(user: HordeUser) -> HordeUser:
    """The requester's row, locked: concurrency and the hold are checked and taken together. NO
    KEY, as the hold's UPDATE: a settlement's ledger rows for this user (a foreign key check) are
    not held up behind it."""
    return HordeUser.objects.select_for_update(no_key=True).get(pk=user.pk)


def request_rows_create(
    *,
    locked_user: HordeUser,
    fields: dict,
    models: list[str],
    workers: list[UUID],
    kudos: Decimal,
    hold: Decimal,
    prompt_tokens: int | None = None,
    tax: Decimal = HORDE_TAX,
    inactive_id: UUID | None = None,
    shared_key: SharedKey | None = None,
    shared_key_reserve: Decimal = Decimal("0"),
    downgraded_priority: bool = False,
) -> GenerationRequest:
    """Insert an active request with its model and worker rows, take its hold and the horde tax
    (`tax`: a chat request's images add theirs). `prompt_tokens`: a chat request's prompt
    estimate, which its price's context follows. `inactive_id`: activate that row, written
    inactive before its images were stored (chat.services.create_chat), instead of inserting one.
    `shared_key`: the key it was made with, which pays its tax and settlements from its kudos, and
    `shared_key_reserve` what the request reserves of them per job (shared_key_reserve_per_job);
    `downgraded_priority`: queued at SHARED_KEY_DOWNGRADED_PRIORITY.

    Runs inside the caller's transaction, on the locked requester.
    """
    from django.conf import settings

    now = timezone.now()
    priority = SHARED_KEY_DOWNGRADED_PRIORITY if downgraded_priority else int(locked_user.kudos)
    values = {
        "requested_models": models,
        "any_model": not models,
        "priority": priority,
        "queue_score": queue_score(priority, now.timestamp()),
        "kudos_quote": kudos,
        "kudos_held": hold,
        "expires_at": now + timedelta(seconds=settings.HORDE_TEXT_REQUEST_TTL_SECONDS),
        "kudos_context": context_multiplier(fields["prompt"], fields["max_length"], prompt_tokens=prompt_tokens),
        "consumed_kudos": tax,  # the tax charged below, in this transaction
        "shared_key_id": shared_key.pk if shared_key is not None else None,
        "shared_key_reserve": shared_key_reserve if shared_key is not None else Decimal("0"),
        **fields,
    }
    if inactive_id is None:
        request = GenerationRequest.objects.create(user=locked_user, **values)
    else:
        if not GenerationRequest.objects.filter(pk=inactive_id, user=locked_user, jobs_waiting=0).update(**values):
            raise HordeError("ChatImageStorageUnavailable", "The request expired before its images were stored.",
                             status=503)
        request = GenerationRequest.objects.get(pk=inactive_id)
    RequestModel.objects.bulk_create([RequestModel(request=request, name=m) for m in dict.fromkeys(models)])
    RequestWorker.objects.bulk_create([RequestWorker(request=request, worker_id=w) for w in dict.fromkeys(workers)])
    if hold:
        kudos_hold(user_id=locked_user.pk, amount=hold)
    kudos_transfer(user_id=locked_user.pk, amount=-tax, kind=KudosTransaction.Kind.HORDE_TAX, request_id=request.id)
    shared_key_consume(shared_key_id=request.shared_key_id, amount=tax)
    queue_grew(request_queue_lists(is_chat=request.is_chat, models=models))
    return request
