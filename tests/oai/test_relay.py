"""Relayed deltas (chat_front.md, "Relayed deltas"): the live horde and its mounted front, a client
streaming over HTTP, and the worker side driven over the real native routes (pop with the stream
hint, POST /api/v2/generate/text/progress, submit). Each reconciliation row is a test.

Two rows need stream entries the horde's script never appends (another generation's delta without
the pinned one's ended marker, a seq out of order: what a lost marker or a failover that recreated
the stream leaves); those tests append the entry to the real stream with XADD, as the script would.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from chat.services import progress
from contract.chat_progress import PROGRESS_ROUTE, chat_progress_stream_key
from tests.oai.conftest import MODEL, HordeTestWorker
from tests.oai.test_text_completions import DelayingProxy

pytestmark = pytest.mark.redis_only
USER = [{"role": "user", "content": "Say hello."}]


# --- the worker side, over the native routes -------------------------------------------------------


class StreamingWorker:
    def __init__(self, live, key: str, model: str = MODEL):
        self.live = live
        self.key = key
        self.model = model
        self.shape = HordeTestWorker(live=live, key=key, model=model)
        self.http = httpx.Client(base_url=live.url, headers={"apikey": key}, timeout=10)

    def pop(self, timeout: float = 10) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.http.post("/api/v2/generate/text/pop", json=self.shape.pop_body()).json()
            if job.get("id"):
                return job
            time.sleep(0.03)
        raise AssertionError("no job popped")

    def post(self, job: dict[str, Any], seq: int, content: str | None = None, reasoning: str | None = None):
        delta: dict[str, Any] = {}
        if content is not None:
            delta["content"] = content
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        answer = self.http.post(PROGRESS_ROUTE, json={"id": job["id"], "seq": seq, "delta": delta})
        assert answer.status_code == 200, answer.text
        return answer.json()

    def submit(self, job: dict[str, Any], content: str, reasoning: str | None = None, **extra: Any):
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        body = {"id": job["id"], "model_id": self.model, "message": message, "finish_reason": "stop", **extra}
        answer = self.http.post("/api/v2/generate/text/submit", json=body)
        assert answer.status_code == 200, answer.text

    def fault(self, job: dict[str, Any]) -> None:
        body = {"id": job["id"], "state": "faulted", "model_id": self.model, "fault_reason": "generation_error"}
        assert self.http.post("/api/v2/generate/text/submit", json=body).status_code == 200

    def close(self) -> None:
        self.http.close()




# --- the client side: the SSE events as they arrive ------------------------------------------------


class SseClient(threading.Thread):
    def __init__(self, url: str, key: str, body: dict[str, Any]):
        super().__init__(daemon=True)
        self.url, self.key, self.body = url, key, body
        self.events: list[Any] = []
        self.status: int | None = None

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.stream(
            "POST", f"{self.url}/chat/completions", json=self.body, headers=headers, timeout=30
        ) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    self.events.append(data if data == "[DONE]" else json.loads(data))

    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict) and "choices" in e]

    def contents(self) -> list[str]:
        return [
            c["choices"][0]["delta"]["content"]
            for c in self.chunks()
            if c["choices"] and "content" in c["choices"][0]["delta"]
        ]

    def reasoning(self) -> list[str]:
        return [
            c["choices"][0]["delta"]["reasoning_content"]
            for c in self.chunks()
            if c["choices"] and "reasoning_content" in c["choices"][0]["delta"]
        ]

    def wait_contents(self, count: int, timeout: float = 5) -> None:
        _wait(lambda: len(self.contents()) >= count, timeout, f"{count} content chunks: {self.events}")

    def finish(self, timeout: float = 10) -> list[Any]:
        self.join(timeout)
        assert not self.is_alive(), self.events
        return self.events


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _stream(front, requester, **body: Any) -> SseClient:
    client = SseClient(
        front.live.v1, requester.key, {"model": MODEL, "messages": USER, "stream": True, **body}
    )
    client.start()
    return client


def _outcomes(front) -> dict[str, int]:
    return {a["horde.outcome"]: v for a, v in front.metrics().get("horde.oai.stream.relay_outcomes", [])}


def _cancels(front) -> dict[str, int]:
    return {a["horde.outcome"]: v for a, v in front.metrics().get("horde.oai.cancels", [])}


def _request_id(job: dict[str, Any]) -> str:
    from chat.models import Generation

    return str(Generation.objects.get(pk=job["id"]).request_id)


def _error(events: list[Any]) -> dict[str, Any]:
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-1] == "[DONE]", events
    return errors[0]


# --- the rows --------------------------------------------------------------------------------------


def test_openai_client_receives_the_workers_tokens_as_separate_chunks(front, requester, streaming_worker):
    import openai

    sdk = openai.OpenAI(base_url=front.live.v1, api_key=requester.key, max_retries=0, timeout=30)
    received: list[Any] = []

    def consume() -> None:
        stream = sdk.chat.completions.create(
            model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
        )
        for chunk in stream:
            received.append(chunk)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    job = streaming_worker.pop()
    assert job["payload"]["stream_progress"] is True
    tokens = ["Hel", "lo", ", wor", "ld."]
    for seq, token in enumerate(tokens, start=1):
        assert streaming_worker.post(job, seq, token) == {"accepted_seq": seq, "cancelled": False}
        # Each token reaches the client before the worker posts the next: relayed, not buffered.
        _wait(
            lambda n=seq: sum(1 for c in received if c.choices and c.choices[0].delta.content) >= n, 5, token
        )
    streaming_worker.submit(job, "".join(tokens), completion_tokens=4, prompt_tokens=7)
    thread.join(10)
    sdk.close()
    assert not thread.is_alive()
    contents = [c.choices[0].delta.content for c in received if c.choices and c.choices[0].delta.content]
    assert contents == tokens
    assert received[0].choices[0].delta.role == "assistant" and not received[0].choices[0].delta.content
    finishes = [c.choices[0].finish_reason for c in received if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert received[-1].choices == [] and received[-1].usage.completion_tokens == 4
    assert received[-1].usage.prompt_tokens == 7
    fingerprints = {c.system_fingerprint for c in received}
    assert len(fingerprints) == 1 and next(iter(fingerprints)).startswith("fp_")
    assert {c.model for c in received} == {MODEL}
    metrics = front.metrics()
    assert [v for _, v in metrics["horde.oai.stream.relayed"]] == [1]
    assert _outcomes(front) == {"equal": 1}
    first = {a["horde.relayed"]: v for a, v in metrics["horde.oai.first_content.duration"]}
    assert set(first) == {True} and first[True][0] == 1


def test_a_final_reply_longer_than_the_relayed_text_sends_the_rest(front, requester, streaming_worker):
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_contents(1)
    streaming_worker.submit(job, "Hello there.")
    events = client.finish()
    assert client.contents() == ["Hel", "lo there."]
    assert [c["choices"][0]["finish_reason"] for c in client.chunks()].count("stop") == 1
    assert events[-1] == "[DONE]" and _outcomes(front) == {"prefix": 1}


def test_a_nul_in_the_posted_and_the_submitted_text_is_not_a_divergence(front, requester, streaming_worker):
    """The stored reply has NUL replaced; the relayed text has it replaced too, so a worker that
    posts and submits the same text is not ended with ChatStreamDiverged."""
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "He\x00l")
    client.wait_contents(1)
    streaming_worker.submit(job, "He\x00llo.")
    events = client.finish()
    assert client.contents() == ["He\ufffdl", "lo."]
    assert events[-1] == "[DONE]" and _outcomes(front) == {"prefix": 1}


def test_a_final_reply_not_starting_with_the_relayed_text_is_diverged(front, requester, streaming_worker):
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_contents(1)
    streaming_worker.submit(job, "Goodbye.")
    error = _error(client.finish())
    assert error["code"] == "ChatStreamDiverged" and error["type"] == "api_error"
    assert error["metadata"]["request_id"] == _request_id(job)
    assert client.contents() == ["Hel"] and _outcomes(front) == {"mismatch": 1}
    assert [a for a, _ in front.metrics()["horde.oai.stream.failures"]] == [
        {"horde.code": "ChatStreamDiverged"}
    ]
    # The request is done: a mismatch cancels nothing (only the entry rows do).
    from chat.models import GenerationRequest

    assert _cancels(front) == {} and GenerationRequest.objects.get(pk=_request_id(job)).cancelled is False


def test_the_pinned_generations_ended_marker_diverges_and_cancels(front, requester, streaming_worker):
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_contents(1)
    streaming_worker.fault(job)  # the horde appends the ended marker; the job is queued again
    error = _error(client.finish())
    assert error["code"] == "ChatStreamDiverged" and _outcomes(front) == {"ended": 1}
    _wait(lambda: _cancels(front).get("acknowledged") == 1, 5, "the front's cancel")
    # The restarted attempt is never spliced into the text sent: the request is cancelled.
    from chat.models import GenerationRequest

    assert GenerationRequest.objects.get(pk=_request_id(job)).cancelled is True


def test_a_native_cancel_ends_the_relayed_stream(front, requester, streaming_worker):
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_contents(1)
    answer = httpx.delete(
        f"{front.live.url}/api/v2/generate/chat/status/{_request_id(job)}", headers={"apikey": requester.key}
    )
    assert answer.status_code == 200, answer.text
    assert _error(client.finish())["code"] == "ChatStreamDiverged"
    assert _outcomes(front) == {"ended": 1}
    assert streaming_worker.post(job, 2, "lo")["cancelled"] is True


def test_another_generations_entry_after_exposure_diverges_and_cancels(front, requester, streaming_worker):
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_contents(1)
    stream = progress.progress_redis()
    key = chat_progress_stream_key(_request_id(job))
    stream.xadd(key, {"gen": str(uuid.uuid4()), "seq": 1, "content": "Other", "worker": "w", "model": MODEL})
    error = _error(client.finish())
    assert error["code"] == "ChatStreamDiverged" and _outcomes(front) == {"replaced_attempt": 1}
    assert client.contents() == ["Hel"]
    _wait(lambda: _cancels(front).get("acknowledged") == 1, 5, "the front's cancel")
    from chat.models import GenerationRequest

    assert GenerationRequest.objects.get(pk=_request_id(job)).cancelled is True


def test_a_seq_out_of_order_after_exposure_diverges_and_cancels(front, requester, streaming_worker):
    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_contents(1)
    stream = progress.progress_redis()
    stream.xadd(chat_progress_stream_key(_request_id(job)), {"gen": job["id"], "seq": 3, "content": "x"})
    error = _error(client.finish())
    assert error["code"] == "ChatStreamDiverged" and _outcomes(front) == {"gap": 1}
    assert client.contents() == ["Hel"]
    # The reconciliation table's row: the front cancels the request (the worker is told at its next post).
    _wait(lambda: _cancels(front).get("acknowledged") == 1, 5, "the front's cancel")
    from chat.models import GenerationRequest

    assert GenerationRequest.objects.get(pk=_request_id(job)).cancelled is True
    assert streaming_worker.post(job, 2, "lo")["cancelled"] is True


class HoldingProxy(DelayingProxy):
    """The live horde behind a proxy that holds the first request starting with `prefix` until
    `released` is set (`held` says it arrived)."""

    def __init__(self, upstream_port: int, prefix: bytes):
        super().__init__(upstream_port, {})
        self.prefix = prefix
        self.held = threading.Event()
        self.released = threading.Event()

    def _requests(self, source, target, hold) -> None:
        try:
            while data := source.recv(65536):
                if data.startswith(self.prefix) and not self.held.is_set():
                    self.held.set()
                    self.released.wait(10)
                target.sendall(data)
        except OSError:
            pass
        finally:
            target.close()


def test_entries_read_with_the_reply_are_sent_first_and_timed_once(front, requester, streaming_worker):
    """The worker's delta and its submit are both read before the stream sends anything (the first
    status read finds the request done): the delta is sent first and is the first content, so
    first_content.duration has one sample, relayed true."""
    proxy = HoldingProxy(front.live.port, b"GET /api/v2/generate/chat/status/")
    try:
        front.configure(native_roots=[proxy.root])
        client = _stream(front, requester)
        job = streaming_worker.pop()
        _wait(proxy.held.is_set, 5, "the front's first status read")
        streaming_worker.post(job, 1, "Hel")
        streaming_worker.submit(job, "Hello.")
        reader = front.state().delta_reader
        # The reader has queued the entry: the stream finds it beside the reply, in the same wake.
        _wait(lambda: any(sub.batches for sub in list(reader._subscriptions.values())), 5, "the entry read")
        proxy.released.set()
        events = client.finish()
    finally:
        proxy.released.set()
        proxy.close()
    deltas = [c["choices"][0]["delta"] for c in client.chunks() if c["choices"]]
    assert deltas[:3] == [{"role": "assistant"}, {"content": "Hel"}, {"content": "lo."}]
    assert client.contents() == ["Hel", "lo."] and events[-1] == "[DONE]"
    assert _outcomes(front) == {"prefix": 1}
    metrics = front.metrics()
    assert [v for _, v in metrics["horde.oai.stream.relayed"]] == [1]
    first = [
        (a["horde.relayed"], a["horde.streamed"], v[0])
        for a, v in metrics["horde.oai.first_content.duration"]
    ]
    assert first == [(True, True, 1)]


def test_before_exposure_an_ended_attempt_is_dropped_and_the_next_one_pins(
    front, requester, streaming_worker
):
    client = _stream(front, requester, horde={"include_reasoning": False})
    first = streaming_worker.pop()
    # Reasoning without horde.include_reasoning sends nothing: the stream is pinned, not exposed.
    streaming_worker.post(first, 1, reasoning="Let me think.")
    streaming_worker.fault(first)
    second = streaming_worker.pop()
    assert second["id"] != first["id"]
    streaming_worker.post(second, 1, "Hi")
    client.wait_contents(1)
    streaming_worker.post(second, 2, " you")
    client.wait_contents(2)
    streaming_worker.submit(second, "Hi you.", reasoning="Let me think again.")
    client.finish()
    assert client.contents() == ["Hi", " you", "."] and client.reasoning() == []
    assert _outcomes(front) == {"prefix": 1}


def test_a_gap_before_exposure_unpins_and_the_reply_is_delivered_whole(front, requester, streaming_worker):
    client = _stream(front, requester, horde={"include_reasoning": False})
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, reasoning="Thinking.")
    stream = progress.progress_redis()
    stream.xadd(chat_progress_stream_key(_request_id(job)), {"gen": job["id"], "seq": 3, "content": "late"})
    streaming_worker.post(job, 2, "Hi")  # the gen is unpinned: not relayed
    time.sleep(0.4)
    assert client.contents() == []
    streaming_worker.submit(job, "Hi there.")
    events = client.finish()
    assert client.contents() == ["Hi there."] and events[-1] == "[DONE]"
    assert _outcomes(front) == {} and "horde.oai.stream.relayed" not in front.metrics()
    first = {a["horde.relayed"] for a, _ in front.metrics()["horde.oai.first_content.duration"]}
    assert first == {False}


def test_reasoning_deltas_only_under_include_reasoning_and_the_rest_of_the_reasoning(
    front, requester, streaming_worker
):
    client = _stream(front, requester, horde={"include_reasoning": True})
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, reasoning="Six times")
    streaming_worker.post(job, 2, "4")
    client.wait_contents(1)
    streaming_worker.submit(job, "42.", reasoning="Six times seven.")
    client.finish()
    deltas = [c["choices"][0]["delta"] for c in client.chunks() if c["choices"]]
    assert deltas[:3] == [{"role": "assistant"}, {"reasoning_content": "Six times"}, {"content": "4"}]
    assert deltas[3:5] == [{"reasoning_content": " seven."}, {"content": "2."}]
    assert _outcomes(front) == {"prefix": 1}


def test_requests_outside_the_relay_and_fronts_without_redis_are_delivered_whole(
    front, requester, streaming_worker
):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    client = _stream(front, requester, tools=tools)
    job = streaming_worker.pop()
    assert "stream_progress" not in job["payload"]
    streaming_worker.submit(job, "No call.")
    client.finish()
    assert client.contents() == ["No call."]

    front.configure(redis_url=None)
    client = _stream(front, requester)
    job = streaming_worker.pop()
    assert "stream_progress" not in job["payload"]
    answer = streaming_worker.http.post(
        PROGRESS_ROUTE, json={"id": job["id"], "seq": 1, "delta": {"content": "x"}}
    )
    assert answer.json()["rc"] == "ChatProgressNotStreaming"
    streaming_worker.submit(job, "Whole reply.")
    client.finish()
    assert client.contents() == ["Whole reply."] and _outcomes(front) == {}


def test_a_request_faulting_after_exposure_is_chat_request_faulted(front, requester, streaming_worker):
    from datetime import timedelta

    from django.utils import timezone

    from chat.models import GenerationRequest
    from chat.services.sweeps import expire_requests

    client = _stream(front, requester)
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Hel")
    client.wait_contents(1)
    # The cleanup claims the request's expiry: the row is deleted and faulted is published.
    GenerationRequest.objects.filter(pk=_request_id(job)).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert expire_requests() == 1
    error = _error(client.finish())
    assert error["code"] == "ChatRequestFaulted" and client.contents() == ["Hel"]
    assert _outcomes(front) == {}
    assert [a for a, _ in front.metrics()["horde.oai.stream.failures"]] == [
        {"horde.code": "ChatRequestFaulted"}
    ]
