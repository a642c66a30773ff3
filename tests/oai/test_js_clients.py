"""POST /v1/chat/completions as the JavaScript clients send it, replayed byte for byte against the live
horde (daphne, the mounted /v1 front, Redis) and the reference worker on its scripted backend, the
demo worker `make run` starts.

The Vercel AI SDK (`ai` 6 with `@ai-sdk/openai-compatible` 2.0.92, and `ai` 7.0.185 with
`@ai-sdk/openai-compatible` 3.0.97) posts from Node or an edge runtime: `Authorization`,
`Content-Type`, its own `User-Agent`, and the keys of `providerOptions.<provider name>` merged into
the body ahead of the messages (here `reasoningEffort` as `reasoning_effort` and the horde's own
object). With the provider's `includeUsage: true`, `streamText` asks for
`stream_options.include_usage`; it reads `delta.reasoning_content` as reasoning and `delta.content`
as text, and shows the text as it is: a `<think>` block in it would reach the user. Both versions
send the same bytes but for the user agent (ADR 0109).

The openai Node SDK 6.49.0 and 7.60.0 (the newest on 2026-12-07) send the same bodies; 7 sends
x-stainless-helper-method before authorization.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.bridge.conftest import LiveHorde as BridgeHorde
from tests.bridge.conftest import running_bridge
from tests.oai.test_chat_apps import lite_events
from workers.bridge.scripted import ScriptedBackend

pytestmark = pytest.mark.django_db(transaction=True)

VERCEL_HEADERS = {
    "authorization": "Bearer {key}",
    "content-type": "application/json",
    "user-agent": "ai-sdk/openai-compatible/2.0.92 ai-sdk/provider-utils/4.0.65 runtime/node.js/v20.20.2",
    "accept": "*/*",
    "accept-language": "*",
    "sec-fetch-mode": "cors",
}
VERCEL_3_USER_AGENT = "ai-sdk-openai-compatible/3.0.97 ai-sdk-provider-utils/5.0.86 node.js/v20.20.2"


@pytest.fixture
def scripted_horde(front, live_horde, make_user) -> Iterator[tuple[str, str, str]]:
    """(the front's /v1 URL, a requester's key, the model), served by the reference worker on its
    scripted backend as `make run`'s demo worker runs it."""
    owner = make_user(f"js-owner-{uuid.uuid4().hex[:6]}", trusted=True)
    requester = make_user(f"js-req-{uuid.uuid4().hex[:6]}", kudos=100_000)
    bridge_horde = BridgeHorde(live_horde.url, owner.key, requester.key)
    with running_bridge(bridge_horde, ScriptedBackend(), pop_wait=0) as (bridge, _out):
        yield front.live.v1, requester.key, bridge.config.horde_model
    bridge_horde.client.close()


def vercel_stream(v1: str, key: str, body: dict, user_agent: str | None = None) -> list[dict]:
    headers = {name: value.format(key=key) for name, value in VERCEL_HEADERS.items()}
    if user_agent:
        headers["user-agent"] = user_agent
    with httpx.stream("POST", f"{v1}/chat/completions", content=json.dumps(body, separators=(",", ":")),
                      headers=headers, timeout=30) as response:
        assert response.status_code == 200, response.read()
        text = response.read().decode()
    assert text.rstrip().endswith("data: [DONE]")
    return lite_events(text)


@pytest.mark.parametrize("user_agent", [None, VERCEL_3_USER_AGENT])
def test_vercel_stream_text_with_reasoning_keeps_the_think_block_out_of_the_text(scripted_horde, user_agent):
    v1, key, model = scripted_horde
    body = {
        "model": model,
        "horde": {"include_reasoning": True},
        "reasoning_effort": "low",
        "messages": [{"role": "user", "content": "think about it"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = vercel_stream(v1, key, body, user_agent)
    deltas = [event["choices"][0]["delta"] for event in events if event["choices"]]
    text = "".join(delta.get("content") or "" for delta in deltas)
    reasoning = "".join(delta.get("reasoning_content") or "" for delta in deltas)
    assert text == "Scripted reply to: think about it"
    assert reasoning == "The user wrote 14 characters; effort low. I answer plainly."
    usage = [event["usage"] for event in events if not event["choices"]]
    assert len(usage) == 1 and usage[0]["completion_tokens_details"]["reasoning_tokens"] > 0

    # Whole, the same request gets the same split.
    whole = httpx.post(f"{v1}/chat/completions", json={**body, "stream": False, "stream_options": None},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
    message = whole.json()["choices"][0]["message"]
    assert message["content"] == text and message["reasoning_content"] == reasoning


OPENAI_NODE_HEADERS = {
    "accept": "application/json",
    "user-agent": "OpenAI/JS 6.49.0",
    "x-stainless-retry-count": "0",
    "x-stainless-lang": "js",
    "x-stainless-package-version": "6.49.0",
    "x-stainless-os": "Linux",
    "x-stainless-arch": "x64",
    "x-stainless-runtime": "node",
    "x-stainless-runtime-version": "v20.20.2",
    "authorization": "Bearer {key}",
    "content-type": "application/json",
    "x-stainless-helper-method": "stream",
    "accept-language": "*",
    "sec-fetch-mode": "cors",
}
# openai-node 7.60.0: the same headers, x-stainless-helper-method before authorization.
OPENAI_NODE_7_HEADERS = {
    "accept": "application/json",
    "user-agent": "OpenAI/JS 7.60.0",
    "x-stainless-retry-count": "0",
    "x-stainless-lang": "js",
    "x-stainless-package-version": "7.60.0",
    "x-stainless-os": "Linux",
    "x-stainless-arch": "x64",
    "x-stainless-runtime": "node",
    "x-stainless-runtime-version": "v20.20.2",
    "x-stainless-helper-method": "stream",
    "authorization": "Bearer {key}",
    "content-type": "application/json",
    "accept-language": "*",
    "sec-fetch-mode": "cors",
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


@pytest.mark.parametrize("node_headers", [OPENAI_NODE_HEADERS, OPENAI_NODE_7_HEADERS], ids=["6.49", "7.60"])
def test_openai_node_history_of_accumulated_stream_messages_is_served(scripted_horde, node_headers):
    """openai-node's `chat.completions.stream(...).finalChatCompletion()` returns messages carrying
    `refusal`, `parsed`, `function.parsed_arguments` and the reasoning; an app pushes them back
    as history, and the next turn must be served like any other."""
    v1, key, model = scripted_horde
    headers = {name: value.format(key=key) for name, value in node_headers.items()}
    call_id = "call_2ba1013ff711b6559ee0aa95"
    body = {
        "model": model,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"parsed_arguments": {"city": ""}, "name": "get_weather", "arguments": "{\"city\":\"\"}"}},
            ], "parsed": None},
            {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
            {"role": "assistant", "reasoning_content": "The user wrote 17 characters; effort low. I answer plainly.",
             "content": "The tool answered: sunny", "refusal": None, "parsed": None},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [WEATHER_TOOL],
        "stream_options": {"include_usage": True},
        "stream": True,
    }
    with httpx.stream("POST", f"{v1}/chat/completions", content=json.dumps(body, separators=(",", ":")),
                      headers=headers, timeout=30) as response:
        assert response.status_code == 200, response.read()
        events = lite_events(response.read().decode())
    calls = [call for event in events if event["choices"] for call in event["choices"][0]["delta"].get("tool_calls", [])]
    assert [(call["index"], call["type"], call["function"]["name"]) for call in calls] == [(0, "function", "get_weather")]
    assert calls[0]["id"].startswith("call_") and json.loads(calls[0]["function"]["arguments"]) == {"city": ""}
    finishes = [event["choices"][0]["finish_reason"] for event in events if event["choices"]]
    assert [f for f in finishes if f] == ["tool_calls"]
    assert not events[-1]["choices"] and events[-1]["usage"]["total_tokens"] > 0
