"""Creating a chat request (spec: chat_requests.md, Routes steps 3-8): mapping, operation key,
known models, worker_max_length, context sizing, flattened prompt, pricing, and the cancel signal.

The body is validated by the contract first (step 2, in the view); everything here works on the
validated `ChatRequest`. The text creation path's pieces (maintenance, concurrency, hold, tax,
queue score, model and worker rows) come from chat.services.admission, so both paths admit alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any, cast
from uuid import UUID, uuid4

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, Max
from django.utils import timezone
from rest_framework.exceptions import ValidationError

from accounts.models import HordeUser, SharedKey
from chat import metrics
from chat.model_reference import is_known_text_model
from chat.models import GenerationRequest
from chat.object_store import chat_messages_key
from chat.pricing import text_request_quote
from chat.services import admission
from chat.services.cancel import request_cancel
from chat.services.chat_images import (
    EXTRA_SOURCE_IMAGE_HORDE_TAX,
    chat_images_store,
    chat_messages_store,
    check_data_url_total,
    image_parts,
    load_chat_images,
    offloaded_messages_body,
    stored_image_messages,
    user_image_total_cap,
)
from chat.services.front_lease import front_lease_until
from contract.chat_errors import ChatRefusal
from contract.chat_limits import CHARS_PER_TOKEN_ESTIMATE, CHAT_IMAGE_PLACEHOLDER, CHAT_IMAGE_PROMPT_TOKENS
from contract.chat_policy import chat_request_requirements, kudos_cap_message
from contract.chat_progress import CHAT_STREAM_PROGRESS_KEY
from contract.chat_shapes import ChatContextAdjustmentReason, ChatContextFit, ChatRequest
from contract.errors import HordeError
from contract.text import TEXT_MAX_CONTEXT_LENGTH_DEFAULT, text_param_range_errors
from workers.declarations import declaration_mask
from workers.models import Worker
from workers.selectors import online_cutoff

log = logging.getLogger(__name__)

# Not in the operation fingerprint: read by the front or acting on admission only.
OPERATION_FINGERPRINT_EXCLUDED_HORDE_KEYS = frozenset(
    {"availability_mode", "dry_run", "include_reasoning", "max_kudos", "operation_key"}
)
# A chat request without horde.max_context_length starts from the text default.
CHAT_MAX_CONTEXT_LENGTH_DEFAULT = TEXT_MAX_CONTEXT_LENGTH_DEFAULT

# Upstream's WarningMessage.NoAvailableWorker, word for word ("confider" included).
NO_AVAILABLE_WORKER_WARNING = (
    "Warning: No available workers can fulfill this request. It will expire in 20 minutes unless a "
    "worker appears. Please confider reducing its size of the request or choosing a different model."
)


# --- mapping the validated body -------------------------------------------------------------


@dataclass(frozen=True)
class ChatSubmission:
    """A validated chat body mapped to the text request it becomes."""

    chat: ChatRequest
    models: list[str]
    model_paths: list[str]  # each model's request path, for UnknownChatModel
    messages: list[dict[str, Any]]  # as stored: developer -> system, absent assistant content null
    params: dict[str, Any]  # the mapped text params the client sent (sampling, seed, stop...)
    max_length: int
    chat_extras: dict[str, Any] | None
    fingerprint: str

    @property
    def horde(self):
        return self.chat.horde

    @property
    def tools(self) -> list[dict[str, Any]]:
        return (self.chat_extras or {}).get("tools") or []


def map_chat_params(chat: ChatRequest) -> dict[str, Any]:
    """The text params of a chat body: only the keys the client sent, numbers normalised so that
    1 and 1.0 map (and fingerprint) alike."""
    params: dict[str, Any] = {}
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        value = getattr(chat, key)
        if value is not None:
            params[key] = float(value)
    if chat.seed is not None:
        params["seed"] = int(chat.seed)
    if chat.reasoning_effort is not None:
        params["reasoning_effort"] = str(chat.reasoning_effort)
    if chat.stop_sequence is not None:
        params["stop_sequence"] = list(chat.stop_sequence)
    return params


def build_chat_extras(wire: dict[str, Any]) -> dict[str, Any] | None:
    """The tool keys and response format a request applies, as the client sent them, only when they
    change the answer; plus the stream hint. None when there are none."""
    extras: dict[str, Any] = {}
    if wire.get("tools"):
        extras["tools"] = wire["tools"]
        # tool_choice none beside tools is kept: guarantees, narrowing and the fingerprint read it.
        for key in ("tool_choice", "parallel_tool_calls"):
            if wire.get(key) is not None:
                extras[key] = wire[key]
    response_format = wire.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") != "text":
        extras["response_format"] = response_format
    if wire.get("stream") is True:
        extras[CHAT_STREAM_PROGRESS_KEY] = True
    return extras or None


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def build_operation_fingerprint(
    *,
    messages: list[dict[str, Any]],
    params: dict[str, Any],
    models: Iterable[str],
    horde_options: dict[str, Any],
    chat_extras: dict[str, Any] | None,
) -> str:
    """SHA-256 of canonical JSON over what defines the operation (spec: Operation key)."""
    document: dict[str, Any] = {
        "messages": messages,
        "params": params,
        "models": sorted(models),
        "horde": {
            k: v for k, v in horde_options.items() if k not in OPERATION_FINGERPRINT_EXCLUDED_HORDE_KEYS
        },
    }
    extras = {k: v for k, v in (chat_extras or {}).items() if k != CHAT_STREAM_PROGRESS_KEY}
    if extras:
        document["chat_extras"] = extras
    # surrogatepass: a JSON body may carry lone surrogates, which plain UTF-8 cannot encode.
    return hashlib.sha256(canonical_json(document).encode("utf-8", "surrogatepass")).hexdigest()


def map_chat_request(chat: ChatRequest) -> ChatSubmission:
    """Map a validated body to its text request parts and fingerprint (no database access)."""
    wire = chat.wire()
    models = chat.model_list
    model_paths = [f"models[{i}]" for i in range(len(models))] if chat.models else ["model"]
    messages = chat.stored_messages()
    params = map_chat_params(chat)
    extras = build_chat_extras(wire)
    fingerprint = build_operation_fingerprint(
        messages=messages,
        params={**params, "max_length": chat.max_length},
        models=models,
        horde_options=chat.horde.model_dump(mode="json"),
        chat_extras=extras,
    )
    return ChatSubmission(
        chat=chat,
        models=models,
        model_paths=model_paths,
        messages=messages,
        params=params,
        max_length=chat.max_length,
        chat_extras=extras,
        fingerprint=fingerprint,
    )


# --- flattened prompt and token estimate ----------------------------------------------------


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _content_text(content: Any) -> tuple[str, int]:
    """A message content as text (parts joined by newlines, images as the placeholder) and its
    image count."""
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    lines, images = [], 0
    for part in content:
        if part.get("type") == "image_url":
            lines.append(CHAT_IMAGE_PLACEHOLDER)
            images += 1
        else:
            lines.append(part.get("text") or "")
    return "\n".join(lines), images


def flatten_message(message: dict[str, Any]) -> tuple[str, int]:
    """One message as `role: text`, an assistant's tool_calls after its text as compact JSON."""
    text, images = _content_text(message.get("content"))
    if message.get("tool_calls"):
        calls = compact_json(message["tool_calls"])
        text = f"{text}\n{calls}" if text else calls
    return f"{message['role']}: {text}", images


def flatten_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt column: messages joined by newlines, then the stored tools as compact JSON (the
    worker renders the definitions into its prompt). An estimate only; workers never receive it."""
    parts = [flatten_message(m)[0] for m in messages]
    if tools:
        parts.append(compact_json(tools))
    return "\n".join(parts)


def estimate_chat_prompt_tokens(prompt: str, image_count: int) -> int:
    """The text estimate of the flattened prompt plus CHAT_IMAGE_PROMPT_TOKENS per image part."""
    return _prompt_tokens(len(prompt), image_count)


def _prompt_tokens(characters: int, image_count: int) -> int:
    """estimate_chat_prompt_tokens from the flattened prompt's length alone."""
    return math.ceil(characters / CHARS_PER_TOKEN_ESTIMATE) + CHAT_IMAGE_PROMPT_TOKENS * image_count


# --- context adjustments ----------------------------------------------------------------------


def chat_turns(messages: list[dict[str, Any]]) -> list[list[int]]:
    """The droppable turns, oldest first, as message indices.

    A turn is a user message with the assistant message right after it, or an assistant message
    carrying tool_calls with the tool messages answering it (a user + tool-calling assistant pair
    takes those tool messages too, so a drop never orphans them); any other message is a turn by
    itself. System messages, the latest user message and everything after it are never dropped.
    """
    user_indices = [i for i, m in enumerate(messages) if m["role"] == "user"]
    cut = user_indices[-1] if user_indices else len(messages)
    turns: list[list[int]] = []
    i = 0
    while i < cut:
        message = messages[i]
        if message["role"] == "system":
            i += 1
            continue
        group = [i]
        tail = message
        if message["role"] == "user" and i + 1 < cut and messages[i + 1]["role"] == "assistant":
            group.append(i + 1)
            tail = messages[i + 1]
        if tail["role"] == "assistant" and tail.get("tool_calls"):
            j = group[-1] + 1
            while j < cut and messages[j]["role"] == "tool":
                group.append(j)
                j += 1
        turns.append(group)
        i = group[-1] + 1
    return turns


@dataclass
class SizedContext:
    messages: list[dict[str, Any]]
    prompt: str
    prompt_tokens: int
    max_context_length: int
    image_count: int
    adjustments: list[dict[str, Any]] = field(default_factory=list)
    # The mode the text sizing ran under (truncate_oldest runs the text sizing as grow).
    resolved_context_fit: str = ChatContextFit.TRUNCATE_OLDEST


def prompt_exceeds_context(tokens: int, max_length: int, context: int) -> HordeError:
    return HordeError(
        "PromptExceedsContext",
        f"The messages are estimated at {tokens} tokens, which with max_length {max_length} do not fit "
        f"a context of {context} tokens.",
        status=400,
    )


def size_chat_context(
    *,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    max_length: int,
    requested_context: int | None,
    context_fit: str,
    growth_bound: int | None,
) -> SizedContext:
    """context_fit (spec: Context adjustments): the estimate plus max_length must fit the context.

    grow raises the context to what the messages need, up to the largest chat context an online
    chat worker serving the models declares; truncate_oldest grows the same way, then runs at the
    larger of that bound and the request's context and drops the oldest turns until they fit.
    """
    requested = requested_context or CHAT_MAX_CONTEXT_LENGTH_DEFAULT
    rendered = [flatten_message(m) for m in messages]
    tools_text = compact_json(tools) if tools else None
    lengths = [len(text) for text, _ in rendered] + ([len(tools_text)] if tools_text else [])
    images = sum(n for _, n in rendered)

    def tokens_of(total_chars: int, parts: int, image_count: int) -> int:
        # The flattened prompt joins its parts with one newline each.
        return _prompt_tokens(total_chars + max(parts - 1, 0), image_count)

    total_chars, parts = sum(lengths), len(lengths)
    tokens = tokens_of(total_chars, parts, images)
    resolved = (
        ChatContextFit.GROW if context_fit == ChatContextFit.TRUNCATE_OLDEST else ChatContextFit(context_fit)
    )
    sized = SizedContext(
        messages=messages,
        prompt="\n".join([text for text, _ in rendered] + ([tools_text] if tools_text else [])),
        prompt_tokens=tokens,
        max_context_length=requested,
        image_count=images,
        resolved_context_fit=str(resolved),
    )
    needed = tokens + max_length
    if needed <= requested:
        return sized
    if context_fit == ChatContextFit.REJECT:
        raise prompt_exceeds_context(tokens, max_length, requested)
    bound = growth_bound or 0
    if needed <= bound:
        sized.max_context_length = needed
        sized.adjustments.append(
            {"from": requested, "to": needed, "reason": ChatContextAdjustmentReason.GROW.value}
        )
        metrics.text_context_fit.add(1, {"horde.outcome": "grown", "horde.mode": str(context_fit)})
        return sized
    if context_fit == ChatContextFit.GROW:
        raise prompt_exceeds_context(tokens, max_length, max(bound, requested))
    # truncate_oldest: run at the larger of the bound and the request's context, drop oldest turns.
    context = max(bound, requested)
    dropped: set[int] = set()
    kept_chars, kept_parts, kept_images = total_chars, parts, images
    for turn in chat_turns(messages):
        if tokens_of(kept_chars, kept_parts, kept_images) + max_length <= context:
            break
        for index in turn:
            dropped.add(index)
            kept_chars -= lengths[index]
            kept_parts -= 1
            kept_images -= rendered[index][1]
    kept_tokens = tokens_of(kept_chars, kept_parts, kept_images)
    if kept_tokens + max_length > context:
        raise prompt_exceeds_context(kept_tokens, max_length, context)
    if context > requested:
        sized.adjustments.append(
            {"from": requested, "to": context, "reason": ChatContextAdjustmentReason.GROW.value}
        )
    kept = [m for i, m in enumerate(messages) if i not in dropped]
    sized.adjustments.append(
        {
            "from": tokens,
            "to": kept_tokens,
            "reason": ChatContextAdjustmentReason.TRUNCATE_OLDEST.value,
            "dropped_messages": len(dropped),
        }
    )
    sized.messages = kept
    sized.prompt = flatten_messages(kept, tools)
    sized.prompt_tokens = kept_tokens
    sized.max_context_length = context
    sized.image_count = kept_images
    metrics.text_context_fit.add(1, {"horde.outcome": "truncated", "horde.mode": str(context_fit)})
    return sized


# --- operation key ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatCreated:
    """What the submit route answers: a new request (202), a repeated key (200) or a quote (200)."""

    request: GenerationRequest | None
    kudos: Decimal
    repeated: bool = False
    message: str | None = None
    warnings: list[dict[str, str]] = field(default_factory=list)
    dry_run: dict[str, Any] | None = None


def ensure_chat_admitting() -> None:
    """Step 4, the admission flag, which gates new chat requests only, then step 5's first check,
    maintenance mode. Both come before authentication, so a caller that fails it hears them first."""
    if not settings.HORDE_CHAT_ADMISSION_ENABLED:
        raise HordeError(
            "ChatAdmissionDisabled",
            "This horde is not accepting new chat requests at the moment.",
            status=503,
        )
    admission.ensure_not_in_maintenance()


def find_operation_claim(*, user: HordeUser, operation_key: UUID) -> GenerationRequest | None:
    """The request holding the user's claim on a key (the claim lives as long as that row)."""
    return (
        GenerationRequest.objects.filter(user=user, operation_key=operation_key)
        .only("id", "kudos_quote", "operation_fingerprint")
        .first()
    )


def answer_operation_claim(claim: GenerationRequest, fingerprint: str) -> ChatCreated:
    """A repeated key: the first request when the operation is the same, else OperationKeyConflict."""
    if claim.operation_fingerprint != fingerprint:
        raise HordeError(
            "OperationKeyConflict",
            "The operation_key was already used for a different request: a repeated submission has to "
            "send the same request.",
            status=400,
        )
    return ChatCreated(request=claim, kudos=claim.kudos_quote, repeated=True)


# --- known models and the serving workers -------------------------------------------------------


@dataclass(frozen=True)
class ChatModelOffers:
    """The online chat workers serving any of the requested models (one query per submission)."""

    served_models: frozenset[str]
    workers: int
    max_context_length: int | None
    max_length: int | None


def chat_model_offers(models: list[str]) -> ChatModelOffers:
    """Count of online chat workers serving any requested model, and their largest chat context
    and max_length; the known-model check, the refusal and the growth bound all read it."""
    rows = list(
        Worker.objects.filter(
            accepts_chat_jobs=True, chat_model_id__in=models, last_check_in__gte=online_cutoff()
        )
        .values("chat_model_id")
        .annotate(workers=Count("id"), context=Max("chat_max_context_length"), length=Max("chat_max_length"))
    )
    contexts = [r["context"] for r in rows if r["context"] is not None]
    lengths = [r["length"] for r in rows if r["length"] is not None]
    return ChatModelOffers(
        # Not None (chat_model_id__in matches names only), which the rows' type does not know.
        served_models=cast(frozenset[str], frozenset(r["chat_model_id"] for r in rows)),
        workers=sum(r["workers"] for r in rows),
        max_context_length=max(contexts) if contexts else None,
        max_length=max(lengths) if lengths else None,
    )


def ensure_models_served(submission: ChatSubmission, offers: ChatModelOffers) -> None:
    """404 UnknownChatModel for the first entry neither the reference nor an online chat worker
    knows; 403 NoEligibleWorker when no online chat worker serves any of them."""
    for model, path in zip(submission.models, submission.model_paths, strict=True):
        if not is_known_text_model(model) and model not in offers.served_models:
            refusal = ChatRefusal(
                "UnknownChatModel", f"The model '{model}' is not known to this horde.", param=path, status=404
            )
            raise HordeError(refusal.rc, refusal.message, status=refusal.status)
    if offers.workers == 0:
        if submission.model_paths == ["model"]:  # a request with models reads "any of the models", one or more
            message = f"No worker is currently serving the model '{submission.models[0]}'."
        else:
            names = ", ".join(f"'{m}'" for m in submission.models)
            message = f"No worker is currently serving any of the models {names}."
        raise HordeError("NoEligibleWorker", message, status=403)


# --- admission --------------------------------------------------------------------------------


def _validate_mapped_params(params: dict[str, Any], max_context_length: int) -> None:
    """The mapped params are held to the text params' ranges: every range a text request enforces
    applies, as the same 400 validation error, never clamped. max_length keeps the chat range."""
    checked = {k: v for k, v in params.items() if k in ("temperature", "top_p", "stop_sequence")}
    errors = text_param_range_errors({**checked, "max_context_length": max_context_length})
    if errors:
        raise ValidationError(errors)


def _worker_list(submission: ChatSubmission) -> tuple[bool, bool, list[UUID]]:
    """(has_worker_list, blacklist, ids). The contract admits worker ids (UUIDs) only."""
    horde = submission.horde
    listed = horde.only if horde.only is not None else horde.ignore
    if listed is None:
        return False, False, []
    return True, horde.ignore is not None, list(listed)


def _quote(models: list[str], prompt: str, max_length: int, prompt_tokens: int) -> Decimal:
    """The quote at the first of `models`, its context priced at the prompt estimate (images too)."""
    quote = text_request_quote(models=models, prompt=prompt, max_length=max_length, n=1, prompt_tokens=prompt_tokens)
    return quote + admission.HORDE_TAX


def chat_request_create(
    *,
    user: HordeUser,
    chat: ChatRequest,
    client_agent: str = "",
    ip_address: str = "",
    front_lease_seconds: int | None = None,
    front_id: str | None = None,
    shared_key: SharedKey | None = None,
) -> ChatCreated:
    """Steps 3-8 of the chat submit for a validated body: map it (map_chat_request), then
    operation key, admission flag, shared checks, known models, worker_max_length, context sizing,
    pricing, then create and activate in one transaction. `shared_key`: the key `user` (its owner)
    was authenticated by; its checks are upstream's text ones (a chat request never downgrades)."""
    try:
        submission = map_chat_request(chat)
    except RecursionError:
        raise HordeError("BadRequest", "The request body nests too deeply.") from None
    horde = submission.horde
    dry_run = horde.dry_run
    operation_key = None if dry_run else horde.operation_key
    # 3. A repeated key is answered before anything that could refuse or charge it.
    if operation_key is not None:
        claim = find_operation_claim(user=user, operation_key=operation_key)
        if claim is not None:
            return answer_operation_claim(claim, submission.fingerprint)
    # 4 and the start of 5.
    ensure_chat_admitting()
    # 5. The rest of the checks every generate route shares (the caller was authenticated).
    if shared_key is not None and (unusable := admission.shared_key_unusable(shared_key)) is not None:
        raise unusable
    admission.check_concurrency(user=user, n=1, models=submission.models)
    # 6. Known models, and at least one online chat worker serving them.
    offers = chat_model_offers(submission.models)
    ensure_models_served(submission, offers)
    # 7. max_tokens above every serving worker's declared max_length is lowered, not refused.
    max_length = submission.max_length
    adjustments: list[dict[str, Any]] = []
    if offers.max_length is not None and max_length > offers.max_length:
        adjustments.append(
            {
                "from": max_length,
                "to": offers.max_length,
                "reason": ChatContextAdjustmentReason.WORKER_MAX_LENGTH.value,
            }
        )
        metrics.chat_max_length_lowered.add(
            1,
            {
                "horde.requested_bucket": metrics.size_bucket(max_length),
                "horde.declared_bucket": metrics.size_bucket(offers.max_length),
                "horde.dry_run": dry_run,
            },
        )
        max_length = offers.max_length
    # 8. Context sizing, the params, pricing; then the request is created and activated.
    sized = size_chat_context(
        messages=submission.messages,
        tools=submission.tools,
        max_length=max_length,
        requested_context=horde.max_context_length,
        context_fit=horde.context_fit,
        growth_bound=offers.max_context_length,
    )
    adjustments.extend(sized.adjustments)
    _validate_mapped_params(submission.params, sized.max_context_length)
    # The price's context is the prompt estimate, image parts included (spec: Flattened prompt).
    prompt_tokens = estimate_chat_prompt_tokens(sized.prompt, sized.image_count)
    # Each kept image adds the extra source image tax to the activation tax, the quote included.
    images = image_parts(sized.messages, submission.messages)
    image_tax = Decimal(EXTRA_SOURCE_IMAGE_HORDE_TAX * len(images))
    kudos = _quote(submission.models, sized.prompt, max_length, prompt_tokens) + image_tax
    if horde.max_kudos is not None and kudos > horde.max_kudos:
        raise HordeError("ChatKudosCapExceeded", kudos_cap_message(float(kudos), horde.max_kudos), status=400)
    if images:  # the requester's image total over the data URLs; a dry run checks only these
        check_data_url_total(images, user_image_total_cap(user))
    if dry_run:
        return ChatCreated(
            request=None,
            kudos=kudos,
            dry_run={
                "estimated_prompt_tokens": sized.prompt_tokens,
                "context_adjustments": adjustments or None,
                "resolved": {
                    "context_fit": sized.resolved_context_fit,
                    "max_length": max_length,
                    "max_context_length": sized.max_context_length,
                },
            },
        )
    # The features are derived from the kept messages: a dropped image turn needs no vision.
    requirements = chat_request_requirements({**submission.chat.wire(), "messages": sized.messages})
    # Multi-model: the hold and the upfront check use the highest multiplier across the list.
    upfront = max(_quote([m], sized.prompt, max_length, prompt_tokens) for m in submission.models) + image_tax
    # The shared key's kudos, then its token limit, as upstream's (a short key is refused below).
    # Read again under the owner's lock below, where it is decided (docs/adr/0089).
    key_short = admission.shared_key_lacks(shared_key, upfront) is not None
    if shared_key is not None and not key_short:
        admission.check_shared_key_limits(shared_key, max_length=max_length, field="max_tokens")
    has_worker_list, blacklist, worker_ids = _worker_list(submission)
    fields = {
        "is_chat": True,
        "prompt": sized.prompt,
        "submitted_prompt": flatten_messages(submission.messages, submission.tools),
        "params": submission.params,
        "n": 1,
        "jobs_waiting": 1,
        "max_length": max_length,
        "max_context_length": sized.max_context_length,
        "has_worker_list": has_worker_list,
        "worker_blacklist": blacklist,
        "trusted_workers": horde.trusted_workers,
        "validated_backends": horde.validated_backends,
        "slow_workers": horde.slow_workers,
        "client_agent": client_agent[:255],
        "ip_address": ip_address[:64],
        "messages": sized.messages,
        "operation_key": operation_key,
        "operation_fingerprint": submission.fingerprint,
        "context_adjustments": adjustments or None,
        "chat_extras": submission.chat_extras,
        "chat_required_features": requirements.declarations,
        "chat_required_mask": declaration_mask(requirements.declarations),
        "chat_conformance": str(requirements.conformance),
        "chat_tools_temperature": requirements.tools_temperature,
        "chat_has_images": requirements.has_images,
        "front_lease_expires_at": front_lease_until(front_lease_seconds),
        # Named without a lease too: a background response's front, which may end it undelivered
        # (docs/adr/0110); only a lease makes its process's end cancel it (front_gone).
        "front_id": front_id,
    }
    # The free output allowance, from the queue ahead on the workers eligible for the request.
    allowance = admission.free_output_allowance_for(user=user, fields=fields, models=submission.models, workers=worker_ids)
    inactive: InactiveRequest | None = None
    if images or settings.HORDE_CHAT_MESSAGES_OFFLOAD_ENABLED:
        # Fetched and normalised before any row; the row is written (inactive) before its objects
        # are stored, so every stored object is referenced by a row until that row is deleted.
        jpegs = load_chat_images(parts=images, user=user) if images else []
        inactive = inactive_request_create(user=user, fields=fields, jpegs=jpegs)
    try:
        with transaction.atomic():
            locked_user = admission.lock_requester(user)
            admission.check_concurrency(user=locked_user, n=1, models=submission.models)
            # The key's creations are its owner's, one at a time under this lock.
            key_funds = admission.shared_key_lacks(shared_key, upfront)
            key_short = key_funds is not None
            if shared_key is not None and not key_short:
                admission.check_shared_key_limits(shared_key, max_length=max_length, field="max_tokens")
            needs_hold = admission.needs_upfront_kudos(
                max_length=max_length,
                slow_workers=horde.slow_workers,
                has_worker_list=has_worker_list,
                allowance=allowance.tokens,
            )
            # The claim is written with the activation: the unique index lets one of two racing
            # submits commit; the other's row, hold and tax roll back here.
            request = admission.request_rows_create(
                locked_user=locked_user,
                fields=fields,
                models=submission.models,
                workers=worker_ids,
                kudos=kudos,
                hold=upfront if needs_hold and locked_user.kudos_available >= upfront else Decimal("0"),
                prompt_tokens=prompt_tokens,
                tax=admission.HORDE_TAX + image_tax,
                inactive_id=inactive.id if inactive else None,
                shared_key=shared_key,
                shared_key_reserve=admission.shared_key_reserve_per_job(
                    shared_key, dearest=upfront, tax=admission.HORDE_TAX + image_tax, n=1
                ),
            )
            if key_short or (needs_hold and locked_user.kudos_available < upfront):
                # Chat requests never downgrade. Kudos do not help a request no worker can serve.
                refusal = admission.no_eligible_worker_refusal(request) or (
                    admission.shared_key_insufficient_error(shared_key, upfront, key_funds)
                    if key_short and shared_key is not None
                    else admission.kudos_upfront_error(
                        allowance=allowance.tokens, kudos=upfront, max_length=max_length,
                        slow_workers=horde.slow_workers,
                    )
                )
                admission.record_allowance_decision(
                    user=user, outcome="refused", requested_max_length=submission.max_length, is_chat=True,
                    allowance=allowance, shared_key=shared_key,
                )
                raise refusal
    except IntegrityError:
        if inactive is not None:
            inactive.discard()
        if operation_key is None:
            raise
        claim = find_operation_claim(user=user, operation_key=operation_key)
        if claim is None:
            raise
        log.info("operation key %s: a concurrent submit won; answering with %s", operation_key, claim.id)
        return answer_operation_claim(claim, submission.fingerprint)
    except BaseException:
        if inactive is not None:  # a refused activation deletes the row and the images it stored
            inactive.discard()
        raise
    admission.record_allowance_decision(
        user=user,
        outcome="funded" if needs_hold else "free",
        requested_max_length=submission.max_length,
        is_chat=True,
        allowance=allowance,
        shared_key=shared_key,
    )
    from chat.selectors.availability import chat_request_availability

    created = ChatCreated(request=request, kudos=kudos)
    if not chat_request_availability(request, created=True).is_possible:
        created = ChatCreated(
            request=request,
            kudos=kudos,
            message=NO_AVAILABLE_WORKER_WARNING,
            warnings=[{"code": "NoAvailableWorker", "message": NO_AVAILABLE_WORKER_WARNING}],
        )
    return created


# --- images ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InactiveRequest:
    """A request row written before its objects (images, messages object) were stored: not in the
    queue (no job waiting) and unknown to its client until activated; a crash before the
    activation leaves it to the expiry sweep, which deletes it with its objects."""

    id: UUID

    def discard(self) -> None:
        """Delete the row; its objects go with it (chat.object_store.delete_objects_with_request)."""
        GenerationRequest.objects.filter(pk=self.id, jobs_waiting=0).delete()


def inactive_request_create(
    *, user: HordeUser, fields: dict[str, Any], jpegs: list[bytes]
) -> InactiveRequest | None:
    """For a request with images or messages to offload: write the row with each image part's url
    replaced by its key's reference, then store the images and the messages object; a store
    failure deletes the row and refuses with 503 ChatImageStorageUnavailable. `fields` takes the
    stored messages and the offload flag. None: nothing to store."""
    request_id = uuid4()
    messages_body = offloaded_messages_body(fields["messages"], jpegs)
    if not jpegs and messages_body is None:
        return None
    fields["messages"], keys = stored_image_messages(fields["messages"], request_id)
    fields["chat_messages_offloaded"] = messages_body is not None
    GenerationRequest.objects.create(
        id=request_id,
        user=user,
        is_chat=True,
        prompt=fields["prompt"],
        messages=fields["messages"],
        max_length=fields["max_length"],
        max_context_length=fields["max_context_length"],
        chat_has_images=bool(keys),
        chat_messages_offloaded=fields["chat_messages_offloaded"],
        jobs_waiting=0,
        expires_at=timezone.now() + timedelta(seconds=settings.HORDE_TEXT_REQUEST_TTL_SECONDS),
    )
    try:
        chat_images_store(keys, jpegs)
        if messages_body is not None:
            chat_messages_store(chat_messages_key(request_id), messages_body)
    except BaseException:
        # The row's deletion deletes what was stored (chat.object_store.delete_objects_with_request).
        GenerationRequest.objects.filter(pk=request_id).delete()
        raise
    return InactiveRequest(id=request_id)


# --- cancel -------------------------------------------------------------------------------------


def chat_request_cancel(*, request: GenerationRequest) -> bool:
    """Cancel as text; request_cancel publishes `cancelled` after the commit when this
    call claimed the cancellation."""
    return request_cancel(request=request)
