"""GET and DELETE /api/v2/generate/chat/status/<id>: the chat status body, the route families kept
apart by is_chat, cancel with its signal, and Redis down."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from chat.models import Generation, GenerationRequest
from tests.chat.chat_route_helpers import MODEL, chat_async, chat_cancel, chat_status, chat_worker

TEXT_STATUS_KEYS = {
    "generations", "finished", "processing", "restarted", "waiting", "done", "faulted", "wait_time",
    "queue_position", "kudos", "is_possible",
}
CHAT_STATUS_KEYS = TEXT_STATUS_KEYS | {
    "context_adjustments", "fault_reason", "fault_rc", "impossible_reason", "eligible_worker_threads",
}


@pytest.fixture
def owner(make_user):
    return make_user("owner")


@pytest.fixture
def queued(horde, make_user, owner):
    worker = chat_worker(owner, threads=3, max_length=1024)
    requester = make_user("r", kudos=10_000)
    response = chat_async(horde.client, requester.key, max_tokens=4096)
    assert response.status_code == 202
    return GenerationRequest.objects.get(pk=response.json()["id"]), worker


def test_status_of_a_waiting_chat_request(horde, queued):
    request, _ = queued
    body = chat_status(horde.client, request.id).json()
    assert set(body) == CHAT_STATUS_KEYS
    assert body["generations"] == [] and body["waiting"] == 1 and body["done"] is False
    assert body["is_possible"] is True and body["eligible_worker_threads"] == 3
    assert body["impossible_reason"] is None
    assert body["context_adjustments"] == [{"from": 4096, "to": 1024, "reason": "worker_max_length"}]
    assert (body["fault_reason"], body["fault_rc"]) == (None, None)
    assert body["kudos"] == 1.0  # the horde tax so far


def test_route_families_do_not_cross(horde, make_user, queued):
    request, _ = queued
    text_id = horde.text_async(make_user("t").key).json()["id"]
    for response in (
        horde.status(request.id),
        horde.cancel(request.id),
        chat_status(horde.client, text_id),
        chat_cancel(horde.client, text_id),
    ):
        assert response.status_code == 404 and response.json()["rc"] == "RequestNotFound"
    assert not GenerationRequest.objects.get(pk=request.id).cancelled
    assert not GenerationRequest.objects.get(pk=text_id).cancelled


def test_finished_generation_carries_its_structured_reply(horde, queued):
    request, worker = queued
    popped_at = request.created + timedelta(seconds=7)
    generation = Generation.objects.create(
        request=request, worker=worker, model=MODEL, lease_expires_at=timezone.now() + timedelta(seconds=150)
    )
    message = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "thinking",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    Generation.objects.filter(pk=generation.pk).update(
        created=popped_at,
        state="ok",
        text="",
        message=message,
        finish_reason="tool_calls",
        native_finish_reason="tool_calls",
        prompt_tokens=12,
        completion_tokens=30,
        reasoning_tokens=20,
        charge_basis="output_estimate",
        finished_at=timezone.now(),
    )
    GenerationRequest.objects.filter(pk=request.pk).update(jobs_waiting=0)
    body = chat_status(horde.client, request.id).json()
    assert body["done"] is True and body["finished"] == 1
    [gen] = body["generations"]
    assert gen["message"] == message and gen["worker_id"] == str(worker.id) and gen["model"] == MODEL
    assert (gen["finish_reason"], gen["native_finish_reason"], gen["charge_basis"]) == (
        "tool_calls", "tool_calls", "output_estimate",
    )
    assert (gen["prompt_tokens"], gen["completion_tokens"], gen["reasoning_tokens"]) == (12, 30, 20)
    assert gen["queue_wait_seconds"] == 7.0
    # The text status route shows none of it: the request is not on that route at all.
    assert horde.status(request.id).status_code == 404


def test_fault_details_show_only_once_faulted(horde, queued):
    request, _ = queued
    GenerationRequest.objects.filter(pk=request.pk).update(
        chat_fault_reason="The worker could not fit the prompt into its context.", chat_fault_rc="ChatWorkerFault"
    )
    body = chat_status(horde.client, request.id).json()
    assert (body["fault_reason"], body["fault_rc"], body["done"]) == (None, None, False)
    GenerationRequest.objects.filter(pk=request.pk).update(faulted=True, jobs_waiting=0)
    body = chat_status(horde.client, request.id).json()
    assert body["done"] is True and body["faulted"] is True
    assert body["fault_reason"] == "The worker could not fit the prompt into its context."
    assert body["fault_rc"] == "ChatWorkerFault"


def test_cancel_stops_the_request_and_releases_the_hold(allowance_at_the_floor, horde, make_user, queued, django_capture_on_commit_callbacks):
    request, _ = queued
    assert request.kudos_held > 0
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = chat_cancel(horde.client, request.id)
    assert response.status_code == 200
    body = response.json()
    assert set(body) == CHAT_STATUS_KEYS
    assert body["done"] is True and body["waiting"] == 0 and body["generations"] == []
    assert request.user.__class__.objects.get(pk=request.user_id).kudos_held == 0
    assert len(callbacks) == 1  # the cancelled signal, after the commit
    # A second cancel claims nothing and publishes nothing.
    with django_capture_on_commit_callbacks(execute=True) as again:
        assert chat_cancel(horde.client, request.id).status_code == 200
    assert again == []


def test_impossible_request_reports_the_declaration_gap(horde, make_user, owner):
    chat_worker(owner, features=["prompt_overflow_refused"])
    response = chat_async(horde.client, make_user("r").key, seed=1)
    assert response.status_code == 202 and response.json()["warnings"]
    body = chat_status(horde.client, response.json()["id"]).json()
    assert body["is_possible"] is False and body["eligible_worker_threads"] == 0
    assert body["impossible_reason"] == {
        "kind": "declaration_gap",
        "missing_declarations": ["seed"],
        "exceeded_limits": [],
    }


@pytest.mark.redis_only
def test_cancel_publishes_the_cancelled_signal(horde, queued, redis_url, django_capture_on_commit_callbacks):
    import redis

    request, _ = queued
    subscriber = redis.Redis.from_url(redis_url).pubsub()
    subscriber.subscribe(f"horde:chat:{request.id}")
    subscriber.get_message(timeout=1)  # the subscribe confirmation
    with django_capture_on_commit_callbacks(execute=True):
        chat_cancel(horde.client, request.id)
    deadline = time.monotonic() + 5
    message = None
    while message is None and time.monotonic() < deadline:
        message = subscriber.get_message(ignore_subscribe_messages=True, timeout=0.5)
    subscriber.close()
    assert message is not None
    assert json.loads(message["data"]) == {"id": str(request.id), "event": "cancelled", "generations": 0}


def test_redis_down_submit_and_cancel_still_succeed(
    horde, make_user, owner, settings, caplog, django_capture_on_commit_callbacks
):
    # A closed port: every publish fails fast and is logged.
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = "redis://127.0.0.1:1/0"
    chat_worker(owner)
    requester = make_user("r")
    with django_capture_on_commit_callbacks(execute=True):
        submitted = chat_async(horde.client, requester.key)
    assert submitted.status_code == 202
    request_id = submitted.json()["id"]
    with django_capture_on_commit_callbacks(execute=True):
        cancelled = chat_cancel(horde.client, request_id)
    assert cancelled.status_code == 200 and cancelled.json()["done"] is True
    assert GenerationRequest.objects.get(pk=request_id).cancelled
    assert "completion signal cancelled" in caplog.text


def test_ids_in_paths_are_read_in_either_case(horde, make_user, queued):
    """A UUID's text is case-insensitive (RFC 9562), as upstream's lookup is: a client that keeps an
    id in upper case polls, cancels and reads a worker with it."""
    request, worker = queued
    lower = chat_status(horde.client, request.id).json()
    assert chat_status(horde.client, str(request.id).upper()).json() == lower
    text_id = horde.text_async(make_user("t").key).json()["id"]
    assert horde.status(text_id.upper()).json() == horde.status(text_id).json()
    cancelled = horde.cancel(text_id.upper())
    assert cancelled.status_code == 200 and cancelled.json()["is_possible"] is not None
    assert GenerationRequest.objects.get(pk=text_id).cancelled
    details = horde.client.get(f"/api/v2/workers/{str(worker.id).upper()}")
    assert details.status_code == 200 and details.json()["id"] == str(worker.id)
