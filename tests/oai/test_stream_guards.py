"""A defect inside a stream after its headers went out ends the stream with an error event (and, on
/v1/responses, `response.failed`), and the chat stream below it is closed, so its request is
cancelled: the client is never left waiting on a connection nothing will write to again. Pure: the
generators run on their own, with a run that records what the stream did."""

from __future__ import annotations

import asyncio
import gc
import json
from types import SimpleNamespace
from typing import Any

import pytest

from oai.metrics import FrontMetrics
from oai.responses.events import stream_response
from oai.responses.references import PreparedBody
from oai.responses.request import screen_responses_request
from oai.streaming import start_stream, stream_completion


def _collect(stream) -> list[bytes]:
    async def run() -> list[bytes]:
        return [event async for event in stream]

    return asyncio.run(run())


def test_a_responses_stream_that_cannot_be_rewritten_ends_failed_and_closes_the_chat_stream():
    closed: list[bool] = []
    thrown: list[BaseException] = []

    async def chat_events():
        try:
            yield b": keepalive\n\n"
            yield b"data: {not json\n\n"
            yield b'data: {"never": "read"}\n\n'
        except ValueError as defect:  # as stream_completion's guard: recorded, then its error event
            thrown.append(defect)
            yield b'data: {"error": {"code": "InternalError", "message": "failed"}}\n\n'
        finally:
            closed.append(True)

    request = screen_responses_request(PreparedBody({"model": "m", "input": "hi", "stream": True}))
    sent = b"".join(_collect(stream_response(request, "0a1b-2c3d", 1, chat_events())))  # type: ignore[arg-type]
    events = [json.loads(line[len(b"data: ") :]) for line in sent.split(b"\n") if line.startswith(b"data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[2]["code"] == "InternalError"
    assert events[3]["response"]["status"] == "failed" and events[3]["response"]["error"]["code"] == "server_error"
    assert b": keepalive" in sent and closed == [True]
    # The defect reached the chat stream, whose guard cancels the request and counts the failure.
    assert [type(error).__name__ for error in thrown] == ["JSONDecodeError"]


class _RecordingRun:
    """What stream_completion reads of a ChatRun, for a reply already decided."""

    def __init__(self) -> None:
        self.state = SimpleNamespace(metrics=FrontMetrics())
        self.settings = SimpleNamespace(keepalive_seconds=10.0)
        self.relayed = None
        self.watcher = object()
        self.not_after = None
        self.request = SimpleNamespace(include_usage=False)
        self.request_id = "req-1"
        self.failures: list[Any] = []
        self.cancelled = False
        self.finished = False
        self.closed_by_client = False
        self.trace = SimpleNamespace(fail=lambda error, after_headers: self.failures.append(error))

    def delivered(self, completion: Any) -> None:
        """Counted by a real run; these tests read the cancel and the failures."""

    def first_content_sent(self) -> None:
        """Timed by a real run; these tests read the cancel and the failures."""

    def client_closed(self) -> None:
        self.closed_by_client = True

    def cancel_in_background(self) -> None:
        self.cancelled = True

    async def finish(self) -> None:
        self.finished = True


def test_a_chat_stream_that_fails_after_its_headers_ends_with_an_error_event_and_cancels():
    run = _RecordingRun()
    # A reply whose tool call lacks its function: building its chunks raises, as a defect would.
    broken = SimpleNamespace(
        id="chatcmpl-1", created=1, model="m", fingerprint=None, content="Hi", reasoning=None, tool_calls=[{"id": "c"}]
    )
    sent = _collect(stream_completion(run, broken))  # type: ignore[arg-type]
    assert sent[0].startswith(b":") and sent[-1] == b"data: [DONE]\n\n"
    error = json.loads(sent[-2][len(b"data: ") :])["error"]
    assert error["code"] == "InternalError" and error["type"] == "api_error"
    assert run.cancelled and run.finished and [e.code for e in run.failures] == ["InternalError"]


def test_a_streamed_response_is_kept_before_its_client_reads_it_completed():
    """A client may stop reading at response.completed (and continue the response at once): what it
    read completed has to be kept by then, not after the rest of the stream."""
    kept: list[str] = []

    async def keep(response: dict[str, Any]) -> None:
        kept.append(response["id"])

    async def chat_events():
        yield b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
        yield b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
        await asyncio.sleep(0)  # what follows [DONE]: the run's finish

    async def read_until_completed() -> None:
        request = screen_responses_request(PreparedBody({"model": "m", "input": "hi", "stream": True}))
        stream = stream_response(request, "0a1b-2c3d", 1, chat_events(), keep=keep)
        async for write in stream:
            if b"event: response.completed" in write:
                break
        await stream.aclose()  # the client went away, as Django closes a stream

    asyncio.run(read_until_completed())
    assert kept == ["resp_0a1b2c3d"]


@pytest.mark.parametrize("ending", ["closed", "dropped"])
def test_a_stream_answer_never_read_still_finishes_its_run(ending):
    """An answer the server closes, or drops, before reading it (a client gone before the first
    send) still runs the stream's finish: its request is cancelled and its slot released. A
    generator never started would end without running its `finally`."""
    run = _RecordingRun()

    async def scenario() -> None:
        stream = await start_stream(stream_completion(run, None))  # type: ignore[arg-type]
        if ending == "closed":
            await stream.aclose()
        else:
            del stream
            gc.collect()
        for _ in range(5):  # the event loop closes a dropped generator in a task of its own
            await asyncio.sleep(0)

    asyncio.run(scenario())
    assert run.closed_by_client and run.finished
