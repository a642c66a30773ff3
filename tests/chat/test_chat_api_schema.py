"""The chat routes' OpenAPI schema comes from the contract's pydantic models (docs/adr/0031): the
served document is valid OpenAPI 3.0, the chat request's schema names exactly the keys the route
accepts, and the status bodies the route answers are the shape contract.chat_status describes."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from drf_spectacular.validation import validate_schema

from chat.models import Generation, GenerationRequest
from contract.chat_shapes import CHAT_HORDE_KEYS, CHAT_REQUEST_KEYS
from contract.chat_status import ChatStatus
from tests.chat.chat_route_helpers import MODEL, chat_async, chat_cancel, chat_status, chat_worker

SCHEMA_URL = "/api/v2/openapi.json?format=json"


@pytest.fixture
def schema(horde):
    response = horde.client.get(SCHEMA_URL)
    assert response.status_code == 200
    return json.loads(response.content)


def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _held_to_contract(body: dict) -> None:
    """The body is a ChatStatus: every key typed as the model says, no key the model lacks, in
    the model's order."""
    status = ChatStatus.model_validate(body)
    dumped = status.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert dumped == body
    assert list(dumped) == list(body)


def test_the_served_schema_is_valid_openapi_30(schema):
    validate_schema(schema)
    text = json.dumps(schema)
    # pydantic's 2020-12 words that OpenAPI 3.0 does not have
    assert '"const"' not in text and '{"type": "null"}' not in text


def test_the_chat_request_schema_is_the_contract_model(schema):
    operation = schema["paths"]["/api/v2/generate/chat/async"]["post"]
    request = operation["requestBody"]["content"]["application/json"]["schema"]
    assert request == {"$ref": "#/components/schemas/ChatRequest"}
    body = _resolve(schema, request)
    assert set(body["properties"]) == CHAT_REQUEST_KEYS
    assert body["required"] == ["messages"] and body["additionalProperties"] is False
    assert set(_resolve(schema, body["properties"]["horde"])["properties"]) == CHAT_HORDE_KEYS
    # The bounds the route's checks enforce are documented.
    assert body["properties"]["max_tokens"]["minimum"] == 16
    assert body["properties"]["messages"]["minItems"] == 1
    status = schema["paths"]["/api/v2/generate/chat/status/{request_id}"]["get"]["responses"]["200"]
    assert status["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatStatus"}


def test_status_bodies_are_the_contracts_shape(horde, make_user):
    owner = make_user("owner")
    worker = chat_worker(owner, threads=3, max_length=1024)
    requester = make_user("r", kudos=10_000)
    response = chat_async(horde.client, requester.key, max_tokens=4096)
    assert response.status_code == 202
    request = GenerationRequest.objects.get(pk=response.json()["id"])
    waiting = chat_status(horde.client, request.id).json()
    assert waiting["context_adjustments"] == [{"from": 4096, "to": 1024, "reason": "worker_max_length"}]
    _held_to_contract(waiting)

    generation = Generation.objects.create(
        request=request, worker=worker, model=MODEL, lease_expires_at=timezone.now() + timedelta(seconds=150)
    )
    Generation.objects.filter(pk=generation.pk).update(
        state="ok",
        text="",
        message={
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        finish_reason="tool_calls",
        native_finish_reason="tool_calls",
        prompt_tokens=12,
        completion_tokens=30,
        charge_basis="output_estimate",
        finished_at=timezone.now(),
    )
    GenerationRequest.objects.filter(pk=request.pk).update(jobs_waiting=0)
    finished = chat_status(horde.client, request.id).json()
    assert finished["done"] is True and finished["generations"][0]["reasoning_tokens"] is None
    _held_to_contract(finished)
    _held_to_contract(chat_cancel(horde.client, request.id).json())


def test_impossible_and_truncated_bodies_are_the_contracts_shape(horde, make_user):
    owner = make_user("owner")
    chat_worker(owner, features=["prompt_overflow_refused"], max_context_length=4096)
    turn = "word " * 800  # about 1000 tokens
    messages = [
        {"role": "user", "content": turn},
        {"role": "assistant", "content": turn},
        {"role": "user", "content": turn},
        {"role": "assistant", "content": turn},
        {"role": "user", "content": "Latest question"},
    ]
    response = chat_async(horde.client, make_user("r").key, seed=1, messages=messages)
    assert response.status_code == 202, response.json()
    body = chat_status(horde.client, response.json()["id"]).json()
    assert body["impossible_reason"]["kind"] == "declaration_gap"
    assert any("dropped_messages" in adjustment for adjustment in body["context_adjustments"])
    _held_to_contract(body)
