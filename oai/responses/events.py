"""The Responses API's stream, from the chat route's (docs/adr/0101-responses-api.md).

The chat route's stream (oai.streaming) runs unchanged, relayed deltas included; each of its
events is rewritten here into the Responses API's typed events, each with its `sequence_number`:

- first `response.created` and `response.in_progress`;
- a chunk's `reasoning_content` opens a reasoning item and is its summary text's delta
  (`response.reasoning_summary_text.delta`; reasoning relayed after the text began stays in that
  open item); its `content` opens the message item
  (`response.output_item.added`, `response.content_part.added`) and is a
  `response.output_text.delta`; its tool calls (each whole) are `function_call` items with their
  arguments in one delta;
- the finish chunk, the usage chunk and `[DONE]` close the open item and end the stream with
  `response.completed` (or `response.incomplete` when the reply was cut at its length), the
  whole `response` object with its usage;
- an error event is an `error` event and `response.failed`; keepalive comments pass as they are.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from oai.responses.reply import (
    INCOMPLETE_REASONS,
    build_response_object,
    function_call_item,
    item_ids,
    message_item,
    output_text_part,
    reasoning_item,
)
from oai.responses.request import ResponsesRequest, namespaced_name
from oai.sse import event_json
from oai.streaming import StartedStream

# What a stream that failed here ends with (its `error` event and `response.failed`).
INTERNAL_ERROR = {
    "code": "InternalError",
    "type": "api_error",
    "message": "The AI Horde front failed while streaming this response, which it cancelled; send it again.",
}


def _sse(data: dict[str, Any]) -> bytes:
    payload = event_json(data)
    return b"event: " + data["type"].encode() + b"\ndata: " + payload + b"\n\n"


class _OpenItem:
    """An item receiving deltas: its output index, id and text so far."""

    def __init__(self, index: int, item_id: str) -> None:
        self.index = index
        self.item_id = item_id
        self.text = ""


class EchoedRequest(Protocol):
    """What the events read of their request: the fields the `response` echoes, and the chat names of
    the functions of namespace tools (a ResponsesRequest, or a background response's kept record)."""

    echo: dict[str, Any]
    namespaced: dict[str, tuple[str, str]]


class ResponseEvents:
    """One streamed response: feed it the chat route's events in order, send what it returns; or, for
    a background response (ADR 0106), its start, then its finished `response` replayed."""

    def __init__(self, request: EchoedRequest, request_id: str, *, created: int, model: str) -> None:
        self.request = request
        # The chat names of namespaced functions; a replay adds those of the finished output's calls.
        self.namespaced = dict(request.namespaced)
        self.request_id = request_id
        self.created = created
        self.model = model
        self.reasoning_id, self.message_id, self.call_prefix = item_ids(request_id)
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # an open item's entry is its in-progress form
        self.open_items: dict[str, _OpenItem] = {}  # "reasoning", "message": the items receiving deltas
        self.done_indexes: set[int] = set()
        self.sent_message = False
        self.calls = 0
        self.opened = {"reasoning": 0, "message": 0}  # items of each kind opened so far
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.x_horde: dict[str, Any] | None = None
        self.ended = False
        # The response of response.completed or response.incomplete, once sent.
        self.delivered: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return _sse(data)

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return build_response_object(
            self.request.echo, self.request_id, created=self.created, model=self.model, status=status, **fields
        )

    def start(self) -> list[bytes]:
        in_progress = self._response("in_progress")
        return [
            self._event("response.created", response=in_progress),
            self._event("response.in_progress", response=in_progress),
        ]

    def feed(self, chat_write: bytes) -> list[bytes]:
        """The Responses events of one write of the chat route's stream: one event, or several sent
        as one write (the relayed chunks read together, oai.deltas); a keepalive passes as it is."""
        events: list[bytes] = []
        for block in chat_write.split(b"\n\n"):
            if block.strip():
                events += self._feed_event(block + b"\n\n")
        return events

    def _feed_event(self, chat_event: bytes) -> list[bytes]:
        if self.ended:
            return []
        if not chat_event.startswith(b"data: "):
            return [chat_event]
        payload = chat_event[len(b"data: ") :].strip()
        if payload == b"[DONE]":
            return self._finish()
        data = json.loads(payload)
        if "error" in data:
            return self.fail(data["error"])
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
        """Opens the kind's item at the next output index. A reasoning item and the message item
        may be open together: the relayed reasoning can go on after the text began (its rest comes
        with the reply), and it stays in the one reasoning item before the message, as in the whole
        response; events name their item by output_index."""
        index = len(self.output)
        # A kind's first item has the reply's id for it (as the whole response); a later one (after
        # a tool call closed it) gets a suffix, so no two items share an id.
        base = self.reasoning_id if kind == "reasoning" else self.message_id
        item_id = base if not self.opened[kind] else f"{base}_{self.opened[kind]}"
        self.opened[kind] += 1
        self.open_items[kind] = _OpenItem(index, item_id)
        events: list[bytes] = []
        if kind == "reasoning":
            item = reasoning_item(item_id, None)
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            events.append(
                self._event(
                    "response.reasoning_summary_part.added",
                    item_id=item_id,
                    output_index=index,
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                )
            )
        else:
            self.sent_message = True
            item = message_item(item_id, "", status="in_progress")
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=output_text_part(""),
                )
            )
        return events

    def _delta(self, kind: str, text: str) -> list[bytes]:
        events = self._open_item(kind) if kind not in self.open_items else []
        item = self.open_items[kind]
        item.text += text
        if kind == "reasoning":
            events.append(
                self._event(
                    "response.reasoning_summary_text.delta",
                    item_id=item.item_id,
                    output_index=item.index,
                    summary_index=0,
                    delta=text,
                )
            )
        else:
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item.item_id,
                    output_index=item.index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        return events

    def _close_items(self) -> list[bytes]:
        """Closes the open items, in their output order."""
        events: list[bytes] = []
        for kind, open_item in sorted(self.open_items.items(), key=lambda pair: pair[1].index):
            events += self._close_item(kind, open_item)
        self.open_items.clear()
        return events

    def _close_item(self, kind: str, open_item: _OpenItem) -> list[bytes]:
        index, item_id, text = open_item.index, open_item.item_id, open_item.text
        events: list[bytes] = []
        if kind == "reasoning":
            part = {"type": "summary_text", "text": text}
            events.append(
                self._event(
                    "response.reasoning_summary_text.done",
                    item_id=item_id,
                    output_index=index,
                    summary_index=0,
                    text=text,
                )
            )
            events.append(
                self._event(
                    "response.reasoning_summary_part.done",
                    item_id=item_id,
                    output_index=index,
                    summary_index=0,
                    part=part,
                )
            )
            item = reasoning_item(item_id, text)
        else:
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=output_text_part(text),
                )
            )
            # A message still open when the reply ends cut is where it was cut (reply.build_output).
            cut = INCOMPLETE_REASONS.get(self.finish_reason or "") is not None
            item = message_item(item_id, text, status="incomplete" if cut else "completed")
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output[index] = item
        self.done_indexes.add(index)
        return events

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        events = self._close_items()
        index = len(self.output)
        item_id = f"{self.call_prefix}_{self.calls}"
        self.calls += 1
        arguments = call["function"]["arguments"]
        item = function_call_item(item_id, call, namespaced=self.namespaced)
        events.append(
            self._event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(item_id, call, status="in_progress", namespaced=self.namespaced),
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
                name=item["name"],
                arguments=arguments,
            )
        )
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.done_indexes.add(index)
        return events

    # --- the end -------------------------------------------------------------------------------

    def _close_output(self) -> list[bytes]:
        events = self._close_items()
        if not self.sent_message and not self.calls:
            # A reply with neither text nor tool calls is one empty message, as the whole response.
            events += self._open_item("message") + self._close_items()
        return events

    def _finish(self) -> list[bytes]:
        events = self._close_output()
        reason = INCOMPLETE_REASONS.get(self.finish_reason or "")
        status = "incomplete" if reason else "completed"
        response = self._response(
            status, output=self.output, usage=self.usage, incomplete_reason=reason, x_horde=self.x_horde
        )
        events.append(self._event(f"response.{status}", response=response))
        self.ended = True
        self.delivered = response
        return events

    def fail(self, error: dict[str, Any]) -> list[bytes]:
        self.ended = True
        code, message = error.get("code"), error.get("message") or "The AI Horde could not finish this response."
        # The response's error.code is one of OpenAI's own codes (the SDK types it so); the horde's
        # code stays on the error event, whose code is any string.
        failed_code = "rate_limit_exceeded" if error.get("type") == "rate_limit_error" else "server_error"
        done = [item for index, item in enumerate(self.output) if index in self.done_indexes]
        failed = self._response("failed", output=done, error={"code": failed_code, "message": message, "type": error.get("type")})
        return [
            self._event("error", code=code, message=message, param=error.get("param")),
            self._event("response.failed", response=failed),
        ]

    # --- a background response (docs/adr/0106-resumable-background-streams.md) -------------------

    def start_queued(self, queued: dict[str, Any]) -> list[bytes]:
        """A background response's first events, sent at once: `response.created` and
        `response.queued`, each with its `queued` response object."""
        return [self._event("response.created", response=queued), self._event("response.queued", response=queued)]

    def in_progress(self, queued: dict[str, Any]) -> bytes:
        """A background response's third event, `response.in_progress`: sent once a worker took its
        request, or with the rest when a reader first sees it ended (the same event either way)."""
        return self._event("response.in_progress", response={**queued, "status": "in_progress"})

    def replay(self, queued: dict[str, Any], finished: dict[str, Any], *, in_progress_sent: bool = False) -> list[bytes]:
        """The events after a background response's start, once it ended: `response.in_progress`
        (unless `in_progress_sent`), then its output's events as a whole reply's stream sends them (built here from the finished
        output: what the chat stream's chunks of the same reply would feed), then its end with the
        `finished` response itself: `response.completed` or `response.incomplete`; a failed one
        `error` and `response.failed`, as a stream that failed; a cancelled one `response.failed` with
        the cancelled response (openai's event types have no cancelled event)."""
        events = [] if in_progress_sent else [self.in_progress(queued)]
        status = finished["status"]
        if status in ("completed", "incomplete"):
            if status == "incomplete":  # its open message closes cut, as the live stream's did
                reason = (finished.get("incomplete_details") or {}).get("reason")
                self.finish_reason = next((chat for chat, cut in INCOMPLETE_REASONS.items() if cut == reason), None)
            for item in finished["output"]:
                events += self._replay_item(item)
            events += self._close_output()
            events.append(self._event(f"response.{status}", response=finished))
        elif status == "failed":
            error = finished.get("error") or {}
            events.append(self._event("error", code=error.get("code"), message=error.get("message") or "", param=None))
            events.append(self._event("response.failed", response=finished))
        else:
            events.append(self._event("response.failed", response=finished))
        self.ended = True
        self.delivered = finished
        return events

    def _replay_item(self, item: dict[str, Any]) -> list[bytes]:
        """One finished output item fed as the chat stream's whole reply feeds it: the reasoning and
        the text each as one delta, a tool call whole."""
        if item["type"] == "reasoning":
            text = "".join(part["text"] for part in item.get("summary") or ())
            return self._delta("reasoning", text) if text else []
        if item["type"] == "message":
            text = "".join(part.get("text", "") for part in item.get("content") or ())
            return self._delta("message", text) if text else []
        name = item["name"]
        if item.get("namespace"):  # the chat name the namespaced item was made from (ADR 0101)
            name = namespaced_name(item["namespace"], name)
            self.namespaced.setdefault(name, (item["namespace"], item["name"]))
        call = {"id": item["call_id"], "function": {"name": name, "arguments": item["arguments"]}}
        return self._call(call)


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": usage["total_tokens"],
    }


async def stream_response(
    request: ResponsesRequest,
    request_id: str,
    created: int,
    chat_events: StartedStream,
    *,
    keep: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
) -> AsyncIterator[bytes]:
    """The Responses stream of the chat route's stream `chat_events` (which ends the run: closing
    this stream closes it). `keep` is given the completed or incomplete response before its last
    event is sent: a client that stops reading there, or continues the
    response at once, finds it kept."""
    writer = ResponseEvents(request, request_id, created=created, model=request.requested_models[0])
    try:
        for event in writer.start():
            yield event
        async for chat_write in chat_events:
            try:
                events = writer.feed(chat_write)
            except Exception as defect:  # the client gets an error, not a stream left open
                # Raised in the chat stream, whose guard logs it, counts it and cancels the request.
                with contextlib.suppress(Exception, StopAsyncIteration):
                    await chat_events.athrow(defect)
                yield b"".join(writer.fail(INTERNAL_ERROR))
                break
            if keep is not None and writer.delivered is not None:
                await keep(writer.delivered)
                keep = None
            if events:
                yield b"".join(events)  # one write in, one write out: a relayed batch stays one send
    finally:
        await chat_events.aclose()
