"""A live horde for the OpenAI front's tests: daphne serving hordesite.asgi:application (the native
API and the mounted /v1/ front, through the Channels router) in a thread of the test process, on a
free port, against the test database; and a test worker that pops chat jobs over HTTP and submits
scripted replies.

Why a thread of the test process: pytest-django's test database (test_<name>[_gwN], or on SQLite
a file, tests/conftest.py) is configured in this process, so the server thread's connections reach
it with nothing to pass along; the tests use `transactional_db` so what they write is committed and
visible to the server, and what the server writes is flushed after each test. Twisted's reactor
runs once per process, so the server is session-scoped; the front's state (its settings, metrics
meter) is rebuilt per test on the server's event loop.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis
from django.conf import settings as django_settings

from oai.settings import FrontSettings
from tests.ports import free_port

MODEL = "Gryphe/MythoMax-L2-13b"
OTHER_MODEL = "koboldcpp/Marx-3B-V3"
# A Responses API stream's events for one output text, between its start and its end.
TEXT_OUTPUT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
ALL_DECLARATIONS = [
    "seed",
    "reasoning_effort",
    "presence_penalty",
    "frequency_penalty",
    "vision",
    "tools",
    "json_object",
    "json_schema",
    "tools_with_response_format",
    "tool_choice_enforced",
    "single_tool_call_enforced",
    "structured_output_enforced",
    "prompt_overflow_refused",
]


def wait_for(predicate, timeout: float = 5.0):
    """The predicate's first truthy value within `timeout` seconds (polled), else its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    return predicate()


@dataclass
class LiveHorde:
    port: int
    loop: asyncio.AbstractEventLoop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def run(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="session")
def live_horde(django_db_setup, django_db_blocker) -> LiveHorde:
    import daphne.server  # noqa: F401  (installs the asyncio reactor first)
    from twisted.internet import reactor

    from hordesite.asgi import application
    from hordesite.web_server import HordeServer

    port = free_port()
    server = HordeServer(
        application=application,
        endpoints=[f"tcp:port={port}:interface=127.0.0.1"],
        signal_handlers=False,
        http_timeout=None,
    )
    thread = threading.Thread(target=server.run, name="live-daphne", daemon=True)
    with django_db_blocker.unblock():
        thread.start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        loop = reactor._asyncioEventloop
        yield LiveHorde(port=port, loop=loop)
        reactor.callFromThread(reactor.stop)
        thread.join(5)


def front_settings(live: LiveHorde, **overrides: Any) -> FrontSettings:
    base = dict(
        native_roots=[f"{live.url}/api/v2"],
        # The default when mounted (hordesite.asgi, which the live server serves): native calls in process.
        native_in_process=True,
        redis_url=django_settings.REDIS_URL,
        poll_seconds=0.1,
        signal_recheck_seconds=0.5,
        keepalive_seconds=0.5,
        fail_fast_grace_seconds=1.0,
        nonstream_timeout_seconds=20.0,
        stream_timeout_seconds=20.0,
        cancel_timeout_seconds=1.5,
        cancel_retry_seconds=0.5,
    )
    base.update(overrides)
    return FrontSettings(**base)


@dataclass
class Front:
    live: LiveHorde
    reader: Any
    provider: Any

    def configure(self, **overrides: Any) -> FrontSettings:
        """A new front state with these settings, and a new meter (the gauges read the new state)."""
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        from oai.metrics import histogram_views
        from oai.state import configure_front, current_states, get_front_state

        # As load_settings: with native roots given, the front calls them over HTTP.
        if "native_roots" in overrides:
            overrides.setdefault("native_in_process", False)
        settings = front_settings(self.live, **overrides)
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader], views=histogram_views())

        async def reset() -> None:
            for state in current_states():
                await state.shutdown()
            configure_front(meter=self.provider.get_meter("test"), settings=settings)
            await get_front_state()

        self.live.run(reset())
        return settings

    def state(self) -> Any:
        from oai.state import get_front_state

        return self.live.run(get_front_state())

    def metrics(self) -> dict[str, list[tuple[dict, Any]]]:
        """name -> [(attributes, value)] from the in-memory reader."""
        data = self.reader.get_metrics_data()
        out: dict[str, list[tuple[dict, Any]]] = {}
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        value = getattr(point, "value", None)
                        if value is None:
                            value = (point.count, point.sum)
                        out.setdefault(metric.name, []).append((dict(point.attributes), value))
        return out


def _restore_anonymous_user() -> None:
    """The anonymous user comes from a data migration, which transactional_db's flush removes."""
    import hashlib

    from accounts.models import HordeUser

    HordeUser.objects.get_or_create(
        api_key_hash=hashlib.sha256(b"0000000000").hexdigest(),
        defaults={"username": "Anonymous", "is_anonymous": True, "concurrency": 30},
    )


@pytest.fixture
def front(live_horde, transactional_db) -> Front:
    _restore_anonymous_user()
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from oai.metrics import histogram_views

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=histogram_views())
    f = Front(live=live_horde, reader=reader, provider=provider)
    f.configure()
    yield f
    # FrontState.shutdown bounds each of its steps; this only guards against a hung event loop.
    f.live.run(_shutdown_states(), timeout=60)


async def _shutdown_states() -> None:
    from oai.state import configure_front, current_states

    for state in current_states():
        await state.shutdown()
    configure_front()


def responses_sse(answer: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a /v1/responses stream as they arrive, each data checked to
    be named by its type (openai-node's and the Vercel SDK's parsers read the name)."""
    name = None
    for line in answer.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
            assert data["type"] == name, (name, data)
            yield name, data


# --- the test worker --------------------------------------------------------------------------------


Reply = Callable[[dict[str, Any]], dict[str, Any] | None]


def text_reply(text: str = "Hello from the horde.", **extra: Any) -> Reply:
    def reply(job: dict[str, Any]) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": "stop", **extra}

    return reply


@dataclass
class HordeTestWorker:
    live: LiveHorde
    key: str
    model: str = MODEL
    features: list[str] = field(default_factory=lambda: list(ALL_DECLARATIONS))
    image_transports: list[str] = field(default_factory=list)
    max_length: int = 2048
    max_context_length: int = 8192
    reply: Reply = field(default_factory=text_reply)
    delay: float = 0.0
    name: str = field(default_factory=lambda: f"oai-test-worker-{uuid.uuid4().hex[:6]}")
    jobs: list[dict[str, Any]] = field(default_factory=list)
    submits: list[httpx.Response] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    paused: threading.Event = field(default_factory=threading.Event)

    def pop_body(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "models": [self.model],
            "max_length": 512,
            "max_context_length": 4096,
            "bridge_agent": "oai-test-worker:1:https://example.org",
            "chat_jobs": True,
            "prompt_jobs": False,
            "chat_features": self.features,
            "chat_limits": {"max_context_length": self.max_context_length, "max_length": self.max_length},
            "model_id": self.model,
            "image_transports": self.image_transports,
        }

    def check_in(self) -> dict[str, Any]:
        response = httpx.post(
            f"{self.live.url}/api/v2/generate/text/pop",
            json=self.pop_body(),
            headers={"apikey": self.key},
            timeout=10,
        )
        assert response.status_code == 200, response.text
        return response.json()

    def start(self) -> HordeTestWorker:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(
            base_url=f"{self.live.url}/api/v2", headers={"apikey": self.key}, timeout=10
        ) as client:
            while not self._stop.is_set():
                if self.paused.is_set():
                    time.sleep(0.02)
                    continue
                try:
                    response = client.post("/generate/text/pop", json=self.pop_body())
                except httpx.HTTPError:
                    time.sleep(0.05)
                    continue
                job = response.json() if response.status_code == 200 else {}
                if not job.get("id"):
                    time.sleep(0.03)
                    continue
                self.jobs.append(job)
                if self.delay:
                    time.sleep(self.delay)
                body = self.reply(job)
                if body is None:
                    continue  # the job is left to lapse
                body = {"id": job["id"], "model_id": self.model, **body}
                answer = client.post("/generate/text/submit", json=body)
                self.submits.append(answer)
                if answer.status_code == 400:  # as the reference worker: a refused reply faults the job
                    client.post(
                        "/generate/text/submit",
                        json={
                            "id": job["id"],
                            "state": "faulted",
                            "model_id": self.model,
                            "fault_reason": "reply_refused",
                        },
                    )


@pytest.fixture
def worker_owner(make_user):
    return make_user(f"owner-{uuid.uuid4().hex[:6]}")


@pytest.fixture
def requester(make_user):
    return make_user(f"requester-{uuid.uuid4().hex[:6]}", kudos=100_000)


@pytest.fixture
def start_worker(live_horde, worker_owner):
    workers: list[HordeTestWorker] = []

    def start(**kwargs: Any) -> HordeTestWorker:
        worker = HordeTestWorker(live=live_horde, key=worker_owner.key, **kwargs)
        worker.check_in()
        workers.append(worker.start())
        return worker

    yield start
    for worker in workers:
        worker.stop()


@pytest.fixture
def client(front, requester):
    """The real OpenAI SDK against the live front, with the SDK's own retries off."""
    import openai

    sdk = openai.OpenAI(base_url=front.live.v1, api_key=requester.key, max_retries=0, timeout=30)
    yield sdk
    sdk.close()


# --- a text worker, as the AI-Horde-Worker "scribe" runs one ----------------------------------------

SCRIBE_BRIDGE_AGENT = "AI Horde Worker~unknown~kai:24:https://github.com/db0/AI-Horde-Worker"


@dataclass
class ScribeTextWorker:
    """Pops text jobs with the scribe's body (only the apikey header) and submits
    `{id, generation, seed: 0}`, as AI-Horde-Worker v24 does."""

    live: LiveHorde
    key: str
    model: str = MODEL
    max_length: int = 512
    max_context_length: int = 4096
    generation: Callable[[dict[str, Any]], str] = field(
        default_factory=lambda: lambda job: " there was a horde."
    )
    name: str = field(default_factory=lambda: f"scribe-{uuid.uuid4().hex[:6]}")
    bridge_agent: str = SCRIBE_BRIDGE_AGENT
    jobs: list[dict[str, Any]] = field(default_factory=list)
    submits: list[httpx.Response] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def pop_body(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "models": [self.model],
            "max_length": self.max_length,
            "max_context_length": self.max_context_length,
            "priority_usernames": [],
            "softprompts": [],
            "bridge_agent": self.bridge_agent,
            "threads": 1,
        }

    def check_in(self) -> None:
        response = httpx.post(
            f"{self.live.url}/api/v2/generate/text/pop",
            json=self.pop_body(),
            headers={"apikey": self.key},
            timeout=10,
        )
        assert response.status_code == 200, response.text

    def start(self) -> ScribeTextWorker:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(
            base_url=f"{self.live.url}/api/v2", headers={"apikey": self.key}, timeout=40
        ) as client:
            while not self._stop.is_set():
                try:
                    response = client.post("/generate/text/pop", json=self.pop_body())
                except httpx.HTTPError:
                    time.sleep(0.05)
                    continue
                job = response.json() if response.status_code == 200 else {}
                if not job.get("id"):
                    time.sleep(0.03)
                    continue
                self.jobs.append(job)
                body = {"id": job["id"], "generation": self.generation(job), "seed": 0}
                self.submits.append(client.post("/generate/text/submit", json=body))


@pytest.fixture
def workers():
    """Test workers a test starts itself, stopped at its end."""
    started: list[HordeTestWorker] = []
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture
def start_text_worker(live_horde, worker_owner):
    workers: list[ScribeTextWorker] = []

    def start(**kwargs: Any) -> ScribeTextWorker:
        worker = ScribeTextWorker(live=live_horde, **{"key": worker_owner.key, **kwargs})
        worker.check_in()
        workers.append(worker.start())
        return worker

    yield start
    for worker in workers:
        worker.stop()


@pytest.fixture
def streaming_worker(live_horde, worker_owner):
    """A chat worker checked in on the live horde that posts progress as the test scripts it."""
    from tests.oai.test_relay import StreamingWorker

    worker = StreamingWorker(live_horde, worker_owner.key)
    worker.shape.check_in()
    yield worker
    worker.close()


@pytest.fixture
def own_redis():
    """A redis-server of this test on a free loopback port (a test may stop it with SIGSTOP); resumed
    and stopped at the end."""
    server = shutil.which("redis-server")
    assert server, "redis-server is not installed"
    port = free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/1"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url, socket_timeout=0.2).ping()
            break
        except redis.RedisError:
            assert time.monotonic() < deadline, "own redis-server did not start"
            time.sleep(0.05)
    try:
        yield process, url
    finally:
        process.send_signal(signal.SIGCONT)  # a no-op once the test has stopped it for good
        process.terminate()
        process.wait(10)
