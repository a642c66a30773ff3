"""The reply side of POST /v1/completions (docs/adr/0014-legacy-completions.md): the text completion,
whole and as stream chunks: `TextCompletion` is the delivered generation read from the native text
status, with the stop sequence cut off as OpenAI does. It imports nothing of the request side (oai.text_completions)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from contract.chat_shapes import ChatContextAdjustmentReason
from oai.mapping import build_system_fingerprint, estimate_tokens
from oai.sse import DONE_EVENT, event_json

TEXT_COMPLETION_ID_PREFIX = "cmpl-"
WORKER_MAX_LENGTH = ChatContextAdjustmentReason.WORKER_MAX_LENGTH.value


class RepliedTextRequest(Protocol):
    """What a text reply reads of its request (oai.text_completions.TextCompletionRequest)."""

    models: list[str]
    prompt: str
    max_tokens: int
    stop: list[str]
    echo: bool
    context_adjustments: list[dict[str, Any]] | None


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text up to the first stop sequence (OpenAI leaves it out), and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if not cuts:
        return text, False
    return text[: min(cuts)], True


class TextCompletion:
    """The delivered text generation, shared by the JSON body and the stream's chunks."""

    estimated_usage = True  # a text worker reports no token counts
    queue_wait = None  # the text status does not carry it

    def __init__(
        self, request: RepliedTextRequest, request_id: str, created: int, status: Mapping[str, Any]
    ):
        generation = status["generations"][0]
        text, stopped = cut_at_stop(generation.get("text") or "", request.stop)
        self.id = TEXT_COMPLETION_ID_PREFIX + request_id
        self.created = created
        self.model = generation.get("model") or (request.models[0] if request.models else "")
        self.fingerprint = build_system_fingerprint(generation.get("worker_id"), generation.get("model"))
        self.generated = text
        self.text = request.prompt + text if request.echo else text
        completion_tokens = estimate_tokens(text)
        # The horde's lowering of max_tokens to its workers' limit, shown as the chat route shows it.
        adjustments = request.context_adjustments or []
        self.x_horde: dict[str, Any] = {"context_adjustments": adjustments} if adjustments else {}
        lowered = [a.get("to") for a in adjustments if isinstance(a, Mapping) and a.get("reason") == WORKER_MAX_LENGTH]
        self.max_length_lowered = bool(lowered)
        max_tokens = lowered[0] if lowered and isinstance(lowered[0], int) else request.max_tokens
        if generation.get("state") in ("censored", "csam"):
            self.finish_reason = "content_filter"
        elif not stopped and completion_tokens >= max_tokens:
            self.finish_reason = "length"
        else:
            self.finish_reason = "stop"
        prompt_tokens = estimate_tokens(request.prompt)
        self.usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    @property
    def empty(self) -> bool:
        return not self.generated


def _object(completion: TextCompletion, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": completion.id,
        "object": "text_completion",
        "created": completion.created,
        "model": completion.model,
        "system_fingerprint": completion.fingerprint,
        "choices": choices,
    }


def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}


def build_text_completion(completion: TextCompletion) -> dict[str, Any]:
    body = _object(completion, [_choice(completion.text, completion.finish_reason)])
    body["usage"] = dict(completion.usage)
    if completion.x_horde:
        body["x_horde"] = completion.x_horde
    return body


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + event_json(data) + b"\n\n"


def build_text_completion_events(completion: TextCompletion, *, include_usage: bool) -> list[bytes]:
    """The text chunk (when there is text), the finish chunk, the usage chunk when asked for, [DONE]."""
    events = []
    if completion.text:
        events.append(_event(_object(completion, [_choice(completion.text, None)])))
    finish = _object(completion, [_choice("", completion.finish_reason)])
    if completion.x_horde:
        finish["x_horde"] = completion.x_horde  # as the chat route's finish chunk
    events.append(_event(finish))
    if include_usage:
        usage_chunk = _object(completion, [])
        usage_chunk["usage"] = dict(completion.usage)
        events.append(_event(usage_chunk))
    events.append(DONE_EVENT)
    return events
