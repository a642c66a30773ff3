"""A chat request end to end over HTTP: a chat worker declares, pops a chat job whose payload
matches the spec's table, submits a structured reply with tool calls and reasoning; the status
shows it, and a subscriber on the completion signal hears `generation` then `done`."""

from __future__ import annotations

import json
import time

import pytest
import redis

from chat.signals import CHAT_SIGNAL_DB, chat_signal_channel

MODEL = "Gryphe/MythoMax-L2-13b"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
DECLARATION = {
    "chat_jobs": True,
    "model_id": MODEL,
    "chat_limits": {"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 1.0},
    "chat_features": ["tools", "seed", "tool_choice_enforced", "prompt_overflow_refused", "not-a-feature"],
    "image_transports": [],
}


def _chat_pop(horde, key, **extra):
    return horde.pop(key, name="chat-worker", models=[MODEL], **DECLARATION, **extra)


def _subscribe(redis_url, request_id):
    client = redis.Redis.from_url(redis_url, db=CHAT_SIGNAL_DB)
    pubsub = client.pubsub()
    pubsub.subscribe(chat_signal_channel(request_id))
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    return client, pubsub


def _events(pubsub, count, timeout=5.0):
    events, deadline = [], time.monotonic() + timeout
    while len(events) < count and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.2)
        if message and message["type"] == "message":
            events.append(json.loads(message["data"]))
    return events


@pytest.mark.redis_only
@pytest.mark.django_db(transaction=True)
def test_chat_request_end_to_end(horde, make_user, redis_url):
    requester, owner = make_user("client", kudos=500), make_user("volunteer")
    # The worker declares first, so the model has an online chat worker.
    assert _chat_pop(horde, owner.key).json()["id"] is None

    created = horde.client.post(
        "/api/v2/generate/chat/async",
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Paris?"},
            ],
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "temperature": 0.5,
            "seed": 7,
            "max_tokens": 300,
        },
        format="json",
        HTTP_APIKEY=requester.key,
    )
    assert created.status_code == 202, created.json()
    request_id = created.json()["id"]
    client, pubsub = _subscribe(redis_url, request_id)

    job = _chat_pop(horde, owner.key).json()
    assert job["chat"] is True and job["ttl"] == 150 and job["model"] == MODEL
    payload = job["payload"]
    assert "prompt" not in payload
    assert payload["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    assert payload["tools"] == [WEATHER_TOOL] and payload["tool_choice"] == "required"
    assert (payload["temperature"], payload["seed"], payload["max_length"], payload["n"]) == (0.5, 7, 300, 1)
    # Every sampling key is present; unsent ones carry the defaults.
    assert (payload["top_p"], payload["frequency_penalty"], payload["presence_penalty"]) == (1.0, 0, 0)
    assert (payload["rep_pen"], payload["top_k"], payload["min_p"]) == (1.0, 0, 0)
    assert "stop_sequence" not in payload and "reasoning_effort" not in payload

    reply = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "The user wants the weather; call the tool.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup_weather", "arguments": '{"city": "Paris"}'}}
        ],
    }
    submitted = horde.chat_submit(
        owner.key,
        job["id"],
        message=reply,
        finish_reason="tool_calls",
        native_finish_reason="tool_calls",
        prompt_tokens=42,
        completion_tokens=19,
        reasoning_tokens=11,
        model_id=MODEL,
    )
    assert submitted.status_code == 200, submitted.json()
    assert submitted.json()["reward"] > 0

    status = horde.client.get(f"/api/v2/generate/chat/status/{request_id}").json()
    assert status["done"] is True and status["finished"] == 1 and status["faulted"] is False
    [generation] = status["generations"]
    assert generation["message"] == reply
    assert generation["finish_reason"] == "tool_calls" and generation["native_finish_reason"] == "tool_calls"
    assert (generation["prompt_tokens"], generation["completion_tokens"], generation["reasoning_tokens"]) == (42, 19, 11)
    assert generation["charge_basis"] == "output_estimate"
    assert isinstance(generation["queue_wait_seconds"], int | float) and generation["queue_wait_seconds"] >= 0
    assert generation["model"] == MODEL

    events = _events(pubsub, 2)
    assert [e["event"] for e in events] == ["generation", "done"]
    assert all(e["id"] == request_id for e in events) and events[-1]["generations"] == 1
    assert all("text" not in e and "message" not in e for e in events)
    pubsub.close()
    client.close()
