"""A forced tool call (tool_choice "required" or a named function) from the openai SDK, strict by
default, through the front at /v1 to the reference worker in front of llama-server (the fake that
reproduces its wire: "required" is a grammar that holds the reply to a call, "auto" a lazy one).
instructor's tool modes, pydantic-ai's structured output and llama-index's structured_predict send
such a choice; before ADR 0091 no llama.cpp bridge declared tool_choice_enforced, and these
requests got 404 no_worker_supports_features."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.bridge.conftest import MODEL, running_bridge
from tests.bridge.conftest import LiveHorde as BridgeHorde
from tests.bridge.fake_backend import FakeLlamaCpp
from tests.bridge.test_live import WEATHER_TOOL

pytestmark = pytest.mark.django_db(transaction=True)

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def llama(front, live_horde, make_user) -> Iterator[tuple[str, str, FakeLlamaCpp]]:
    """(the front's /v1 URL, a requester's key, the fake llama-server), the reference worker
    serving MODEL from it; its model answers in text unless a grammar forces the call."""
    fake = FakeLlamaCpp()
    fake.model_prefers_text = True
    fake.start()
    owner = make_user(f"tc-owner-{uuid.uuid4().hex[:6]}", trusted=True)
    requester = make_user(f"tc-req-{uuid.uuid4().hex[:6]}", kudos=100_000)
    bridge_horde = BridgeHorde(live_horde.url, owner.key, requester.key)
    with running_bridge(bridge_horde, fake.url, pop_wait=0):
        yield front.live.v1, requester.key, fake
    bridge_horde.client.close()
    fake.stop()


def _client(v1: str, key: str):
    import openai

    return openai.OpenAI(base_url=v1, api_key=key, max_retries=0, timeout=30)


def test_openai_sdk_tool_choice_required_reaches_the_llama_cpp_bridge(llama):
    v1, key, fake = llama
    client = _client(v1, key)
    listed = {model.id: model for model in client.models.list().data}
    assert "tool_choice" in listed[MODEL].supported_parameters  # type: ignore[attr-defined]
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=64,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments == '{"city":"Paris"}'
    (sent,) = fake.chat_requests()
    assert sent["tool_choice"] == "required" and sent["tools"] == [WEATHER_TOOL]


def test_openai_sdk_named_function_choice_reaches_llama_server_as_required_with_that_tool(llama):
    v1, key, fake = llama
    completion = _client(v1, key).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[TIME_TOOL, WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI finishes a named choice
    assert [call.function.name for call in choice.message.tool_calls or []] == ["get_weather"]
    (sent,) = fake.chat_requests()
    assert sent["tool_choice"] == "required" and sent["tools"] == [WEATHER_TOOL]
