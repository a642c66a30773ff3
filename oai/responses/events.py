"""The Responses API's stream, from the chat route's (docs/adr/0101-responses-api.md).

The chat route's stream (oai.streaming) runs unchanged, relayed deltas included; each of its
events is rewritten here into the Responses API's typed events, each with its `sequence_number`:

- first `response.created` and `response.in_progress`;
- a chunk's `reasoning_content` opens a reasoning item and is its summary text's delta
  (`response.reasoning_summary_text.delta`); its `content` opens the message item
  (`response.output_item.added`, `response.content_part.added`) and is a
  `response.output_text.delta`; its tool calls (each whole) are `function_call` items with their
  arguments in one delta;
- the finish chunk, the usage chunk and `[DONE]` close the open item and end the stream with
  `response.completed` (or `response.incomplete` when the reply was cut at its length), the
  whole `response` object with its usage;
- an error event is an `error` event and `response.failed`; keepalive comments pass as they are.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from oai.responses.reply import (
    INCOMPLETE_REASONS,
    build_response_object,
    function_call_item,
    item_ids,
    message_item,
    output_text_part,
    reasoning_item,
)
from oai.responses.request import ResponsesRequest


def _sse(data: dict[str, Any]) -> bytes:
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    return b"event: " + data["type"].encode() + b"\ndata: " + payload + b"\n\n"


class ResponseEvents:
    """One streamed response: feed it the chat route's events in order, send what it returns."""

    def __init__(self, request: ResponsesRequest, request_id: str, *, created: int, model: str) -> None:
        self.request = request
        self.request_id = request_id
        self.created = created
        self.model = model
        self.reasoning_id, self.message_id, self.call_prefix = item_ids(request_id)
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: str | None = None  # "reasoning" or "message": the item receiving deltas
        self.text = ""
        self.sent_message = False
        self.calls = 0
        self.opened = {"reasoning": 0, "message": 0}  # items of each kind opened so far
        self.item_id = ""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.x_horde: dict[str, Any] | None = None
        self.ended = False
        self.delivered = False  # ended in response.completed or response.incomplete

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return _sse(data)

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return build_response_object(
            self.request, self.request_id, created=self.created, model=self.model, status=status, **fields
        )

    def start(self) -> list[bytes]:
        in_progress = self._response("in_progress")
        return [
            self._event("response.created", response=in_progress),
            self._event("response.in_progress", response=in_progress),
        ]

    def feed(self, chat_write: bytes) -> list[bytes]:
        """The Responses events of one write of the chat route's stream: one event, or the relayed
        chunks read together, which the relay sends as one write (oai.deltas.pending_events)."""
        events: list[bytes] = []
        for chat_event in chat_write.split(b"\n\n"):
            if chat_event:
                events += self._feed_event(chat_event + b"\n\n")
        return events

    def _feed_event(self, chat_event: bytes) -> list[bytes]:
        """The Responses events of one chat route event (a keepalive passes as it is)."""
        if self.ended:
            return []
        if not chat_event.startswith(b"data: "):
            return [chat_event]
        payload = chat_event[len(b"data: ") :].strip()
        if payload == b"[DONE]":
            return self._finish()
        data = json.loads(payload)
        if "error" in data:
            return self._fail(data["error"])
        events: list[bytes] = []
        if data.get("model"):
            self.model = data["model"]
        if data.get("usage"):
            self.usage = _usage(data["usage"])
        for choice in data.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._delta("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if data.get("x_horde"):
            self.x_horde = data["x_horde"]
        return events

    # --- items ---------------------------------------------------------------------------------

    def _open_item(self, kind: str) -> list[bytes]:
        events = self._close_item()
        index = len(self.output)
        self.open, self.text = kind, ""
        # A kind's first item has the reply's id for it (as the whole response); a later one (text,
        # then more reasoning) gets a suffix, so no two items share an id.
        base = self.reasoning_id if kind == "reasoning" else self.message_id
        self.item_id = base if not self.opened[kind] else f"{base}_{self.opened[kind]}"
        self.opened[kind] += 1
        if kind == "reasoning":
            item = reasoning_item(self.item_id, None)
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            events.append(
                self._event(
                    "response.reasoning_summary_part.added",
                    item_id=self.item_id,
                    output_index=index,
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                )
            )
        else:
            self.sent_message = True
            item = message_item(self.item_id, "", status="in_progress")
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=self.item_id,
                    output_index=index,
                    content_index=0,
                    part=output_text_part(""),
                )
            )
        return events

    def _delta(self, kind: str, text: str) -> list[bytes]:
        events = self._open_item(kind) if self.open != kind else []
        self.text += text
        index = len(self.output)
        if kind == "reasoning":
            events.append(
                self._event(
                    "response.reasoning_summary_text.delta",
                    item_id=self.item_id,
                    output_index=index,
                    summary_index=0,
                    delta=text,
                )
            )
        else:
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self.item_id,
                    output_index=index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        return events

    def _close_item(self) -> list[bytes]:
        if self.open is None:
            return []
        index, text = len(self.output), self.text
        events: list[bytes] = []
        if self.open == "reasoning":
            part = {"type": "summary_text", "text": text}
            events.append(
                self._event(
                    "response.reasoning_summary_text.done",
                    item_id=self.item_id,
                    output_index=index,
                    summary_index=0,
                    text=text,
                )
            )
            events.append(
                self._event(
                    "response.reasoning_summary_part.done",
                    item_id=self.item_id,
                    output_index=index,
                    summary_index=0,
                    part=part,
                )
            )
            item = reasoning_item(self.item_id, text)
        else:
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=self.item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=self.item_id,
                    output_index=index,
                    content_index=0,
                    part=output_text_part(text),
                )
            )
            item = message_item(self.item_id, text)
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.open, self.text = None, ""
        return events

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        events = self._close_item()
        index = len(self.output)
        item_id = f"{self.call_prefix}_{self.calls}"
        self.calls += 1
        arguments = call["function"]["arguments"]
        events.append(
            self._event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(item_id, call, status="in_progress"),
            )
        )
        events.append(
            self._event(
                "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=arguments
            )
        )
        events.append(
            self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                name=call["function"]["name"],
                arguments=arguments,
            )
        )
        item = function_call_item(item_id, call)
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    # --- the end -------------------------------------------------------------------------------

    def _finish(self) -> list[bytes]:
        events = self._close_item()
        if not self.sent_message and not self.calls:
            # A reply with neither text nor tool calls is one empty message, as the whole response.
            events += self._open_item("message") + self._close_item()
        reason = INCOMPLETE_REASONS.get(self.finish_reason or "")
        status = "incomplete" if reason else "completed"
        response = self._response(
            status, output=self.output, usage=self.usage, incomplete_reason=reason, x_horde=self.x_horde
        )
        events.append(self._event(f"response.{status}", response=response))
        self.ended = self.delivered = True
        return events

    def _fail(self, error: dict[str, Any]) -> list[bytes]:
        self.ended = True
        code, message = error.get("code"), error.get("message") or "The AI Horde could not finish this response."
        failed = self._response("failed", output=self.output, error={"code": code, "message": message})
        return [
            self._event("error", code=code, message=message, param=error.get("param")),
            self._event("response.failed", response=failed),
        ]


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": usage["total_tokens"],
    }


async def stream_response(
    request: ResponsesRequest,
    request_id: str,
    created: int,
    chat_events: AsyncGenerator[bytes, None],
    *,
    keep: Callable[[list[dict[str, Any]]], Awaitable[None]] | None = None,
) -> AsyncIterator[bytes]:
    """The Responses stream of the chat route's stream `chat_events` (which ends the run: closing
    this stream closes it). `keep` is given the output items of a completed or incomplete response,
    once sent."""
    writer = ResponseEvents(request, request_id, created=created, model=request.requested_models[0])
    try:
        for event in writer.start():
            yield event
        async for chat_write in chat_events:
            events = writer.feed(chat_write)
            if events:  # what was read together goes out together, as on the chat route
                yield b"".join(events)
    finally:
        await chat_events.aclose()
    if keep is not None and writer.delivered:
        await keep(writer.output)
