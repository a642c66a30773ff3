"""The OpenAI front's text requests served by koboldcpp 1.76's embedded horde worker, which pops and
submits with Python's urllib exactly as koboldcpp.py's make_url_request does (the same headers,
json.dumps bodies, Connection: close). What it received and what the clients got are the ones
seen in the run of docs/adr/0113-koboldcpp-embedded-worker.md.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.oai.conftest import LiveHorde

pytestmark = pytest.mark.slow

MODEL = "koboldcpp/tiny"
BRIDGE_AGENT = "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"
GENERATION = ")yKG7yc@u there*\x0cҐQpX[)"


def kcpp_request(url: str, data: dict[str, Any], key: str) -> dict[str, Any] | None:
    """koboldcpp.py's make_url_request for a POST: its headers, its body, None on any error."""
    headers = {"apikey": key, "User-Agent": "KoboldCppEmbeddedWorkerV2", "Client-Agent": "KoboldCppEmbedWorker:2"}
    request = urllib.request.Request(url, data=json.dumps(data).encode("utf-8"), headers=headers, method="POST")
    request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read().decode("utf-8", "ignore"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


@dataclass
class KoboldCppWorker:
    """run_horde_worker's loop, its own generate replaced by a fixed reply (`--hordegenlen 120
    --hordemaxctx 1024`)."""

    live: LiveHorde
    key: str
    jobs: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def pop(self) -> dict[str, Any] | None:
        body = {
            "name": "kcpp-tiny", "models": [MODEL], "max_length": 120, "max_context_length": 1024,
            "priority_usernames": [], "softprompts": [], "bridge_agent": BRIDGE_AGENT,
        }
        return kcpp_request(f"{self.live.url}/api/v2/generate/text/pop", body, self.key)

    def start(self) -> KoboldCppWorker:
        assert self.pop() is not None  # checked in before the first request
        self._thread = threading.Thread(target=self._run, name="kcpp-tiny", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            pop = self.pop()
            if not pop or not pop["id"]:
                time.sleep(0.05)
                continue
            self.jobs.append(pop)
            submit = {"id": pop["id"], "generation": GENERATION, "state": "ok"}
            reply = kcpp_request(f"{self.live.url}/api/v2/generate/text/submit", submit, self.key)
            if reply:
                self.rewards.append(reply["reward"])


@pytest.fixture
def kcpp(live_horde, make_user):
    worker = KoboldCppWorker(live=live_horde, key=make_user("kcpp-owner", trusted=True).key).start()
    yield worker
    worker.stop()


def post(front, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{front.live.v1}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=40)


def test_a_legacy_completion_reaches_it_as_a_text_job(front, requester, kcpp):
    """Seen: the payload it got was {prompt, n, max_length, max_context_length} (no samplers: it
    uses its own defaults); the front's context is the prompt's estimate plus max_tokens, at least 80."""
    answer = post(front, requester.key, "/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == GENERATION
    assert answer.json()["choices"][0]["finish_reason"] == "stop"  # a text worker reports none
    [job] = kcpp.jobs
    assert job["payload"] == {"prompt": "Once upon a time", "n": 1, "max_length": 30, "max_context_length": 80}
    # The reply reaches the client on the completion signal, which can beat the submit's answer
    # to the worker's thread.
    deadline = time.monotonic() + 10
    while not kcpp.rewards and time.monotonic() < deadline:
        time.sleep(0.02)
    assert job["model"] == MODEL and kcpp.rewards and kcpp.rewards[0] > 0


def test_max_tokens_past_its_max_length_is_lowered_to_it(front, requester, kcpp):
    answer = post(front, requester.key, "/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300})
    assert answer.status_code == 200, answer.text
    assert answer.json()["x_horde"]["context_adjustments"] == [
        {"from": 300, "to": 120, "reason": "worker_max_length"}
    ]
    assert kcpp.jobs[0]["payload"]["max_length"] == 120


def test_a_chat_completion_is_not_for_it(front, requester, kcpp):
    """It declares no chat jobs, so it never sees a chat request (chat_requests.md), and a model
    only it serves is unknown to the chat route."""
    answer = post(
        front, requester.key, "/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 30},
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "model_not_found" and answer.json()["error"]["param"] == "model"
    assert kcpp.jobs == []
