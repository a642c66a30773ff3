"""The reference worker's pieces without a horde: configuration, backend probe and errors, reasoning,
tool controls, the scripted backend's schema instances, and that it imports no Django (nor any
HTTP package: it speaks HTTP through the standard library)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest

from contract.chat_declaration import ChatFaultReason, ChatFinishReason
from tests.bridge.fake_backend import RouteServer
from workers.bridge.backends import (
    BackendDown,
    BackendError,
    ChatStreamReader,
    OpenAIBackend,
    classify_backend_error,
    normalise_base_url,
)
from workers.bridge.config import _ENV, ConfigError, build_parser, load_config
from workers.bridge.jobs import (
    chat_backend_request,
    chat_submit_body,
    enforce_tool_controls,
    finish_reason,
    parse_chat_response,
    parse_text_response,
    split_reasoning,
)
from workers.bridge.scripted import ScriptedBackend, minimal_instance

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_bridge_loads_no_django_no_http_package_and_nothing_of_the_project_but_contract():
    code = (
        "import sys, workers.bridge.cli, workers.bridge.__main__\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('django', 'rest_framework', 'celery', 'accounts', 'chat', 'hordesite', 'oai', 'httpx', 'httpcore', "
        "'requests', 'urllib3') "
        "or (m.startswith('workers.') and not m.startswith('workers.bridge')))\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- configuration ----------------------------------------------------------------------------------


def test_config_from_environment_and_flags():
    env = {
        "BRIDGE_API_KEY": "secret",
        "BRIDGE_BACKEND": "http://127.0.0.1:8080/v1",
        "BRIDGE_THREADS": "3",
        "BRIDGE_FEATURES": "tools,tool_choice_enforced",
        "BRIDGE_TEXT_JOBS": "0",
        "BRIDGE_MAX_LENGTH": "300",
    }
    config = load_config(["--threads", "2", "--horde-model", "koboldcpp/Qwen3-8B"], env)
    assert config.api_key == "secret" and config.backend == "http://127.0.0.1:8080/v1"
    assert config.threads == 2  # the flag wins
    assert config.add_features == {"tools", "tool_choice_enforced"}
    assert config.text_jobs is False and config.chat_jobs is True
    assert config.max_length == 300 and config.horde_model == "koboldcpp/Qwen3-8B"


def test_a_flag_given_wins_over_the_environment_even_at_its_default():
    """A flag on the command line wins, also when it repeats its default (docs/configuration.md): a
    worker started with --threads 1 in a shell that exports BRIDGE_THREADS=4 runs one thread."""
    env = {"BRIDGE_API_KEY": "secret", "BRIDGE_THREADS": "4", "BRIDGE_HORDE_URL": "http://elsewhere.invalid:9000",
           "BRIDGE_POP_WAIT": "0", "BRIDGE_BACKEND": "http://127.0.0.1:8080/v1"}
    config = load_config(
        ["--threads", "1", "--horde-url", "http://127.0.0.1:8000", "--pop-wait", "10", "--backend", "scripted"], env
    )
    assert (config.threads, config.horde_url, config.pop_wait, config.backend) == (1, "http://127.0.0.1:8000", 10, "scripted")
    # Not given: the environment, then the default.
    assert load_config([], env).threads == 4 and load_config([], {"BRIDGE_API_KEY": "k"}).threads == 1


def test_every_option_has_a_variable_named_in_its_help():
    """README and docs/configuration.md promise it: every flag also reads a BRIDGE_* variable, named
    in `python -m workers.bridge --help`."""
    options = {action.dest: action for action in build_parser()._actions if action.dest != "help"}
    assert set(options) == set(_ENV)
    unnamed = {dest: variable for dest, (variable, _convert) in _ENV.items() if variable not in (options[dest].help or "")}
    assert unnamed == {}


def test_a_key_that_starts_with_a_dash_is_the_flags_value():
    """The horde's keys are token_urlsafe, so one in 64 starts with "-": `--api-key "$KEY"` as the
    README writes it must still take it (argparse read it as an unknown option and exited 2)."""
    config = load_config(["--api-key", "-Xq3_key", "--backend-key", "--bk", "--backend", "scripted"], {})
    assert (config.api_key, config.backend_key, config.backend) == ("-Xq3_key", "--bk", "scripted")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "API key"),
        (["--api-key", "k", "--feature", "telepathy"], "unknown feature"),
        (["--api-key", "k", "--no-chat", "--no-text"], "nothing to serve"),
        (["--api-key", "k", "--threads", "0"], "--threads"),
        # The horde refuses a pop declaring more (upstream's bound): refused before the first pop.
        (["--api-key", "k", "--threads", "51"], "--threads is 1 to 50"),
        # A URL without its scheme was a traceback from the client, not a usage error.
        (["--api-key", "k", "--horde-url", "aihorde.net"], "--horde-url is an http:// or https:// URL"),
        (["--api-key", "k", "--backend", "localhost:8080/v1"], "--backend is `scripted` or an http:// or https:// URL"),
        # 0 is no "no timeout": every backend read would fail at once, the backend "not ready" for ever.
        (["--api-key", "k", "--backend-timeout", "0"], "--backend-timeout is more than 0"),
        (["--api-key", "k", "--backend-timeout", "nan"], "--backend-timeout is more than 0"),
        # 0 or less: with a horde that answers pops at once, a pop loop without a pause.
        (["--api-key", "k", "--pop-interval", "0"], "--pop-interval is more than 0"),
        (["--api-key", "k", "--lease-margin", "-5"], "--lease-margin is 0 or more"),
        (["--api-key", "k", "--stop-grace", "-1"], "--stop-grace is 0 or more"),
        # 0 served jobs for ever (read as no bound), a negative count stopped after the first job.
        (["--api-key", "k", "--max-jobs", "0"], "--max-jobs is at least 1"),
        (["--api-key", "k", "--max-jobs", "-1"], "--max-jobs is at least 1"),
    ],
)
def test_config_refusals(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv, {})


def test_base_url_normalised():
    assert normalise_base_url("http://127.0.0.1:8080") == ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080")
    assert normalise_base_url("http://h:11434/v1/") == ("http://h:11434/v1", "http://h:11434")


# --- backend probe and errors -------------------------------------------------------------------------


@pytest.fixture
def route_backend() -> Iterator[Callable[[dict[str, object]], OpenAIBackend]]:
    """A backend client on a local server answering each GET path with its JSON (404 elsewhere)."""
    servers: list[RouteServer] = []

    def start(routes: dict[str, object]) -> OpenAIBackend:
        server = RouteServer({("GET", path): body for path, body in routes.items()})
        servers.append(server)
        return OpenAIBackend(server.start())

    yield start
    for server in servers:
        server.stop()


def test_probe_vllm_context_from_max_model_len(route_backend):
    backend = route_backend({"/v1/models": {"data": [{"id": "Qwen/Qwen3-8B", "owned_by": "vllm", "max_model_len": 40960}]}})
    caps = backend.probe(None)
    assert (caps.kind, caps.model, caps.context) == ("vllm", "Qwen/Qwen3-8B", 40960)
    assert "prompt_overflow_refused" in caps.features and "tools" not in caps.features


def test_probe_ollama_truncates_so_no_overflow_guarantee(route_backend):
    backend = route_backend(
        {"/v1/models": {"data": [{"id": "qwen3:8b", "owned_by": "library"}]}, "/api/version": {"version": "0.12.0"}}
    )
    caps = backend.probe(None)
    # No /api/show nor /api/ps: Ollama's smallest default context, and the log says so.
    assert caps.kind == "ollama" and caps.context == 4096
    assert any("--max-context-length" in note for note in caps.notes)
    assert "prompt_overflow_refused" not in caps.features and "reasoning_effort" in caps.features


def test_probe_llamacpp_prefers_the_running_context(route_backend):
    backend = route_backend(
        {
            "/v1/models": {"data": [{"id": "m.gguf", "owned_by": "llamacpp", "meta": {"n_ctx_train": 131072}}]},
            "/props": {"default_generation_settings": {"n_ctx": 4096}, "chat_template": "{{ messages }}",
                       "modalities": {"vision": True}},
        }
    )
    caps = backend.probe("m.gguf")
    assert caps.kind == "llamacpp" and caps.context == 4096
    assert "tools" not in caps.features  # the template does not render tools
    assert "vision" in caps.features and caps.image_transports == {"base64", "messages_url"}


def test_probe_unreachable_backend_is_down():
    backend = OpenAIBackend("http://127.0.0.1:9/v1")
    with pytest.raises(BackendDown):
        backend.probe(None)


@pytest.mark.parametrize(
    ("status", "text", "reason"),
    [
        (400, '{"error":{"message":"This model\'s maximum context length is 4096 tokens."}}', ChatFaultReason.PROMPT_OVERFLOW),
        (400, "the request exceeds the available context size", ChatFaultReason.PROMPT_OVERFLOW),
        (500, "failed to parse grammar", ChatFaultReason.UNBUILDABLE_GRAMMAR),
        (400, "Unsupported JSON schema feature: patternProperties", ChatFaultReason.UNBUILDABLE_GRAMMAR),
        (500, "CUDA out of memory", ChatFaultReason.GENERATION_ERROR),
    ],
)
def test_backend_errors_classified(status, text, reason):
    assert classify_backend_error(status, text).fault_reason == reason


def test_unavailable_backend_is_down():
    assert isinstance(classify_backend_error(503, "Loading model"), BackendDown)


# --- replies ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "reasoning", "expected"),
    [
        ("<think>hmm</think>\n\nHello", None, ("Hello", "hmm")),
        ("<think>cut off at max_len", None, ("", "cut off at max_len")),
        ("hidden start</think>Answer", None, ("Answer", "hidden start")),
        ("Plain", "from the parser", ("Plain", "from the parser")),
        ("Plain", None, ("Plain", None)),
        (None, None, (None, None)),
    ],
)
def test_split_reasoning(content, reasoning, expected):
    assert split_reasoning(content, reasoning) == expected


def test_finish_reasons():
    assert finish_reason("stop", True) == ChatFinishReason.TOOL_CALLS
    assert finish_reason("tool_calls", False) == ChatFinishReason.STOP
    assert finish_reason("length", False) == ChatFinishReason.LENGTH
    assert finish_reason("eos", False) == ChatFinishReason.STOP
    assert finish_reason(None, False) == ChatFinishReason.STOP


def test_a_reply_vllm_aborted_or_failed_is_a_fault_not_a_stop():
    # vLLM answers finish_reason "abort" (request aborted by its engine) or "error": the text is
    # cut off, so it must fault the job rather than be submitted as a finished "stop" reply.
    for native in ("abort", "error"):
        chat = {"choices": [{"message": {"role": "assistant", "content": "Half a rep"}, "finish_reason": native}]}
        with pytest.raises(BackendError):
            parse_chat_response(chat)
        with pytest.raises(BackendError):
            parse_text_response({"choices": [{"text": "Half a rep", "finish_reason": native}]})
    assert parse_chat_response(
        {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
    ).content == "ok"


def test_submit_body_keeps_minted_ids_and_omits_unreported_counts():
    reply = parse_chat_response(
        {
            "choices": [
                {
                    "message": {"role": "assistant", "content": "",
                                "tool_calls": [{"id": "abc", "type": "function",
                                                "function": {"name": "f", "arguments": {"x": 1}}}]},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3},
        }
    )
    body = chat_submit_body("job", "model", reply)
    assert body["message"] == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "abc", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}],
    }
    assert body["finish_reason"] == "tool_calls" and body["native_finish_reason"] == "stop"
    assert body["prompt_tokens"] == 3 and "completion_tokens" not in body and "reasoning_tokens" not in body


def _calls(*names):
    return {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": "{}"}} for i, n in enumerate(names)
    ]}, "finish_reason": "tool_calls"}]}


def test_tool_controls():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert enforce_tool_controls({"tools": tools}, parse_chat_response(_calls("g"))) is not None
    no_call = parse_chat_response({"choices": [{"message": {"role": "assistant", "content": "hi"}}]})
    assert enforce_tool_controls({"tools": tools, "tool_choice": "required"}, no_call) is not None
    assert enforce_tool_controls({"tools": tools, "tool_choice": "auto"}, no_call) is None
    reply = parse_chat_response(_calls("f", "f"))
    assert enforce_tool_controls({"tools": tools, "parallel_tool_calls": False}, reply) is None
    assert [c["id"] for c in reply.tool_calls] == ["c0"]  # the first call kept


def test_tool_controls_of_a_named_choice():
    """A payload that still carries a named choice beside other tools: a call to another of them
    breaks it (the bridge sent llama-server only the named tool; another backend got them all)."""
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    named = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    assert enforce_tool_controls(named, parse_chat_response(_calls("f"))) is None
    assert enforce_tool_controls(named, parse_chat_response(_calls("g"))) == "tool_choice names 'f', and the model called 'g'"


def test_backend_request_carries_the_job():
    payload = {
        "messages": [{"role": "user", "content": "x"}], "max_length": 100, "temperature": 0.2, "top_p": 0.9,
        "frequency_penalty": 0, "presence_penalty": 0.4, "rep_pen": 1.0, "top_k": 0, "min_p": 0.05,
        "seed": 3, "stop_sequence": ["END"], "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
        "reasoning_effort": "none", "n": 1, "max_context_length": 4096,
    }
    body = chat_backend_request(payload, model="m", kind="llamacpp")
    assert body == {
        "model": "m", "messages": payload["messages"], "max_tokens": 100, "temperature": 0.2, "top_p": 0.9,
        "presence_penalty": 0.4, "min_p": 0.05, "seed": 3, "reasoning_effort": "none", "stop": ["END"],
        "tools": payload["tools"], "tool_choice": "required",
        # llama.cpp gives a bare json_object no grammar: it is sent as the schema {"type": "object"}.
        "response_format": {"type": "json_schema", "json_schema": {"name": "json_object", "schema": {"type": "object"}}},
    }
    generic = chat_backend_request(payload, model="m", kind="openai")
    assert "min_p" not in generic and "repeat_penalty" not in generic


# --- the scripted backend ----------------------------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 3}, "b": {"type": "integer", "minimum": 5}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}, "minItems": 2},
    {"type": "object", "properties": {"kind": {"enum": ["x", "y"]}, "at": {"type": "string", "format": "date-time"},
                                      "n": {"type": ["null", "integer"], "multipleOf": 7, "minimum": 1}},
     "required": ["kind", "at", "n"]},
    {"$defs": {"p": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
     "type": "object", "properties": {"owner": {"$ref": "#/$defs/p"}, "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["owner", "tags"]},
    {"anyOf": [{"type": "string", "const": "hi"}, {"type": "integer"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
               {"properties": {"b": {"type": "null"}}, "required": ["b"]}]},
    {"type": "number", "minimum": -3.5, "maximum": -1},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_minimal_instance_is_valid(schema):
    jsonschema.validate(minimal_instance(schema), schema, format_checker=jsonschema.FormatChecker())


def test_scripted_backend_is_deterministic_and_answers_every_shape():
    backend = ScriptedBackend()
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 50,
            "tools": [{"type": "function", "function": {"name": "w", "parameters": SCHEMAS[0]}}]}
    first, again = backend.chat(body, timeout=5), backend.chat(body, timeout=5)
    assert first == again
    call = first["choices"][0]["message"]["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[0])

    schema_body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 50,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[3]}}}
    jsonschema.validate(json.loads(backend.chat(schema_body, timeout=5)["choices"][0]["message"]["content"]), SCHEMAS[3])

    reply = parse_chat_response(backend.chat({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                              "reasoning_effort": "high"}, timeout=5))
    assert reply.reasoning and reply.content == "Scripted reply to: Hi"[:16]
    assert reply.finish_reason == ChatFinishReason.LENGTH

    with pytest.raises(Exception) as overflow:
        backend.chat({"messages": [{"role": "user", "content": "x" * 200_000}], "max_tokens": 50}, timeout=5)
    assert overflow.value.fault_reason == ChatFaultReason.PROMPT_OVERFLOW


# --- streamed replies ------------------------------------------------------------------------------


def _sse(*chunks: object) -> list[str]:
    lines: list[str] = []
    for chunk in chunks:
        lines += [f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}", ""]
    return lines


def _delta(delta: dict, finish: str | None = None) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@pytest.mark.parametrize(
    "whole",
    [
        "<think>Plan the answer.</think>\n\nThe answer.",
        "  <think>\nunclosed reasoning cut at max_length",
        "No reasoning at all, <think> in the middle stays content.",
        "<thinking> is not the tag",
        "<think></think>Only content.",
    ],
)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 100])
def test_streamed_think_split_matches_the_whole_reply_split(whole, size):
    reader = ChatStreamReader()
    posted_content, posted_reasoning = "", ""
    for line in _sse(*[_delta({"content": whole[i : i + size]}) for i in range(0, len(whole), size)], "[DONE]"):
        content, reasoning = reader.feed_line(line)
        posted_content, posted_reasoning = posted_content + content, posted_reasoning + reasoning
    content, reasoning = reader.finish()
    posted_content, posted_reasoning = posted_content + content, posted_reasoning + reasoning
    expected_content, expected_reasoning = split_reasoning(whole)
    assert posted_content == expected_content
    assert posted_reasoning.strip() == (expected_reasoning or "")
    reply = parse_chat_response(reader.response(), split_think=False)
    assert (reply.content, reply.reasoning) == (expected_content, expected_reasoning or None)


@pytest.mark.parametrize("size", [1, 3, 100])
def test_a_streamed_reply_keeps_the_split_it_was_posted_with(size):
    """A lone </think> is known only after the text before it was posted as content: the reply
    submitted keeps that content, so it starts with what the front relayed."""
    whole = "hidden start\n</think>\n\nAnswer"
    reader = ChatStreamReader()
    posted = ""
    for line in _sse(*[_delta({"content": whole[i : i + size]}) for i in range(0, len(whole), size)], "[DONE]"):
        posted += reader.feed_line(line)[0]
    posted += reader.finish()[0]
    reply = parse_chat_response(reader.response(), split_think=False)
    assert reply.content == posted == whole and reply.reasoning is None
    # The same reply read whole is split.
    assert split_reasoning(whole) == ("Answer", "hidden start")


def test_stream_reader_assembles_reasoning_calls_finish_and_usage():
    reader = ChatStreamReader()
    lines = [": keep-alive", "event: message"] + _sse(
        _delta({"role": "assistant", "content": None}),
        _delta({"reasoning": "vLLM names it "}),  # vLLM's and Ollama's key
        _delta({"reasoning_content": "reasoning."}),
        _delta({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
        _delta({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "g", "arguments": '{"x"'}}]}),
        _delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        _delta({"tool_calls": [{"index": 1, "function": {"arguments": ":2}"}}]}),
        _delta({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        _delta({}, "tool_calls"),
        {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}},
        "[DONE]",
    )
    posted = [reader.feed_line(line) for line in lines]
    assert [r for _, r in posted if r] == ["vLLM names it ", "reasoning."]
    assert reader.done
    reply = parse_chat_response(reader.response())
    assert reply.reasoning == "vLLM names it reasoning."
    assert reply.content is None and reply.finish_reason == ChatFinishReason.TOOL_CALLS
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in reply.tool_calls] == [
        ("call_a", "f", '{"a":1}'),
        ("call_b", "g", '{"x":2}'),
    ]
    assert (reply.prompt_tokens, reply.completion_tokens) == (9, 7)


def test_stream_reader_refuses_an_error_chunk_and_a_cut_stream():
    reader = ChatStreamReader()
    with pytest.raises(BackendError) as error:
        reader.feed_line('data: {"error": {"code": 400, "message": "the request exceeds the available context size"}}')
    assert error.value.fault_reason == ChatFaultReason.PROMPT_OVERFLOW
    cut = ChatStreamReader()
    cut.feed_line(f"data: {json.dumps(_delta({'content': 'Hel'}))}")
    with pytest.raises(BackendError, match="ended before the reply finished"):
        cut.response()
    with pytest.raises(BackendError, match="not JSON"):
        ChatStreamReader().feed_line("data: {broken")


def test_progress_interval_flag_and_environment():
    assert load_config(["--api-key", "k"], {}).progress_interval == 0.25
    assert load_config(["--api-key", "k"], {"BRIDGE_PROGRESS_INTERVAL": "0.5"}).progress_interval == 0.5
    assert load_config(["--api-key", "k", "--progress-interval", "0"], {"BRIDGE_PROGRESS_INTERVAL": "2"}).progress_interval == 0
    with pytest.raises(ConfigError, match="progress-interval"):
        load_config(["--api-key", "k", "--progress-interval", "-1"], {})


def test_a_job_still_served_when_run_closes_the_clients_is_left_to_its_lease():
    """A pop answered after the stop deadline's faults (a held pop returns a job as run() ends):
    the thread serving it finds the horde's client closed. It leaves the job to its lease (the
    horde requeues it) instead of raising out of the thread."""
    from io import StringIO

    from workers.bridge.config import BridgeConfig
    from workers.bridge.worker import Bridge

    out = StringIO()
    backend = ScriptedBackend()
    config = BridgeConfig(horde_url="http://127.0.0.1:9", api_key="k" * 22, worker_name="closing", backend="scripted")
    bridge = Bridge(config, backend, out=out)
    bridge.caps = backend.probe(None)
    bridge.close_clients()

    bridge._serve({"id": "0" * 32, "payload": {"prompt": "Once", "max_length": 8}, "ttl": 150})

    assert bridge.held == {}
    assert "left to its lease: the bridge stopped while serving it" in out.getvalue()


def test_probe_llamacpp_behind_a_proxy_without_props_reads_the_models_meta(route_backend):
    # A proxy that forwards only /v1: llama-server's /v1/models still says who it is (owned_by
    # "llamacpp") and, in its meta, the slot's context (n_ctx) beside the trained one.
    backend = route_backend(
        {"/v1/models": {"object": "list", "data": [{
            "id": "qwen3-8b", "object": "model", "created": 1765029600, "owned_by": "llamacpp",
            "meta": {"vocab_type": 2, "n_vocab": 151936, "n_ctx": 8192, "n_ctx_train": 40960, "n_embd": 4096}}]}}
    )
    caps = backend.probe(None)
    assert (caps.kind, caps.context) == ("llamacpp", 8192)
    assert "prompt_overflow_refused" in caps.features
    assert caps.context_shared  # the slots are not known: a cache they may share is divided
