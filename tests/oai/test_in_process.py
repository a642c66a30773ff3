"""Native calls in process (docs/adr/0008-oai-native-calls-in-process.md): mounted in the horde's web
process, the front hands each native call to that process's application instead of sending it over
TCP; the settings choose it, the call keeps the HTTP call's outcomes (answer, refusal, lost answer,
no slot), and HORDE_OAI_NATIVE_ROOTS still sends the calls over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from oai import horde_client
from oai.horde_client import HordeClient, NativeUnreachable, SubmitAnswerLost
from oai.metrics import FrontMetrics
from oai.settings import FrontSettings, load_settings
from tests.oai.conftest import MODEL
from tests.ports import free_port

USER = [{"role": "user", "content": "Hello?"}]


# --- settings -------------------------------------------------------------------------------------


def test_in_process_is_the_default_without_native_roots():
    assert load_settings({}).native_in_process is True
    assert load_settings({"HORDE_OAI_NATIVE_ROOTS": ""}).native_in_process is True


def test_native_roots_send_the_calls_over_http():
    settings = load_settings({"HORDE_OAI_NATIVE_ROOTS": "http://horde-a:8000/api/v2"})
    assert settings.native_in_process is False
    assert settings.native_roots == ["http://horde-a:8000/api/v2"]


def test_the_in_process_setting_wins_both_ways():
    assert load_settings({"HORDE_OAI_NATIVE_IN_PROCESS": "false"}).native_in_process is False
    forced = load_settings(
        {"HORDE_OAI_NATIVE_ROOTS": "http://127.0.0.1:8000/api/v2", "HORDE_OAI_NATIVE_IN_PROCESS": "true"}
    )
    assert forced.native_in_process is True


# --- the in-process call, against a stand-in application -------------------------------------------


class _App:
    """A WSGI stand-in for the horde's native application: records each environ and answers."""

    def __init__(self, *, status: str = "202 Accepted", body: object = None, delay: float = 0.0):
        self.status = status
        self.body = {"id": "b7e7c1f4-0000-4000-8000-000000000000", "kudos": 12} if body is None else body
        self.delay = delay
        self.environs: list[dict] = []
        self.closed = 0
        self.threads: set[str] = set()

    def __call__(self, environ, start_response):
        self.environs.append({**environ, "body": environ["wsgi.input"].read()})
        self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        if isinstance(self.body, Exception):
            raise self.body
        start_response(self.status, [("Content-Type", "application/json"), ("Retry-After", "7")])
        app = self

        class Result(list):
            def close(self):
                app.closed += 1

        return Result([json.dumps(self.body).encode()])


@pytest.fixture
def mounted():
    import hordesite.asgi  # noqa: F401  (mounts the horde's application: restored after the test)

    previous = horde_client.mounted_native_app()

    def mount(app) -> HordeClient:
        horde_client.mount_native_app(app, root_path="/api/v2")
        settings = FrontSettings(
            native_roots=["http://horde.example:8123/api/v2"],
            native_in_process=True,
            native_timeout_seconds=0.5,
            native_max_connections=1,
        )
        return HordeClient(settings, FrontMetrics())

    yield mount
    horde_client.mount_native_app(previous)


def test_a_call_is_the_same_http_request_given_to_the_application(mounted):
    app = _App()
    client = mounted(app)
    assert client.in_process

    async def go():
        try:
            return await client.submit(
                {"model": MODEL, "x": "é"}, {"apikey": "k" * 22, "Client-Agent": "a:1:b"}
            )
        finally:
            await client.aclose()

    answer = asyncio.run(go())
    assert answer.status == 202 and answer.body["kudos"] == 12
    assert answer.headers["retry-after"] == "7"
    environ = app.environs[0]
    assert environ["REQUEST_METHOD"] == "POST"
    assert environ["PATH_INFO"] == "/api/v2/generate/chat/async"
    assert environ["HTTP_HOST"] == "horde.example:8123"
    assert environ["HTTP_APIKEY"] == "k" * 22 and environ["HTTP_CLIENT_AGENT"] == "a:1:b"
    assert environ["CONTENT_TYPE"] == "application/json"
    assert int(environ["CONTENT_LENGTH"]) == len(environ["body"])
    assert json.loads(environ["body"]) == {"model": MODEL, "x": "é"}
    assert environ["REMOTE_ADDR"] == "127.0.0.1"
    assert app.closed == 1  # the response is closed (Django's request_finished) as a WSGI server does
    assert all(name.startswith("oai-native") for name in app.threads)  # off the event loop


def test_a_query_string_and_a_get(mounted):
    app = _App(status="200 OK", body=[{"name": MODEL}])
    client = mounted(app)

    async def go():
        try:
            return await client.models()
        finally:
            await client.aclose()

    answer = asyncio.run(go())
    assert answer.ok and answer.body == [{"name": MODEL}]
    assert app.environs[0]["PATH_INFO"] == "/api/v2/status/models"
    assert app.environs[0]["QUERY_STRING"] == "type=text&chat=true"
    assert "CONTENT_LENGTH" not in app.environs[0]


def test_an_answer_that_does_not_come_in_time_is_a_lost_answer(mounted):
    client = mounted(_App(delay=1.0))

    async def go():
        try:
            await client.submit({"model": MODEL}, {})
        finally:
            await client.aclose()

    with pytest.raises(SubmitAnswerLost):
        asyncio.run(go())


def test_no_free_call_slot_is_unreachable(mounted):
    client = mounted(_App(delay=1.0))

    async def go():
        try:
            first = asyncio.ensure_future(client.submit({"model": MODEL}, {}))
            await asyncio.sleep(0.05)
            with pytest.raises(NativeUnreachable):
                await client.status("b7e7c1f4-0000-4000-8000-000000000000")  # the one slot is taken
            with pytest.raises(SubmitAnswerLost):
                await first
        finally:
            await client.aclose()

    asyncio.run(go())


def test_an_application_error_is_a_500(mounted):
    client = mounted(_App(body=RuntimeError("boom")))

    async def go():
        try:
            return await client.status("b7e7c1f4-0000-4000-8000-000000000000")
        finally:
            await client.aclose()

    answer = asyncio.run(go())
    assert answer.status == 500 and answer.body is None


def test_the_mounted_body_bound_is_the_native_routes(mounted):
    import io
    import sys

    from contract.chat_limits import MAX_CHAT_BODY_BYTES
    from hordesite.asgi import native_app

    started: list[str] = []
    environ = {
        "REQUEST_METHOD": "POST",
        "SCRIPT_NAME": "",
        "PATH_INFO": "/api/v2/generate/chat/async",
        "QUERY_STRING": "",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(MAX_CHAT_BODY_BYTES + 1),
        "wsgi.input": io.BytesIO(b"{}"),
        "wsgi.url_scheme": "http",
        "wsgi.errors": sys.stderr,
    }
    body = b"".join(native_app(environ, lambda status, headers, exc_info=None: started.append(status)))
    assert started == ["413 Request Entity Too Large"]
    assert json.loads(body) == {
        "message": f"The request body is over {MAX_CHAT_BODY_BYTES} bytes.",
        "rc": "RequestTooLarge",
    }


# --- against the live horde ------------------------------------------------------------------------


def test_mounted_front_serves_in_process_without_its_roots(front, client, start_worker):
    """The native root is a closed port: only the in-process call can reach the horde."""
    front.configure(native_roots=[f"http://127.0.0.1:{free_port()}/api/v2"], native_in_process=True)
    assert front.state().client.in_process
    start_worker()
    completion = client.chat.completions.create(model=MODEL, messages=USER)
    assert completion.choices[0].message.content
    calls = {attrs["horde.call_type"] for attrs, _ in front.metrics()["horde.oai.native.duration"]}
    assert {"submit", "status"} <= calls


def test_native_roots_call_the_horde_over_http(front, client, start_worker, live_horde):
    front.configure(native_roots=[f"{live_horde.url}/api/v2"])
    assert not front.state().client.in_process
    start_worker()
    assert client.chat.completions.create(model=MODEL, messages=USER).choices[0].message.content


def test_mounted_front_answer_is_compact_json_with_its_length(front, requester, start_worker, live_horde):
    """The front renders its answer itself (as DRF's JSONRenderer: compact UTF-8) with its length."""
    import httpx

    start_worker(
        reply=lambda job: {"message": {"role": "assistant", "content": "héllo"}, "finish_reason": "stop"}
    )
    response = httpx.post(
        f"{live_horde.url}/v1/chat/completions",
        json={"model": MODEL, "messages": USER},
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=30,
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["content-length"]) == len(response.content)
    assert response.headers["access-control-allow-origin"] == "*"
    assert '"content":"héllo"' in response.content.decode()


# --- the completion signal in process (docs/adr/0054) ---------------------------------------------


def test_the_completion_signal_in_process_wakes_only_the_requests_it_names_and_they_still_poll():
    from oai.waiter import ChatRequestWatcher, InProcessSignals, WaitBudget, WakeSource

    async def scenario() -> None:
        signals = InProcessSignals()
        listener = signals.listener()
        await listener.ensure_started()
        wake = await listener.register("r1")
        other = await listener.register("r2")
        gone = await listener.register("r3")
        await listener.unregister("r3", gone)
        watcher = ChatRequestWatcher(
            wake=wake, budget=WaitBudget(time.monotonic(), 60), recheck_seconds=5.0, poll_seconds=0.2, disconnected=None
        )
        # Nothing published: the wait is the poll's (0.2 s), as without a listener, not the re-check's.
        started = time.monotonic()
        assert await watcher.next_wake() == WakeSource.POLL
        assert 0.15 < time.monotonic() - started < 5.0
        # The horde's submit publishes from one of its serving threads. Watched with a poll far off,
        # so that only the signal can end the wait whenever a loaded box starts the thread.
        patient = ChatRequestWatcher(
            wake=wake, budget=WaitBudget(time.monotonic(), 60), recheck_seconds=60.0, poll_seconds=30.0, disconnected=None
        )
        published = threading.Thread(
            target=signals.publish, args=({"id": "r1", "event": "cancelled", "generations": 0},)
        )
        started = time.monotonic()
        asyncio.get_running_loop().call_later(0.05, published.start)
        assert await patient.next_wake() == WakeSource.SIGNAL
        assert time.monotonic() - started < 15.0
        assert wake.cancelled_signal and wake.last_message["event"] == "cancelled"
        assert not other.event.is_set() and not gone.event.is_set()
        signals.publish({"id": "unknown", "event": "finished", "generations": 1})  # no one waits on it
        await asyncio.sleep(0.05)
        assert not other.event.is_set()
        published.join()

    asyncio.run(scenario())
