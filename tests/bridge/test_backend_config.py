"""A backend that cannot serve (ADR 0131). Configured wrong, met at start: a `--model` the backend
does not serve, a key it refuses, an address that answers no model list; the bridge says what is
wrong before it pops, instead of taking jobs and faulting every one of them. Failing job after job
while it runs: the bridge pauses its pops, so the requests are not faulted at the pace of its pops."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from chat.models import Generation
from contract.chat_declaration import CHAT_WORKER_FAULT_MESSAGES, ChatFaultReason
from tests.bridge.conftest import LiveHorde, LogBuffer, bridge_config, running_bridge
from tests.bridge.fake_backend import (
    DEFAULT_REPLY,
    LLAMA_CONTEXT_OVERFLOW,
    LLAMA_SERVER_ERROR,
    FakeLlamaCpp,
    RouteServer,
)
from tests.bridge.test_ollama import ollama
from workers.bridge.backends import BackendDown, BackendError, BackendRefused, OpenAIBackend
from workers.bridge.scripted import ScriptedBackend
from workers.bridge.worker import Bridge
from workers.models import Worker

VLLM_MODELS = {"object": "list", "data": [{"id": "Qwen/Qwen3-8B", "object": "model", "owned_by": "vllm",
                                           "max_model_len": 40960}]}
# vLLM started with --api-key: every /v1 route answers this without the bearer key.
VLLM_UNAUTHORIZED = (401, {"error": "Unauthorized"})


@contextmanager
def route_server(routes) -> Iterator[str]:
    server = RouteServer(routes)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


def _until(condition, out: LogBuffer, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, out.text()
        time.sleep(0.05)


@contextmanager
def started_bridge(horde: LiveHorde, backend_url: str, **overrides) -> Iterator[tuple[Bridge, LogBuffer, list[int]]]:
    """A bridge run in a thread (not waited for its first pop: these never get there)."""
    out = LogBuffer()
    bridge = Bridge(bridge_config(horde, backend_url, **overrides), OpenAIBackend(backend_url, timeout=10), out=out)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(bridge.run(install_signals=False)), daemon=True)
    thread.start()
    try:
        yield bridge, out, result
    finally:
        bridge.request_stop(immediately=True)
        thread.join(20)
        assert not thread.is_alive(), out.text()


# --- a model the backend does not serve ------------------------------------------------------------


def test_a_model_ollama_has_not_pulled_is_refused_naming_the_ones_it_has():
    with ollama(model="qwen3:8b") as fake:
        backend = OpenAIBackend(fake.url, timeout=10)
        with pytest.raises(BackendError) as refused:
            backend.probe("qwen3:14b")
        assert "'qwen3:14b'" in str(refused.value) and "qwen3:8b" in str(refused.value)
        assert "--model" in str(refused.value)
        assert backend.probe("qwen3:8b").model == "qwen3:8b"


def test_a_model_named_without_the_tag_ollama_reads_is_served():
    with ollama(model="qwen3:latest") as fake:
        assert OpenAIBackend(fake.url, timeout=10).probe("qwen3").model == "qwen3"


def test_a_model_vllm_does_not_serve_is_refused():
    # vLLM answers a request naming another model 404 "The model `qwen3-8b` does not exist."
    with route_server({("GET", "/v1/models"): VLLM_MODELS}) as url, pytest.raises(BackendError) as refused:
        OpenAIBackend(url, timeout=10).probe("qwen3-8b")
    assert "'qwen3-8b'" in str(refused.value) and "Qwen/Qwen3-8B" in str(refused.value)


def test_llama_server_serves_its_one_model_whatever_the_name_and_the_log_says_so():
    fake = FakeLlamaCpp()
    fake.start()
    try:
        caps = OpenAIBackend(fake.url, timeout=10).probe("my-qwen")
    finally:
        fake.stop()
    assert caps.model == "my-qwen"
    assert any("not listed" in note and fake.model in note for note in caps.notes)


def test_a_bridge_given_a_model_the_backend_lacks_takes_no_job_and_says_why(live_horde):
    with ollama(model="qwen3:8b") as fake, started_bridge(live_horde, fake.url, model="qwen3:14b") as (bridge, out, _):
        _until(lambda: out.text().count("backend not ready") >= 1, out)
        assert "'qwen3:14b'" in out.text() and "qwen3:8b" in out.text()
        assert not bridge.ready.is_set()
        assert not Worker.objects.filter(name=bridge.config.worker_name).exists()  # it never popped
        assert not [r for r in fake.requests if r[1] == "/v1/chat/completions"]


# --- a backend that refuses the bridge's key, or answers no model list ------------------------------


def test_a_backend_refusing_the_key_is_named_at_start_and_the_bridge_exits(live_horde):
    with route_server({("GET", "/v1/models"): lambda _body: VLLM_UNAUTHORIZED}) as url:
        with pytest.raises(BackendRefused) as refused:
            OpenAIBackend(url, timeout=10).probe(None)
        assert "401" in str(refused.value) and "pass the backend's API key with --backend-key" in str(refused.value)
        with pytest.raises(BackendRefused) as refused:
            OpenAIBackend(url, api_key="not-the-key", timeout=10).probe(None)
        assert "the key given with --backend-key (BRIDGE_BACKEND_KEY) is not one it takes" in str(refused.value)
        with started_bridge(live_horde, url) as (bridge, out, result):
            _until(lambda: bool(result), out)
    assert result == [2]
    assert "--backend-key" in out.text() and "backend not ready" not in out.text()
    assert not Worker.objects.filter(name=bridge.config.worker_name).exists()


def test_a_model_list_that_is_not_there_says_what_the_address_answered():
    # --backend pointing at another program (a web UI): an HTML 404 where /v1/models should be.
    html = "<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head><body><h1>Not Found</h1></body></html>"
    with route_server({("GET", "/v1/models"): lambda _body: (404, html)}) as url, pytest.raises(BackendDown) as down:
        OpenAIBackend(url, timeout=10).probe(None)
    message = str(down.value)
    assert "404" in message and "404 Not Found" in message and "\n" not in message


def test_a_backend_not_running_says_the_connection_was_refused():
    with pytest.raises(BackendDown) as down:
        OpenAIBackend("http://127.0.0.1:9/v1", timeout=10).probe(None)
    assert "ConnectionRefusedError" in str(down.value)


# --- an error page in place of an answer --------------------------------------------------------------

NGINX_502 = ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1>"
             "</center>\r\n<hr><center>nginx/1.24.0</center>\r\n</body>\r\n</html>\r\n")


def test_a_proxy_s_error_page_is_one_log_line_naming_it_and_the_backend_is_down():
    # The backend behind a reverse proxy died: the proxy answers its HTML page.
    routes = {("GET", "/v1/models"): VLLM_MODELS,
              ("POST", "/v1/chat/completions"): lambda _body: (502, NGINX_502)}
    with route_server(routes) as url:
        backend = OpenAIBackend(url, timeout=10)
        backend.probe(None)
        with pytest.raises(BackendDown) as down:
            backend.chat({"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert str(down.value) == "backend answered 502: an HTML page: 502 Bad Gateway"


# --- a backend that fails every job ------------------------------------------------------------------


def _faulted(request_id: str) -> int:
    return Generation.objects.filter(request_id=request_id, state=Generation.State.FAULTED).count()


def test_a_backend_failing_job_after_job_pauses_the_pops_before_the_request_is_lost(live_horde, fake_backend):
    # A backend that answers every generation 500 (its model no longer fits, its engine died):
    # the request is handed out again after each fault, and faulted for good past its retries.
    fake_backend.fail_with = LLAMA_SERVER_ERROR
    with running_bridge(live_horde, fake_backend.url) as (bridge, out):
        request_id = live_horde.chat()
        _until(lambda: "no pops for" in out.text(), out)
        status = live_horde.chat_status(request_id)
        bridge.request_stop(immediately=True)  # within the pause
    assert not status["faulted"] and _faulted(request_id) == 2  # one retry left, for another worker
    assert len(fake_backend.chat_requests()) == 2
    assert "the backend failed 2 jobs in a row (last: backend answered 500: " in out.text()
    assert "llama_decode failed" in out.text()


def test_after_the_pause_a_backend_that_recovered_serves_the_request(live_horde, fake_backend):
    fake_backend.fail_with = LLAMA_SERVER_ERROR
    with running_bridge(live_horde, fake_backend.url) as (_bridge, out):
        request_id = live_horde.chat()
        _until(lambda: "no pops for" in out.text(), out)
        fake_backend.fail_with = None
        status = live_horde.wait(request_id, timeout=20)
    assert status["done"] and not status["faulted"] and _faulted(request_id) == 2
    assert status["generations"][0]["message"]["content"] == DEFAULT_REPLY


def test_a_job_the_backend_refuses_for_its_prompt_is_no_failure_of_the_backend(live_horde, fake_backend):
    # 400 exceed_context_size_error: this request's prompt, not a failing backend.
    fake_backend.fail_with = LLAMA_CONTEXT_OVERFLOW
    with running_bridge(live_horde, fake_backend.url) as (_bridge, out):
        status = live_horde.wait(live_horde.chat(), until=lambda s: s["faulted"])
    assert status["fault_reason"] == CHAT_WORKER_FAULT_MESSAGES[ChatFaultReason.PROMPT_OVERFLOW]
    assert "no pops for" not in out.text()


def test_the_scripted_backend_s_error_directive_does_not_pause_the_demo_worker(live_horde):
    with running_bridge(live_horde, ScriptedBackend()) as (_bridge, out):
        request_id = live_horde.chat(messages=[{"role": "user", "content": "Hi [scripted:error]"}])
        status = live_horde.wait(request_id, until=lambda s: s["faulted"])
    assert _faulted(request_id) == 3 and "no pops for" not in out.text()
    assert status["fault_reason"] == CHAT_WORKER_FAULT_MESSAGES[ChatFaultReason.GENERATION_ERROR]
