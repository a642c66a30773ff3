"""The reference worker in front of llama.cpp's llama-server (issue 11, items 9-14): each behaviour
against the fake that reproduces llama-server's wire (tests/bridge/fake_backend.py), most of
them with a live horde, as the bridge runs for a volunteer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from chat.models import Generation
from contract.chat_declaration import CHAT_WORKER_FAULT_MESSAGES, ChatFaultReason
from tests.bridge.conftest import running_bridge
from tests.bridge.fake_backend import DEFAULT_REPLY, FakeLlamaCpp, RouteServer, fake_tokenize
from workers.bridge.backends import (
    BackendError,
    GenerationStopped,
    OpenAIBackend,
    apply_overrides,
    classify_backend_error,
    public_model_name,
)
from workers.bridge.config import BridgeConfig, load_config
from workers.bridge.jobs import chat_backend_request, response_format_for, trim_prompt_start
from workers.bridge.worker import job_context, jobs_at_once
from workers.models import Worker

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@contextmanager
def llama_server(**options) -> Iterator[FakeLlamaCpp]:
    fake = FakeLlamaCpp(**options)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


def _probe(fake: FakeLlamaCpp, **config):
    """What the bridge declares at start, without a horde (the backend probe and its sizing)."""
    backend = OpenAIBackend(fake.url, timeout=10)
    caps = backend.probe(None)
    bridge_config = BridgeConfig(api_key="k", worker_name="w", backend=fake.url, **config)
    jobs = jobs_at_once(bridge_config, caps)
    return backend, caps, jobs, job_context(bridge_config, caps, jobs)[0]


def _words(tokens: int) -> str:
    """A text of about `tokens` tokens by the fake's tokenizer ("word" and " " one token each)."""
    return "word " * (tokens // 2)


def _wait(predicate, timeout: float = 15.0, message: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, message
        time.sleep(0.1)


# --- 9. json_object ---------------------------------------------------------------------------------


def test_the_fake_gives_a_bare_json_object_no_grammar_as_llama_server_does():
    with llama_server() as fake:
        answer = httpx.post(f"{fake.url}/chat/completions", json={
            "messages": [{"role": "user", "content": "Give me JSON"}], "response_format": {"type": "json_object"}})
        assert answer.json()["choices"][0]["message"]["content"] == "Hello from the fake llama.cpp."
        schema_answer = httpx.post(f"{fake.url}/chat/completions", json={
            "messages": [{"role": "user", "content": "Give me JSON"}],
            "response_format": {"type": "json_object", "schema": {"type": "object"}}})
        assert json.loads(schema_answer.json()["choices"][0]["message"]["content"]) == {}


def test_json_object_reaches_llama_server_as_the_schema_object(live_horde):
    with llama_server() as fake, running_bridge(live_horde, fake.url) as (_, out):
        status = live_horde.wait(live_horde.chat(
            messages=[{"role": "user", "content": "Answer in JSON: what colour is the sky?"}],
            response_format={"type": "json_object"},
        ))
    assert status["done"] and not status["faulted"], out.text()
    assert isinstance(json.loads(status["generations"][0]["message"]["content"]), dict)
    assert fake.chat_requests()[0]["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "json_object", "schema": {"type": "object"}}}


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("llamacpp", {"response_format": {"type": "json_schema",
                                          "json_schema": {"name": "json_object", "schema": {"type": "object"}}}}),
        ("vllm", {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "json_object", "schema": {"type": "object"}}}}),
        ("tabbyapi", {"json_schema": {"type": "object"}}),
        ("ollama", {"response_format": {"type": "json_object"}}),  # its /v1 turns it into format "json"
    ],
)
def test_json_object_in_the_form_each_backend_enforces(kind, expected):
    assert response_format_for(kind, {"type": "json_object"}) == expected
    body = chat_backend_request({"messages": [], "response_format": {"type": "json_object"}}, model="m", kind=kind)
    assert {k: body[k] for k in expected} == expected
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}
    assert response_format_for(kind, schema_format) == {"response_format": schema_format}


# --- 10. context and slots ------------------------------------------------------------------------------


def test_declared_context_holds_while_the_threads_run_at_once(live_horde):
    # llama-server -c 2048 with its default 4 slots over one unified cache: /props says n_ctx 2048.
    with llama_server(n_ctx=2048, total_slots=4) as fake:
        fake.delay = 1.0
        with running_bridge(live_horde, fake.url, threads=2) as (bridge, out):
            worker = Worker.objects.get(name=bridge.config.worker_name)
            assert worker.chat_max_context_length == 1024 and worker.max_context_length == 1024
            assert "context 1024 (2048 shared by 2 jobs at once)" in out.text()
            ids = [live_horde.chat(messages=[{"role": "user", "content": _words(700) + f"q{i}"}], max_tokens=200,
                                   horde={"max_context_length": 1024}) for i in range(2)]
            statuses = [live_horde.wait(request_id) for request_id in ids]
    assert all(s["done"] and not s["faulted"] for s in statuses), out.text()
    assert fake.max_in_flight == 2  # side by side, and the shared cache held both
    assert fake.errors == []


def test_a_full_shared_cache_is_not_taken_for_an_overflowing_prompt(live_horde):
    # The volunteer says each job has the whole context (--no-context-split) while the slots share
    # one cache: two 1,200-token prompts do not fit in 2048 together, though each fits alone.
    with llama_server(n_ctx=2048, total_slots=4) as fake:
        fake.delay = 1.5
        with running_bridge(live_horde, fake.url, threads=2, context_split=False) as (bridge, out):
            assert Worker.objects.get(name=bridge.config.worker_name).chat_max_context_length == 2048
            ids = [live_horde.chat(messages=[{"role": "user", "content": _words(1200) + f"q{i}"}], max_tokens=64)
                   for i in range(2)]
            statuses = [live_horde.wait(request_id, timeout=30) for request_id in ids]
    # llama-server fails every slot processing when the shared cache overflows, the job that was
    # running as well as the one that did not fit (ADR 0112).
    overflows = [e for e in fake.errors if e == ("/v1/chat/completions", 500, "Context size has been exceeded.")]
    assert len(overflows) >= 2
    log = out.text()
    assert "chat faulted (generation_error)" in log and "the KV cache the slots share was full" in log
    assert "chat faulted (prompt_overflow)" not in log
    # Each was handed out again, and if it kept meeting a full cache it failed as a backend error,
    # not as a prompt too long for the worker.
    generation_error = CHAT_WORKER_FAULT_MESSAGES[ChatFaultReason.GENERATION_ERROR]
    assert all(s["done"] or s["fault_reason"] == generation_error for s in statuses), statuses


def test_a_full_shared_cache_met_while_streaming_is_a_generation_error(live_horde):
    """A streamed generation that fails in its slot is answered 200 text/event-stream, then
    `data: {"error": {"code": 500, "message": "Context size has been exceeded.", ...}}` and no
    [DONE] (llama-server b1-0c1e570, ADR 0112): the bridge faults it as the backend's error, not
    as a stream that ended early nor as a prompt too long."""
    with llama_server(n_ctx=2048, total_slots=4) as fake:
        fake.delay = 1.5
        with running_bridge(live_horde, fake.url, threads=2, context_split=False) as (bridge, out):
            ids = [live_horde.chat(messages=[{"role": "user", "content": _words(1200) + f"q{i}"}], max_tokens=64,
                                   stream=True) for i in range(2)]
            statuses = [live_horde.wait(request_id, timeout=30) for request_id in ids]
    assert any(record.total == 1 and record.finished for record in fake.streams)  # the error event alone
    log = out.text()
    assert "chat faulted (generation_error)" in log and "the KV cache the slots share was full" in log
    assert "ended before the reply finished" not in log and "chat faulted (prompt_overflow)" not in log
    generation_error = CHAT_WORKER_FAULT_MESSAGES[ChatFaultReason.GENERATION_ERROR]
    assert all(s["done"] or s["fault_reason"] == generation_error for s in statuses), statuses


def test_never_more_jobs_at_once_than_the_backend_has_slots(live_horde):
    with llama_server(n_ctx=8192, total_slots=2) as fake:
        fake.delay = 1.0
        with running_bridge(live_horde, fake.url, threads=4) as (bridge, out):
            worker = Worker.objects.get(name=bridge.config.worker_name)
            ids = [live_horde.chat(messages=[{"role": "user", "content": f"q{i}"}]) for i in range(4)]
            for request_id in ids:
                assert live_horde.wait(request_id)["done"]
    assert "threads 4 lowered to 2: the backend runs 2 slot(s)" in out.text()
    assert worker.threads == 2 and worker.chat_max_context_length == 4096
    assert fake.max_requests_at_once == 2  # the bridge never queued a job inside the backend


def test_context_detection_and_the_flags_that_override_it():
    with llama_server(n_ctx=8192, total_slots=4) as fake:
        _, caps, jobs, context = _probe(fake, threads=3)
        assert (caps.slots, caps.context_shared, jobs, context) == (4, True, 3, 2730)
        assert _probe(fake, threads=3, context_split=False)[3] == 8192
        assert _probe(fake, threads=3, max_context_length=4000)[3] == 4000
        assert _probe(fake, threads=1)[3] == 8192
        fake.endpoint_slots = False  # --no-slots: /props still says total_slots
        assert _probe(fake, threads=8)[2] == 4
    # --no-kv-unified: /props reports a slot's own share of -c.
    with llama_server(n_ctx=8192, total_slots=2, kv_unified=False) as fake:
        assert _probe(fake, threads=2, context_split=False)[3] == 4096
    # One slot: nothing shared, nothing divided.
    with llama_server(n_ctx=8192, total_slots=1) as fake:
        _, caps, jobs, context = _probe(fake, threads=3)
        assert (caps.context_shared, jobs, context) == (False, 1, 8192)


def test_the_context_flags_read_the_environment():
    assert load_config(["--api-key", "k"], {"BRIDGE_CONTEXT_SPLIT": "0"}).context_split is False
    assert load_config(["--api-key", "k", "--no-context-split"], {}).context_split is False
    assert load_config(["--api-key", "k"], {}).context_split is True


def test_server_errors_classified_as_llama_server_means_them():
    full = classify_backend_error(500, '{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}')
    assert full.fault_reason == ChatFaultReason.GENERATION_ERROR
    overflow = classify_backend_error(400, json.dumps({"error": {
        "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 3000, "n_ctx": 2048,
        "message": "request (3000 tokens) exceeds the available context size (2048 tokens), try increasing it"}}))
    assert overflow.fault_reason == ChatFaultReason.PROMPT_OVERFLOW


# --- 11. token counts ------------------------------------------------------------------------------------


def test_a_chat_prompt_that_cannot_fit_is_faulted_from_the_counted_tokens(live_horde):
    cjk = "天" * 1500  # 375 tokens by the horde's 4-characters estimate; the tokenizer counts 3,000
    with llama_server(n_ctx=2048, total_slots=1) as fake, running_bridge(live_horde, fake.url) as (bridge, out):
        status = live_horde.wait(live_horde.chat(messages=[{"role": "user", "content": cjk}], max_tokens=64),
                                 until=lambda s: s["faulted"])
    log = out.text()
    faults = [line for line in log.splitlines() if "chat faulted (prompt_overflow)" in line]
    assert status["fault_reason"] == CHAT_WORKER_FAULT_MESSAGES[ChatFaultReason.PROMPT_OVERFLOW]
    counted = len(fake_tokenize(fake.apply_template({"messages": [{"role": "user", "content": cjk}]}), add_special=True))
    assert counted > 3000
    assert faults and all(f"the prompt is {counted} tokens (counted by the backend's tokenizer)" in line for line in faults)
    assert len(faults) == bridge.stats.faulted  # each job it was given: faulted once
    assert fake.chat_requests() == []  # never sent to generate
    tokenized = [body for path, body in fake.requests if path == "/tokenize"]
    assert tokenized and tokenized[0]["add_special"] is True


def test_a_reply_budget_past_the_context_is_lowered_to_what_is_left(live_horde):
    prompt = _words(1900)
    with llama_server(n_ctx=2048, total_slots=1) as fake, running_bridge(live_horde, fake.url) as (_, out):
        status = live_horde.wait(live_horde.chat(messages=[{"role": "user", "content": prompt}], max_tokens=400))
    assert status["done"] and not status["faulted"], out.text()
    counted = len(fake_tokenize(fake.apply_template({"messages": [{"role": "user", "content": prompt}]}), add_special=True))
    assert fake.chat_requests()[0]["max_tokens"] == 2048 - counted
    assert fake.errors == []


def test_a_long_text_prompt_is_trimmed_from_the_start(live_horde):
    story = "".join(f"Chapter {i}: the dragon slept and the knight waited. " for i in range(240))  # ~12,000 chars
    assert len(story) > 12000
    with llama_server(n_ctx=8192, total_slots=1) as fake, running_bridge(live_horde, fake.url) as (_, out):
        status = live_horde.wait(live_horde.text(
            prompt=story, params={"max_length": 80, "max_context_length": 1024}), chat=False)
    assert status["done"] and not status["faulted"], out.text()
    sent = fake.completion_requests()[0]["prompt"]
    assert story.endswith(sent) and len(sent) < len(story)
    tokens = len(fake_tokenize(sent, add_special=True))
    assert 1024 - 80 - 10 <= tokens <= 1024 - 80  # as much of the end as fits
    assert "text prompt trimmed from the start" in out.text()
    assert fake.errors == []


def test_trimming_converges_on_the_counted_budget():
    def count(text: str) -> int:
        return len(fake_tokenize(text, add_special=True))

    for text in ("天地" * 3000, "word " * 5000, "mixed 天 text, " * 900):
        trimmed, tokens = trim_prompt_start(text, 1000, count)
        assert text.endswith(trimmed) and tokens == count(trimmed) and 990 <= tokens <= 1000
    assert trim_prompt_start("short", 1000, count) == ("short", count("short"))


def test_tokenizer_routes_of_vllm_and_koboldcpp():
    vllm = RouteServer({
        ("GET", "/v1/models"): {"data": [{"id": "Qwen/Qwen3-8B", "owned_by": "vllm", "max_model_len": 40960}]},
        ("POST", "/tokenize"): lambda body: (200, {"count": 7 if "messages" in body else 3,
                                                   "max_model_len": 40960, "tokens": [1, 2, 3]}),
    })
    kobold = RouteServer({
        ("GET", "/v1/models"): {"data": [{"id": "koboldcpp/Llama-3-8B", "owned_by": "koboldcpp"}]},
        ("GET", "/api/extra/true_max_context_length"): {"value": 8192},
        ("POST", "/api/extra/tokencount"): lambda body: (200, {"value": len(body["prompt"].split()), "ids": []}),
    })
    try:
        backend = OpenAIBackend(vllm.start())
        caps = backend.probe(None)
        assert caps.tokenizer == "/tokenize" and backend.count_tokens("one two three") == 3
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
        assert backend.count_chat_tokens(body) == 7 + 512  # an image part costs CHAT_IMAGE_PROMPT_TOKENS
        sent = vllm.requests[-1][2]
        assert sent["model"] == "Qwen/Qwen3-8B" and sent["add_generation_prompt"] is True
        assert sent["messages"] == [{"role": "user", "content": "hi"}]

        backend = OpenAIBackend(kobold.start())
        assert backend.probe(None).tokenizer == "/api/extra/tokencount"
        assert backend.count_tokens("one two three four") == 4
        assert backend.count_chat_tokens({"messages": [{"role": "user", "content": "a b"}]}) == 3  # "user: a b"
    finally:
        vllm.stop()
        kobold.stop()


# --- 12. tools probed --------------------------------------------------------------------------------------


def test_tools_declared_only_when_the_server_takes_them(live_horde):
    with llama_server(jinja=False) as fake, running_bridge(live_horde, fake.url) as (bridge, out):
        worker = Worker.objects.get(name=bridge.config.worker_name)
        assert fake.props()["chat_template_caps"]["supports_tools"]  # /props looks as with --jinja
        assert "tools" not in worker.chat_features
        assert "tools param requires --jinja flag" in out.text()
        # Plain chat still works on the --no-jinja server.
        assert live_horde.wait(live_horde.chat())["done"]
    probes = [body for path, body in fake.requests if path == "/apply-template" and body.get("tools")]
    assert probes and fake.chat_requests()[0].get("tools") is None

    with llama_server(jinja=True) as fake:
        _, caps, _, _ = _probe(fake)
        assert "tools" in caps.features


def test_an_older_build_without_apply_template_is_probed_with_a_one_token_chat():
    with llama_server(jinja=False) as fake:
        fake.has_apply_template = False
        _, caps, _, _ = _probe(fake)
        assert "tools" not in caps.features
        probe = next(body for body in fake.chat_requests() if body.get("tools"))
        assert probe["max_tokens"] == 1
        assert ("/apply-template", 404, "File Not Found") in fake.errors
    with llama_server(jinja=True) as fake:
        fake.has_apply_template = False
        assert "tools" in _probe(fake)[1].features


# --- 13. the advertised model name ---------------------------------------------------------------------------


def test_the_model_is_advertised_without_the_folder_path(live_horde):
    path = "/home/volunteer/models/Qwen3-8B-Q4_K_M.gguf"
    with llama_server(model=path) as fake, running_bridge(live_horde, fake.url, horde_model=None) as (bridge, out):
        worker = Worker.objects.get(name=bridge.config.worker_name)
        assert worker.chat_model_id == "Qwen3-8B-Q4_K_M" and worker.served_models == ["Qwen3-8B-Q4_K_M"]
        assert live_horde.wait(live_horde.chat(model="Qwen3-8B-Q4_K_M"))["done"]
    assert fake.chat_requests()[0]["model"] == path  # the backend still gets its own id
    assert "/home/volunteer" not in json.dumps(bridge.pop_body())


@pytest.mark.parametrize(
    ("model_id", "model_path", "public"),
    [
        ("/home/v/models/Qwen3-8B-Q4_K_M.gguf", "/home/v/models/Qwen3-8B-Q4_K_M.gguf", "Qwen3-8B-Q4_K_M"),
        ("../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", None, "Meta-Llama-3.1-8B-Instruct-Q4_K_M"),
        ("C:\\Users\\v\\models\\mistral-7b.Q5_K_M.gguf", None, "mistral-7b.Q5_K_M"),
        ("models/phi-4", "models/phi-4", "phi-4"),  # the -m path as typed, per /props model_path
        ("Qwen/Qwen3-8B", None, None),  # a Hugging Face repo id is a name
        ("qwen3:8b", None, None),
        ("my-alias", "/srv/m.gguf", None),  # --alias: the volunteer's chosen name
    ],
)
def test_public_model_name(model_id, model_path, public):
    assert public_model_name(model_id, model_path) == public


# --- 14. tool_choice_enforced ------------------------------------------------------------------------------


def test_tool_choice_enforced_is_declared_once_the_server_takes_tool_choice_required():
    """llama-server builds a grammar for tool_choice "required" that holds the reply from its first
    token until a call is complete (not the lazy one of "auto"): declared once a probe with tools
    and tool_choice required is accepted, never without --jinja."""
    with llama_server() as fake:
        _, caps, _, _ = _probe(fake)
        assert {"tools", "tool_choice_enforced"} <= caps.features
        assert any("tool_choice_enforced" in note for note in caps.notes)
        probe = next(body for path, body in fake.requests if path == "/apply-template" and body.get("tool_choice"))
        assert probe["tool_choice"] == "required" and [t["function"]["name"] for t in probe["tools"]] == ["horde_probe"]
        assert fake.chat_requests() == []  # parsed, never generated
    with llama_server(jinja=False) as fake:
        _, caps, _, _ = _probe(fake)
        assert not {"tools", "tool_choice_enforced"} & caps.features
    with llama_server() as fake:  # a build without /apply-template: a one-token chat completion
        fake.has_apply_template = False
        _, caps, _, _ = _probe(fake)
        assert "tool_choice_enforced" in caps.features
        assert any(body.get("tool_choice") == "required" and body["max_tokens"] == 1 for body in fake.chat_requests())
    with llama_server() as fake:  # --no-feature is the volunteer saying otherwise
        caps = OpenAIBackend(fake.url).probe(None)
        apply_overrides(caps, add=set(), remove={"tool_choice_enforced"}, transports=None)
        assert "tool_choice_enforced" not in caps.features


def test_a_named_function_choice_reaches_llama_server_as_required_with_that_tool_alone():
    """llama-server reads tool_choice as a string: an object is the wrong type, taken as "auto"
    (a lazy grammar). The horde already narrows a named choice to required and the one tool; a
    payload that still carries the object is sent so too."""
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    payload = {"messages": [{"role": "user", "content": "hi"}], "tools": [other, WEATHER_TOOL],
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    body = chat_backend_request(payload, model="m", kind="llamacpp")
    assert body["tool_choice"] == "required" and body["tools"] == [WEATHER_TOOL]
    assert chat_backend_request(payload, model="m", kind="vllm")["tool_choice"] == payload["tool_choice"]
    with llama_server() as fake:
        fake.model_prefers_text = True
        backend = OpenAIBackend(fake.url, timeout=10)
        sent = backend.chat({**payload, "model": fake.model, "max_tokens": 50}, timeout=10)
        assert not sent["choices"][0]["message"].get("tool_calls")  # the object: "auto", and the model wrote text
        forced = backend.chat(body, timeout=10)["choices"][0]
        assert forced["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        backend.close()


def test_strict_tool_choice_required_and_named_are_served_with_the_call(live_horde):
    with llama_server() as fake, running_bridge(live_horde, fake.url) as (bridge, _):
        fake.model_prefers_text = True  # unforced, this model answers in text
        worker = Worker.objects.get(name=bridge.config.worker_name)
        assert {"tools", "tool_choice_enforced"} <= set(worker.chat_features)
        required = live_horde.wait(live_horde.chat(tools=[WEATHER_TOOL], tool_choice="required"))
        assert required["done"] and not required["faulted"], required
        call = required["generations"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather" and required["generations"][0]["finish_reason"] == "tool_calls"
        other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
        named = live_horde.wait(live_horde.chat(
            tools=[other, WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
        assert named["done"] and named["generations"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert named["generations"][0]["finish_reason"] == "stop"  # as OpenAI finishes a named choice
        auto = live_horde.wait(live_horde.chat(tools=[WEATHER_TOOL], tool_choice="auto"))
        assert auto["done"] and not auto["generations"][0]["message"].get("tool_calls")
    sent = fake.chat_requests()
    assert sent[0]["tool_choice"] == "required" and sent[0]["tools"] == [WEATHER_TOOL]
    assert sent[1]["tool_choice"] == "required" and sent[1]["tools"] == [WEATHER_TOOL]  # the named one alone


def test_a_reply_without_the_required_call_is_faulted_and_the_guarantee_withdrawn(live_horde):
    """A template whose call format llama.cpp does not recognise gets no grammar, and the model
    answers in text: the bridge faults the job tool_violation (the horde hands it on), never
    submits the reply as conforming, and declares tool_choice_enforced no more, so the strict
    request is not restarted on it again but waits for a worker that keeps the guarantee."""
    with llama_server() as fake, running_bridge(live_horde, fake.url) as (bridge, out):
        fake.tool_grammar, fake.model_prefers_text = False, True
        request_id = live_horde.chat(tools=[WEATHER_TOOL], tool_choice="required")
        status = live_horde.wait(request_id, until=lambda s: s["restarted"] == 1 and not s["is_possible"])
        assert status["impossible_reason"]["missing_declarations"] == ["tool_choice_enforced"]
        assert not status["faulted"] and status["waiting"] == 1
        assert "tool_choice required, and the model answered without a call" in out.text()
        assert "tool_choice_enforced withdrawn from the next pop" in out.text()
        assert "tool_choice_enforced" not in bridge.declaration.chat_features
        assert bridge.stats.ok == 0
    assert len(fake.chat_requests()) == 1  # generated once, not submitted, not handed back to it
    assert not Generation.objects.filter(chat_refusal_rc__isnull=False).exists()


def test_a_reply_cut_at_max_tokens_before_the_required_call_keeps_the_guarantee(live_horde):
    """Seen on the real llama-server (ADR 0112): under tool_choice required its grammar lets the
    model write text before the call, so a model that talks first and a small max_tokens end the
    reply at "length" with text and no call. The grammar held; the budget ran out. The job is
    faulted (a reply without the required call is never submitted), but the guarantee stays, so
    a strict request with room for the call is still served here."""
    with llama_server() as fake, running_bridge(live_horde, fake.url) as (bridge, out):
        fake.text_before_call = "I will look that up with the weather tool for you now. " * 3
        cut = live_horde.wait(live_horde.chat(tools=[WEATHER_TOOL], tool_choice="required", max_tokens=16),
                              until=lambda s: s["faulted"] or s["done"])
        assert cut["faulted"] and not cut["generations"]
        # The bridge logs its fault once the horde answered it, which can be after the status read.
        _wait(lambda: "the reply was cut at max_tokens before the required call" in out.text(), 10, out.text())
        assert "withdrawn" not in out.text()
        assert "tool_choice_enforced" in bridge.declaration.chat_features
        served = live_horde.wait(live_horde.chat(tools=[WEATHER_TOOL], tool_choice="required", max_tokens=200))
        assert served["done"] and not served["faulted"], served
        reply = served["generations"][0]
        assert reply["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert reply["message"]["content"].startswith("I will look that up")
    cut_answers = [body for body in fake.chat_requests() if body.get("max_tokens") == 16]
    assert cut_answers and all(body["tool_choice"] == "required" for body in cut_answers)


def test_the_fake_cuts_a_required_call_as_llama_server_does():
    """The wire seen on llama-server b1-0c1e570 (ADR 0112): text before the call, cut by max_tokens,
    is a 200 with that text, no tool_calls and finish_reason "length"."""
    with llama_server() as fake:
        fake.text_before_call = "I will look that up with the weather tool for you now. " * 3
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL],
                "tool_choice": "required", "max_tokens": 8}
        choice = httpx.post(f"{fake.url}/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == "I will look that "  # 8 tokens of the fake's tokenizer
        whole = httpx.post(f"{fake.url}/chat/completions", json={**body, "max_tokens": 200}).json()["choices"][0]
        assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == fake.text_before_call
        assert whole["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_guarantee_the_volunteer_asserted_stays_after_a_violation(live_horde):
    """--feature tool_choice_enforced is the volunteer's word: a violation faults the job, and the
    declaration keeps the guarantee."""
    asserted = {"tool_choice_enforced"}
    with llama_server() as fake, running_bridge(live_horde, fake.url, add_features=asserted) as (bridge, out):
        fake.tool_grammar, fake.model_prefers_text = False, True
        status = live_horde.wait(live_horde.chat(tools=[WEATHER_TOOL], tool_choice="required"),
                                 until=lambda s: s["faulted"])
        assert status["fault_rc"] == "ChatWorkerFault"
        assert "withdrawn" not in out.text()
        assert "tool_choice_enforced" in bridge.declaration.chat_features
    assert len(fake.chat_requests()) == 3


# --- the backend's connection -------------------------------------------------------------------------


class _Deltas:
    """A progress sink that keeps the deltas and says stop after `stop_after` of them."""

    def __init__(self, stop_after: int | None = None):
        self.content: list[str] = []
        self.stop_after = stop_after

    def delta(self, content: str, reasoning_content: str | None = None) -> bool:
        self.content.append(content)
        return self.stop_after is None or len(self.content) < self.stop_after

    def flush(self) -> bool:
        return True

    def lease_extension(self) -> float:
        return 0.0


def test_a_stream_read_to_its_end_keeps_the_connection_and_a_stopped_one_is_closed():
    with llama_server() as fake:
        backend = OpenAIBackend(fake.url, timeout=10)
        body = {"model": fake.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
        streamed = _Deltas()
        first = backend.chat(body, timeout=10, progress=streamed)
        whole = backend.chat(body, timeout=10)
        again = backend.chat(body, timeout=10, progress=_Deltas())
        assert first["choices"][0]["message"]["content"] == "".join(streamed.content) == DEFAULT_REPLY
        assert len(streamed.content) > 3  # the reply came in the fake's 4-character chunks
        assert whole["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"] == DEFAULT_REPLY
        assert all(record.finished for record in fake.streams)
        assert len(set(fake.peers)) == 1  # one keep-alive connection served the three calls

        fake.chunk_delay = 0.05
        fake.stream_ended.clear()
        with pytest.raises(GenerationStopped):
            backend.chat(body, timeout=10, progress=_Deltas(stop_after=2))
        assert fake.stream_ended.wait(5)
        assert fake.streams[-1].closed_early and not fake.streams[-1].finished  # llama-server stops generating
        fake.chunk_delay = 0.0
        assert backend.chat(body, timeout=10)["choices"][0]["message"]["content"] == DEFAULT_REPLY
        assert len(set(fake.peers)) == 2  # the half-read stream's connection was not used again
        backend.close()


@pytest.mark.parametrize("sse_error_event", [False, True])
def test_a_stream_that_fails_mid_reply_is_the_backends_error_not_a_reply(sse_error_event):
    """The shared cache overflows after the first chunks. llama-server since late 2025 streams
    `data: {"error": ...}` and ends; before, an SSE `error: {...}` event, then `data: [DONE]`, which
    read as a finished stream submitted the reply cut where it failed as a complete one."""
    with llama_server() as fake:
        fake.stream_fail_after = 3
        fake.sse_error_event = sse_error_event
        backend = OpenAIBackend(fake.url, timeout=10)
        body = {"model": fake.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
        streamed = _Deltas()
        with pytest.raises(BackendError, match="Context size has been exceeded") as raised:
            backend.chat(body, timeout=10, progress=streamed)
        assert raised.value.fault_reason == ChatFaultReason.GENERATION_ERROR
        assert "".join(streamed.content) == DEFAULT_REPLY[:12]  # the three chunks before the failure were relayed
        backend.close()
