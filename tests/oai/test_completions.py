"""The OpenAI front with the real openai client against a live horde and a test worker: plain and
streamed replies, tool calls, structured output and reasoning (spec: chat_front.md, Response shape
and the stream's events)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.oai.conftest import MODEL, OTHER_MODEL, text_reply

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hello?"}]


def test_plain_reply(client, start_worker):
    worker = start_worker()
    completion = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64)
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "Hello from the horde."
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == MODEL
    assert completion.system_fingerprint.startswith("fp_") and len(completion.system_fingerprint) == 13
    assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens > 0
    assert (
        completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    # The worker got the messages and the token limit as the chat job payload.
    payload = worker.jobs[0]["payload"]
    assert payload["messages"] == USER and payload["max_length"] == 64


def test_reasoning_effort_reaches_the_worker(client, start_worker):
    """reasoning_effort is a field of the native chat request: the front forwards the SDK's key
    unchanged, and the worker receives it in the job (docs/adr/0058-reasoning-keys-at-the-front.md)."""
    worker = start_worker()  # declares reasoning_effort
    client.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="low")
    assert worker.jobs[0]["payload"]["reasoning_effort"] == "low"
    client.chat.completions.create(model=MODEL, messages=USER)
    assert "reasoning_effort" not in worker.jobs[1]["payload"]  # no default is sent


def test_reasoning_object_maps_to_the_native_keys(front, requester, start_worker):
    """OpenRouter's reasoning object, as Open WebUI and OpenRouter-style clients send it, on the
    wire: effort is reasoning_effort, enabled false is effort none, exclude hides the reasoning
    whole and streamed, and a reasoning_effort that agrees is accepted (ADR 0087)."""
    worker = start_worker(reply=lambda job: REASONING)

    def post(body: dict) -> httpx.Response:
        return httpx.post(
            f"{front.live.v1}/chat/completions",
            json={"model": MODEL, "messages": USER, **body},
            headers={"Authorization": f"Bearer {requester.key}"},
            timeout=20,
        )

    shown = post({"reasoning": {"effort": "high"}})
    assert shown.status_code == 200, shown.text
    assert shown.json()["choices"][0]["message"]["reasoning_content"] == "Six times seven."
    assert worker.jobs[-1]["payload"]["reasoning_effort"] == "high"
    assert post({"reasoning": {"effort": "low"}, "reasoning_effort": "low"}).status_code == 200
    assert worker.jobs[-1]["payload"]["reasoning_effort"] == "low"
    assert post({"reasoning": {"enabled": False}}).status_code == 200
    assert worker.jobs[-1]["payload"]["reasoning_effort"] == "none"
    assert post({"reasoning": {"enabled": True}}).status_code == 200
    assert "reasoning_effort" not in worker.jobs[-1]["payload"]  # the worker's default effort

    hidden = post({"reasoning": {"effort": "medium", "exclude": True}})
    assert hidden.status_code == 200, hidden.text
    message = hidden.json()["choices"][0]["message"]
    assert message["content"] == "42." and "reasoning_content" not in message
    assert hidden.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
    streamed = post({"reasoning": {"exclude": True}, "stream": True})
    assert streamed.status_code == 200, streamed.text
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    deltas = [event["choices"][0]["delta"] for event in events if event["choices"]]
    assert not any("reasoning_content" in delta for delta in deltas)
    assert "".join(delta.get("content") or "" for delta in deltas) == "42."
    assert post({"reasoning": {"exclude": False}}).json()["choices"][0]["message"]["reasoning_content"]
    assert post({"reasoning": None}).status_code == 200  # null counts as omitted


def test_reported_counts_and_reasoning_tokens(client, start_worker):
    start_worker(
        reply=lambda job: {
            "message": {"role": "assistant", "content": "Four."},
            "finish_reason": "length",
            "native_finish_reason": "max_tokens",
            "prompt_tokens": 11,
            "completion_tokens": 7,
            "reasoning_tokens": 3,
        }
    )
    completion = client.chat.completions.create(model=MODEL, messages=USER)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (11, 7)
    assert completion.usage.completion_tokens_details.reasoning_tokens == 3
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].native_finish_reason == "max_tokens"


def test_models_list_serves_any_listed_model(front, requester, start_worker):
    start_worker(model=OTHER_MODEL)
    response = httpx.post(
        f"{front.live.v1}/chat/completions",
        json={"models": [MODEL, OTHER_MODEL], "messages": USER},
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=20,
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == OTHER_MODEL


def test_sillytavern_custom_source_body_is_served(front, requester, start_worker):
    """SillyTavern's Chat Completion source "Custom (OpenAI-compatible)" posts this body from its
    server (src/endpoints/backends/chat-completions.js): its client always sets `logit_bias`, `{}`
    unless a bias preset has entries. OpenAI serves `logit_bias` at its default, so the front does too
    (as /v1/completions does), and does not forward it; a bias with entries is still refused."""
    worker = start_worker()
    body = {
        "messages": [{"role": "system", "content": "You are Seraphina."}, *USER],
        "model": MODEL,
        "temperature": 1,
        "max_tokens": 300,
        "stream": False,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "top_p": 1,
        "logit_bias": {},
    }
    url = f"{front.live.v1}/chat/completions"
    headers = {"Authorization": f"Bearer {requester.key}"}
    response = httpx.post(url, json=body, headers=headers, timeout=20)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello from the horde."
    assert "logit_bias" not in worker.jobs[0]["payload"]
    for value in (None, {}):
        served = httpx.post(url, json={**body, "logit_bias": value}, headers=headers, timeout=20)
        assert served.status_code == 200, served.text
    refused = httpx.post(url, json={**body, "logit_bias": {"50256": -100}}, headers=headers, timeout=20)
    assert refused.status_code == 400
    assert (refused.json()["error"]["param"], refused.json()["error"]["code"]) == (
        "logit_bias",
        "UnsupportedChatParameter",
    )


def test_sdk_replayed_stream_fields_are_dropped(client, start_worker):
    """What the openai SDK sends back when an app appends a streamed assistant reply to `messages`
    (its accumulated message: tool_calls[].index, function.parsed_arguments, refusal, audio,
    annotations, function_call, parsed), plus a tool message with `name`: the front drops the keys
    it does not serve and forwards the rest unchanged to the worker."""
    worker = start_worker()
    replayed_call = {
        "index": 0,
        "id": "call_0",
        "type": "function",
        "function": {
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
            "parsed_arguments": {"city": "Oslo"},
        },
    }
    history = [
        {"role": "user", "content": "Hi", "extra_user_key": 1},
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "audio": None,
            "annotations": [],
            "function_call": None,
            "parsed": None,
            "tool_calls": [replayed_call],
        },
        {"role": "tool", "content": "Sunny.", "tool_call_id": "call_0", "name": "get_weather"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And now?", "cache_control": {"type": "ephemeral"}}],
        },
    ]
    completion = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], logprobs=False, store=False
    )
    assert completion.choices[0].message.content == "Hello from the horde."
    sent = worker.jobs[0]["payload"]["messages"]
    assert "extra_user_key" not in sent[0]
    assert not {"refusal", "audio", "annotations", "function_call", "parsed"} & set(sent[1])
    assert "index" not in sent[1]["tool_calls"][0]
    assert "parsed_arguments" not in sent[1]["tool_calls"][0]["function"]
    assert "name" not in sent[2]
    assert "cache_control" not in sent[3]["content"][0]
    assert sent == [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "Sunny.", "tool_call_id": "call_0"},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
    ]


def test_empty_reply_carries_the_notice(client, start_worker):
    start_worker(reply=lambda job: {"message": {"role": "assistant", "content": ""}, "finish_reason": "stop"})
    completion = client.chat.completions.create(model=MODEL, messages=USER)
    assert completion.choices[0].message.content == ""
    assert completion.model_extra["x_horde"]["notice"]


def test_unserved_keys_of_tools_and_tool_choice_are_dropped(client, start_worker):
    """A tools entry keeps type and function, its function name, description, parameters and strict,
    with the parameters schema forwarded unchanged (its own keys included); a tool_choice object keeps
    type and function, and its function name. What clients add beside them (Anthropic-style
    cache_control, a function's examples) is dropped as OpenAI ignores it, not refused."""
    worker = start_worker(reply=calls_reply("get_weather"))
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "examples": ["Oslo"], "x-unit": "none"}},
        "additionalProperties": False,
    }
    tool = {
        "type": "function",
        "cache_control": {"type": "ephemeral"},
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": parameters,
            "strict": False,
            "examples": [{"city": "Oslo"}],
        },
    }
    completion = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        extra_body={
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "get_weather", "x": 1}, "cache_control": {}},
        },
    )
    assert completion.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert worker.jobs[0]["payload"]["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": parameters,
                "strict": False,
            },
        }
    ]


# --- streaming -----------------------------------------------------------------------------------


def test_streamed_reply_chunks_in_order_with_usage(client, start_worker):
    start_worker(
        reply=lambda job: {
            "message": {"role": "assistant", "content": "Streamed whole.", "reasoning_content": "Thinking."},
            "finish_reason": "stop",
            "prompt_tokens": 5,
            "completion_tokens": 4,
        }
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content is None
    assert chunks[1].choices[0].delta.model_extra["reasoning_content"] == "Thinking."
    assert chunks[2].choices[0].delta.content == "Streamed whole."
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[3].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 9
    assert len({c.id for c in chunks}) == 1 and len({c.system_fingerprint for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stream_options_include_obfuscation_is_accepted(client, start_worker):
    """stream_options.include_obfuscation is OpenAI's (the SDK types it beside include_usage); clients
    set it to false to save bandwidth. The front never pads its chunks, so either value is served as
    it is, and stream_options keeps refusing keys OpenAI does not know."""
    start_worker()
    for obfuscation in (False, True):
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=USER,
                stream=True,
                stream_options={"include_usage": True, "include_obfuscation": obfuscation},
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from the horde."
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=USER, stream=True, stream_options={"include_obfuscation": "no"}
        )
    assert (caught.value.param, caught.value.code) == ("stream_options.include_obfuscation", "BadRequest")


def test_stream_sends_keepalives_then_done(front, requester, start_worker):
    start_worker(delay=1.2)
    lines = []
    with httpx.stream(
        "POST",
        f"{front.live.v1}/chat/completions",
        json={"model": MODEL, "messages": USER, "stream": True},
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=20,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                lines.append(line)
    comments = [line for line in lines if line.startswith(":")]
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert len(comments) >= 2  # the opening comment and at least one keepalive while the worker ran
    assert data[-1] == "[DONE]"
    assert json.loads(data[0])["choices"][0]["delta"] == {"role": "assistant"}
    # No usage chunk without include_usage.
    assert all("usage" not in json.loads(d) for d in data[:-1])


# --- tools, structured output, reasoning ----------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def calls_reply(*names: str, finish: str = "tool_calls"):
    def reply(job):
        calls = [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": '{"city": "Oslo"}'}}
            for i, n in enumerate(names)
        ]
        return {
            "message": {"role": "assistant", "content": None, "tool_calls": calls},
            "finish_reason": finish,
        }

    return reply


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_tool_calls(client, start_worker, tool_choice):
    worker = start_worker(reply=calls_reply("get_weather"))
    completion = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice=tool_choice
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("call_0", "get_weather", '{"city": "Oslo"}')
    ]
    assert worker.jobs[0]["payload"]["tool_choice"] == tool_choice


def test_forced_function_is_sent_narrowed_and_finishes_with_stop(client, start_worker):
    worker = start_worker(reply=calls_reply("get_time"))
    completion = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert completion.choices[0].message.tool_calls[0].function.name == "get_time"
    assert completion.choices[0].finish_reason == "stop"
    payload = worker.jobs[0]["payload"]
    assert payload["tool_choice"] == "required" and [t["function"]["name"] for t in payload["tools"]] == [
        "get_time"
    ]


def test_parallel_tool_calls_off_keeps_the_first_call(client, start_worker):
    start_worker(reply=calls_reply("get_weather", "get_time"))
    completion = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, TIME], parallel_tool_calls=False
    )
    assert [c.function.name for c in completion.choices[0].message.tool_calls] == ["get_weather"]


def test_streamed_tool_calls_come_whole_in_one_chunk(client, start_worker):
    start_worker(reply=calls_reply("get_weather", "get_time"))
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME], stream=True)
    )
    tool_chunks = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(tool_chunks) == 1
    calls = tool_chunks[0].choices[0].delta.tool_calls
    assert [(c.index, c.id, c.function.name) for c in calls] == [
        (0, "call_0", "get_weather"),
        (1, "call_1", "get_time"),
    ]
    assert tool_chunks[0].choices[0].delta.content is None


def test_tool_history_round_trip(client, start_worker):
    start_worker(
        reply=lambda job: {
            "message": {"role": "assistant", "content": "It is sunny."},
            "finish_reason": "stop",
        }
    )
    first_call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": "{}"},
        "index": 0,
    }
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [first_call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    ]
    completion = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert completion.choices[0].message.content == "It is sunny."


def test_an_assistant_message_of_tool_calls_alone_reaches_the_worker_with_null_content(client, start_worker):
    """chat_front.md, Messages: an assistant's content "null or omitted only with tool_calls, and
    then forwarded as null" (omitted, as the Vercel AI SDK sends it, or null)."""
    worker = start_worker(reply=text_reply("It is sunny."))
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    for assistant in ({"role": "assistant", "tool_calls": [call]}, {"role": "assistant", "content": None, "tool_calls": [call]}):
        messages = [*USER, assistant, {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
        assert worker.jobs[-1]["payload"]["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [call]}


COLOUR = {
    "type": "json_schema",
    "json_schema": {
        "name": "colour",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"shade": {"type": "string"}},
            "required": ["shade"],
            "additionalProperties": False,
        },
    },
}


def test_json_schema_strict(client, start_worker):
    worker = start_worker(
        reply=lambda job: {
            "message": {"role": "assistant", "content": '{"shade": "teal"}'},
            "finish_reason": "stop",
        }
    )
    completion = client.chat.completions.create(model=MODEL, messages=USER, response_format=COLOUR)
    assert json.loads(completion.choices[0].message.content) == {"shade": "teal"}
    assert worker.jobs[0]["payload"]["response_format"] == COLOUR


def test_json_schema_strict_nonconformant_reply_faults(client, start_worker):
    import openai

    start_worker(
        reply=lambda job: {"message": {"role": "assistant", "content": "not json"}, "finish_reason": "stop"}
    )
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, response_format=COLOUR)
    assert caught.value.status_code == 502 and caught.value.code == "ChatRequestFaulted"
    assert caught.value.response.headers["x-should-retry"] == "false"


REASONING = {
    "message": {"role": "assistant", "content": "42.", "reasoning_content": "Six times seven."},
    "finish_reason": "stop",
    "reasoning_tokens": 4,
}


def test_reasoning_on_by_default(client, start_worker):
    start_worker(reply=lambda job: REASONING)
    completion = client.chat.completions.create(model=MODEL, messages=USER)
    message = completion.choices[0].message
    assert message.content == "42."
    assert message.model_extra["reasoning_content"] == "Six times seven."


def test_reasoning_off(client, start_worker):
    start_worker(reply=lambda job: REASONING)
    completion = client.chat.completions.create(
        model=MODEL, messages=USER, extra_body={"horde": {"include_reasoning": False}}
    )
    message = completion.choices[0].message
    assert message.content == "42."
    assert "reasoning_content" not in (message.model_extra or {})
    assert completion.usage.completion_tokens_details.reasoning_tokens == 4
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, stream=True, extra_body={"horde": {"include_reasoning": False}}
        )
    )
    assert not any(
        c.choices and (c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "42."
