"""The Responses objects and stream events the front sends, read by openai-python's own types: every
required field present and of its type (the SDK parses streams without validating, so a gap shows
only as a missing attribute in a client's hands). Pure: no database, no Redis."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from oai.responses.events import ResponseEvents
from oai.responses.references import PreparedBody
from oai.responses.request import screen_responses_request

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
    data: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m1", "choices": []}
    if delta is not None or finish is not None:
        data["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    if usage:
        data["usage"] = usage
    return b"data: " + json.dumps(data).encode()


def _stream(chat: list[bytes]) -> list[dict[str, Any]]:
    request = screen_responses_request(PreparedBody({"model": "m", "input": "hi", "stream": True, "tools": TOOLS}))
    writer = ResponseEvents(request, "0a1b-2c3d", created=1, model="m")
    sent = writer.start()
    for event in chat:
        sent += writer.feed(event)
    return [json.loads(raw.split(b"data: ", 1)[1]) for raw in sent]


END = [_chunk(usage=USAGE), b"data: [DONE]"]
STREAMS = {
    "reasoning and text": [
        _chunk({"role": "assistant"}),
        _chunk({"reasoning_content": "think"}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk(finish="stop"),
        *END,
    ],
    "tool call": [
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
        _chunk(finish="tool_calls"),
        *END,
    ],
    "cut at its length": [_chunk({"content": "He"}), _chunk(finish="length"), *END],
    "failed": [
        _chunk({"content": "He"}),
        b'data: {"error":{"message":"The reply diverged.","type":"server_error","code":"RelayDiverged","param":null}}',
    ],
}


@pytest.mark.parametrize("name", list(STREAMS))
def test_every_stream_event_is_one_of_the_sdks_types(name: str) -> None:
    events = _stream(STREAMS[name])
    for data in events:
        EVENTS.validate_python(data)  # raises on a missing required field or a wrong type or literal
    last = events[-1]
    Response.model_validate(last["response"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_failed_response_carries_an_sdk_error_code_and_the_error_event_the_hordes() -> None:
    events = _stream(STREAMS["failed"])
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == "RelayDiverged"
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "The reply diverged.", "type": "server_error"}


def test_usage_has_the_sdks_required_details() -> None:
    usage = _stream(STREAMS["reasoning and text"])[-1]["response"]["usage"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


def test_relayed_chunks_sent_as_one_write_are_each_rewritten() -> None:
    """The relay sends the chunks read together as one write (oai.deltas.pending_events)."""
    one_write = _chunk({"role": "assistant"}) + b"\n\n" + _chunk({"content": "Hel"}) + b"\n\n" + _chunk({"content": "lo"}) + b"\n\n"
    events = _stream([one_write, _chunk(finish="stop"), *END])
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    assert events[-1]["type"] == "response.completed"


def test_reasoning_relayed_after_the_text_began_stays_in_its_item() -> None:
    events = _stream(
        [
            _chunk({"reasoning_content": "Six times"}),
            _chunk({"content": "4"}),
            _chunk({"reasoning_content": " seven."}),
            _chunk({"content": "2."}),
            _chunk(finish="stop"),
            *END,
        ]
    )
    for data in events:
        EVENTS.validate_python(data)
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    reasoning = [(e["output_index"], e["delta"]) for e in events if e["type"] == "response.reasoning_summary_text.delta"]
    assert reasoning == [(0, "Six times"), (0, " seven.")]
    text = [(e["output_index"], e["delta"]) for e in events if e["type"] == "response.output_text.delta"]
    assert text == [(1, "4"), (1, "2.")]
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["summary"] == [{"type": "summary_text", "text": "Six times seven."}]
    assert output[1]["content"][0]["text"] == "42."
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [0, 1]


# --- background responses (docs/adr/0102-responses-background.md) ------------------------------------


def _background_record() -> dict[str, Any]:
    """What oai.responses.background.start keeps under `background` for a request with tools."""
    request = screen_responses_request(
        PreparedBody({"model": "m", "input": "hi", "tools": TOOLS, "background": True}), keeps_items=True
    )
    return {
        "request_id": "0a1b-2c3d",
        "created": 1,
        "echo": request.echo,
        "namespaced": {},
        "models": request.requested_models,
        "include_reasoning": request.include_reasoning,
        "prompt_estimate": request.prompt_estimate(),
    }


def _native(status: int, body: dict[str, Any] | None = None) -> Any:
    import httpx

    from oai.horde_client import NativeAnswer

    return NativeAnswer(status, body, httpx.Headers())


GENERATION = {
    "message": {"role": "assistant", "content": "Hello."},
    "finish_reason": "stop",
    "model": "m1",
    "prompt_tokens": 3,
    "completion_tokens": 2,
}


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        ({"generations": [GENERATION], "done": True}, "completed"),
        ({"generations": [{**GENERATION, "finish_reason": "length"}], "done": True}, "incomplete"),
        ({"generations": [], "done": True, "faulted": True, "fault_reason": "The worker failed."}, "failed"),
        ({"generations": [], "done": True, "faulted": False, "waiting": 0, "processing": 0}, "cancelled"),
        (None, "failed"),  # the horde no longer has the request
    ],
)
def test_every_finished_background_response_is_the_sdks_response(answer: dict[str, Any] | None, status: str) -> None:
    from oai.responses.background import _finished

    gone = _native(404, {"message": "Request not found", "rc": "RequestNotFound"})
    finished = _finished(_background_record(), gone if answer is None else _native(200, answer))
    assert finished is not None and finished["status"] == status and finished["background"] is True
    Response.model_validate(finished)
    if status == "failed":
        assert finished["error"]["code"] == "server_error" and finished["error"]["message"]
    if status in ("completed", "incomplete"):
        assert finished["output"][0]["content"][0]["text"] == "Hello." and finished["usage"]["total_tokens"] == 5


def test_a_background_request_still_running_or_read_through_a_gateways_404_page_is_not_finished() -> None:
    from oai.responses.background import _finished

    assert _finished(_background_record(), _native(200, {"generations": [], "done": False, "processing": 1})) is None
    assert _finished(_background_record(), _native(404, None)) is None  # not the horde's answer (ADR 0105)
    kong = _native(404, {"message": "no Route matched with those values"})  # a gateway's JSON 404
    assert _finished(_background_record(), kong) is None


@pytest.mark.parametrize(
    ("answer", "ends"),
    [
        ({"generations": [GENERATION], "done": True}, ["response.output_item.added", "response.completed"]),
        ({"generations": [{**GENERATION, "finish_reason": "length"}], "done": True}, ["response.incomplete"]),
        ({"generations": [], "done": True, "faulted": True, "fault_reason": "The worker failed."}, ["error", "response.failed"]),
        ({"generations": [], "done": True, "faulted": False, "waiting": 0, "processing": 0}, ["response.failed"]),
    ],
)
def test_every_background_stream_event_is_one_of_the_sdks_types(answer: dict[str, Any], ends: list[str]) -> None:
    """A background response's stream (docs/adr/0106-resumable-background-streams.md), whatever its end."""
    from oai.responses.background import _finished
    from oai.responses.background_stream import ReplayedRequest
    from oai.responses.reply import queued_response

    finished = _finished(_background_record(), _native(200, answer))
    assert finished is not None
    queued = queued_response(finished, model="m")
    writer = ResponseEvents(ReplayedRequest(), "0a1b-2c3d", created=1, model="m")
    sent = writer.start_queued(queued) + writer.replay(queued, finished)
    events = [json.loads(raw.split(b"data: ", 1)[1]) for raw in sent]
    for data in events:
        EVENTS.validate_python(data)
    assert [e["type"] for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert [e["type"] for e in events if e["type"] in ends] == ends
    assert events[0]["response"]["status"] == "queued" and events[2]["response"]["status"] == "in_progress"
    assert events[-1]["response"] == finished and events[-1]["response"]["status"] == finished["status"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
