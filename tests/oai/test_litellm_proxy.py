"""The LiteLLM proxy 1.110.2 (`litellm --config config.yaml`, unchanged) in front of the horde's /v1: the
requests it sent the horde, captured on the wire between the two and replayed here byte for byte (the
model name aside) against the live horde and its mounted front, the worker side driven over the real
native routes. docs/adr/0115 says how it was run and what it does.

A model entry `openai/<horde model>` with `api_base: <horde>/v1` and the horde key: the proxy posts with
the openai SDK it embeds (`AsyncOpenAI/Python 3.63.0`, its x-stainless-* headers, a read timeout of
6000 s) the body its own client sent, mostly key for key, and it always adds
`stream_options: {"include_usage": true}` to a stream, which it reads for its usage and spend logs.
It parses a whole reply into the SDK's ChatCompletion and re-reads a stream chunk by chunk (`data:`
events, `[DONE]`); comments such as the horde's `: keepalive` are skipped, and it waits for the first
data chunk before it answers its own client at all.

- `text-completion-openai/<model>` posts /v1/completions the same way (a stream with the SDK's headers
  in httpx's capitalised defaults and `"stream": true` second).
- `hosted_vllm/<model>` posts with its own httpx client: `json.dumps` spacing, `user-agent:
  litellm/1.110.2`, `accept: */*`, `"stream": false` on a whole request.
- At its start it lists `GET /v1/models` once per entry (`user-agent: litellm/1.110.2`); its `/health`
  posts `max_tokens: 16`, a real (paid) request to each entry.
- It retries 408, 409, 429 and every 5xx twice (three requests), whatever `x-should-retry` says: the
  horde's 502 ChatRequestFaulted, which says `x-should-retry: false`, reaches the horde three times
  unless the operator sets a retry policy (ADR 0115). The horde's answers that tell every client not to
  retry are asserted here; the proxy's own policy is its operator's.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from chat.models import Generation, GenerationRequest
from tests.oai.conftest import MODEL, wait_for

pytestmark = pytest.mark.slow

PROXY_SDK_AGENT = "AsyncOpenAI/Python 3.63.0"
PROXY_AGENT = "litellm/1.110.2"
WEATHER_TOOL = (
    '[{"type":"function","function":{"name":"get_weather","description":"Weather of a city","parameters":'
    '{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]'
)
TOOL_CALL = {"id": "call_220398119ef3f24f1e00c3fc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":""}'}}


def _stainless(read_timeout: str) -> list[tuple[str, str]]:
    return [
        ("user-agent", PROXY_SDK_AGENT),
        ("x-stainless-lang", "python"),
        ("x-stainless-package-version", "3.63.0"),
        ("x-stainless-os", "Linux"),
        ("x-stainless-arch", "x64"),
        ("x-stainless-runtime", "CPython"),
        ("x-stainless-runtime-version", "3.11.7"),
        ("x-stainless-async", "async:asyncio"),
        ("x-stainless-raw-response", "true"),
        ("x-stainless-retry-count", "0"),
        ("x-stainless-read-timeout", read_timeout),
    ]


def sdk_post_headers(key: str, body: bytes, host: str, *, read_timeout: str = "6000.0") -> list[tuple[str, str]]:
    """The headers of the proxy's openai SDK post, in its order (a health check reads for 600 s)."""
    return [
        ("host", host),
        ("accept-encoding", "gzip, deflate"),
        ("connection", "keep-alive"),
        ("authorization", f"Bearer {key}"),
        ("accept", "application/json"),
        ("content-type", "application/json"),
        *_stainless(read_timeout),
        ("content-length", str(len(body))),
    ]


def sdk_text_stream_headers(key: str, body: bytes, host: str) -> list[tuple[str, str]]:
    """text-completion-openai's stream: httpx's own defaults, capitalised, then the SDK's."""
    return [
        ("Host", host),
        ("Accept-Encoding", "gzip, deflate"),
        ("Connection", "keep-alive"),
        ("authorization", f"Bearer {key}"),
        ("accept", "application/json"),
        ("content-type", "application/json"),
        *_stainless("6000.0"),
        ("Content-Length", str(len(body))),
    ]


def vllm_post_headers(key: str, body: bytes, host: str) -> list[tuple[str, str]]:
    """hosted_vllm's own httpx client."""
    return [
        ("host", host),
        ("accept", "*/*"),
        ("accept-encoding", "gzip, deflate"),
        ("connection", "keep-alive"),
        ("user-agent", PROXY_AGENT),
        ("authorization", f"Bearer {key}"),
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
    ]


def _host(live_horde) -> str:
    return f"127.0.0.1:{live_horde.port}"


def _chat(messages: str, rest: str = "") -> bytes:
    return ('{"model":"' + MODEL + '","messages":' + messages + rest + "}").encode()


HELLO = '[{"role":"user","content":"Hello, horde"}]'
WEATHER = '[{"role":"user","content":"Weather in Paris?"}]'
STREAM_USAGE = ',"stream":true,"stream_options":{"include_usage":true}'


def post(live_horde, path: str, body: bytes, headers: list[tuple[str, str]], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{live_horde.url}/v1{path}", content=body, headers=headers, timeout=20, **kwargs)


def sse_data(answer: httpx.Response) -> list[Any]:
    """The stream's `data:` payloads as the proxy's SDK reads them: comments skipped, `[DONE]` kept."""
    events: list[Any] = []
    for block in answer.text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_usage(usage: dict[str, Any]) -> None:
    """What the proxy copies into its own answer and its spend logs."""
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def assert_chat_stream(events: list[Any], *, finish: str) -> list[dict[str, Any]]:
    """One id and object throughout, one finish_reason, then one usage chunk (choices []) and [DONE]."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finishes == [finish]
    assert chunks[-1]["choices"] == []
    assert_usage(chunks[-1]["usage"])
    assert [c for c in chunks if c.get("usage")] == [chunks[-1]]
    return [ch["delta"] for c in chunks for ch in c["choices"]]


# --- at its start --------------------------------------------------------------------------------------


def test_litellm_proxy_start_lists_the_models(front, requester, start_worker, live_horde):
    start_worker()
    headers = [
        ("host", _host(live_horde)),
        ("accept", "*/*"),
        ("connection", "keep-alive"),
        ("user-agent", PROXY_AGENT),
        ("authorization", f"Bearer {requester.key}"),
        ("accept-encoding", "identity"),
    ]
    answer = httpx.get(f"{live_horde.url}/v1/models", headers=headers, timeout=10)
    assert answer.status_code == 200
    assert [m["id"] for m in answer.json()["data"]] == [MODEL]


def test_litellm_proxy_start_with_a_bad_key_is_told_so(front, live_horde):
    headers = [
        ("host", _host(live_horde)),
        ("accept", "*/*"),
        ("connection", "keep-alive"),
        ("user-agent", PROXY_AGENT),
        ("authorization", "Bearer not-a-horde-key-123"),
        ("accept-encoding", "identity"),
    ]
    answer = httpx.get(f"{live_horde.url}/v1/models", headers=headers, timeout=10)
    assert answer.status_code == 401  # its AuthenticationError, not retried
    assert answer.json()["error"]["code"] == "invalid_api_key"
    assert answer.headers["x-should-retry"] == "false"


# --- chat completions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "read_timeout"),
    [
        (_chat(HELLO), "6000.0"),
        (_chat(HELLO, ',"temperature":0.5,"stop":["\\n","END"],"max_tokens":20,"seed":42'), "6000.0"),
        (_chat(HELLO, ',"max_completion_tokens":20'), "6000.0"),
        # its /health: a real request with max_tokens 16, the horde's floor (MIN_CHAT_MAX_TOKENS)
        (_chat('[{"role":"user","content":"What\'s 1 + 1?"}]', ',"max_tokens":16'), "600.0"),
    ],
    ids=["plain", "stop-seed-max_tokens", "max_completion_tokens", "health-check"],
)
def test_litellm_proxy_whole_chat(front, requester, start_worker, live_horde, body, read_timeout):
    worker = start_worker()
    headers = sdk_post_headers(requester.key, body, _host(live_horde), read_timeout=read_timeout)
    answer = post(live_horde, "/chat/completions", body, headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    data = answer.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert isinstance(data["created"], int) and data["model"] == MODEL
    (choice,) = data["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "Hello from the horde."}
    assert_usage(data["usage"])
    payload, sent = worker.jobs[0]["payload"], json.loads(body)
    assert payload["max_length"] == (sent.get("max_completion_tokens") or sent.get("max_tokens") or 512)
    assert payload.get("stop_sequence") == sent.get("stop") and payload.get("seed") == sent.get("seed")


def test_litellm_proxy_streamed_chat_with_the_usage_it_always_asks(front, requester, start_worker, live_horde):
    """Its client need not ask for the usage: the proxy adds stream_options itself and drops the usage
    chunk again when its client did not ask. (Relayed token by token with Redis, whole without.)"""
    start_worker()
    body = _chat(HELLO, STREAM_USAGE)
    answer = post(live_horde, "/chat/completions", body, sdk_post_headers(requester.key, body, _host(live_horde)))
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    deltas = assert_chat_stream(sse_data(answer), finish="stop")
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == "Hello from the horde."


def tool_reply(job: dict[str, Any]) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}, "finish_reason": "tool_calls"}


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_litellm_proxy_tools_whole(front, requester, start_worker, live_horde, tool_choice):
    worker = start_worker(reply=tool_reply)
    body = _chat(WEATHER, ',"tools":' + WEATHER_TOOL + ',"tool_choice":"' + tool_choice + '"')
    answer = post(live_horde, "/chat/completions", body, sdk_post_headers(requester.key, body, _host(live_horde)))
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"] == [TOOL_CALL]
    assert worker.jobs[0]["payload"]["tool_choice"] == tool_choice
    assert_usage(answer.json()["usage"])


def test_litellm_proxy_tools_streamed(front, requester, start_worker, live_horde):
    start_worker(reply=tool_reply)
    body = _chat(WEATHER, ',"tools":' + WEATHER_TOOL + ',"tool_choice":"required"' + STREAM_USAGE)
    answer = post(live_horde, "/chat/completions", body, sdk_post_headers(requester.key, body, _host(live_horde)))
    assert answer.status_code == 200
    deltas = assert_chat_stream(sse_data(answer), finish="tool_calls")
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert calls == [{"index": 0, **TOOL_CALL}]


def test_litellm_proxy_tool_result_turn_without_content(front, requester, start_worker, live_horde):
    """The proxy forwards its client's assistant turn as the SDK dumped it: tool_calls and no content
    key at all."""
    worker = start_worker()
    messages = (
        '[{"role":"user","content":"Weather?"},{"role":"assistant","tool_calls":[{"id":"call_b55e391f37857a63980f420e",'
        '"function":{"arguments":"{\\"city\\":\\"\\"}","name":"get_weather"},"type":"function"}]},'
        '{"role":"tool","tool_call_id":"call_b55e391f37857a63980f420e","content":"sunny"}]'
    )
    body = _chat(messages, ',"tools":' + WEATHER_TOOL)
    answer = post(live_horde, "/chat/completions", body, sdk_post_headers(requester.key, body, _host(live_horde)))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "Hello from the horde."
    sent = worker.jobs[0]["payload"]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["id"] == "call_b55e391f37857a63980f420e"


def test_litellm_proxy_json_schema(front, requester, start_worker, live_horde):
    worker = start_worker(
        reply=lambda job: {"message": {"role": "assistant", "content": '{"name":"","age":0}'}, "finish_reason": "stop"}
    )
    schema = (
        ',"response_format":{"type":"json_schema","json_schema":{"name":"person","strict":true,"schema":'
        '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},'
        '"required":["name","age"],"additionalProperties":false}}}'
    )
    body = _chat(HELLO, schema)
    answer = post(live_horde, "/chat/completions", body, sdk_post_headers(requester.key, body, _host(live_horde)))
    assert answer.status_code == 200, answer.text
    assert json.loads(answer.json()["choices"][0]["message"]["content"]) == {"name": "", "age": 0}
    assert worker.jobs[0]["payload"]["response_format"]["json_schema"]["name"] == "person"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_litellm_proxy_hosted_vllm_body(front, requester, start_worker, live_horde, stream):
    start_worker()
    rest = ', "stream": true, "stream_options": {"include_usage": true}' if stream else ', "stream": false'
    body = ('{"model": "' + MODEL + '", "messages": [{"role": "user", "content": "Hello, horde"}]' + rest + "}").encode()
    answer = post(live_horde, "/chat/completions", body, vllm_post_headers(requester.key, body, _host(live_horde)))
    assert answer.status_code == 200, answer.text
    if stream:
        deltas = assert_chat_stream(sse_data(answer), finish="stop")
        assert "".join(d.get("content") or "" for d in deltas) == "Hello from the horde."
    else:
        assert answer.json()["choices"][0]["message"]["content"] == "Hello from the horde."


# --- refusals it maps to its own errors (and which of them it would retry) -------------------------------


def test_litellm_proxy_refusals_are_not_retried(front, requester, start_worker, live_horde):
    """4xx other than 408/409/429: its BadRequestError and NotFoundError, sent once; each also says
    x-should-retry: false for the SDKs that read it."""
    start_worker()
    host = _host(live_horde)
    cases = [
        (_chat(HELLO, ',"n":2'), 400, "UnsupportedChatParameter"),
        (_chat('[{"role":"user","content":"' + "word " * 40000 + '"}]'), 400, None),
        (b'{"model":"ghost-model","messages":' + HELLO.encode() + b"}", 404, "model_not_found"),
    ]
    for body, status, code in cases:
        answer = post(live_horde, "/chat/completions", body, sdk_post_headers(requester.key, body, host))
        assert answer.status_code == status, answer.text
        assert answer.headers["x-should-retry"] == "false"
        if code:
            assert answer.json()["error"]["code"] == code
    assert GenerationRequest.objects.count() == 0


def test_litellm_proxy_faulted_request_says_do_not_retry(front, requester, start_worker, live_horde):
    """A request every attempt of which faulted: 502 ChatRequestFaulted, x-should-retry: false. The proxy
    ignores the header and sends it twice more unless its retry policy says 0 (ADR 0115)."""
    start_worker(reply=lambda job: {"state": "faulted", "fault_reason": "generation_error"})
    body = _chat(HELLO)
    answer = post(live_horde, "/chat/completions", body, sdk_post_headers(requester.key, body, _host(live_horde)))
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == "ChatRequestFaulted"
    assert answer.headers["x-should-retry"] == "false"


def test_litellm_proxy_retries_of_a_concurrency_refusal_cost_nothing(front, requester, start_worker, live_horde):
    """Over the requester's concurrency: 429 TooManyPrompts, which its router sends three times (no
    Retry-After, about 1.2 s apart); each is refused before any row or charge."""
    from accounts.models import HordeUser

    worker = start_worker()
    worker.paused.set()  # the first request waits
    HordeUser.objects.filter(pk=requester.user.pk).update(concurrency=1)
    first = httpx.post(
        f"{live_horde.url}/api/v2/generate/chat/async",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}]},
        headers={"apikey": requester.key},
        timeout=10,
    )
    assert first.status_code == 202, first.text
    kudos = HordeUser.objects.get(pk=requester.user.pk).kudos
    body = _chat(HELLO)
    for _ in range(3):
        answer = post(live_horde, "/chat/completions", body, sdk_post_headers(requester.key, body, _host(live_horde)))
        assert answer.status_code == 429
        assert answer.json()["error"]["code"] == "TooManyPrompts"
    assert GenerationRequest.objects.count() == 1
    assert HordeUser.objects.get(pk=requester.user.pk).kudos == kudos


# --- a cancel: its client goes away mid-stream -------------------------------------------------------------


@pytest.mark.redis_only  # the relayed stream
def test_litellm_proxy_closing_mid_stream_cancels_the_request(front, requester, streaming_worker, live_horde):
    """Once the first content chunk reached it, the proxy's client closing makes the proxy close its
    connection to the horde, which cancels the request and settles on what was streamed."""
    body = _chat('[{"role":"user","content":"Tell me a story"}]', STREAM_USAGE)
    headers = sdk_post_headers(requester.key, body, _host(live_horde))
    shown: list[str] = []
    closed = threading.Event()

    def proxy() -> None:
        with httpx.Client(timeout=30) as http:
            request = http.build_request("POST", f"{live_horde.url}/v1/chat/completions", content=body, headers=headers)
            response = http.send(request, stream=True)
            try:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            shown.append(choice["delta"].get("content") or "")
                    if "".join(shown) == "Once upon":
                        break
            finally:
                response.close()
                closed.set()

    thread = threading.Thread(target=proxy, daemon=True)
    thread.start()
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Once")
    streaming_worker.post(job, 2, " upon")
    assert closed.wait(10) and "".join(shown) == "Once upon"
    request = GenerationRequest.objects.get()
    assert wait_for(lambda: GenerationRequest.objects.get(pk=request.pk).cancelled, 5), "not cancelled"
    assert streaming_worker.post(job, 3, " a time")["cancelled"] is True
    generation = Generation.objects.get(pk=job["id"])
    assert generation.state == Generation.State.CANCELLED
    assert generation.settled_character_count == len("Once upon")
    thread.join(5)


# --- text completions (text-completion-openai/) ----------------------------------------------------------


def test_litellm_proxy_text_completion_whole(front, requester, start_text_worker, live_horde):
    start_text_worker(generation=lambda job: " the dragon slept.")
    body = ('{"model":"' + MODEL + '","prompt":"Once upon a time","max_tokens":32}').encode()
    answer = post(live_horde, "/completions", body, sdk_post_headers(requester.key, body, _host(live_horde)))
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    (choice,) = data["choices"]
    assert choice["text"] == " the dragon slept." and choice["finish_reason"] == "stop" and choice["index"] == 0
    assert_usage(data["usage"])


def test_litellm_proxy_text_completion_streamed(front, requester, start_text_worker, live_horde):
    start_text_worker(generation=lambda job: " the dragon slept.")
    body = (
        '{"model":"' + MODEL + '","stream":true,"prompt":"Once upon a time","max_tokens":32,'
        '"stream_options":{"include_usage":true}}'
    ).encode()
    answer = post(live_horde, "/completions", body, sdk_text_stream_headers(requester.key, body, _host(live_horde)))
    assert answer.status_code == 200
    events = sse_data(answer)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == " the dragon slept."
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["stop"]
    assert chunks[-1]["choices"] == [] and [c for c in chunks if c.get("usage")] == [chunks[-1]]
    assert_usage(chunks[-1]["usage"])
