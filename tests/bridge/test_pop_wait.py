"""The bridge's pop wait against hordes that do not know the key (ADR 0024): one that ignores it
(upstream: unknown keys are dropped) is polled about once a pop_interval, not in a tight loop; one
that refuses it (a strict schema) is popped without it from then on. The hordes are small local
HTTP servers answering find_user and pop as such a horde would."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from tests.http_fakes import QuietHandler, close_server, serve
from workers.bridge.config import BridgeConfig, ConfigError, load_config
from workers.bridge.scripted import ScriptedBackend
from workers.bridge.worker import Bridge

EMPTY_POP = {
    "payload": {},
    "id": None,
    "ids": [],
    "messages": None,
    "ttl": None,
    "extra_source_images": [],
    "skipped": {},
    "softprompt": None,
    "model": None,
}


class OtherHorde:
    """Answers every pop empty at once; `strict` refuses a body with a key it does not know. The
    first `garbled` answers to find_user and to pop are 200 with an HTML page, as a proxy or a
    load balancer in front of a horde may answer while it restarts."""

    def __init__(self, *, strict: bool, garbled: int = 0):
        self.strict = strict
        self.garbled = {"GET": garbled, "POST": garbled}
        self.pops: list[tuple[float, dict[str, Any]]] = []
        self.user_reads = 0
        horde = self

        class Handler(QuietHandler):
            def _garbled(self, method: str) -> bool:
                if not horde.garbled[method]:
                    return False
                horde.garbled[method] -= 1
                self.send_body(200, b"<html><body>Please wait</body></html>", "text/html")
                return True

            def do_GET(self):  # noqa: N802
                horde.user_reads += 1
                if not self._garbled("GET"):
                    self.send_json(200, {"username": "other#1", "id": 1})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                horde.pops.append((time.monotonic(), body))
                if self._garbled("POST"):
                    return
                if horde.strict and "wait" in body:
                    self.send_json(
                        400,
                        {"errors": {"wait": "Additional properties are not allowed"}, "message": "Input payload validation failed"},
                    )
                else:
                    self.send_json(200, EMPTY_POP)

        self.server = serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        close_server(self.server)


def run_for(horde: OtherHorde, seconds: float, **overrides: Any) -> Bridge:
    values: dict[str, Any] = {
        "horde_url": horde.url,
        "api_key": "k" * 22,
        "worker_name": "pop-wait-bridge",
        "backend": "scripted",
        "pop_interval": 0.5,
        "pop_wait": 10,
    }
    values.update(overrides)
    bridge = Bridge(BridgeConfig(**values), ScriptedBackend(), out=open("/dev/null", "w"))  # noqa: SIM115
    thread = threading.Thread(target=lambda: bridge.run(install_signals=False), daemon=True)
    thread.start()
    time.sleep(seconds)
    bridge.request_stop()
    thread.join(10)
    assert not thread.is_alive()
    return bridge


@pytest.fixture
def ignoring():
    horde = OtherHorde(strict=False)
    yield horde
    horde.close()


@pytest.fixture
def strict():
    horde = OtherHorde(strict=True)
    yield horde
    horde.close()


def test_a_horde_that_ignores_the_wait_is_polled_once_a_pop_interval(ignoring):
    run_for(ignoring, 2.2)
    times = [at for at, _ in ignoring.pops]
    # The check-in, at once the first pop asking to wait, then 0.5 s apart: not a tight loop, and
    # still polling (a loaded box may start the bridge late, so the floor is loose).
    assert 3 <= len(times) <= 7, times
    assert all(b - a >= 0.45 for a, b in zip(times[1:], times[2:], strict=False))
    bodies = [body for _, body in ignoring.pops]
    assert "wait" not in bodies[0]  # the first pop checks in
    assert all(body["wait"] == 10 for body in bodies[1:])


def test_a_horde_that_refuses_the_wait_is_popped_without_it(strict):
    bridge = run_for(strict, 1.8)
    bodies = [body for _, body in strict.pops]
    assert ["wait" in body for body in bodies[:3]] == [False, True, False]
    assert all("wait" not in body for body in bodies[2:])
    assert bridge.pop_wait == 0 and bridge.fatal is None


def test_an_answer_that_is_not_a_json_object_is_retried_as_an_unavailable_horde():
    """A 200 whose body is not a JSON object (a proxy's page) neither ends the start nor the
    thread that popped: both are retried as when the horde cannot be reached."""
    horde = OtherHorde(strict=False, garbled=1)
    try:
        bridge = run_for(horde, 3.5)
    finally:
        horde.close()
    assert horde.user_reads == 2  # the page, then the user
    assert len(horde.pops) >= 2, horde.pops  # the page, then popping again after the backoff
    assert bridge.fatal is None


def test_pop_wait_setting():
    assert load_config(["--api-key", "k"], environ={}).pop_wait == 10
    assert load_config(["--api-key", "k"], environ={"BRIDGE_POP_WAIT": "0"}).pop_wait == 0
    assert load_config(["--api-key", "k", "--pop-wait", "20"], environ={}).pop_wait == 20
    with pytest.raises(ConfigError, match="--pop-wait is 0 to 20"):
        load_config(["--api-key", "k", "--pop-wait", "21"], environ={})
