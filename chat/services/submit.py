"""The submit: store a worker's result (the first submit wins), charge and reward in one transaction.

A text job submits `generation`; a chat job submits a structured reply (spec: chat_requests.md,
"Structured submit"), verified against the request before the compare-and-set claims the job.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal
from typing import Any, NoReturn
from uuid import UUID

from django.db import DatabaseError, connection, transaction
from django.db.models import Exists, F, OuterRef
from django.utils import timezone

from accounts.models import HordeUser
from accounts.services import kudos_settle
from chat.gate_shadow import record_gate_shadow_outcome, record_outcome
from chat.metrics import chat_worker_faults, text_empty_generations
from chat.models import Generation, GenerationRequest
from chat.pricing import (
    chat_charge_basis,
    chat_things_count,
    kudos_amount,
    text_generation_kudos,
    things_count,
)
from chat.selectors.status import stored_results_and_done
from chat.services import front_lease
from chat.services.faults import requeue_dropped_job
from chat.services.progress import end_progress_after_fault, end_progress_after_submit
from chat.signals import publish_chat_signal
from chat.sql import chat_reply_submit, generation_with_relations, priced_text_submit, run_prepared
from contract.chat_declaration import chat_worker_fault_message, chat_worker_fault_metric_reason
from contract.chat_errors import ChatRefusal
from contract.chat_limits import MAX_CHAT_FAULT_REASON_LENGTH
from contract.chat_progress import streams_progress
from contract.chat_verify import parse_chat_submit, verify_chat_reply
from contract.errors import HordeError
from contract.text import replace_nul
from workers.services import worker_record_job

log = logging.getLogger(__name__)

# The refusals of a reply that are recorded on the request and the generation before the 400.
CHAT_REFUSAL_RCS = frozenset({"ChatSubmitInvalid", "ChatSubmitNonconformant", "ChatModelMismatch"})
# chat_fault_rc of a fault the worker explained with a known fault_reason.
CHAT_WORKER_FAULT_RC = "ChatWorkerFault"


@dataclass(frozen=True)
class TextSubmit:
    """The validated text fields of a submit."""

    text: str = ""
    state: str = "ok"
    seed: int = 0
    gen_metadata: list = field(default_factory=list)


# --- shared ---------------------------------------------------------------------------------


def _load_generation(*, user: HordeUser, generation_id: UUID) -> Generation:
    generation = generation_with_relations(generation_id)
    if generation is None:
        raise HordeError("InvalidJobID", f"Processing Generation with ID {generation_id} does not exist.")
    if generation.worker.owner_id != user.pk:
        raise HordeError("WrongCredentials", "Wrong credentials to submit as this worker.")
    return generation


def _not_pending_error(generation_id: UUID, state: str | None) -> HordeError:
    if state is None:  # gone since it was read (its request expired or was deleted)
        return HordeError("InvalidJobID", f"Processing Generation with ID {generation_id} does not exist.")
    if state in (Generation.State.FAULTED, Generation.State.CANCELLED):
        return HordeError(
            "AbortedGen",
            f"Processing Generation with ID {generation_id} took too long to process and has been "
            "aborted! Please check your worker's speed and make sure it can finish within the lease.",
        )
    return HordeError("DuplicateGen", f"Processing Generation with ID {generation_id} already submitted.")


def _current_state(generation_id: UUID) -> str | None:
    return Generation.objects.filter(pk=generation_id).values_list("state", flat=True).first()


def _apply_fault(generation: Generation, *, now, seed: int = 0, gen_metadata: list | None = None) -> None:
    """Claim the pending generation as faulted, count the dropped job and restart it, together.

    The worker counter reads the refusal the horde stored, so a worker cannot claim the exemption.
    """
    with transaction.atomic():
        won = Generation.objects.filter(pk=generation.pk, state=Generation.State.PROCESSING).update(
            state=Generation.State.FAULTED,
            text=None,
            seed=seed,
            gen_metadata=gen_metadata or [],
            finished_at=now,
        )
        if not won:
            raise _not_pending_error(generation.pk, _current_state(generation.pk))
        requeue_dropped_job(
            generation_id=generation.pk, request_id=generation.request_id, worker_id=generation.worker_id
        )
        if generation.request.is_chat and streams_progress(generation.request.chat_extras):
            transaction.on_commit(
                lambda: end_progress_after_fault(generation.pk, generation.request_id), robust=True
            )
    record_gate_shadow_outcome(generation, "faulted")


def hold_share(request: GenerationRequest) -> Decimal:
    """What one result of a text request releases of its hold: its quote over n, rounded up to the
    cent, so its n results release the whole hold (the last one the rest). Rounded to the nearest,
    a hold of 3p + 1 kept 0.01 held on a done request (docs/adr/0090)."""
    return (request.kudos_quote / request.n).quantize(Decimal("0.01"), rounding=ROUND_CEILING)


def _settle(generation: Generation, *, state: str, tokens: int, reward: Decimal, now) -> None:
    """Reward the owner, charge the requester the same and release the hold's share.

    Runs inside the transaction whose compare-and-set stored the result (and its kudos).
    """
    request = generation.request
    worker = generation.worker
    charge = reward  # 0 for a result the worker withheld (UNPAID_STATES)
    # The horde's one lock order (docs/adr/0068-one-lock-order.md): the request, the worker, then
    # both balances. Locking the request also serialises the submits of one chat request, so the
    # completion check after it sees every result, and each generation releases its share of the
    # hold as it is charged.
    locked = GenerationRequest.objects.select_for_update(no_key=True).only("kudos_held").get(pk=request.pk)
    # A chat request's one job releases the whole hold (taken at its dearest model).
    release = locked.kudos_held if request.is_chat else min(locked.kudos_held, hold_share(request))
    worker_record_job(
        worker=worker, tokens=tokens, seconds=(now - generation.created).total_seconds(), kudos=reward
    )
    kudos_settle(
        payee_id=worker.owner_id,
        payer_id=request.user_id,
        reward=reward,
        charge=charge,
        release_held=release,
        request_id=request.pk,
        generation_id=generation.pk,
        shared_key_id=request.shared_key_id,
    )
    GenerationRequest.objects.filter(pk=request.pk).update(
        consumed_kudos=F("consumed_kudos") + charge, kudos_held=F("kudos_held") - release
    )


# --- entry points ---------------------------------------------------------------------------


def job_submit(
    *, user: HordeUser, generation_id: UUID, text: TextSubmit | None, chat_body: Mapping[str, Any] | None
) -> Decimal:
    """Store a worker's result for a text or chat job; returns the reward.

    `chat_body` is the whole body when it is chat-shaped (carries message, model_id, finish_reason
    or fault_reason); `text` is its text fields when they validate (always for a text-shaped body).
    """
    if chat_body is None and text is not None and text.state != "faulted" and connection.vendor == "postgresql":
        # A text job as its pop priced it: one statement, no read (docs/adr/0026-price-at-pop.md).
        reward = _priced_text_submit(user=user, generation_id=generation_id, data=text)
        if reward is not None:
            return reward
    # Anything else, or a priced submit that did not win (to say why): read the job and decide.
    generation = _load_generation(user=user, generation_id=generation_id)
    if front_lease.front_gone(generation.request):  # nobody can receive it (docs/adr/0028)
        front_lease.cancel_for_dead_front(generation.request_id)
        raise _not_pending_error(generation.pk, _current_state(generation.pk))
    try:
        if generation.request.is_chat:
            if chat_body is None:
                return _chat_job_text_shaped(generation, text)
            return _chat_submit(generation, chat_body)
        if chat_body is not None and ("message" in chat_body or text is None):
            raise ChatRefusal(
                "ChatSubmitInvalid", "A text job's submit sends generation, not message.", param="message"
            )
    except ChatRefusal as refusal:
        # The native error body: {"message", "rc"} at the refusal's status.
        raise HordeError(refusal.rc, refusal.message, status=refusal.status) from None
    assert text is not None
    # On a text job the chat keys (model_id, fault_reason...) are ignored.
    return _text_submit(generation, text)


# Results the worker reports it withheld (its own filter): nobody is charged for them, so nobody is
# paid either; kudos are only ever moved, never made (docs/adr/0070-withheld-results-are-not-paid.md).
UNPAID_STATES = ("censored", "csam")


def _text_state(data: TextSubmit) -> str:
    return data.state if data.state in ("ok", "censored", "csam", "faulted") else "ok"


def _uncapped_tokens(text: str | None) -> int:
    """things_count before its max_length cap, which the priced statement applies from the row."""
    return things_count(text, 2**31 - 1)


def _priced_text_submit(*, user: HordeUser, generation_id: UUID, data: TextSubmit) -> Decimal | None:
    """PostgreSQL, a text job priced at its pop: the claim, the reward from the stored rate, and the
    whole settlement in one statement (chat.sql.priced_text_submit). None when it did not win: not
    found, another owner's, a chat job, not pending, or popped before its price was stored."""
    now = timezone.now()
    state = _text_state(data)
    row = run_prepared(
        *priced_text_submit(
            generation_id=generation_id,
            owner_id=user.pk,
            state=state,
            text=data.text,
            seed=data.seed,
            gen_metadata=json.dumps(data.gen_metadata),
            tokens=_uncapped_tokens(data.text),
            charged=state not in UNPAID_STATES,
            processing=Generation.State.PROCESSING,
            now=now,
        )
    )
    if row is None:
        return None
    request_id, reward, created, max_length, trusted, over_capacity, model = row
    _count_if_empty(state=state, text=data.text, model=model, is_chat=False)
    if over_capacity:
        record_outcome(
            "completed", max_length=max_length, trusted=trusted, is_chat=False, service_seconds=(now - created).total_seconds()
        )
    return reward


def _text_reward(generation: Generation, text: str | None) -> tuple[int, Decimal]:
    """(tokens, reward) of a text reply: from the price its pop stored, or (a job popped before
    prices were stored) from the request as the pop would have priced it."""
    if generation.price_rate is not None:
        # The pop stores the price's columns together: a rate comes with its flat part and cap.
        assert generation.price_flat is not None and generation.price_max_length is not None
        tokens = things_count(text, generation.price_max_length)
        return tokens, kudos_amount(tokens * generation.price_rate + generation.price_flat)
    request = generation.request
    tokens = things_count(text, request.max_length)
    return tokens, text_generation_kudos(
        model=generation.model,
        prompt=request.prompt,
        context=request.kudos_context,
        generation=text,
        max_length=request.max_length,
        owner_trusted=generation.worker.owner.trusted,
        tokens=tokens,
    )


def _text_submit(generation: Generation, data: TextSubmit) -> Decimal:
    now = timezone.now()
    state = _text_state(data)
    if state == "faulted":
        _apply_fault(generation, now=now, seed=data.seed, gen_metadata=data.gen_metadata)
        return Decimal("0")
    tokens, reward = _text_reward(generation, data.text)
    if state in UNPAID_STATES:
        reward = Decimal("0")
    with transaction.atomic():
        won = Generation.objects.filter(pk=generation.pk, state=Generation.State.PROCESSING).update(
            state=state,
            text=data.text,
            seed=data.seed,
            gen_metadata=data.gen_metadata,
            finished_at=now,
            kudos=reward,
        )
        if not won:
            raise _not_pending_error(generation.pk, _current_state(generation.pk))
        _settle(generation, state=state, tokens=tokens, reward=reward, now=now)
        _count_if_empty(state=state, text=data.text, model=generation.model, is_chat=False)
        if generation.request.front_id is not None:
            # A front waits on this text request (it named its process): wake it now, not at its
            # next poll (docs/adr/0055). Other text requests publish nothing, as upstream's.
            generations, done = stored_results_and_done(generation.request_id, is_chat=False)
            publish_chat_signal(generation.request_id, "generation", generations)
            if done:
                publish_chat_signal(generation.request_id, "done", generations)
    record_gate_shadow_outcome(generation, "completed", now=now)
    return reward


# --- chat -----------------------------------------------------------------------------------


def _chat_job_text_shaped(generation: Generation, data: TextSubmit | None) -> Decimal:
    """A text-shaped body for a chat job: a fault still lands (without a reason); a reply is refused."""
    if data is not None and data.state == "faulted":
        _count_worker_fault(generation, None)
        _apply_fault(generation, now=timezone.now())
        return Decimal("0")
    current = _current_state(generation.pk)  # as _chat_submit: a late reply is answered before it is checked
    if current != Generation.State.PROCESSING:
        raise _not_pending_error(generation.pk, current)
    refusal = ChatRefusal(
        "ChatSubmitInvalid", "A chat job's submit needs message, finish_reason and model_id.", param="message"
    )
    _refuse(generation, refusal)


def _chat_submit(generation: Generation, body: Mapping[str, Any]) -> Decimal:
    if body.get("state") == "faulted":
        return _chat_fault(generation, body)
    # A reply to a job that is no longer pending is answered before it is checked, so no refusal is
    # stored on the request for it and the abort counts as a dropped job.
    current = _current_state(generation.pk)
    if current != Generation.State.PROCESSING:
        raise _not_pending_error(generation.pk, current)
    try:
        submit = parse_chat_submit(body)
        assert submit.finish_reason is not None  # a reply (a fault went to _chat_fault) has one
        _check_model(generation, submit.model_id)
        request = generation.request
        verified = verify_chat_reply(
            submit.message or {},
            submit.finish_reason,
            extras=request.chat_extras,
            conformance=request.chat_conformance,
        )
    except ChatRefusal as refusal:
        _refuse(generation, refusal)
    return _store_chat_reply(
        generation,
        submit=submit,
        message=verified.message,
        finish_reason=verified.finish_reason,
        dropped=verified.dropped_tool_calls,
    )


def _check_model(generation: Generation, model_id: str) -> None:
    if model_id != generation.assigned_model:
        raise ChatRefusal(
            "ChatModelMismatch",
            f"The job was assigned the model '{generation.assigned_model}', not '{model_id}'.",
            param="model_id",
        )


def _refuse(generation: Generation, refusal: ChatRefusal) -> NoReturn:
    """Record a refused reply in its own commit, then send the 400."""
    if refusal.rc in CHAT_REFUSAL_RCS:
        record_chat_refusal(generation=generation, rc=refusal.rc, message=refusal.message)
    raise refusal


def record_chat_refusal(*, generation: Generation, rc: str, message: str) -> bool:
    """Store a refusal of a reply to a pending generation (TextWaitingPrompt.record_chat_refusal).

    The request's chat_fault_reason/rc take the latest refusal (never cleared) and the generation's
    chat_refusal_rc decides the worker counter of its later fault. Committed on its own, before the
    400, so it outlives the refused submit; a failed write is logged and the refusal still sent.
    """
    try:
        with transaction.atomic():
            claimed = Generation.objects.filter(pk=generation.pk, state=Generation.State.PROCESSING).update(
                chat_refusal_rc=rc
            )
            if claimed:
                GenerationRequest.objects.filter(pk=generation.request_id).update(
                    chat_fault_reason=message[:MAX_CHAT_FAULT_REASON_LENGTH], chat_fault_rc=rc
                )
            return bool(claimed)
    except DatabaseError:
        log.exception("could not record the chat refusal %s of generation %s", rc, generation.pk)
        return False


def record_chat_worker_fault(*, generation: Generation, fault_reason: Any) -> bool:
    """Store the horde's message for a known fault_reason (TextWaitingPrompt.record_chat_worker_fault).

    Only while the generation is pending and the horde has not refused a reply of it: that refusal
    is more specific, and is what a worker's reply_refused follows. Never stores worker text.
    Committed before the fault is applied, so a fault crossing the limit signals it.
    """
    message = chat_worker_fault_message(fault_reason)
    if message is None:
        return False
    pending_unrefused = Generation.objects.filter(
        pk=generation.pk,
        request=OuterRef("pk"),
        state=Generation.State.PROCESSING,
        chat_refusal_rc__isnull=True,
    )
    try:
        with transaction.atomic():
            return bool(
                GenerationRequest.objects.filter(Exists(pending_unrefused), pk=generation.request_id).update(
                    chat_fault_reason=message, chat_fault_rc=CHAT_WORKER_FAULT_RC
                )
            )
    except DatabaseError:
        log.exception("could not record the worker fault of generation %s", generation.pk)
        return False


def _count_if_empty(*, state: str, text: str | None, model: str, is_chat: bool) -> None:
    """The per-model empty-generation counter (spec: Structured submit): a stored ok reply
    without text. It is charged and rewarded as any other; the count lets operators see a model
    whose workers answer with nothing."""
    if state == "ok" and not text:
        text_empty_generations.add(1, {"horde.model": model, "horde.chat": is_chat})


def _count_worker_fault(generation: Generation, fault_reason: Any) -> None:
    # Before the fault is applied: a repeated fault submit for a faulted job is counted again.
    chat_worker_faults.add(
        1,
        {
            "horde.reason": chat_worker_fault_metric_reason(fault_reason),
            "horde.worker_trusted": bool(generation.worker.owner.trusted),
        },
    )


def _chat_fault(generation: Generation, body: Mapping[str, Any]) -> Decimal:
    """A faulted chat job: {id, state: faulted, model_id, fault_reason?}, handled as a faulted text job."""
    submit = parse_chat_submit(body)  # ChatSubmitInvalid without model_id; not a reply, so not recorded
    _check_model(generation, submit.model_id)
    fault_reason = body.get("fault_reason")  # as sent: the metric tells unknown from none
    _count_worker_fault(generation, fault_reason)
    record_chat_worker_fault(generation=generation, fault_reason=fault_reason)
    _apply_fault(generation, now=timezone.now())
    return Decimal("0")


def _clean(value: Any) -> Any:
    """NUL replaced in every string of a reply (build_stored_reply)."""
    if isinstance(value, str):
        return replace_nul(value)
    if isinstance(value, Mapping):
        return {_clean(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def build_stored_reply(message: Mapping[str, Any]) -> dict[str, Any]:
    """The stored message: role and content, plus tool_calls and reasoning_content only when submitted."""
    stored: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    for key in ("tool_calls", "reasoning_content"):
        if message.get(key) is not None:
            stored[key] = message[key]
    return _clean(stored)


def _chat_reward(generation: Generation, stored: Mapping[str, Any]) -> tuple[int, Decimal]:
    """(tokens, reward) of a chat reply, as _text_reward: the charge and the speed sample count the
    verified reply (reasoning and tool calls too, chat_things_count), priced as its pop stored (or,
    a job popped before prices were stored, at the model that served it). Reported token counts
    never change the charge."""
    if generation.price_rate is not None:
        # The pop stores the price's columns together: a rate comes with its flat part and cap.
        assert generation.price_flat is not None and generation.price_max_length is not None
        tokens = chat_things_count(stored, generation.price_max_length)
        return tokens, kudos_amount(tokens * generation.price_rate + generation.price_flat)
    request = generation.request
    tokens = chat_things_count(stored, request.max_length)
    return tokens, text_generation_kudos(
        model=generation.assigned_model or generation.model,
        prompt=request.prompt,
        context=request.kudos_context,
        generation=None,
        max_length=request.max_length,
        owner_trusted=generation.worker.owner.trusted,
        tokens=tokens,
    )


def _store_chat_reply(
    generation: Generation, *, submit, message: Mapping[str, Any], finish_reason: str, dropped: int
) -> Decimal:
    request = generation.request
    stored = build_stored_reply(message)
    state = submit.state
    now = timezone.now()
    tokens, reward = _chat_reward(generation, stored)
    if state in UNPAID_STATES:
        reward = Decimal("0")
    columns = {  # in a fixed order: the statement's text is prepared once
        "state": state,
        "text": stored.get("content") or "",
        "message": stored,
        "finish_reason": finish_reason,
        "native_finish_reason": _clean(submit.native_finish_reason),
        "prompt_tokens": submit.prompt_tokens,
        "completion_tokens": submit.completion_tokens,
        "reasoning_tokens": submit.reasoning_tokens,
        "charge_basis": chat_charge_basis(),
    }
    with transaction.atomic():
        # The claim of the pending job writes every reply column, so a submit that loses to a
        # cancel or a duplicate writes none of them; the settlement is gated on it.
        if connection.vendor == "postgresql":
            statement = chat_reply_submit(
                generation_id=generation.pk,
                payee_id=generation.worker.owner_id,
                columns={**columns, "message": json.dumps(stored)},
                tokens=tokens,
                reward=reward,
                processing=Generation.State.PROCESSING,
                now=now,
            )
            won = run_prepared(*statement) is not None
        else:
            won = bool(
                Generation.objects.filter(pk=generation.pk, state=Generation.State.PROCESSING).update(
                    **columns, finished_at=now, kudos=reward
                )
            )
            if won:
                _settle(generation, state=state, tokens=tokens, reward=reward, now=now)
        if not won:
            raise _not_pending_error(generation.pk, _current_state(generation.pk))
        if not stored.get("tool_calls"):  # calls alone are a complete reply
            _count_if_empty(state=state, text=columns["text"], model=generation.model, is_chat=True)
        generations, done = stored_results_and_done(request.pk)
        publish_chat_signal(request.pk, "generation", generations)
        if done:
            publish_chat_signal(request.pk, "done", generations)
        if streams_progress(request.chat_extras):
            transaction.on_commit(lambda: end_progress_after_submit(generation.pk), robust=True)
    record_gate_shadow_outcome(generation, "completed", now=now)
    log.info(
        "horde.job_submit.done generation=%s request=%s dropped_tool_calls=%d",
        generation.pk,
        request.pk,
        dropped,
        extra={"generation_id": str(generation.pk), "dropped_tool_calls": dropped},
    )
    return reward
