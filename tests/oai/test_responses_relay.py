"""Relayed deltas through POST /v1/responses (chat_front.md "Relayed deltas", ADR 0101): the live
horde and its mounted front, the worker posting progress over the real native routes, and the
client reading the Responses API's events as they arrive (the real openai SDK where it fits)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from tests.oai.conftest import MODEL, responses_sse
from tests.oai.test_relay import _cancels, _outcomes, _request_id, _wait

pytestmark = pytest.mark.redis_only


class ResponsesSseClient(threading.Thread):
    """POST /v1/responses with stream: true, its (event, data) pairs as they arrive."""

    def __init__(self, url: str, key: str, body: dict[str, Any]):
        super().__init__(daemon=True)
        self.url, self.key, self.body = url, key, body
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.status: int | None = None

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.stream("POST", f"{self.url}/responses", json=self.body, headers=headers, timeout=30) as r:
            self.status = r.status_code
            for event in responses_sse(r):
                self.events.append(event)

    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    def deltas(self, kind: str = "response.output_text.delta") -> list[str]:
        return [data["delta"] for name, data in self.events if name == kind]

    def wait_deltas(self, count: int, kind: str = "response.output_text.delta", timeout: float = 5) -> None:
        _wait(lambda: len(self.deltas(kind)) >= count, timeout, f"{count} {kind}: {self.events}")

    def finish(self, timeout: float = 10) -> list[tuple[str, dict[str, Any]]]:
        self.join(timeout)
        assert not self.is_alive(), self.events
        return self.events


def _stream(front, requester, **body: Any) -> ResponsesSseClient:
    client = ResponsesSseClient(front.live.v1, requester.key, {"model": MODEL, "input": "Say hello.", "stream": True, **body})
    client.start()
    return client


def _cancelled(job: dict[str, Any]) -> bool:
    from chat.models import GenerationRequest

    return GenerationRequest.objects.get(pk=_request_id(job)).cancelled


def test_the_sdk_receives_each_posted_token_as_its_own_delta_before_the_submit(front, requester, streaming_worker):
    import openai

    sdk = openai.OpenAI(base_url=front.live.v1, api_key=requester.key, max_retries=0, timeout=30)
    received: list[Any] = []

    def consume() -> None:
        with sdk.responses.create(model=MODEL, input="Say hello.", stream=True) as stream:
            for event in stream:
                received.append(event)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    job = streaming_worker.pop()
    assert job["payload"]["stream_progress"] is True
    tokens = ["Hel", "lo", ", wor", "ld."]
    for seq, token in enumerate(tokens, start=1):
        assert streaming_worker.post(job, seq, token) == {"accepted_seq": seq, "cancelled": False}
        # Each token reaches the client before the worker posts the next: relayed, not buffered.
        _wait(lambda n=seq: sum(1 for e in received if e.type == "response.output_text.delta") >= n, 5, token)
    assert not any(e.type == "response.output_text.done" for e in received)
    streaming_worker.submit(job, "".join(tokens), completion_tokens=4, prompt_tokens=7)
    thread.join(10)
    sdk.close()
    assert not thread.is_alive()
    assert [e.delta for e in received if e.type == "response.output_text.delta"] == tokens
    names = [e.type for e in received]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-5:] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in received] == list(range(len(received)))
    done = next(e for e in received if e.type == "response.output_text.done")
    assert done.text == "Hello, world."
    completed = received[-1].response
    assert completed.status == "completed" and completed.output_text == "Hello, world."
    assert completed.usage.output_tokens == 4 and completed.usage.input_tokens == 7
    assert completed.usage.total_tokens == 11
    assert _outcomes(front) == {"equal": 1}


def test_reasoning_deltas_are_a_reasoning_item_before_the_message(front, requester, streaming_worker):
    client = _stream(front, requester, horde={"include_reasoning": True})
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, reasoning="Six times")
    client.wait_deltas(1, "response.reasoning_summary_text.delta")
    streaming_worker.post(job, 2, reasoning=" seven.")
    streaming_worker.post(job, 3, "4")
    client.wait_deltas(1)
    streaming_worker.submit(job, "42.", reasoning="Six times seven.")
    events = client.finish()
    assert client.deltas("response.reasoning_summary_text.delta") == ["Six times", " seven."]
    assert client.deltas() == ["4", "2."]
    added = [data["item"]["type"] for name, data in events if name == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    output = events[-1][1]["response"]["output"]
    assert events[-1][0] == "response.completed"
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["summary"] == [{"type": "summary_text", "text": "Six times seven."}]
    assert output[1]["content"][0]["text"] == "42."


def test_the_rest_of_the_reasoning_after_the_text_keeps_one_reasoning_item(front, requester, streaming_worker):
    """The submitted reasoning may be longer than the relayed one, its rest sent after the text:
    the completed response still holds the reasoning item and the message, as the whole one does."""
    client = _stream(front, requester, horde={"include_reasoning": True})
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, reasoning="Six times")
    streaming_worker.post(job, 2, "4")
    client.wait_deltas(1)
    streaming_worker.submit(job, "42.", reasoning="Six times seven.")
    events = client.finish()
    assert events[-1][0] == "response.completed", events[-1]
    output = events[-1][1]["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"], output
    assert output[0]["summary"][0]["text"] == "Six times seven."
    assert output[1]["content"][0]["text"] == "42."


def test_a_final_reply_longer_than_the_relayed_text_sends_the_rest(front, requester, streaming_worker):
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_deltas(1)
    streaming_worker.submit(job, "Hello there.")
    events = client.finish()
    assert client.deltas() == ["Hel", "lo there."]
    done = [data["text"] for name, data in events if name == "response.output_text.done"]
    assert done == ["Hello there."]
    assert events[-1][0] == "response.completed"
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == "Hello there."
    assert _outcomes(front) == {"prefix": 1}


def test_a_final_reply_not_starting_with_the_relayed_text_fails_the_response(front, requester, streaming_worker):
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_deltas(1)
    streaming_worker.submit(job, "Goodbye.")
    events = client.finish()
    assert client.deltas() == ["Hel"]
    assert [name for name, _ in events[-2:]] == ["error", "response.failed"]
    error, failed = events[-2][1], events[-1][1]["response"]
    assert error["code"] == "ChatStreamDiverged"
    assert failed["status"] == "failed" and failed["error"]["message"] == error["message"]
    assert "response.completed" not in client.names() and "response.output_text.done" not in client.names()
    assert _outcomes(front) == {"mismatch": 1}
    # As on the chat route: the request is done, so a mismatch cancels nothing.
    assert _cancels(front) == {} and _cancelled(job) is False


def test_the_attempt_ending_after_exposure_fails_the_response_and_cancels(front, requester, streaming_worker):
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_deltas(1)
    streaming_worker.fault(job)  # the horde appends the ended marker; the job is queued again
    events = client.finish()
    assert [name for name, _ in events[-2:]] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "ChatStreamDiverged" and _outcomes(front) == {"ended": 1}
    _wait(lambda: _cancels(front).get("acknowledged") == 1, 5, "the front's cancel")
    assert _cancelled(job) is True


def test_a_native_cancel_ends_the_relayed_response(front, requester, streaming_worker):
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_deltas(1)
    answer = httpx.delete(
        f"{front.live.url}/api/v2/generate/chat/status/{_request_id(job)}", headers={"apikey": requester.key}
    )
    assert answer.status_code == 200, answer.text
    events = client.finish()
    assert [name for name, _ in events[-2:]] == ["error", "response.failed"]
    assert _outcomes(front) == {"ended": 1}
    assert streaming_worker.post(job, 2, "lo")["cancelled"] is True


def test_a_client_leaving_mid_relay_has_its_request_cancelled(front, requester, streaming_worker):
    headers = {"Authorization": f"Bearer {requester.key}"}
    body = {"model": MODEL, "input": "Say hello.", "stream": True}
    with httpx.stream("POST", f"{front.live.v1}/responses", json=body, headers=headers, timeout=10) as r:
        lines = r.iter_lines()
        job = streaming_worker.pop()
        streaming_worker.post(job, 1, "Hel")
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                break
    left = time.monotonic()
    _wait(lambda: _cancelled(job), 5, "the request cancelled")
    assert time.monotonic() - left < 5
    # The worker learns it at its next post.
    assert streaming_worker.post(job, 2, "lo")["cancelled"] is True


def test_the_sdks_stream_helper_reads_interleaved_relayed_reasoning(front, requester, streaming_worker):
    """openai-python's responses.stream() helper accumulates the events by output_index: its final
    response is the reasoning item then the message, with the whole texts."""
    import openai

    sdk = openai.OpenAI(base_url=front.live.v1, api_key=requester.key, max_retries=0, timeout=30)
    result: dict[str, Any] = {}
    texts: list[str] = []

    def consume() -> None:
        with sdk.responses.stream(model=MODEL, input="6*7?", extra_body={"horde": {"include_reasoning": True}}) as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    texts.append(event.delta)
            result["final"] = stream.get_final_response()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, reasoning="Six times")
    streaming_worker.post(job, 2, "4")
    _wait(lambda: texts == ["4"], 5, "the first text delta")
    streaming_worker.post(job, 3, reasoning=" seven")
    streaming_worker.submit(job, "42.", reasoning="Six times seven.")
    thread.join(10)
    sdk.close()
    assert not thread.is_alive()
    final = result["final"]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].summary[0].text == "Six times seven."
    assert final.output_text == "42." and texts == ["4", "2."]
