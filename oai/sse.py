"""Streamed chunks and keepalive comments (spec: chat_front.md, the stream's events 1-7).

A reply is delivered whole: role chunk, reasoning chunk (under horde.include_reasoning), content
chunk, tool-call chunk (each call whole with its index, without content), the finish chunk with
x_horde, the usage chunk when stream_options.include_usage, then [DONE]. A relayed stream
(oai.deltas) sends `build_delta_event` chunks as the deltas arrive, then the rest (the tool calls
last), and the same tail.
"""

from __future__ import annotations

import json
from typing import Any

from oai.errors import ChatFrontError, sse_error_event
from oai.mapping import PROVIDER, Completion

DONE_EVENT = b"data: [DONE]\n\n"
KEEPALIVE_EVENT = b": keepalive\n\n"


# Characters JSON may leave unescaped in a string (NEL, LINE and PARAGRAPH SEPARATOR) that readers
# splitting lines with str.splitlines() take for line ends (httpx's iter_lines, httpx-sse before 0.4.2):
# escaped, a data line stays one line for them; the decoded text is the same.
UNICODE_LINE_ENDS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event_json(data: dict[str, Any]) -> bytes:
    """`data` as one line of an event's data: compact JSON, UTF-8, those line ends escaped."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).translate(UNICODE_LINE_ENDS).encode()


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + event_json(data) + b"\n\n"


def _chunk(completion: Completion, delta: dict[str, Any], **choice: Any) -> dict[str, Any]:
    return {
        "id": completion.id,
        "object": "chat.completion.chunk",
        "created": completion.created,
        "model": completion.model,
        "provider": PROVIDER,
        "system_fingerprint": completion.fingerprint,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **choice}],
    }


def build_keepalive_event() -> bytes:
    return KEEPALIVE_EVENT


def build_delta_event(
    completion_id: str, created: int, model: str, fingerprint: str | None, delta: dict[str, Any]
) -> bytes:
    """One relayed chunk (role, reasoning_content or content), before the reply is known."""
    return _event(
        {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "provider": PROVIDER,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
        }
    )


def build_completion_events(completion: Completion, *, include_usage: bool) -> list[bytes]:
    events = [_event(_chunk(completion, {"role": "assistant"}))]
    if completion.reasoning:
        events.append(_event(_chunk(completion, {"reasoning_content": completion.reasoning})))
    if completion.content:
        events.append(_event(_chunk(completion, {"content": completion.content})))
    if completion.tool_calls:
        events.append(_event(_chunk(completion, tool_calls_delta(completion))))
    return events + build_completion_tail_events(completion, include_usage=include_usage)


def tool_calls_delta(completion: Completion) -> dict[str, Any]:
    """The reply's tool calls as one delta: each call whole, with its index."""
    calls = [
        {
            "index": i,
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
        }
        for i, c in enumerate(completion.tool_calls or ())
    ]
    return {"tool_calls": calls}


def build_completion_tail_events(completion: Completion, *, include_usage: bool) -> list[bytes]:
    """The finish chunk with x_horde, the usage chunk when asked for, and [DONE]."""
    events: list[bytes] = []
    finish = _chunk(
        completion,
        {},
        finish_reason=completion.finish_reason,
        native_finish_reason=completion.native_finish_reason,
    )
    if completion.x_horde:
        finish["x_horde"] = completion.x_horde
    events.append(_event(finish))
    if include_usage:
        usage_chunk = _chunk(completion, {})
        usage_chunk["choices"] = []
        usage_chunk["usage"] = completion.usage.model_dump(exclude_none=True)
        events.append(_event(usage_chunk))
    events.append(DONE_EVENT)
    return events


def build_error_events(error: ChatFrontError, request_id: str | None) -> list[bytes]:
    return [sse_error_event(error, request_id), DONE_EVENT]
