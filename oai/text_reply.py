"""The reply side of POST /v1/completions (docs/adr/0014-legacy-completions.md): the text completion,
whole and as stream chunks: `TextCompletion` is the delivered generation read from the native text
status, with the stop sequence cut off as OpenAI does. It imports nothing of the request side (oai.text_completions)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from oai.mapping import build_system_fingerprint, estimate_tokens
from oai.sse import DONE_EVENT

TEXT_COMPLETION_ID_PREFIX = "cmpl-"


class RepliedTextRequest(Protocol):
    """What a text reply reads of its request (oai.text_completions.TextCompletionRequest)."""

    models: list[str]
    prompt: str
    max_tokens: int
    stop: list[str]
    echo: bool


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
    max_length_lowered = False  # only a chat request's max_length is lowered to the workers'

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
        if generation.get("state") in ("censored", "csam"):
            self.finish_reason = "content_filter"
        elif not stopped and completion_tokens >= request.max_tokens:
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
    return body


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def build_text_completion_events(completion: TextCompletion, *, include_usage: bool) -> list[bytes]:
    """The text chunk (when there is text), the finish chunk, the usage chunk when asked for, [DONE]."""
    events = []
    if completion.text:
        events.append(_event(_object(completion, [_choice(completion.text, None)])))
    events.append(_event(_object(completion, [_choice("", completion.finish_reason)])))
    if include_usage:
        usage_chunk = _object(completion, [])
        usage_chunk["usage"] = dict(completion.usage)
        events.append(_event(usage_chunk))
    events.append(DONE_EVENT)
    return events
