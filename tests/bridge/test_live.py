"""The reference worker against a live horde and a fake llama.cpp server (both real HTTP servers)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from chat.models import Generation, GenerationRequest
from contract.chat_declaration import CHAT_WORKER_FAULT_MESSAGES, ChatFaultReason
from tests.bridge.conftest import MODEL, running_bridge
from tests.bridge.fake_backend import (
    LLAMA_CONTEXT_OVERFLOW,
    LLAMA_GRAMMAR_ERROR,
    LLAMA_SERVER_ERROR,
    chat_completion,
)
from tests.bridge.processes import checked_in_bridge_process, signal_and_wait
from workers.bridge.scripted import ScriptedBackend
from workers.models import Worker

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_declaration_comes_from_the_backend(live_horde, fake_backend):
    with running_bridge(live_horde, fake_backend.url, max_length=1024) as (bridge, _):
        worker = Worker.objects.get(name=bridge.config.worker_name)
    assert worker.accepts_chat_jobs and worker.accepts_prompt_jobs
    assert worker.chat_model_id == MODEL and worker.served_models == [MODEL]
    # The context the server runs with (/props n_ctx), not the one the model was trained for.
    assert worker.chat_max_context_length == 8192
    assert worker.chat_max_length == 1024
    features = set(worker.chat_features)
    assert {"tools", "json_object", "json_schema", "structured_output_enforced", "prompt_overflow_refused",
            "tool_choice_enforced"} <= features  # tool_choice required is a grammar there (ADR 0091)
    # Not what llama.cpp does not do: reasoning_effort, vision (no mmproj), tools with a format
    # grammar.
    assert not features & {"reasoning_effort", "vision", "tools_with_response_format", "single_tool_call_enforced"}
    assert worker.image_transports == ["messages_url"]
    assert worker.bridge_agent.startswith("horde-bridge:")


def test_a_backend_without_the_overflow_guarantee_is_told_it_serves_best_effort_chat_alone(
    live_horde, fake_backend
):
    with running_bridge(live_horde, fake_backend.url) as (_, out):
        assert "horde.conformance best_effort" not in out.text()
    with running_bridge(live_horde, fake_backend.url, remove_features={"prompt_overflow_refused"}) as (_, out):
        assert (
            "note: chat requests are served only under horde.conformance best_effort: this backend is not known "
            "to refuse an over-long prompt (prompt_overflow_refused); if it does, start with --feature "
            "prompt_overflow_refused"
        ) in out.text()


def test_chat_round_trip_with_tools_and_reasoning(live_horde, fake_backend):
    def answer(body):
        if body["messages"][-1]["role"] == "tool":
            # Qwen3 on a server without a reasoning parser: the <think> block is in the content.
            return chat_completion(
                {"role": "assistant", "content": "<think>The tool says sunny.</think>\n\nIt is sunny in Paris."},
                "stop",
                usage={"prompt_tokens": 60, "completion_tokens": 14, "total_tokens": 74},
            )
        return chat_completion(
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "The user wants the weather; I call the tool.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}, "id": "Xk3mP0aQ9"}
                ],
            },
            "tool_calls",
            usage={
                "prompt_tokens": 42,
                "completion_tokens": 25,
                "total_tokens": 67,
                "completion_tokens_details": {"reasoning_tokens": 11},
            },
        )

    fake_backend.chat_handler = answer
    with running_bridge(live_horde, fake_backend.url) as (bridge, out):
        first = live_horde.chat(
            tools=[WEATHER_TOOL], tool_choice="auto", temperature=0.3, seed=7, stop=["\nUser:"], frequency_penalty=0.5
        )
        status = live_horde.wait(first)
        generation = status["generations"][0]
        message = generation["message"]
        assert status["done"] and not status["faulted"]
        assert message["tool_calls"] == [
            {"id": "Xk3mP0aQ9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        ]
        assert message["content"] is None
        assert message["reasoning_content"] == "The user wants the weather; I call the tool."
        assert generation["finish_reason"] == "tool_calls"
        assert generation["native_finish_reason"] == "tool_calls"
        assert (generation["prompt_tokens"], generation["completion_tokens"], generation["reasoning_tokens"]) == (42, 25, 11)

        sent = fake_backend.chat_requests()[0]
        assert sent["tools"] == [WEATHER_TOOL] and sent["tool_choice"] == "auto"
        assert sent["temperature"] == 0.3 and sent["seed"] == 7 and sent["stop"] == ["\nUser:"]
        assert sent["frequency_penalty"] == 0.5 and sent["max_tokens"] == 64 and sent["stream"] is False
        assert sent["model"] == fake_backend.model

        second = live_horde.chat(
            tools=[WEATHER_TOOL],
            messages=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]},
                {"role": "tool", "tool_call_id": "Xk3mP0aQ9", "content": "sunny, 21 C"},
            ],
        )
        generation = live_horde.wait(second)["generations"][0]
        assert generation["message"]["content"] == "It is sunny in Paris."
        assert generation["message"]["reasoning_content"] == "The tool says sunny."
        assert generation["finish_reason"] == "stop"
        assert generation["reasoning_tokens"] is None  # not reported: omitted, stored as null
    log = out.text()
    assert "chat ok: 25 tokens" in log and "1 tool call(s), reasoning" in log
    assert "summary: 2 jobs (2 ok, 0 faulted, 0 dropped)" in log


def test_json_schema_reply(live_horde, fake_backend):
    schema = {
        "type": "object",
        "properties": {"shade": {"type": "string"}},
        "required": ["shade"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "colour", "strict": True, "schema": schema}}
    with running_bridge(live_horde, fake_backend.url):
        status = live_horde.wait(live_horde.chat(response_format=response_format))
    assert status["done"] and not status["faulted"]
    assert json.loads(status["generations"][0]["message"]["content"]) == {"shade": ""}  # the schema's grammar
    assert fake_backend.chat_requests()[0]["response_format"] == response_format


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (LLAMA_CONTEXT_OVERFLOW, ChatFaultReason.PROMPT_OVERFLOW),
        (LLAMA_GRAMMAR_ERROR, ChatFaultReason.UNBUILDABLE_GRAMMAR),
        (LLAMA_SERVER_ERROR, ChatFaultReason.GENERATION_ERROR),
    ],
)
def test_backend_error_faults_with_its_reason(live_horde, fake_backend, error, reason):
    fake_backend.fail_with = error
    with running_bridge(live_horde, fake_backend.url) as (_, out):
        # Faulted jobs are handed out again; the request faults past FAULTED_GENERATIONS_LIMIT.
        status = live_horde.wait(live_horde.chat(), until=lambda s: s["faulted"])
    assert status["fault_reason"] == CHAT_WORKER_FAULT_MESSAGES[reason]
    assert status["fault_rc"] == "ChatWorkerFault"
    assert f"chat faulted ({reason})" in out.text()


def test_tool_violation_is_faulted_not_submitted(live_horde, fake_backend):
    fake_backend.chat_handler = lambda body: chat_completion(
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "rm_rf", "arguments": "{}"}}]},
        "tool_calls",
    )
    with running_bridge(live_horde, fake_backend.url):
        status = live_horde.wait(live_horde.chat(tools=[WEATHER_TOOL], tool_choice="auto"), until=lambda s: s["faulted"])
    assert status["fault_reason"] == CHAT_WORKER_FAULT_MESSAGES[ChatFaultReason.TOOL_VIOLATION]


def test_refused_reply_is_faulted_as_reply_refused(live_horde, fake_backend):
    fake_backend.chat_handler = lambda body: chat_completion({"role": "assistant", "content": "not json at all"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    with running_bridge(live_horde, fake_backend.url) as (_, out):
        status = live_horde.wait(
            live_horde.chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}),
            until=lambda s: s["faulted"],
        )
    # The horde's refusal is more specific than the worker's reply_refused, so it stays.
    assert status["fault_rc"] == "ChatSubmitNonconformant"
    assert "chat faulted (reply_refused)" in out.text()
    assert Generation.objects.filter(chat_refusal_rc="ChatSubmitNonconformant").exists()


def test_lease_is_honoured_job_given_up_before_it_ends(live_horde, fake_backend, settings):
    settings.HORDE_TEXT_JOB_LEASE_SECONDS = 4  # the pop's ttl
    fake_backend.delay = 30
    with running_bridge(live_horde, fake_backend.url, lease_margin=1.0) as (bridge, out):
        request_id = live_horde.chat()
        assert fake_backend.generating.wait(10)
        started = time.monotonic()
        deadline = started + 10
        while not Generation.objects.filter(request_id=request_id, state=Generation.State.FAULTED).exists():
            assert time.monotonic() < deadline, out.text()
            time.sleep(0.1)
        gave_up_after = time.monotonic() - started
        bridge.request_stop(immediately=True)
    assert gave_up_after < 4.5  # before the 4 s lease ended (plus polling)
    assert "gave the job up 1 s before its 4 s lease ends" in out.text()


def test_lapsed_lease_submit_is_dropped(live_horde, fake_backend):
    from django.utils import timezone

    from chat.services.sweeps import abort_stale_generations

    fake_backend.delay = 2
    with running_bridge(live_horde, fake_backend.url) as (bridge, out):
        request_id = live_horde.chat()
        assert fake_backend.generating.wait(10)
        # The horde's stale sweep aborts the job while the backend still generates.
        Generation.objects.filter(request_id=request_id).update(lease_expires_at=timezone.now())
        assert abort_stale_generations() == 1
        deadline = time.monotonic() + 10
        while bridge.stats.dropped == 0:
            assert time.monotonic() < deadline, out.text()
            time.sleep(0.1)
        fake_backend.delay = 0
    assert "dropped: the horde aborted the job before the submit: its lease lapsed or its request was cancelled (AbortedGen)" in out.text()


def test_text_job_through_completions(live_horde, fake_backend):
    with running_bridge(live_horde, fake_backend.url):
        request_id = live_horde.text(
            params={"max_length": 40, "temperature": 0.5, "top_k": 40, "rep_pen": 1.1, "stop_sequence": ["\n\n"]},
            validated_backends=True,
        )
        status = live_horde.wait(request_id, chat=False)
    assert status["done"]
    assert status["generations"][0]["text"] == " the dragon slept."
    sent = fake_backend.completion_requests()[0]
    assert sent["prompt"] == "Once upon a time" and sent["max_tokens"] == 40 and sent["stop"] == ["\n\n"]
    assert sent["temperature"] == 0.5 and sent["top_k"] == 40 and sent["repeat_penalty"] == 1.1
    assert fake_backend.chat_requests() == []


def test_scripted_backend_serves_the_horde(live_horde):
    with running_bridge(live_horde, ScriptedBackend()) as (_, out):
        status = live_horde.wait(live_horde.chat(reasoning_effort="low", messages=[{"role": "user", "content": "Hi"}]))
    message = status["generations"][0]["message"]
    assert message["content"] == "Scripted reply to: Hi"
    assert message["reasoning_content"].startswith("The user wrote 2 characters")
    assert "summary: 1 jobs (1 ok" in out.text()


def test_threads_serve_jobs_at_once(live_horde, fake_backend):
    fake_backend.delay = 3.0
    with running_bridge(live_horde, fake_backend.url, threads=3):
        ids = [live_horde.chat(messages=[{"role": "user", "content": f"q{i}"}]) for i in range(3)]
        started = time.monotonic()
        for request_id in ids:
            assert live_horde.wait(request_id, timeout=30)["done"]
        elapsed = time.monotonic() - started
    # Three 3 s generations side by side: two of them one after another would take 6 s.
    assert elapsed < 2 * fake_backend.delay


# --- stopping -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_mid_job_finishes_the_held_job(live_horde, fake_backend):
    fake_backend.delay = 2.0
    with checked_in_bridge_process(live_horde, fake_backend.url, "--stop-grace", "15") as proc:
        request_id = live_horde.chat()
        assert fake_backend.generating.wait(10)
        output, _ = signal_and_wait(proc, signal.SIGTERM, timeout=20)
    assert proc.returncode == 0, output
    assert "SIGTERM: no more pops; finishing 1 held job(s)" in output
    assert "summary: 1 jobs (1 ok, 0 faulted, 0 dropped)" in output
    status = live_horde.chat_status(request_id)
    assert status["done"] and status["generations"][0]["message"]["content"] == "Hello from the fake llama.cpp."


@pytest.mark.slow
def test_sigterm_faults_what_it_cannot_finish_in_the_grace(live_horde, fake_backend):
    fake_backend.delay = 30.0
    with checked_in_bridge_process(live_horde, fake_backend.url, "--stop-grace", "0.5") as proc:
        request_id = live_horde.chat()
        assert fake_backend.generating.wait(10)
        output, stopped_after = signal_and_wait(proc, signal.SIGTERM, timeout=15)
    assert proc.returncode == 0, output
    assert stopped_after < 5, output
    assert "faulted at stop" in output and "summary: 1 jobs (0 ok, 1 faulted, 0 dropped)" in output
    generation = Generation.objects.get(request_id=request_id)
    assert generation.state == Generation.State.FAULTED  # handed back at once, not at its lease end


class FlakyBackend(ScriptedBackend):
    """The scripted backend, switched off and on: down, it refuses connections as a stopped server does."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def healthy(self) -> bool:
        return not self.down

    def chat(self, body, *, timeout, progress=None):
        from workers.bridge.backends import BackendDown

        if self.down:
            raise BackendDown("backend unreachable: ConnectError: [Errno 111] Connection refused")
        return super().chat(body, timeout=timeout, progress=progress)


def test_backend_down_faults_the_job_and_pauses_pops(live_horde):
    backend = FlakyBackend()
    with running_bridge(live_horde, backend) as (bridge, out):
        backend.down = True
        first = live_horde.chat(messages=[{"role": "user", "content": "one"}])
        deadline = time.monotonic() + 10
        while "backend down; probing again" not in out.text():
            assert time.monotonic() < deadline, out.text()
            time.sleep(0.1)
        assert Generation.objects.get(request_id=first).state == Generation.State.FAULTED
        assert "chat faulted (generation_error)" in out.text()
        backend.down = False  # back: the request, handed out again, is served
        status = live_horde.wait(first, timeout=15)
    assert status["done"] and status["generations"][0]["message"]["content"] == "Scripted reply to: one"
    assert "backend is back: popping again" in out.text()


def test_horde_down_backs_off_until_stopped(fake_backend):
    from tests.bridge.conftest import LogBuffer
    from workers.bridge.config import BridgeConfig
    from workers.bridge.worker import Bridge

    out = LogBuffer()
    config = BridgeConfig(horde_url="http://127.0.0.1:9", api_key="k" * 22, worker_name="lonely", backend=fake_backend.url)
    bridge = Bridge(config, ScriptedBackend(), out=out)
    import threading

    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(bridge.run(install_signals=False)))
    thread.start()
    time.sleep(2.5)
    bridge.request_stop()
    thread.join(10)
    lines = [line for line in out.text().splitlines() if "horde unreachable" in line]
    assert 1 <= len(lines) <= 3  # 1 s, then 2 s: backing off, not hammering
    assert result == [0]


def test_an_offloaded_request_is_fetched_gzipped_from_its_messages_url(live_horde, fake_backend, settings):
    """The bridge declares messages_url whatever its backend: with the offload on, its job carries
    the URL, which the live horde serves gzipped, and the backend receives the messages whole."""
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_ENABLED = True
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_BYTES = 64
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_GZIP = True
    messages = [{"role": "user", "content": "Tell me about the sea. " * 20}]
    with running_bridge(live_horde, fake_backend.url):
        status = live_horde.wait(live_horde.chat(messages=messages))
    assert status["done"] and not status["faulted"], status
    assert list(Generation.objects.values_list("image_transport", flat=True)) == ["messages_url"]
    assert fake_backend.chat_requests()[0]["messages"] == messages


def test_a_messages_url_that_cannot_be_fetched_faults_the_job_without_a_reason(live_horde, fake_backend, settings):
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_ENABLED = True
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_BYTES = 64
    settings.HORDE_PUBLIC_URL = "http://127.0.0.1:9"  # nothing listens there: the fetch fails
    messages = [{"role": "user", "content": "Tell me about the sea. " * 20}]
    with running_bridge(live_horde, fake_backend.url) as (_, out):
        request_id = live_horde.chat(messages=messages)
        deadline = time.monotonic() + 15
        while not Generation.objects.filter(request__id=request_id, state=Generation.State.FAULTED).exists():
            assert time.monotonic() < deadline, out.text()
            time.sleep(0.1)
    # No fault reason was sent, so the request records no worker fault message.
    assert GenerationRequest.objects.get(pk=request_id).chat_fault_reason is None
    assert "chat faulted (no reason)" in out.text() and fake_backend.chat_requests() == []


def test_a_bridge_in_maintenance_serves_its_owners_request_at_once(live_horde, fake_backend):
    """In maintenance the horde refuses the pop while none of the owner's requests waits; the
    reference worker keeps polling at its interval, so the owner's test request is served at once
    while another user's waits (docs/adr/0083)."""
    with running_bridge(live_horde, fake_backend.url) as (bridge, out):
        worker_id = Worker.objects.get(name=bridge.config.worker_name).id
        put = live_horde.client.put(f"workers/{worker_id}", json={"maintenance": True}, headers={"apikey": live_horde.worker_key})
        assert put.status_code == 200, put.text
        deadline = time.monotonic() + 10
        while "aintenance" not in out.text():  # its pop was refused (and, before, it waited 60 s)
            assert time.monotonic() < deadline, out.text()
            time.sleep(0.05)
        # Queued once a pop was refused: a long poll begun before the switch may take a job it wakes for.
        theirs = live_horde.text()
        mine = live_horde.client.post(
            "generate/text/async", json={"models": [MODEL], "prompt": "Mine"}, headers={"apikey": live_horde.worker_key}
        )
        assert mine.status_code == 202, mine.text
        assert live_horde.wait(mine.json()["id"], chat=False, timeout=10)["done"]
        assert live_horde.text_status(theirs)["waiting"] == 1
