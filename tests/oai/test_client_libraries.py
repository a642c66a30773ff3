"""LangChain's `ChatOpenAI` and `OpenAI` and LiteLLM, used unchanged against the front: the live horde
(daphne, the mounted /v1 front, Redis), the reference worker and the fake llama-server streaming its
reply in small pieces (relayed as such with Redis). What each library's user sees: the reply, its tokens as separate chunks in
order, the usage, a tool call, a structured reply, and the library's own error classes.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.bridge.conftest import MODEL, running_bridge
from tests.bridge.conftest import LiveHorde as BridgeHorde
from tests.bridge.fake_backend import DEFAULT_REPLY, FakeLlamaCpp
from tests.bridge.test_live import WEATHER_TOOL

# Whole replies, tools and errors run in both passes (the embedded default too); the token-by-token
# streams need Redis, which relays the worker's deltas (without it a stream is delivered whole).
pytestmark = pytest.mark.django_db(transaction=True)

# LiteLLM fetches its model cost map from GitHub when imported unless told to read its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
TEXT_REPLY = " the dragon slept."  # the fake llama-server's completion


@pytest.fixture
def horde(front, live_horde, make_user) -> Iterator[tuple[str, str]]:
    """(the front's /v1 URL, a requester's key), with the reference worker serving MODEL from the
    fake llama-server, which streams its reply three characters at a time."""
    fake_backend = FakeLlamaCpp()
    fake_backend.chunk_chars, fake_backend.chunk_delay = 3, 0.03
    fake_backend.start()
    owner = make_user(f"lib-owner-{uuid.uuid4().hex[:6]}", trusted=True)
    requester = make_user(f"lib-req-{uuid.uuid4().hex[:6]}", kudos=100_000)
    bridge_horde = BridgeHorde(live_horde.url, owner.key, requester.key)
    with running_bridge(bridge_horde, fake_backend.url, progress_interval=0.05, pop_wait=0):
        yield front.live.v1, requester.key
    bridge_horde.client.close()
    fake_backend.stop()


def chat_model(v1: str, key: str, **options: Any):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=v1, api_key=key, model=MODEL, max_retries=0, timeout=30, **options)


def test_langchain_chat_invoke_returns_the_reply_with_its_usage(horde):
    message = chat_model(*horde).invoke("Say hello.")
    assert message.content == DEFAULT_REPLY
    assert message.response_metadata["finish_reason"] == "stop"
    assert message.response_metadata["model_name"] == MODEL
    usage = message.usage_metadata
    assert usage["output_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_langchain_chat_stream_gives_the_reply_one_finish_and_the_usage(horde):
    """In both passes: the stream adds up to the reply, whether relayed (Redis) or whole."""
    chunks = list(chat_model(*horde, stream_usage=True).stream("Say hello."))
    assert "".join(chunk.content for chunk in chunks) == DEFAULT_REPLY
    assert [f for f in (chunk.response_metadata.get("finish_reason") for chunk in chunks) if f] == ["stop"]
    assert len([chunk for chunk in chunks if chunk.usage_metadata]) == 1


@pytest.mark.redis_only
def test_langchain_chat_stream_yields_the_workers_tokens_in_order_and_the_usage(horde):
    chunks = list(chat_model(*horde, stream_usage=True).stream("Say hello."))
    contents = [chunk.content for chunk in chunks if chunk.content]
    assert "".join(contents) == DEFAULT_REPLY
    assert len(contents) > 1, contents  # relayed as the worker posted it, not the whole reply at the end
    finishes = [chunk.response_metadata.get("finish_reason") for chunk in chunks]
    assert [f for f in finishes if f] == ["stop"]
    usages = [chunk.usage_metadata for chunk in chunks if chunk.usage_metadata]
    assert len(usages) == 1 and usages[0]["output_tokens"] > 0


@pytest.mark.redis_only
def test_langchain_chat_astream(horde):
    async def contents() -> list[str]:
        return [chunk.content async for chunk in chat_model(*horde).astream("Say hello.") if chunk.content]

    received = asyncio.run(contents())
    assert "".join(received) == DEFAULT_REPLY and len(received) > 1


def test_langchain_bound_tools_give_a_tool_call(horde):
    message = chat_model(*horde).bind_tools([WEATHER_TOOL]).invoke("What is the weather in Paris?")
    assert message.response_metadata["finish_reason"] == "tool_calls"
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"], dict) and call["id"]


def test_langchain_structured_output_by_json_schema(horde):
    schema = {
        "title": "Person",
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    person = chat_model(*horde).with_structured_output(schema, method="json_schema").invoke("Who?")
    assert isinstance(person, dict) and set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and isinstance(person["age"], int)


def test_langchain_openai_completion_class(horde):
    from langchain_openai import OpenAI

    v1, key = horde
    llm = OpenAI(base_url=v1, api_key=key, model=MODEL, max_retries=0, timeout=30, max_tokens=40)
    assert llm.invoke("Once upon a time") == TEXT_REPLY
    assert "".join(llm.stream("Once upon a time")) == TEXT_REPLY


@pytest.mark.redis_only
def test_litellm_completion_whole_and_streamed(horde):
    import litellm

    v1, key = horde
    call = {"model": f"openai/{MODEL}", "api_base": v1, "api_key": key, "messages": [{"role": "user", "content": "Hi"}]}
    whole = litellm.completion(**call)
    assert whole.choices[0].message.content == DEFAULT_REPLY and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens > 0

    chunks = list(litellm.completion(**call, stream=True, stream_options={"include_usage": True}))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(contents) == DEFAULT_REPLY and len(contents) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert [c.usage.completion_tokens for c in chunks if getattr(c, "usage", None)] == [whole.usage.completion_tokens]


def test_litellm_async_and_text_completion(horde):
    import litellm

    v1, key = horde
    reply = asyncio.run(
        litellm.acompletion(model=f"openai/{MODEL}", api_base=v1, api_key=key, messages=[{"role": "user", "content": "Hi"}])
    )
    assert reply.choices[0].message.content == DEFAULT_REPLY
    text = litellm.text_completion(
        model=f"text-completion-openai/{MODEL}", api_base=v1, api_key=key, prompt="Once upon a time", max_tokens=40
    )
    assert text.choices[0].text == TEXT_REPLY


def test_litellm_maps_the_fronts_errors_to_its_own_classes(horde):
    import litellm

    v1, key = horde
    message = [{"role": "user", "content": "Hi"}]
    with pytest.raises(litellm.NotFoundError, match="not known to this horde"):
        litellm.completion(model="openai/no-such/model", api_base=v1, api_key=key, messages=message)
    with pytest.raises(litellm.AuthenticationError):
        litellm.completion(model=f"openai/{MODEL}", api_base=v1, api_key="not-a-horde-key", messages=message)
    with pytest.raises(litellm.BadRequestError):
        litellm.completion(model=f"openai/{MODEL}", api_base=v1, api_key=key, messages=[])
