"""Every refusal as the OpenAI SDK raises it: exception class, status, param and code (spec:
chat_front.md, Request keys, Message roles, No eligible worker, Kudos cap)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from contract.chat_limits import MAX_CHAT_SCHEMA_NESTING, MAX_CHAT_TOOL_COUNT
from tests.oai.conftest import MODEL, OTHER_MODEL

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hello?"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# The front's fail-fast grace where a test tells "at once" from "after the grace": long, so that a
# loaded box's slow answer is still far from it.
GRACE = 10.0


def _nested(levels: int) -> dict:
    """An object schema nesting `levels` levels below its root."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


REFUSALS = [
    # (request keys, SDK exception, param, code)
    ({"foo": 1}, openai.BadRequestError, "foo", "UnsupportedChatParameter"),
    ({"logprobs": True}, openai.BadRequestError, "logprobs", "UnsupportedChatParameter"),
    ({"service_tier": "flex"}, openai.BadRequestError, "service_tier", "UnsupportedChatParameter"),
    ({"temperature": 2.5}, openai.BadRequestError, "temperature", "UnsupportedChatParameter"),
    ({"top_p": -0.1}, openai.BadRequestError, "top_p", "UnsupportedChatParameter"),
    ({"presence_penalty": 3}, openai.BadRequestError, "presence_penalty", "UnsupportedChatParameter"),
    ({"max_tokens": 0}, openai.BadRequestError, "max_tokens", "UnsupportedChatParameter"),
    (
        {"max_completion_tokens": 8},
        openai.BadRequestError,
        "max_completion_tokens",
        "UnsupportedChatParameter",
    ),
    ({"n": 0}, openai.BadRequestError, "n", "UnsupportedChatParameter"),
    ({"n": 2}, openai.BadRequestError, "n", "UnsupportedChatParameter"),
    ({"stop": ["a", "b", "c", "d", "e"]}, openai.BadRequestError, "stop", "UnsupportedChatParameter"),
    ({"messages": []}, openai.BadRequestError, "messages", "BadRequest"),
    (
        {"messages": [{"role": "function", "content": "x", "name": "f"}]},
        openai.BadRequestError,
        "messages[0].role",
        "UnsupportedChatParameter",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        openai.BadRequestError,
        "messages[0].content[0].type=input_audio",
        "UnsupportedChatParameter",
    ),
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        openai.BadRequestError,
        "messages[0].tool_calls",
        "UnsupportedChatParameter",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "tool", "content": "y", "tool_call_id": "c"},
            ]
        },
        openai.BadRequestError,
        "messages[1].role",
        "UnsupportedChatParameter",
    ),
    ({"models": [MODEL]}, openai.BadRequestError, "models", "ChatRequestConflict"),
    ({"model": None}, openai.BadRequestError, "model", "BadRequest"),
    (
        {"model": None, "models": ["a", "b", "c", "d", "e", "f"]},
        openai.BadRequestError,
        "models",
        "UnsupportedChatParameter",
    ),
    ({"model": None, "models": [MODEL, ""]}, openai.BadRequestError, "models[1]", "UnsupportedChatParameter"),
    (
        {"model": None, "models": [MODEL, OTHER_MODEL, MODEL]},
        openai.BadRequestError,
        "models[2]",
        "BadRequest",
    ),
    ({"model": "llama3:8b"}, openai.NotFoundError, "model", "model_not_found"),
    ({"model": None, "models": [MODEL, "a:b"]}, openai.NotFoundError, "models[1]", "model_not_found"),
    ({"tool_choice": "auto"}, openai.BadRequestError, "tool_choice", "ChatRequestConflict"),
    ({"parallel_tool_calls": False}, openai.BadRequestError, "parallel_tool_calls", "ChatRequestConflict"),
    (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        openai.BadRequestError,
        "tool_choice",
        "ChatRequestConflict",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "c",
                    "strict": True,
                    "schema": {"type": "object", "properties": {"a": {"type": "string"}}},
                },
            }
        },
        openai.BadRequestError,
        "response_format.json_schema.schema",
        "UnsupportedChatParameter",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "c", "schema_": {"type": "object"}},
            }
        },
        openai.BadRequestError,
        "response_format.json_schema.schema_",
        "UnsupportedChatParameter",
    ),
    (
        {"stream_options": {"include_usage": True, "extra": 1}},
        openai.BadRequestError,
        "stream_options.extra",
        "UnsupportedChatParameter",
    ),
    (
        {"response_format": {"type": "json_object"}, "horde": {"openai_guards": True}},
        openai.BadRequestError,
        "messages",
        "ChatRequestConflict",
    ),
    (
        {"response_format": {"type": "json_object", "strict": True}},
        openai.BadRequestError,
        "response_format.strict",
        "UnsupportedChatParameter",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "c"}}},
        openai.BadRequestError,
        "response_format.json_schema.schema",
        "BadRequest",
    ),
    # Schemas nested deeper than MAX_CHAT_SCHEMA_NESTING, refused at their path.
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(MAX_CHAT_SCHEMA_NESTING + 1)}}]},
        openai.BadRequestError,
        "tools[0].function.parameters",
        "UnsupportedChatParameter",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "c", "schema": _nested(MAX_CHAT_SCHEMA_NESTING + 1)},
            }
        },
        openai.BadRequestError,
        "response_format.json_schema.schema",
        "UnsupportedChatParameter",
    ),
    # More tools than MAX_CHAT_TOOL_COUNT: a value outside the service contract.
    (
        {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_CHAT_TOOL_COUNT + 1)]},
        openai.BadRequestError,
        "tools",
        "UnsupportedChatParameter",
    ),
    ({"max_tokens": 100, "max_completion_tokens": 200}, openai.BadRequestError, "max_completion_tokens", "ChatRequestConflict"),
    ({"horde": {"nope": True}}, openai.BadRequestError, "horde.nope", "UnsupportedChatParameter"),
    # The keys the front applies itself are typed as OpenAI types them, not served as if omitted.
    ({"stream": "true"}, openai.BadRequestError, "stream", "BadRequest"),
    ({"user": 7}, openai.BadRequestError, "user", "BadRequest"),
    ({"metadata": {"run": 1}}, openai.BadRequestError, "metadata", "BadRequest"),
    ({"max_tokens": 20000}, openai.BadRequestError, "max_tokens", "BadRequest"),
    # Integers too large for a float are compared as integers, not a 500.
    ({"temperature": 10**400}, openai.BadRequestError, "temperature", "UnsupportedChatParameter"),
    ({"max_tokens": 10**400}, openai.BadRequestError, "max_tokens", "BadRequest"),
    ({"n": 10**400}, openai.BadRequestError, "n", "UnsupportedChatParameter"),
    # A seed is a 64-bit signed integer, as OpenAI types it; a larger one is not forwarded to a worker.
    ({"seed": 2**63}, openai.BadRequestError, "seed", "BadRequest"),
    ({"seed": -(2**63) - 1}, openai.BadRequestError, "seed", "BadRequest"),
    ({"seed": 2**70}, openai.BadRequestError, "seed", "BadRequest"),
    # Forwarded to the native route, which types it (ChatReasoningEffort).
    ({"reasoning_effort": "extreme"}, openai.BadRequestError, "reasoning_effort", "BadRequest"),
    # OpenRouter's reasoning object (ADR 0087): typed at its own paths, contradictions refused.
    ({"reasoning": "high"}, openai.BadRequestError, "reasoning", "BadRequest"),
    ({"reasoning": {"effort": "extreme"}}, openai.BadRequestError, "reasoning.effort", "BadRequest"),
    ({"reasoning": {"exclude": "yes"}}, openai.BadRequestError, "reasoning.exclude", "BadRequest"),
    ({"reasoning": {"enabled": 1}}, openai.BadRequestError, "reasoning.enabled", "BadRequest"),
    ({"reasoning": {"summary": "auto"}}, openai.BadRequestError, "reasoning.summary", "UnsupportedChatParameter"),
    ({"reasoning": {"max_tokens": 2000}}, openai.BadRequestError, "reasoning.max_tokens", "UnsupportedChatParameter"),
    (
        {"reasoning": {"effort": "high"}, "reasoning_effort": "low"},
        openai.BadRequestError,
        "reasoning.effort",
        "ChatRequestConflict",
    ),
    (
        {"reasoning": {"enabled": False, "effort": "low"}},
        openai.BadRequestError,
        "reasoning.effort",
        "ChatRequestConflict",
    ),
    (
        {"reasoning": {"enabled": True, "effort": "none"}},
        openai.BadRequestError,
        "reasoning.effort",
        "ChatRequestConflict",
    ),
    (
        {"reasoning": {"exclude": True}, "horde": {"include_reasoning": True}},
        openai.BadRequestError,
        "reasoning.exclude",
        "ChatRequestConflict",
    ),
    # A mistyped include_reasoning is refused as without the object, not overwritten by it.
    (
        {"reasoning": {"exclude": True}, "horde": {"include_reasoning": "yes"}},
        openai.BadRequestError,
        "horde.include_reasoning",
        "BadRequest",
    ),
]


@pytest.mark.parametrize(("keys", "exception", "param", "code"), REFUSALS)
def test_refusal_maps_to_the_sdk_exception(client, keys, exception, param, code):
    body = {"model": MODEL, "messages": USER, **keys}
    model = body.pop("model")
    messages = body.pop("messages")
    kwargs = {"model": model} if model is not None else {}
    with pytest.raises(exception) as caught:
        client.chat.completions.create(
            messages=messages, extra_body=body, **kwargs
        ) if model is not None else client.chat.completions.with_raw_response.create(
            model=openai.NOT_GIVEN, messages=messages, extra_body=body
        )
    error = caught.value
    assert (error.param, error.code) == (param, code), error.body
    assert error.response.headers["x-should-retry"] == "false"
    assert error.response.headers["access-control-allow-origin"] == "*"


def test_no_model_sent(front, requester):
    response = httpx.post(
        f"{front.live.v1}/chat/completions",
        json={"messages": USER},
        headers={"Authorization": f"Bearer {requester.key}"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"


def test_unknown_model_from_the_horde(client, start_worker):
    start_worker()
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nobody/knows-this-model", messages=USER)
    assert (caught.value.param, caught.value.code) == ("model", "model_not_found")
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model=openai.NOT_GIVEN, messages=USER, extra_body={"models": [MODEL, "nobody/knows-this-model"]}
        )
    assert caught.value.param == "models[1]"


def test_messages_too_long_for_every_context_name_the_messages(client, start_worker):
    """The horde's PromptExceedsContext (no truncation makes the latest message fit) names the
    messages, as OpenAI's context_length_exceeded does, not null."""
    start_worker()  # max_context_length 8192
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 10_000}])
    assert (caught.value.param, caught.value.code) == ("messages", "PromptExceedsContext"), caught.value.body


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "temperature": NaN, "messages": []}',
        b"{not json",
        b'{"model": "m", "messages": [], "top_p": Infinity}',
        # Past a float's range: Python reads it as infinity, which the native call's JSON cannot
        # carry (inside a tool's parameters, which nothing else reads, this was a 500).
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",'
        b' "function": {"name": "f", "parameters": {"type": "object", "x": 1e999}}}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",'
        b' "json_schema": {"name": "n", "schema": {"type": "number", "maximum": -' + b"9" * 400 + b'.5}}}}',
    ],
)
def test_not_json_or_nan_is_bad_request(front, requester, body):
    response = httpx.post(
        f"{front.live.v1}/chat/completions",
        content=body,
        headers={"Authorization": f"Bearer {requester.key}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "BadRequest"


@pytest.mark.parametrize("route", ["/chat/completions", "/completions"])
@pytest.mark.parametrize(
    ("body", "param"),
    [
        # A value the screening echoes in its refusal (a role), and a key it names: the answer was a
        # 500, the echoed text holding what UTF-8 cannot encode.
        (b'{"model": "m", "prompt": "p", "messages": [{"role": "\\ud800", "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "prompt": "p", "messages": [{"role": "user", "content": "x"}], "\\udfff": 1}', "\\udfff"),
        ("\ufeff".encode() + b'{"model": "m", "prompt": "\\udc00"}', "prompt"),
        ('{"model": "m", "prompt": "p"}'.encode("utf-16"), None),
    ],
    ids=["echoed-role", "key", "bom-prompt", "utf-16"],
)
def test_a_lone_surrogate_anywhere_is_bad_request(front, requester, route, body, param):
    if param is None:  # a UTF-16 body, which Python's parser reads with surrogatepass: a lone one encoded
        body = body.replace('"p"'.encode("utf-16-le"), '"\ud800"'.encode("utf-16-le", "surrogatepass"))
    response = httpx.post(
        f"{front.live.v1}{route}",
        content=body,
        headers={"Authorization": f"Bearer {requester.key}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "BadRequest" and "lone surrogate" in error["message"]
    assert error["param"] == (param or "prompt")


def test_bad_key_is_authentication_error(front, start_worker):
    start_worker()
    sdk = openai.OpenAI(base_url=front.live.v1, api_key="not-a-horde-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=USER)
    assert caught.value.status_code == 401 and caught.value.type == "authentication_error"


def test_anonymous_only_where_allowed(front, start_worker):
    start_worker()
    url = f"{front.live.v1}/chat/completions"
    response = httpx.post(url, json={"model": MODEL, "messages": USER}, timeout=20)
    assert response.status_code == 200, response.text
    front.configure(allow_anonymous=False)
    response = httpx.post(url, json={"model": MODEL, "messages": USER}, timeout=20)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


# --- availability ---------------------------------------------------------------------------------


def test_no_chat_worker_serving_the_model(client):
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER)
    assert caught.value.status_code == 503 and caught.value.code == "no_eligible_worker"
    assert caught.value.response.headers["retry-after"] == "30"


def _pending_requests():
    from chat.models import GenerationRequest

    return list(GenerationRequest.objects.filter(is_chat=True).values_list("cancelled", flat=True))


def test_no_eligible_worker_after_the_grace(client, start_worker):
    start_worker()  # untrusted owner: a trusted_workers request has no eligible worker
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=USER, extra_body={"horde": {"trusted_workers": True}}
        )
    elapsed = time.monotonic() - started
    assert caught.value.status_code == 503 and caught.value.code == "no_eligible_worker"
    assert caught.value.response.headers["retry-after"] == "30"
    assert 1.0 <= elapsed < 8
    assert _pending_requests() == [True]  # cancelled


def test_declaration_gap_is_404_at_once(client, start_worker):
    start_worker(features=["prompt_overflow_refused"])  # no tools
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[TOOL])
    assert caught.value.code == "no_worker_supports_features"
    assert "tools" in caught.value.message
    assert "retry-after" not in caught.value.response.headers
    assert _pending_requests() == [True]


def test_reasoning_effort_needs_a_worker_declaring_it(client, start_worker):
    start_worker(features=["prompt_overflow_refused"])
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="none")
    assert caught.value.code == "no_worker_supports_features"
    assert "reasoning_effort" in caught.value.message


def test_a_withdrawn_feature_is_404_at_once_after_a_served_request(front, client, start_worker):
    """A worker that stops declaring tools: the next tools request is refused at once (the
    availability caches follow its check-in), not after the front's grace."""
    worker = start_worker()  # every feature
    reply = client.chat.completions.create(model=MODEL, messages=USER, tools=[TOOL])
    assert reply.choices[0].finish_reason in ("tool_calls", "stop")
    worker.features = ["prompt_overflow_refused"]
    worker.check_in()
    front.configure(fail_fast_grace_seconds=GRACE)
    started = time.monotonic()
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[TOOL])
    assert caught.value.code == "no_worker_supports_features" and "tools" in caught.value.message
    assert time.monotonic() - started < GRACE / 2


def test_limit_gap_is_400_no_worker_supports_limit(client, start_worker):
    start_worker(max_context_length=4096)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=USER, extra_body={"horde": {"max_context_length": 8192}}
        )
    assert (caught.value.code, caught.value.param) == ("no_worker_supports_limit", "horde.max_context_length")
    assert "a context length that high" in caught.value.message and "4096 tokens" in caught.value.message


def test_a_limit_gap_without_a_model_list_entry_names_the_limit():
    """When the model list holds no entry for a requested model, the limit's name stands in the
    value's place."""
    from oai.native_errors import gap_error
    from oai.schema import screen_request

    request = screen_request({"model": MODEL, "messages": USER, "max_tokens": 4000})
    reason = {"kind": "declaration_gap", "missing_declarations": [], "exceeded_limits": ["max_length"]}
    error = gap_error(reason, request, None)
    assert (error.status, error.code, error.param) == (400, "no_worker_supports_limit", "max_tokens")
    assert error.message == (
        "No worker eligible for this request currently declares a completion limit that high; the largest "
        "any online worker for the model declares now is max_length tokens."
    )


def test_limit_gap_found_at_submit_reads_the_declared_value(front, make_user, start_worker):
    """A requester without the kudos upfront learns of the gap at submit (the horde's 403
    NoEligibleWorker); the front still names what the workers declare, read from the model list."""
    poor = make_user("poor", kudos=0)
    start_worker(max_context_length=4096, max_length=2048)
    client = openai.OpenAI(base_url=front.live.v1, api_key=poor.key, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2000, extra_body={"horde": {"max_context_length": 8192}}
        )
    client.close()
    assert (caught.value.code, caught.value.param) == ("no_worker_supports_limit", "horde.max_context_length")
    assert caught.value.body["message"] == (
        "No worker eligible for this request currently declares a context length that high; the largest "
        "any online worker for the model declares now is 4096 tokens."
    )


def test_a_models_list_of_one_reads_the_listed_models(client, start_worker):
    start_worker(max_context_length=4096)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=openai.NOT_GIVEN,
            messages=USER,
            extra_body={"models": [MODEL], "horde": {"max_context_length": 8192}},
        )
    assert "the largest any online worker for the listed models declares now is 4096 tokens" in caught.value.message


def test_streamed_refusal_at_the_first_read_has_the_same_status(client, start_worker):
    start_worker(features=["prompt_overflow_refused"])
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[TOOL], stream=True)
    assert caught.value.code == "no_worker_supports_features"


def test_fail_fast_with_zero_eligible_threads(front, client, start_worker):
    front.configure(fail_fast_grace_seconds=GRACE)
    start_worker()
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            extra_body={"horde": {"trusted_workers": True, "availability_mode": "fail_fast"}},
        )
    assert time.monotonic() - started < GRACE / 2  # decided at the first read, before the grace
    error = caught.value
    assert (error.status_code, error.code, error.param) == (
        503,
        "queue_unavailable",
        "horde.availability_mode",
    )
    assert error.response.headers["retry-after"] == "30"
    assert "0 eligible worker threads" in error.message
    assert _pending_requests() == [True]


def test_fail_fast_admits_a_request_a_worker_can_serve(front, client, start_worker):
    front.configure(nonstream_timeout_seconds=300)  # the horde-wide wait estimate fits this budget
    start_worker()
    completion = client.chat.completions.create(
        model=MODEL, messages=USER, extra_body={"horde": {"availability_mode": "fail_fast"}}
    )
    assert completion.choices[0].message.content


def test_kudos_cap(client, start_worker):
    start_worker()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, extra_body={"horde": {"max_kudos": 1}})
    error = caught.value
    assert (error.code, error.param, error.type) == (
        "max_kudos_exceeded",
        "horde.max_kudos",
        "invalid_request_error",
    )
    assert error.body["metadata"]["max_kudos"] == 1
    assert error.body["metadata"]["kudos_estimate"] > 1
    assert _pending_requests() == []


@pytest.mark.parametrize(
    ("message", "said"),
    [
        ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "a user message."),
        ({"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "an assistant message."),
    ],
)
def test_a_refused_content_part_names_its_role_with_its_article(message, said):
    from oai.errors import ChatFrontError
    from oai.schema import screen_request

    with pytest.raises(ChatFrontError) as caught:
        screen_request({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}, message]})
    assert caught.value.message.endswith(f"is not supported on {said}")
    assert caught.value.param.startswith("messages[1].content[0].type=")
