"""Native answers as OpenAI errors: a refused submit (a native schema failure named by the param the
client sent, the kudos cap, authentication, rate limits, an unknown model, a declaration gap), and
the waits' verdicts (no eligible worker, a declaration gap read on the status)."""

from __future__ import annotations

import contextlib
import re
from typing import Any

from contract.chat_errors import param_from_native_message
from contract.chat_policy import parse_kudos_cap_message
from oai.errors import ChatFrontError, invalid_api_key
from oai.horde_client import HordeClient, NativeAnswer, NativeUnreachable
from oai.schema import ChatCompletionRequest
from oai.text_completions import TextCompletionRequest
from oai.waiter import NO_ELIGIBLE_WORKER_RETRY_AFTER_SECONDS

# Native text param keys that differ from the OpenAI parameter they come from (the chat route's and
# the text route's, whose sampler keys sit under params.).
NATIVE_FIELD_PARAMETERS = {
    "max_length": "max_tokens",
    "stop_sequence": "stop",
    "max_context_length": "horde.max_context_length",
    "rep_pen": "presence_penalty",
    "trusted_workers": "horde.trusted_workers",
    "validated_backends": "horde.validated_backends",
    "slow_workers": "horde.slow_workers",
}
# The native routes' refusals whose message does not start with the field's path (upstream's text
# rcs, the chat route's context refusal), by the OpenAI param they come from.
NATIVE_RC_PARAMETERS = {
    "TokenOverflow": "max_tokens",
    "MissingFullSamplerOrder": "sampler_order",
    "TooManyStopSequences": "stop",
    "ExcessiveStopSequence": "stop",
    "MissingPrompt": "prompt",
    # No context holds the messages kept (the latest user message on): OpenAI's context_length_exceeded names them.
    "PromptExceedsContext": "messages",
}
# A native field path: its name, then any index suffix ("stop_sequence[0]").
NATIVE_FIELD_PATTERN = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<rest>.*)$")
GAP_GUARANTEES = frozenset(
    {
        "tool_choice_enforced",
        "single_tool_call_enforced",
        "structured_output_enforced",
        "prompt_overflow_refused",
    }
)
LIMIT_WORDS = {
    "max_length": ("a completion limit", "max_tokens", "tokens"),
    "max_context_length": ("a context length", "horde.max_context_length", "tokens"),
}


def _strip_path(message: str) -> tuple[str | None, str]:
    param = param_from_native_message(message)
    if param is None:
        return None, message
    text = message[len(param) + 2 :].lstrip(":").strip()
    return param, text or message


def _kudos_cap_error(message: str) -> ChatFrontError:
    metadata: dict[str, Any] = {}
    parsed = parse_kudos_cap_message(message)
    if parsed is not None:
        metadata = {"kudos_estimate": parsed[0], "max_kudos": parsed[1]}
    return ChatFrontError(
        400,
        "max_kudos_exceeded",
        message,
        param="horde.max_kudos",
        type="invalid_request_error",
        should_retry=False,
        metadata=metadata,
    )


def native_field_param(field: str, request: ChatCompletionRequest | TextCompletionRequest) -> str | None:
    """The OpenAI param of a native schema failure's field: `params.stop_sequence[0]` is `stop[0]`
    (`stop` when the client sent one string), `workers[1]` the horde list it came from."""
    if field == "payload":
        return None
    field = field.removeprefix("params.")
    match = NATIVE_FIELD_PATTERN.match(field)
    if match is None:
        return field
    name, rest = match["name"], match["rest"]
    if name == "workers":
        return f"horde.{getattr(request, 'worker_list_key', None) or 'only'}{rest}"
    if name == "models" and getattr(request, "model_key", "models") == "model":
        return "model"
    if name == "stop_sequence":
        stop = (
            request.stop_is_string
            if isinstance(request, TextCompletionRequest)
            else isinstance(request.chat.stop, str)
        )
        if stop and rest == "[0]":
            return "stop"
    return NATIVE_FIELD_PARAMETERS.get(name, name) + rest


def submit_declaration_gap(answer: NativeAnswer) -> dict[str, Any] | None:
    """The impossible_reason of a submit refused as NoEligibleWorker for a declaration gap (a
    requester without the kudos upfront learns of the gap at submit), else None."""
    body = answer.body if isinstance(answer.body, dict) else {}
    reason = body.get("impossible_reason")
    if body.get("rc") == "NoEligibleWorker" and isinstance(reason, dict) and reason.get("kind") == "declaration_gap":
        return reason
    return None


def native_submit_error(
    answer: NativeAnswer, request: ChatCompletionRequest | TextCompletionRequest
) -> ChatFrontError:
    body = answer.body if isinstance(answer.body, dict) else {}
    status = answer.status
    rc = body.get("rc")
    message = body.get("message") or f"The AI Horde answered {status}."
    if status == 400 and isinstance(body.get("errors"), dict) and body["errors"]:
        field_name, text = next(iter(body["errors"].items()))
        param = native_field_param(str(field_name), request)
        return ChatFrontError(400, "BadRequest", f"{message}: {text}", param=param, should_retry=False)
    if rc == "ChatKudosCapExceeded":
        return _kudos_cap_error(message)
    if status == 401 or rc in ("InvalidAPIKey", "AnonForbidden"):
        return invalid_api_key(message)
    if status == 429:
        retry_after = _int_header(answer, "Retry-After")
        return ChatFrontError(
            429, rc or "rate_limit_exceeded", message, type="rate_limit_error", retry_after=retry_after
        )
    if rc == "NoEligibleWorker":
        reason = submit_declaration_gap(answer)
        if reason is not None:  # the run reads the model list first (declaration_gap_error)
            return gap_error(reason, request, None)
        return no_eligible_worker(message)
    if rc == "UnknownChatModel":
        param, text = _strip_path(message)
        return ChatFrontError(404, "model_not_found", text, param=param or "model", should_retry=False)
    param, text = _strip_path(message)
    if status >= 500:
        # A horde 503 (its database unavailable) tells the client when to come back.
        return ChatFrontError(
            status, rc or "HordeUnavailable", text, param=param, type="api_error",
            retry_after=_int_header(answer, "Retry-After"),
        )
    param = param or NATIVE_RC_PARAMETERS.get(rc or "")
    return ChatFrontError(status, rc or "BadRequest", text, param=param, should_retry=False)


def _int_header(answer: NativeAnswer, name: str) -> int | None:
    try:
        return int(float(answer.headers.get(name, "")))
    except ValueError:
        return None


def no_eligible_worker(message: str | None = None) -> ChatFrontError:
    return ChatFrontError(
        503,
        "no_eligible_worker",
        message
        or "No online worker could take this request within the grace period; workers come and go, "
        "try again later.",
        type="api_error",
        retry_after=NO_ELIGIBLE_WORKER_RETRY_AFTER_SECONDS,
    )


def _limit_sentence(limit: str, value: int | None, listed: bool) -> str:
    """The sentence of one exceeded limit; without a model list entry the limit's name stands in
    the value's place."""
    words, _param, unit = LIMIT_WORDS[limit]
    scope = "the listed models" if listed else "the model"
    return (
        f"No worker eligible for this request currently declares {words} that high; the largest any "
        f"online worker for {scope} declares now is {limit if value is None else value} {unit}."
    )


def gap_error(
    reason: dict[str, Any],
    request: ChatCompletionRequest | TextCompletionRequest,
    offers: dict[str, Any] | None,
) -> ChatFrontError:
    missing = list(reason.get("missing_declarations") or [])
    exceeded = list(reason.get("exceeded_limits") or [])
    models = request.requested_models
    if exceeded and not missing and set(exceeded) <= {"max_length", "max_context_length"}:
        sentences = []
        for limit in ("max_length", "max_context_length"):
            if limit not in exceeded:
                continue
            values = [((offers or {}).get(m) or {}).get(limit) for m in models]
            declared = [v for v in values if isinstance(v, int)]
            largest = max(declared) if declared else None
            sentences.append(_limit_sentence(limit, largest, request.lists_models))
        param = "max_tokens" if "max_length" in exceeded else "horde.max_context_length"
        return ChatFrontError(
            400,
            "no_worker_supports_limit",
            " ".join(sentences),
            param=param,
            type="invalid_request_error",
            should_retry=False,
        )
    parts = []
    if missing:
        parts.append("no online worker serving the model declares " + ", ".join(missing))
    if exceeded:
        parts.append(
            "the request exceeds the "
            + ", ".join(exceeded)
            + " limit of every online worker serving the model"
        )
    message = "No worker supports the features this request needs: " + "; ".join(parts) + "."
    if set(missing) & GAP_GUARANTEES:
        message += " Guarantees are not required under horde.conformance best_effort."
    return ChatFrontError(
        404,
        "no_worker_supports_features",
        message,
        type="invalid_request_error",
        should_retry=False,
        metadata={"impossible_reason": reason},
    )


async def declaration_gap_error(
    client: HordeClient, reason: dict[str, Any], request: ChatCompletionRequest | TextCompletionRequest
) -> ChatFrontError:
    """The answer to a declaration gap; a size-limit gap reads the model list for the declared values."""
    exceeded = set(reason.get("exceeded_limits") or [])
    offers: dict[str, Any] | None = None
    if (
        exceeded
        and not reason.get("missing_declarations")
        and exceeded <= {"max_length", "max_context_length"}
    ):
        with contextlib.suppress(NativeUnreachable):
            answer = await client.models()
            if answer.ok and isinstance(answer.body, list):
                # An entry without a name matches no requested model.
                offers = {
                    e["name"]: e.get("chat") or {}
                    for e in answer.body
                    if isinstance(e, dict) and isinstance(e.get("name"), str)
                }
    return gap_error(reason, request, offers)

