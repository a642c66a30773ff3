"""Creating a text request (POST /generate/text/async): the operation key, the quote, the
downgrade, and the rows through chat.services.admission."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from uuid import UUID

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import HordeUser, SharedKey
from accounts.selectors import anonymous_user_get
from chat.model_reference import dearest_known_text_model
from chat.models import GenerationRequest
from chat.pricing import text_request_quote
from chat.selectors.models import text_workers_limits
from chat.services.admission import (
    HORDE_TAX,
    AllowanceOutcome,
    check_concurrency,
    check_shared_key_limits,
    ensure_not_in_maintenance,
    free_output_allowance_for,
    kudos_upfront_error,
    lock_requester,
    needs_upfront_kudos,
    no_eligible_worker_refusal,
    record_allowance_decision,
    request_rows_create,
    shared_key_insufficient_error,
    shared_key_lacks,
    shared_key_reserve_per_job,
    shared_key_unusable,
)
from contract.chat_limits import CHARS_PER_TOKEN_ESTIMATE
from contract.chat_shapes import ChatContextAdjustmentReason
from contract.errors import HordeError
from contract.text import (
    TEXT_MAX_CONTEXT_LENGTH_RANGE,
    TEXT_MAX_LENGTH_RANGE,
    TEXT_MISSING_PROMPT_MESSAGE,
    text_params_refusal,
)

log = logging.getLogger(__name__)


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
    # Sent by the OpenAI front (/v1/completions): a max_length above every online worker's serving
    # the models is lowered to the largest, as a chat request's is (docs/adr/0095).
    lower_max_length_to_workers: bool = False
    # Sent by the front when it sized max_context_length itself (an estimate that errs high, not the
    # client's horde.max_context_length): above every online worker's it is lowered (ADR 0111).
    lower_max_context_length_to_workers: bool = False


# Upstream's text async answer when no worker can serve the request (it is still queued).
TEXT_NO_AVAILABLE_WORKER_WARNING = (
    "Warning: No available workers can fulfill this request. It will expire in 20 minutes. "
    "Consider reducing the amount of tokens to generate."
)


@dataclass(frozen=True)
class CreatedRequest:
    request: GenerationRequest | None
    kudos: Decimal
    message: str | None = None
    # A repeated operation key: the claim's request, nothing queued or charged (200).
    repeated: bool = False
    # The max_length lowered to the workers' (lower_max_length_to_workers), as a chat request's.
    context_adjustments: list[dict] | None = None


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
        # Only when asked: the fingerprints stored before the option existed stay the same.
        **({"lower_max_length_to_workers": True} if data.lower_max_length_to_workers else {}),
        **({"lower_max_context_length_to_workers": True} if data.lower_max_context_length_to_workers else {}),
    }
    canonical = json.dumps(defining, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def text_operation_claim(*, user: HordeUser, operation_key: UUID, fingerprint: str) -> CreatedRequest | None:
    """A repeated text operation key: the first request when it is the same operation, else
    OperationKeyConflict; None when the user has no claim on the key."""
    # The claim is the user's whatever the route: a key a chat request holds is another operation.
    claim = (
        GenerationRequest.objects.filter(user=user, operation_key=operation_key)
        .only("id", "is_chat", "kudos_quote", "operation_fingerprint", "context_adjustments")
        .first()
    )
    if claim is None:
        return None
    if claim.is_chat or claim.operation_fingerprint != fingerprint:
        raise HordeError(
            "OperationKeyConflict",
            "The operation_key was already used for a different request: a repeated submission has to "
            "send the same request.",
            status=400,
        )
    return CreatedRequest(
        request=claim, kudos=claim.kudos_quote, repeated=True, context_adjustments=claim.context_adjustments
    )


def text_request_create(
    *,
    user: HordeUser,
    data: TextRequestInput,
    client_agent: str = "",
    ip_address: str = "",
    front_lease_seconds: int | None = None,
    front_id: str | None = None,
    shared_key: SharedKey | None = None,
) -> CreatedRequest:
    """Price, admit and queue a text request (or only quote it, on a dry run). A repeated operation
    key is answered first, before anything that could refuse or charge it, as on the chat route.
    `shared_key`: the key `user` (its owner) was authenticated by."""

    if not data.prompt:
        raise HordeError("MissingPrompt", TEXT_MISSING_PROMPT_MESSAGE)
    operation_key = None if data.dry_run else data.operation_key
    fingerprint = text_operation_fingerprint(data) if operation_key is not None else ""
    if operation_key is not None:
        repeated = text_operation_claim(user=user, operation_key=operation_key, fingerprint=fingerprint)
        if repeated is not None:
            return repeated
    ensure_not_in_maintenance()
    refusal = text_params_refusal(data.params, max_length=data.max_length, max_context_length=data.max_context_length)
    if refusal is not None:
        raise HordeError(*refusal)
    lowering = data.lower_max_length_to_workers or data.lower_max_context_length_to_workers
    adjustments = _lowered_to_workers(data) if lowering else None
    downgraded_priority = False
    if shared_key is not None:
        unusable = shared_key_unusable(shared_key)
        if unusable is not None:
            if not (unusable.rc == "SharedKeyEmpty" and data.allow_downgrade and settings.HORDE_ALLOW_ANONYMOUS):
                raise unusable
            # Upstream: a spent key with allow_downgrade asks as the anonymous user, at its
            # priority, within the key's limits still.
            check_shared_key_limits(shared_key, max_length=data.max_length)
            user, shared_key, downgraded_priority = anonymous_user_get(), None, True

    def quote() -> Decimal:
        return text_request_quote(
            models=data.models, prompt=data.prompt, max_length=data.max_length, n=data.n
        ) + HORDE_TAX

    kudos = quote()
    if data.dry_run:
        return CreatedRequest(request=None, kudos=kudos, context_adjustments=adjustments)

    try:
        request, kudos, message = _text_request_rows(
            user=user,
            data=data,
            kudos=kudos,
            quote=quote,
            shared_key=shared_key,
            downgraded_priority=downgraded_priority,
            extra_fields={
                "client_agent": client_agent[:255],
                "ip_address": ip_address[:64],
                "operation_key": operation_key,
                "operation_fingerprint": fingerprint,
                "front_lease_expires_at": (
                    timezone.now() + timedelta(seconds=front_lease_seconds) if front_lease_seconds else None
                ),
                "front_id": front_id if front_lease_seconds else None,
                "context_adjustments": adjustments,
            },
        )
    except IntegrityError:
        # Two submits with one key: the unique index let the other commit; answer with it.
        repeated = None
        if operation_key is not None:
            repeated = text_operation_claim(user=user, operation_key=operation_key, fingerprint=fingerprint)
        if repeated is None:
            raise
        assert repeated.request is not None  # a claim answers with its stored request
        log.info("operation key %s: a concurrent text submit won; answering with %s", operation_key, repeated.request.id)
        return repeated
    from chat.selectors.availability import chat_request_availability

    if not chat_request_availability(request, created=True).is_possible:
        message = TEXT_NO_AVAILABLE_WORKER_WARNING
    return CreatedRequest(request=request, kudos=kudos, message=message, context_adjustments=adjustments)


def _lowered_to_workers(data: TextRequestInput) -> list[dict] | None:
    """Fit data to the online text workers serving its models (the front's legacy completions).
    lower_max_length_to_workers: a max_length above the largest worker's is lowered to it (OpenAI's
    max_tokens is an upper bound), the chat route's worker_max_length adjustment, returned.
    lower_max_context_length_to_workers: a context above the largest of the workers that could take
    the request (its completion and worker rules) is lowered to it (the front's own ask, which errs
    high, ADR 0111; never a client's), not below the prompt's four-characters-a-token estimate and
    the completion. None when max_length was not lowered."""
    limits = text_workers_limits(data.models)
    if not limits:
        return None
    largest_length = max(length for _id, length, _context in limits)
    adjustments = None
    if data.lower_max_length_to_workers and TEXT_MAX_LENGTH_RANGE[0] <= largest_length < data.max_length:
        adjustments = [
            {"from": data.max_length, "to": largest_length, "reason": ChatContextAdjustmentReason.WORKER_MAX_LENGTH.value}
        ]
        # The context it needs is its prompt and its completion (the front sends their sum), as a
        # chat request is sized after its lowering: kept, it could still exceed every worker's context.
        data.max_context_length = max(
            largest_length, TEXT_MAX_CONTEXT_LENGTH_RANGE[0], data.max_context_length - (data.max_length - largest_length)
        )
        data.max_length = largest_length
    if not data.lower_max_context_length_to_workers:
        return adjustments
    # A worker that cannot take the request anyway (its completion limit, the worker list, the
    # trusted-workers, validated-backends and slow-workers rules) must not hold the ask above one that can.
    restrictions = GenerationRequest(
        has_worker_list=bool(data.workers),
        worker_blacklist=data.worker_blacklist,
        trusted_workers=data.trusted_workers,
        validated_backends=data.validated_backends,
        slow_workers=data.slow_workers,
    )
    contexts = [
        context
        for _id, length, context in text_workers_limits(
            data.models, restrictions=restrictions, listed_worker_ids=set(data.workers)
        )
        if length >= data.max_length
    ]
    if contexts and data.max_context_length > max(contexts):
        needed = math.ceil(len(data.prompt) / CHARS_PER_TOKEN_ESTIMATE) + data.max_length
        data.max_context_length = max(max(contexts), needed, TEXT_MAX_CONTEXT_LENGTH_RANGE[0])
    return adjustments


def _text_request_rows(
    *,
    user: HordeUser,
    data: TextRequestInput,
    kudos: Decimal,
    quote,
    extra_fields: dict,
    shared_key: SharedKey | None,
    downgraded_priority: bool,
) -> tuple[GenerationRequest, Decimal, str | None]:
    """The creation transaction of a text request: concurrency, the shared key's kudos, the hold
    (or the downgrade to the free output allowance), the rows."""
    requested = data.max_length
    # A listed request holds its kudos upfront under this setting and is never lowered.
    downgrade_disabled = bool(settings.HORDE_UPFRONT_KUDOS_ON_WORKERLIST and data.workers)
    # The shared key's kudos, then its token limit, as upstream's; its kudos at the dearest listed
    # model (spec: Pricing).
    # Read again under the owner's lock below, where it is decided (docs/adr/0089); here it only
    # orders the key's refusals as upstream's.
    key_short = shared_key is not None and shared_key_lacks(shared_key, _dearest_quote(data)) is not None
    key_funds = None
    if key_short and data.allow_downgrade and not downgrade_disabled:
        # Upstream admits it at the anonymous priority; it still draws the key down to 0.
        downgraded_priority, key_short = True, False
    if shared_key is not None and not key_short:
        check_shared_key_limits(shared_key, max_length=data.max_length)
    message = None
    outcome: AllowanceOutcome = "free"

    def row_fields() -> dict:
        return {
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
        }

    # Measured at the requested max_length, before the lock: the queue ahead on the eligible workers.
    allowance = free_output_allowance_for(user=user, fields=row_fields(), models=data.models, workers=data.workers)
    with transaction.atomic():
        locked_user = lock_requester(user)
        check_concurrency(user=locked_user, n=data.n, models=data.models)
        if shared_key is not None and not downgraded_priority:
            # The key's creations are its owner's, one at a time under this lock: what it has left
            # after its unsettled requests' reserve is read by one of them at a time.
            key_funds = shared_key_lacks(shared_key, _dearest_quote(data))
            if key_funds is not None and data.allow_downgrade and not downgrade_disabled:
                downgraded_priority, key_funds = True, None
            key_short = key_funds is not None
            if not key_short:
                check_shared_key_limits(shared_key, max_length=data.max_length)
        hold = Decimal("0")
        if needs_upfront_kudos(
            max_length=data.max_length,
            slow_workers=data.slow_workers,
            has_worker_list=bool(data.workers),
            allowance=allowance.tokens,
        ):
            if locked_user.kudos_available >= kudos:
                hold, outcome = kudos, "funded"
            elif (
                data.allow_downgrade
                and data.slow_workers
                and data.max_length > allowance.tokens
                and not downgrade_disabled
            ):
                data.max_length = allowance.tokens
                kudos = quote()
                message = (
                    f"This request was downgraded to {allowance.tokens} tokens: the requester lacks the kudos upfront."
                )
                outcome = "downgraded"
                log.info(
                    "text request of user %s downgraded from %d to %d tokens: %s kudos available",
                    locked_user.pk, requested, allowance.tokens, locked_user.kudos_available,
                )
            else:
                outcome = "refused"
        if key_short:
            outcome = "refused"
        request = request_rows_create(
            locked_user=locked_user,
            fields=row_fields(),
            models=data.models,
            workers=data.workers,
            kudos=kudos,
            hold=hold,
            shared_key=shared_key,
            shared_key_reserve=shared_key_reserve_per_job(
                shared_key, dearest=_dearest_quote(data), tax=HORDE_TAX, n=data.n
            ) if shared_key is not None and shared_key.has_kudos_limit else Decimal("0"),
            downgraded_priority=downgraded_priority,
        )
        if outcome == "refused":
            # The row is rolled back with the refusal; it exists here so that the worker check
            # reads it as the status would.
            refusal = no_eligible_worker_refusal(request) or (
                shared_key_insufficient_error(shared_key, _dearest_quote(data), key_funds)
                if key_short and shared_key is not None
                else kudos_upfront_error(
                    allowance=allowance.tokens, kudos=kudos, max_length=data.max_length, slow_workers=data.slow_workers
                )
            )
            record_allowance_decision(
                user=user, outcome=outcome, requested_max_length=requested, is_chat=False, allowance=allowance,
                shared_key=shared_key,
            )
            raise refusal
    record_allowance_decision(
        user=user, outcome=outcome, requested_max_length=requested, is_chat=False, allowance=allowance,
        shared_key=shared_key,
    )
    return request, kudos, message


def _dearest_quote(data: TextRequestInput) -> Decimal:
    """The request's kudos at the dearest of its models, for a shared key's checks and reserve.
    Without a list, any worker's model serves it and is charged (chat.services.pop._job_price), so
    the dearer of the reference's dearest model and an unknown model bounds it (docs/adr/0089)."""
    dearest_known = dearest_known_text_model()
    models = [[m] for m in data.models] or [[], *([[dearest_known]] if dearest_known else [])]
    return max(
        text_request_quote(models=m, prompt=data.prompt, max_length=data.max_length, n=data.n) for m in models
    ) + HORDE_TAX
