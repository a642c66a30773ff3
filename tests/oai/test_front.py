"""The front around the request: disconnects, operation keys and lost-submit recovery, admission,
CORS, model cards, metrics, the finished-request log line and the standalone process."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.http_fakes import QuietHandler, close_server, serve
from tests.oai.conftest import MODEL, OTHER_MODEL, HordeTestWorker, text_reply, wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hello?"}]
ROOT = Path(__file__).resolve().parents[2]


def _requests():
    from chat.models import GenerationRequest

    return list(GenerationRequest.objects.filter(is_chat=True))



def _idle_worker(live_horde, worker_owner) -> HordeTestWorker:
    """A chat worker that checked in (so the model is served) but does not pop."""
    worker = HordeTestWorker(live=live_horde, key=worker_owner.key)
    worker.check_in()
    return worker


# --- disconnects ----------------------------------------------------------------------------------


def _post_and_drop(url: str, key: str, body: dict, after: float) -> None:
    """Send the request and close the connection after `after` seconds (a stream: once it opened)."""
    headers = {"Authorization": f"Bearer {key}"}
    if body.get("stream"):
        with httpx.stream("POST", url, json=body, headers=headers, timeout=10) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # the opening comment: the stream is open and waiting
            time.sleep(after)
        return
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(url, json=body, headers=headers, timeout=after)


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_the_horde_request_within_2s(
    front, requester, live_horde, worker_owner, stream, caplog
):
    """Also what the front records of it: the disconnect wake, and the request's end as
    client_closed, 499 for a non-streamed request and 200 for a stream whose headers went out."""
    _idle_worker(live_horde, worker_owner)
    caplog.set_level("INFO", logger="oai.requests")
    body = {"model": MODEL, "messages": USER, "stream": stream}
    thread = threading.Thread(
        target=_post_and_drop, args=(f"{front.live.v1}/chat/completions", requester.key, body, 1.0)
    )
    thread.start()
    assert wait_for(_requests, 5), "the request was not submitted"
    thread.join()
    # Cancelled on the disconnect's wake (asserted below), well before the request's 20 s timeout
    # would have ended it; the bound leaves a loaded box its time.
    cancelled = wait_for(lambda: all(r.cancelled for r in _requests()) and _requests(), 10)
    assert cancelled, "the horde request was not cancelled"
    # The horde marks the row before its answer reaches the front, which counts the cancel then.
    acknowledged = ({"horde.outcome": "acknowledged"}, 1)
    assert wait_for(lambda: acknowledged in front.metrics().get("horde.oai.cancels", []), 10)
    wakes = front.metrics()["horde.oai.wakes"]
    disconnect = {
        "horde.wake_source": "disconnect",
        "horde.found_finished": False,
        "horde.found_done_without_generation": False,
    }
    assert (disconnect, 1) in wakes
    status_code = 200 if stream else 499
    ended = {"horde.streamed": stream, "horde.status_code": status_code, "horde.code": "client_closed"}
    # The finished line is logged last, once the request's duration is recorded.
    (record,) = wait_for(lambda: [r for r in caplog.records if r.name == "oai.requests"], 10)
    durations = front.metrics()["horde.oai.request.duration"]
    assert [a for a, _ in durations] == [ended] and durations[0][1][0] == 1
    assert f" status={status_code} code=client_closed " in record.getMessage()
    assert (record.code, record.status_code, record.woke_by) == ("client_closed", status_code, "disconnect")


def test_stream_disconnect_while_streaming_through_the_sdk(front, requester, live_horde, worker_owner):
    _idle_worker(live_horde, worker_owner)
    sdk = openai.OpenAI(base_url=front.live.v1, api_key=requester.key, max_retries=0)
    stream = sdk.chat.completions.create(model=MODEL, messages=USER, stream=True)
    assert wait_for(_requests, 5)
    stream.close()  # the SDK closes the response while the front waits
    # Within half the stream's 20 s timeout, which would otherwise end (and cancel) it.
    assert wait_for(lambda: all(r.cancelled for r in _requests()), 10)
    sdk.close()


# --- operation key and lost-submit recovery ------------------------------------------------------


class _LosingProxy(QuietHandler):
    """Forwards a chat submit to the real horde, then drops the connection without an answer."""

    target = ""
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        headers = {
            k: v for k, v in self.headers.items() if k.lower() in ("apikey", "client-agent", "content-type")
        }
        httpx.post(self.target + self.path.removeprefix("/api/v2"), content=body, headers=headers, timeout=10)
        import json

        _LosingProxy.seen.append(json.loads(body))
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)


def test_lost_submit_is_recovered_with_its_operation_key(front, client, start_worker, live_horde):
    _LosingProxy.target = f"{live_horde.url}/api/v2"
    _LosingProxy.seen = []
    proxy = serve(_LosingProxy)
    try:
        front.configure(
            native_roots=[f"http://127.0.0.1:{proxy.server_address[1]}/api/v2", f"{live_horde.url}/api/v2"]
        )
        start_worker()
        completion = client.chat.completions.create(model=MODEL, messages=USER)
        assert completion.choices[0].message.content
    finally:
        close_server(proxy)
    requests = _requests()
    assert len(requests) == 1  # the re-sent submit found the first one's claim: one request, one charge
    assert str(requests[0].operation_key) == _LosingProxy.seen[0]["horde"]["operation_key"]
    assert completion.id == f"chatcmpl-{requests[0].id}"
    assert ({"horde.existing_claim": True}, 1) in front.metrics()["horde.oai.submit.recoveries"]


class _GatewayTimeoutProxy(QuietHandler):
    """A gateway in front of the horde that gives up on a slow upstream: it forwards a chat submit to
    the real horde, which queues the request, then answers 504 with its own HTML page, as nginx does."""

    target = ""
    seen: list[dict] = []
    # How many submits it answers with its page; after them it passes the horde's answers on.
    pages = 1_000_000

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        headers = {
            k: v for k, v in self.headers.items() if k.lower() in ("apikey", "client-agent", "content-type")
        }
        answer = httpx.post(
            self.target + self.path.removeprefix("/api/v2"), content=body, headers=headers, timeout=10
        )
        _GatewayTimeoutProxy.seen.append(json.loads(body))
        if len(_GatewayTimeoutProxy.seen) > _GatewayTimeoutProxy.pages:
            self.send_body(answer.status_code, answer.content, "application/json")
            return
        self.send_body(504, b"<html><body><h1>504 Gateway Time-out</h1></body></html>", "text/html")

    def _forward(self) -> None:
        """Status reads and cancels pass through."""
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("apikey", "client-agent")}
        answer = httpx.request(
            self.command, self.target + self.path.removeprefix("/api/v2"), headers=headers, timeout=10
        )
        self.send_body(answer.status_code, answer.content, "application/json")

    do_GET = do_DELETE = _forward  # noqa: N815


def test_a_gateways_error_page_for_the_submit_is_a_lost_answer_and_recovered(front, client, start_worker, live_horde):
    """A 5xx answer that is not the horde's (no JSON error body) says nothing of whether the submit
    landed: the front re-sends it with its operation key, as for an answer lost on the way, instead of
    answering an error the SDK retries as a second request while the first is served and charged."""
    _GatewayTimeoutProxy.target = f"{live_horde.url}/api/v2"
    _GatewayTimeoutProxy.seen = []
    _GatewayTimeoutProxy.pages = 1_000_000
    proxy = serve(_GatewayTimeoutProxy)
    try:
        front.configure(
            native_roots=[f"http://127.0.0.1:{proxy.server_address[1]}/api/v2", f"{live_horde.url}/api/v2"]
        )
        start_worker()
        completion = client.chat.completions.create(model=MODEL, messages=USER)
        assert completion.choices[0].message.content
    finally:
        close_server(proxy)
    requests = _requests()
    assert len(requests) == 1  # one request, one charge
    assert str(requests[0].operation_key) == _GatewayTimeoutProxy.seen[0]["horde"]["operation_key"]
    assert completion.id == f"chatcmpl-{requests[0].id}"
    assert ({"horde.existing_claim": True}, 1) in front.metrics()["horde.oai.submit.recoveries"]


def test_a_given_up_submit_whose_search_meets_a_gateways_page_is_searched_again(
    front, client, live_horde, worker_owner
):
    """The submit and its re-send both meet the gateway's page: the front answers 502 with the
    outcome unknown and looks the key's request up to cancel it. That look-up meeting the page too
    is not the horde saying it holds nothing: it is sent again with the cancel retries, and once the
    gateway passes the horde's answer on, the request the first submit created is cancelled."""
    _GatewayTimeoutProxy.target = f"{live_horde.url}/api/v2"
    _GatewayTimeoutProxy.seen = []
    _GatewayTimeoutProxy.pages = 3  # the submit, its re-send and the first look-up
    proxy = serve(_GatewayTimeoutProxy)
    try:
        front.configure(
            native_roots=[f"http://127.0.0.1:{proxy.server_address[1]}/api/v2"], cancel_retry_seconds=0.3
        )
        HordeTestWorker(live=live_horde, key=worker_owner.key).check_in()
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model=MODEL, messages=USER)
        assert caught.value.status_code == 502 and caught.value.body["metadata"] == {"submit_outcome": "unknown"}
        assert caught.value.response.headers["x-should-retry"] == "false"
        (request,) = _requests()
        assert wait_for(lambda: _requests()[0].cancelled, 5), "the request the first submit created was left queued"
    finally:
        close_server(proxy)
    assert {body["horde"]["operation_key"] for body in _GatewayTimeoutProxy.seen} == {str(request.operation_key)}


class _GatewayNotFoundProxy(QuietHandler):
    """A gateway in front of the horde that answers its first status reads with its own 404 page (a
    route it has not loaded yet), then passes everything through."""

    target = ""
    pages = 0
    reads = 0
    page = (b"<html><body><h1>404 Not Found</h1></body></html>", "text/html")

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        if self.command == "GET" and "/status/" in self.path:
            type(self).reads += 1
            if type(self).reads <= type(self).pages:
                page, content_type = type(self).page
                self.send_body(404, page, content_type)
                return
        headers = {
            k: v for k, v in self.headers.items() if k.lower() in ("apikey", "client-agent", "content-type")
        }
        answer = httpx.request(
            self.command, self.target + self.path.removeprefix("/api/v2"), content=body, headers=headers, timeout=10
        )
        self.send_body(answer.status_code, answer.content, "application/json")

    do_GET = do_POST = do_DELETE = _forward  # noqa: N815


@pytest.mark.parametrize(
    "page",
    [
        (b"<html><body><h1>404 Not Found</h1></body></html>", "text/html"),
        (b'{"message":"no Route matched with those values"}', "application/json"),  # Kong's
    ],
)
def test_a_gateways_404_page_for_a_status_read_is_not_the_request_gone(front, client, start_worker, live_horde, page):
    """Only the horde's own 404 (RequestNotFound) says the request no longer exists: a gateway's page
    or JSON in its place is a failed read, read again, and the request is delivered, not answered
    ChatRequestFaulted and left queued for a worker to serve and the requester to pay."""
    _GatewayNotFoundProxy.page = page
    _GatewayNotFoundProxy.target = f"{live_horde.url}/api/v2"
    _GatewayNotFoundProxy.pages = 2
    _GatewayNotFoundProxy.reads = 0
    proxy = serve(_GatewayNotFoundProxy)
    try:
        front.configure(native_roots=[f"http://127.0.0.1:{proxy.server_address[1]}/api/v2"])
        start_worker(delay=0.5)
        completion = client.chat.completions.create(model=MODEL, messages=USER)
        assert completion.choices[0].message.content
    finally:
        close_server(proxy)
    assert _GatewayNotFoundProxy.reads > 2
    (request,) = _requests()
    assert completion.id == f"chatcmpl-{request.id}"


def test_native_root_rotation_on_connection_failure(front, client, start_worker, live_horde):
    dead = f"http://127.0.0.1:{free_port()}/api/v2"
    front.configure(native_roots=[dead, f"{live_horde.url}/api/v2"])
    start_worker()
    assert client.chat.completions.create(model=MODEL, messages=USER).choices[0].message.content
    assert front.state().client.roots[front.state().client._current] == f"{live_horde.url}/api/v2"


def test_unreachable_horde_is_503(front, client):
    front.configure(native_roots=[f"http://127.0.0.1:{free_port()}/api/v2"])
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER)
    assert caught.value.status_code == 503 and caught.value.code == "HordeUnavailable"


# --- the wait's other ends --------------------------------------------------------------------------


def test_cancelled_elsewhere_is_chat_request_no_generation(front, client, live_horde, worker_owner, caplog):
    _idle_worker(live_horde, worker_owner)
    caplog.set_level("INFO", logger="oai.requests")
    result: dict = {}

    def call():
        try:
            client.chat.completions.create(model=MODEL, messages=USER)
        except openai.APIStatusError as error:
            result["error"] = error

    thread = threading.Thread(target=call)
    thread.start()
    request = wait_for(_requests, 5)[0]
    assert httpx.delete(f"{live_horde.url}/api/v2/generate/chat/status/{request.id}").status_code == 200
    thread.join(10)
    error = result["error"]
    assert (error.status_code, error.code) == (502, "ChatRequestNoGeneration")
    assert error.response.headers["x-should-retry"] == "false"
    # The read that found the request done without a generation is marked so.
    done_without = [
        (a, v) for a, v in front.metrics()["horde.oai.wakes"] if a["horde.found_done_without_generation"]
    ]
    assert done_without and all(not a["horde.found_finished"] for a, _ in done_without)
    (record,) = [r for r in caplog.records if r.name == "oai.requests"]
    assert record.done_without_generation_reads == sum(v for _, v in done_without) >= 1
    assert " status=502 code=ChatRequestNoGeneration " in record.getMessage()


def test_budget_end_is_408_and_cancels(front, client, live_horde, worker_owner):
    front.configure(nonstream_timeout_seconds=1.0)
    _idle_worker(live_horde, worker_owner)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER)
    assert (caught.value.status_code, caught.value.code) == (408, "ChatRequestTimeout")
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert wait_for(lambda: all(r.cancelled for r in _requests()), 10)


def test_stream_error_after_headers_is_an_sse_error_event(front, client, live_horde, worker_owner):
    front.configure(stream_timeout_seconds=1.0)
    _idle_worker(live_horde, worker_owner)
    stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True)
    with pytest.raises(openai.APIError) as caught:
        list(stream)
    assert "ChatRequestTimeout" in str(caught.value.body) or caught.value.code == "ChatRequestTimeout"
    assert ({"horde.code": "ChatRequestTimeout"}, 1) in front.metrics()["horde.oai.stream.failures"]


def test_no_eligible_worker_after_the_grace_is_an_sse_error_event_with_retry_after(
    front, requester, live_horde, worker_owner
):
    """trusted_workers with only an untrusted worker online: the first read passes (the grace
    starts), the headers go out, and after the grace the stream ends in the error event, whose
    metadata.retry_after is the Retry-After a non-streamed answer carries."""
    _idle_worker(live_horde, worker_owner)
    body = {"model": MODEL, "messages": USER, "stream": True, "horde": {"trusted_workers": True}}
    with httpx.stream(
        "POST",
        f"{front.live.v1}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=10,
    ) as response:
        assert response.status_code == 200
        assert "retry-after" not in response.headers
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 2
    (request,) = _requests()
    assert json.loads(events[0].removeprefix("data: ")) == {
        "error": {
            "message": "No online worker could take this request within the grace period; workers come and "
            "go, try again later.",
            "type": "api_error",
            "param": None,
            "code": "no_eligible_worker",
            "metadata": {"request_id": str(request.id), "retry_after": 30},
        }
    }
    assert front.metrics()["horde.oai.stream.failures"] == [({"horde.code": "no_eligible_worker"}, 1)]
    assert wait_for(lambda: all(r.cancelled for r in _requests()), 10)


# --- admission ------------------------------------------------------------------------------------


def test_body_over_the_limit_is_413(front, requester):
    front.configure(max_body_bytes=1000)
    response = httpx.post(
        f"{front.live.v1}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]},
        headers={"Authorization": f"Bearer {requester.key}"},
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "RequestTooLarge"
    assert response.headers["x-should-retry"] == "false"


def test_slow_body_is_408(front, live_horde):
    """At the ASGI level (daphne reads a body whole before calling the application; a server that
    streams bodies, such as uvicorn, hands the front a slow one)."""
    import asyncio

    from oai.asgi import FrontASGI

    front.configure(body_read_timeout_seconds=0.3)
    sent: list[dict] = []

    async def never_app(scope, receive, send):  # pragma: no cover - must not be reached
        raise AssertionError("the body never arrived")

    async def receive():
        if not sent and not getattr(receive, "first", False):
            receive.first = True
            return {"type": "http.request", "body": b'{"model"', "more_body": True}
        await asyncio.sleep(10)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-length", b"100")],
    }
    live_horde.run(FrontASGI(never_app)(scope, receive, send))
    assert sent[0]["status"] == 408
    assert b"RequestBodyTimeout" in sent[1]["body"]


def test_inflight_cap_per_source_is_503_front_at_capacity(front, requester, live_horde, worker_owner):
    """Two slots per client address (the address the one trusted proxy forwarded): two requests from
    one address and one from another are in flight, which the gauges show, and a third from the
    first address is refused."""
    front.configure(max_inflight_per_source=2, trusted_proxy_count=1)
    worker = _idle_worker(live_horde, worker_owner)
    url = f"{front.live.v1}/chat/completions"
    body = {"model": MODEL, "messages": USER}

    def post(address: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {requester.key}", "X-Forwarded-For": address}
        return httpx.post(url, json=body, headers=headers, timeout=30)

    answers: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda a=address: answers.append(post(a)))
        for address in ("203.0.113.1", "203.0.113.1", "203.0.113.2")
    ]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: len(_requests()) == 3, 5)
    gauges = front.metrics()
    assert gauges["horde.oai.inflight"] == [({}, 3)]
    assert gauges["horde.oai.inflight.sources"] == [({}, 2)]
    assert gauges["horde.oai.inflight.source_max"] == [({}, 2)]
    refused = post("203.0.113.1")
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "FrontAtCapacity")
    # The cap reached is the address's, and the message says so.
    assert refused.json()["error"]["message"] == (
        "This AI Horde front holds 2 requests from your address, its limit per address; "
        "try again when one of them ends."
    )
    assert refused.headers["retry-after"]
    worker.start()
    for thread in threads:
        thread.join(20)
    worker.stop()
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert ({"horde.status_code": 503, "horde.code": "FrontAtCapacity"}, 1) in front.metrics()[
        "horde.oai.requests.refused"
    ]
    gauges = front.metrics()
    assert [gauges[name] for name in ("horde.oai.inflight", "horde.oai.inflight.sources")] == [[({}, 0)], [({}, 0)]]


# --- CORS -----------------------------------------------------------------------------------------


def test_browser_preflight(front):
    response = httpx.options(
        f"{front.live.v1}/chat/completions",
        headers={
            "Origin": "null",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert response.status_code in (200, 204)
    assert response.headers["access-control-allow-origin"] == "*"
    allowed = [h.strip().lower() for h in response.headers["access-control-allow-headers"].split(",")]
    assert "authorization" in allowed and "content-type" in allowed
    assert "POST" in response.headers["access-control-allow-methods"]
    exposed = response.headers["access-control-expose-headers"].lower()
    assert "retry-after" in exposed and "x-should-retry" in exposed


def test_every_answer_allows_any_origin(front, requester, start_worker):
    start_worker()
    headers = {"Origin": "null", "Authorization": f"Bearer {requester.key}"}
    for response in (
        httpx.get(f"{front.live.v1}/models", headers=headers),
        httpx.post(
            f"{front.live.v1}/chat/completions",
            json={"model": MODEL, "messages": USER},
            headers=headers,
            timeout=20,
        ),
        httpx.post(f"{front.live.v1}/chat/completions", json={"messages": USER}, headers=headers),
    ):
        assert response.headers["access-control-allow-origin"] == "*"
        assert "x-should-retry" in response.headers["access-control-expose-headers"].lower()


def test_an_event_stream_accept_header_is_answered_as_the_body_asks(front, requester, start_worker):
    """SSE clients (fetch-event-source, httpx-sse, a browser's own reader) send Accept:
    text/event-stream; as OpenAI, the body's `stream` decides the answer, never a 406."""
    start_worker()
    headers = {"Authorization": f"Bearer {requester.key}", "Accept": "text/event-stream"}
    body = {"model": MODEL, "messages": USER}
    url = f"{front.live.v1}/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=20) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    whole = httpx.post(url, json=body, headers=headers, params={"format": "api"}, timeout=20)
    assert whole.status_code == 200 and whole.json()["object"] == "chat.completion"
    refused = httpx.post(url, json={"messages": USER}, headers=headers, timeout=20)
    assert 400 <= refused.status_code < 500 and "error" in refused.json()
    assert refused.headers["content-type"].startswith("application/json")


# Characters JSON leaves unescaped in a string that str.splitlines() (httpx's iter_lines, httpx-sse
# before 0.4.2, and the SSE readers built on them) takes for line ends: NEL, LINE and PARAGRAPH SEPARATOR.
UNICODE_LINE_ENDS = "a\u0085b\u2028c\u2029d"


def _data_lines(url: str, key: str, body: dict) -> list[dict]:
    """Every data event of a stream, read as universal-newline line readers read it: each line is
    whole JSON."""
    with httpx.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=20) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    return [json.loads(line[len("data: ") :]) for line in lines]


def test_a_reply_with_unicode_line_separators_streams_one_json_per_line(front, requester, start_worker, start_text_worker):
    start_worker(reply=text_reply(UNICODE_LINE_ENDS))
    chunks = _data_lines(
        f"{front.live.v1}/chat/completions", requester.key, {"model": MODEL, "messages": USER, "stream": True}
    )
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == UNICODE_LINE_ENDS
    events = _data_lines(f"{front.live.v1}/responses", requester.key, {"model": MODEL, "input": "Hi", "stream": True})
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == UNICODE_LINE_ENDS
    start_text_worker(generation=lambda job: UNICODE_LINE_ENDS)
    chunks = _data_lines(f"{front.live.v1}/completions", requester.key, {"model": MODEL, "prompt": "Hi", "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == UNICODE_LINE_ENDS


# --- model cards ------------------------------------------------------------------------------------


def test_models_match_the_workers_online(front, client, start_worker):
    start_worker(
        features=["tools", "tool_choice_enforced", "json_schema", "seed", "vision"],
        max_length=1024,
        max_context_length=4096,
    )
    start_worker(
        model=OTHER_MODEL, features=["prompt_overflow_refused"], max_length=512, max_context_length=2048
    )
    cards = {model.id: model for model in client.models.list()}
    assert set(cards) == {MODEL, OTHER_MODEL}
    card = cards[MODEL].model_dump()
    assert card["context_length"] == 4096 and card["top_provider"]["max_completion_tokens"] == 1024
    assert card["architecture"]["input_modalities"] == ["text", "image"]
    assert card["supported_parameters"] == [
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "tools",
        "tool_choice",
        "response_format",
    ]
    assert card["x_horde"]["workers"] == 1
    other = cards[OTHER_MODEL].model_dump()
    assert other["supported_parameters"] == ["max_tokens", "temperature", "top_p", "stop"]
    assert other["architecture"]["input_modalities"] == ["text"]
    # models.retrieve reads the same card, its id's slashes and all.
    assert "/" in MODEL and client.models.retrieve(MODEL).model_dump() == card
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nobody/serves-this")
    assert caught.value.body == {
        "message": "The model `nobody/serves-this` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_models_answer_a_wrong_key_401_as_openai_does(front, client, start_worker):
    """An app that tests its connection by listing the models (Open WebUI, SillyTavern) learns of a
    wrong key there, not at its first completion; no key is still the anonymous caller's list."""
    start_worker()
    wrong = openai.OpenAI(base_url=front.live.v1, api_key="not-a-horde-key", max_retries=0, timeout=30)
    for call in (wrong.models.list, lambda: wrong.models.retrieve(MODEL)):
        with pytest.raises(openai.AuthenticationError) as caught:
            call()
        assert caught.value.body["code"] == "invalid_api_key"
        assert caught.value.body["type"] == "authentication_error"
        assert caught.value.response.headers["x-should-retry"] == "false"
    wrong.close()
    assert [model.id for model in client.models.list()] == [MODEL]
    anonymous = httpx.get(f"{front.live.v1}/models", timeout=10)
    assert anonymous.status_code == 200 and [card["id"] for card in anonymous.json()["data"]] == [MODEL]


# --- metrics and the finished line ------------------------------------------------------------------


def test_a_refused_request_carrying_a_retry_count_is_counted(front, client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[], extra_headers={"x-stainless-retry-count": "2"}
        )
    assert front.metrics()["horde.oai.client_retry_hints"][0][1] == 1


def test_a_retry_count_that_is_not_a_number_is_not_counted(front, requester):
    """The header is the client's: a value str.isdigit takes and int() does not ("\u00b2", one latin-1
    byte) leaves the request as it is, refused here for its empty messages, not a 500."""
    response = httpx.post(
        f"{front.live.v1}/chat/completions",
        json={"model": MODEL, "messages": []},
        headers={"Authorization": f"Bearer {requester.key}", "x-stainless-retry-count": b"\xb2"},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "horde.oai.client_retry_hints" not in front.metrics()


def test_metrics_of_a_delivered_completion(front, client, start_worker):
    start_worker()
    client.chat.completions.with_raw_response.create(
        model=MODEL, messages=USER, extra_headers={"x-stainless-retry-count": "1"}
    )
    metrics = front.metrics()
    assert ({"horde.streamed": False}, 1) in metrics["horde.oai.requests.admitted"]
    delivered = {
        "horde.model": MODEL,
        "horde.estimated_usage": True,
        "horde.finish_reason": "stop",
        "horde.max_length_lowered": False,
    }
    assert (delivered, 1) in metrics["horde.oai.completions"]
    assert metrics["horde.oai.client_retry_hints"][0][1] == 1
    call_types = {a["horde.call_type"] for a, _ in metrics["horde.oai.native.duration"]}
    assert {"submit", "status"} <= call_types
    assert any(a["horde.wake_source"] == "immediate" for a, _ in metrics["horde.oai.wakes"])
    assert any(a["horde.found_finished"] for a, _ in metrics["horde.oai.wakes"])
    durations = dict((tuple(sorted(a.items())), v) for a, v in metrics["horde.oai.request.duration"])
    assert durations[(("horde.code", "ok"), ("horde.status_code", 200), ("horde.streamed", False))][0] == 1
    for name in ("horde.oai.queue_wait", "horde.oai.first_content.duration", "horde.oai.request.body_bytes"):
        assert metrics[name], name
    assert metrics["horde.oai.inflight"][0][1] == 0


def test_completions_count_a_max_length_lowered_to_the_workers(front, client, start_worker):
    """horde.oai.completions records the finish reason and whether the horde lowered max_length to
    the largest its workers declare (spec: Context adjustments), so a length finish can be told apart."""
    start_worker(max_length=512)
    completion = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1024)
    assert completion.model_extra["x_horde"]["context_adjustments"][0]["reason"] == "worker_max_length"
    attributes = [a for a, _ in front.metrics()["horde.oai.completions"]]
    assert attributes == [
        {
            "horde.model": MODEL,
            "horde.estimated_usage": True,
            "horde.finish_reason": "stop",
            "horde.max_length_lowered": True,
        }
    ]


def test_a_reply_of_tool_calls_alone_is_not_counted_empty(front, client, start_worker):
    """horde.oai.completions.empty counts the replies x_horde.notice reports: no text, no tool calls."""
    from tests.oai.test_completions import WEATHER, calls_reply

    worker = start_worker(reply=calls_reply("get_weather"))
    called = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    assert called.choices[0].message.tool_calls and "notice" not in (called.model_extra.get("x_horde") or {})
    assert not front.metrics().get("horde.oai.completions.empty")
    worker.reply = lambda job: {"message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}
    empty = client.chat.completions.create(model=MODEL, messages=USER)
    assert empty.model_extra["x_horde"]["notice"]
    assert front.metrics()["horde.oai.completions.empty"] == [({"horde.model": MODEL}, 1)]


def test_metrics_of_refusals_and_errors(front, client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, temperature=5)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=USER)
    metrics = front.metrics()
    assert ({"horde.status_code": 400, "horde.code": "UnsupportedChatParameter"}, 1) in metrics[
        "horde.oai.requests.refused"
    ]
    assert (
        {
            "horde.status_code": 503,
            "horde.code": "no_eligible_worker",
            "horde.streamed": False,
            "horde.reason": "",
        },
        1,
    ) in metrics["horde.oai.requests.errors"]


LINE = re.compile(
    r"^Chat request (?P<id>[0-9a-f-]{36}) finished: streamed=False submitted_at=\d+\.\d+ woke_at=\d+\.\d+ "
    r"woke_by=(signal|immediate|poll|recheck) waited=\d+\.\d+s status=200 code=ok wakes=\d+ estimated_usage=True "
    r"done_without_generation_reads=0 requested_model=Gryphe/MythoMax-L2-13b served_model=Gryphe/MythoMax-L2-13b "
    r"retry_after=none first_read_wait_time=none first_read_eligible_worker_threads=none$"
)


def test_finished_request_log_line(front, client, start_worker, caplog):
    start_worker()
    caplog.set_level("INFO", logger="oai.requests")
    completion = client.chat.completions.create(model=MODEL, messages=USER)
    records = [r for r in caplog.records if r.name == "oai.requests"]
    assert len(records) == 1
    record = records[0]
    assert LINE.match(record.getMessage()), record.getMessage()
    assert completion.id == f"chatcmpl-{record.request_id}"
    assert record.status_code == 200 and record.code == "ok" and record.served_model == MODEL
    assert record.streamed is False and record.estimated_usage is True


def test_the_finished_line_is_an_opentelemetry_log_record_with_its_fields(front, client, start_worker):
    """configure_telemetry's bridge: the line goes to OpenTelemetry logs with the record's extra as
    attributes, which a log backend can query (status_code, code, served_model, x_request_id...)."""
    import logging

    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor

    from oai.telemetry import bridge_request_log

    exporter = InMemoryLogRecordExporter()
    provider = LoggerProvider()
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    request_log = logging.getLogger("oai.requests")
    level = request_log.level
    request_log.setLevel(logging.INFO)
    bridge_request_log(provider)
    bridge_request_log(provider)  # once per process
    try:
        start_worker()
        completion = client.chat.completions.create(model=MODEL, messages=USER)
    finally:
        bridged = [h for h in request_log.handlers if isinstance(h, LoggingHandler)]
        for handler in bridged:
            request_log.removeHandler(handler)
        request_log.setLevel(level)
    assert len(bridged) == 1
    (exported,) = exporter.get_finished_logs()
    record = exported.log_record
    assert LINE.match(str(record.body)), record.body
    assert record.attributes["request_id"] == completion.id.removeprefix("chatcmpl-")
    assert record.attributes["x_request_id"] == completion._request_id  # ADR 0128
    assert record.attributes["status_code"] == 200 and record.attributes["code"] == "ok"
    assert record.attributes["served_model"] == MODEL and record.attributes["streamed"] is False


def test_queue_unavailable_line_and_unsubmitted_line(front, client, start_worker, caplog):
    start_worker()
    caplog.set_level("INFO", logger="oai.requests")
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            extra_body={"horde": {"trusted_workers": True, "availability_mode": "fail_fast"}},
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, extra_body={"horde": {"max_kudos": 1}})
    lines = [r.getMessage() for r in caplog.records if r.name == "oai.requests"]
    assert " status=503 code=queue_unavailable " in lines[0] and " retry_after=30 " in lines[0]
    assert " queue_reason=no_eligible_threads wait_time=" in lines[0]
    assert "eligible_worker_threads=0 first_read_wait_time=" in lines[0]
    assert lines[1].startswith("Unsubmitted chat request finished: streamed=False submitted_at=none")
    assert " status=400 code=max_kudos_exceeded " in lines[1]


# --- the standalone front --------------------------------------------------------------------------


def test_python_m_oai_serves_the_front_alone(front, client, start_worker, live_horde, requester):
    start_worker()
    port = free_port()
    env = {
        **os.environ,
        "HORDE_OAI_NATIVE_ROOTS": f"{live_horde.url}/api/v2",
        "HORDE_OAI_PORT": str(port),
        "HORDE_OAI_POLL_SECONDS": "0.1",
        "HORDE_OAI_SIGNAL_RECHECK_SECONDS": "0.5",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "oai"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: _healthy(base), 20), (
            process.stderr.read1().decode() if process.poll() else "no answer"
        )
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=requester.key, max_retries=0)
        assert [m.id for m in sdk.models.list()] == [MODEL]
        assert sdk.chat.completions.create(model=MODEL, messages=USER).choices[0].message.content
        chunks = list(sdk.chat.completions.create(model=MODEL, messages=USER, stream=True))
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert httpx.get(f"{base}/v1/openapi.json").status_code == 200
        sdk.close()
    finally:
        process.terminate()
        process.wait(10)


def test_python_m_oai_logs_in_utc_as_the_horde_does():
    # Django sets the process's TZ from TIME_ZONE, whose default is America/Chicago: the standalone
    # front's log lines were six hours off the horde's (UTC) in the same log collector.
    env = {**os.environ, "HORDE_OAI_NATIVE_ROOTS": f"http://127.0.0.1:{free_port()}/api/v2",
           "HORDE_OAI_PORT": str(free_port())}
    for name in ("DJANGO_SETTINGS_MODULE", "TZ"):
        env.pop(name, None)
    process = subprocess.Popen(
        [sys.executable, "-m", "oai"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline().decode()
        logged = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=datetime.UTC)
    finally:
        process.terminate()
        process.wait(10)
    assert abs((datetime.datetime.now(datetime.UTC) - logged).total_seconds()) < 60, line


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1).json() == {"status": "ok"}
    except (httpx.HTTPError, ValueError):
        return False


def test_front_at_capacity_names_the_cap_reached():
    from oai.admission import InflightLimiter, front_at_capacity

    limiter = InflightLimiter(max_total=3, max_per_source=2)
    assert limiter.acquire("a") and limiter.acquire("a") and limiter.acquire("b")
    assert limiter.acquire("a") is None and limiter.acquire("c") is None
    assert "from your address" in front_at_capacity(limiter, "a").message
    assert front_at_capacity(limiter, "c").message == (
        "This AI Horde front is at its in-flight request limit; try again shortly."
    )


def test_a_workers_first_measured_speed_does_not_leave_it_refused_its_own_long_request(front, requester, start_worker):
    """A fresh worker's first reply measures its speed; the process's copies of it (the online
    workers the status reads, the row its pop reads) still hold it unmeasured for a few seconds, at a
    capacity of 1,200 tokens. A request for 2,048 right after was 503 no_eligible_worker: the capable
    worker the rule found online was that worker itself."""
    start_worker()  # its chat limits admit 2,048 tokens
    auth = {"Authorization": f"Bearer {requester.key}"}
    for max_tokens in (50, 2048):
        answer = httpx.post(
            f"{front.live.v1}/chat/completions",
            json={"model": MODEL, "messages": USER, "max_tokens": max_tokens},
            headers=auth,
            timeout=30,
        )
        assert answer.status_code == 200, (max_tokens, answer.text)
