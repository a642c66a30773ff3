"""Eligibility rule 3: a chat request fits the worker's chat_limits, and its text limits do not
apply (spec: chat_requests.md, "Eligibility"), in the pop and in the availability the status
reports. The worker pops as the scribe worker does, with its short text limits (max_length 80,
max_context_length 1024), and declares far larger chat limits."""

from __future__ import annotations

from chat.models import GenerationRequest
from chat.selectors.availability import chat_request_availability
from chat.selectors.queue import worker_may_take
from tests.chat.chat_route_helpers import ALL_DECLARATIONS, MODEL, chat_async, chat_status
from workers.models import Worker

SCRIBE = {
    "name": "scribe",
    "models": [MODEL],
    "max_length": 80,
    "max_context_length": 1024,
    "priority_usernames": [],
    "softprompts": [],
    "threads": 2,
    "chat_jobs": True,
    "model_id": MODEL,
    "chat_features": ALL_DECLARATIONS,
    "chat_limits": {"max_context_length": 8192, "max_length": 1024},
}


def test_chat_limits_not_text_limits_admit_a_chat_request(horde, make_user):
    requester, owner = make_user("client", kudos=10_000), make_user("volunteer")
    assert horde.pop(owner.key, **SCRIBE).json()["id"] is None
    created = chat_async(
        horde.client, requester.key, max_tokens=900, horde={"max_context_length": 4096, "context_fit": "reject"}
    )
    assert created.status_code == 202 and created.json()["warnings"] == [], created.json()
    request_id = created.json()["id"]
    request = GenerationRequest.objects.get(pk=request_id)
    assert (request.max_length, request.max_context_length) == (900, 4096)  # above both text limits
    status = chat_status(horde.client, request_id).json()
    assert status["is_possible"] is True and status["eligible_worker_threads"] == 2, status
    assert status["context_adjustments"] is None
    worker = Worker.objects.select_related("owner").get(name="scribe")
    assert worker_may_take(worker, request, set()) is True  # the Python twin agrees
    job = horde.pop(owner.key, **SCRIBE).json()
    assert job["chat"] is True and job["payload"]["max_length"] == 900
    assert job["payload"]["max_context_length"] == 4096


def test_a_text_request_still_meets_the_text_limits(horde, make_user):
    requester, owner = make_user("client", kudos=10_000), make_user("volunteer")
    horde.pop(owner.key, **SCRIBE)
    request_id = horde.text_async(requester.key, models=[MODEL], params={"max_length": 100, "max_context_length": 1024}).json()["id"]
    assert horde.status(request_id).json()["is_possible"] is False
    job = horde.pop(owner.key, **SCRIBE).json()
    assert job["id"] is None and job["skipped"] == {"max_length": 1}


def test_a_chat_request_over_the_chat_limits_is_refused_by_them(horde, make_user):
    requester, owner = make_user("client", kudos=10_000), make_user("volunteer")
    horde.pop(owner.key, **{**SCRIBE, "max_context_length": 32768})  # a text context above the chat one
    created = chat_async(
        horde.client, requester.key, max_tokens=100, horde={"max_context_length": 16384, "context_fit": "reject"}
    )
    request_id = created.json()["id"]
    status = chat_status(horde.client, request_id).json()
    assert status["is_possible"] is False and status["eligible_worker_threads"] == 0
    assert status["impossible_reason"] == {
        "kind": "declaration_gap", "missing_declarations": [], "exceeded_limits": ["max_context_length"]
    }
    job = horde.pop(owner.key, **{**SCRIBE, "max_context_length": 32768}).json()
    assert job["id"] is None and job["skipped"] == {"max_context_length": 1}
    request = GenerationRequest.objects.get(pk=request_id)
    assert chat_request_availability(request).eligible_worker_threads == 0
