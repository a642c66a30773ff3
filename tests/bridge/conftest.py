"""Fixtures for the reference worker's tests: a live horde (pytest-django's live_server, a WSGI
server in a thread on the test database), a fake llama.cpp server, and a bridge run in a thread.

live_server serves the native API's plain sync DRF views as daphne would; the bridge talks to it
over HTTP exactly as it talks to a deployed horde.
"""

from __future__ import annotations

import io
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.bridge.fake_backend import FakeLlamaCpp
from workers.bridge.backends import Backend, OpenAIBackend
from workers.bridge.config import BridgeConfig
from workers.bridge.worker import Bridge

MODEL = "bridge-test/qwen3-8b"


class LogBuffer(io.StringIO):
    """The bridge's output, readable while it runs."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            return super().write(text)

    def text(self) -> str:
        with self._lock:
            return self.getvalue()


@pytest.fixture
def fake_backend() -> Iterator[FakeLlamaCpp]:
    fake = FakeLlamaCpp()
    fake.start()
    yield fake
    fake.stop()


class LiveHorde:
    """The test's requester side, over HTTP against the live server."""

    def __init__(self, url: str, worker_key: str, requester_key: str):
        self.url = url
        self.worker_key = worker_key
        self.requester_key = requester_key
        self.client = httpx.Client(base_url=f"{url}/api/v2/", timeout=30)

    def chat(self, **body: Any) -> str:
        body.setdefault("model", MODEL)
        body.setdefault("messages", [{"role": "user", "content": "What is the weather in Paris?"}])
        body.setdefault("max_tokens", 64)
        response = self.client.post("generate/chat/async", json=body, headers={"apikey": self.requester_key})
        assert response.status_code == 202, response.text
        return response.json()["id"]

    def text(self, **body: Any) -> str:
        body.setdefault("models", [MODEL])
        body.setdefault("prompt", "Once upon a time")
        response = self.client.post("generate/text/async", json=body, headers={"apikey": self.requester_key})
        assert response.status_code == 202, response.text
        return response.json()["id"]

    def chat_status(self, request_id: str) -> dict[str, Any]:
        response = self.client.get(f"generate/chat/status/{request_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def text_status(self, request_id: str) -> dict[str, Any]:
        response = self.client.get(f"generate/text/status/{request_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def wait(self, request_id: str, *, chat: bool = True, timeout: float = 20.0, until=None) -> dict[str, Any]:
        until = until or (lambda s: s["done"] or s["faulted"])
        deadline = time.monotonic() + timeout
        while True:
            status = self.chat_status(request_id) if chat else self.text_status(request_id)
            if until(status):
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"request {request_id} not settled in {timeout} s: {status}")
            time.sleep(0.1)


@pytest.fixture
def live_horde(live_server, transactional_db, make_user) -> Iterator[LiveHorde]:
    worker = make_user(f"bridge-owner-{uuid.uuid4().hex[:4]}", trusted=True)
    requester = make_user(f"requester-{uuid.uuid4().hex[:4]}", kudos=10000)
    horde = LiveHorde(live_server.url, worker.key, requester.key)
    yield horde
    horde.client.close()


def bridge_config(horde: LiveHorde, backend: str, **overrides: Any) -> BridgeConfig:
    values: dict[str, Any] = {
        "horde_url": horde.url,
        "api_key": horde.worker_key,
        "worker_name": f"bridge-{uuid.uuid4().hex[:8]}",
        "backend": backend,
        "horde_model": MODEL,
        "pop_interval": 0.1,
        "stop_grace": 5.0,
        "lease_margin": 1.0,
        "backend_timeout": 30.0,
    }
    values.update(overrides)
    return BridgeConfig(**values)


@contextmanager
def running_bridge(
    horde: LiveHorde, backend: Backend | str, **overrides: Any
) -> Iterator[tuple[Bridge, LogBuffer]]:
    """A bridge serving in a thread until the block ends; waits for its first pop first."""
    if isinstance(backend, str):
        backend = OpenAIBackend(backend, timeout=30.0)
    config = bridge_config(horde, backend.name if hasattr(backend, "name") else "x", **overrides)
    out = LogBuffer()
    bridge = Bridge(config, backend, out=out)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(bridge.run(install_signals=False)), daemon=True)
    thread.start()
    if not bridge.ready.wait(15):
        bridge.request_stop(immediately=True)
        raise AssertionError(f"the bridge never popped:\n{out.text()}")
    try:
        yield bridge, out
    finally:
        bridge.request_stop()
        thread.join(20)
        assert not thread.is_alive(), out.text()
