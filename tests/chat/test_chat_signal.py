"""The completion signal: events generation, done, cancelled and faulted on horde:chat:<id>,
published after commit and best effort (chat_requests.md, "Completion signal")."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from decimal import Decimal

import pytest
import redis
from django.conf import settings as django_settings
from django.utils import timezone

from chat import signals, tasks
from chat.models import Generation, GenerationRequest
from chat.services.cancel import request_cancel
from contract.chat_declaration import CHAT_WORKER_FAULT_MESSAGES
from tests.chat.chat_jobs import CHAT_MODEL, make_chat_request, make_chat_worker, pop_chat_job, reply, submit

FAULT = {"state": "faulted", "model_id": CHAT_MODEL}
CLOSED_PORT = "redis://127.0.0.1:1/0"


@pytest.fixture
def people(make_user):
    return make_user("requester", kudos=1000), make_user("owner")


@pytest.fixture
def worker(people):
    return make_chat_worker(people[1].user)


@pytest.fixture
def published(monkeypatch):
    """Every message publish_now is asked to send, with whether the request row existed then."""
    sent: list[dict] = []

    def record(request_id, event, generations, **fault):
        row = GenerationRequest.objects.filter(pk=request_id).exists()
        sent.append({"id": str(request_id), "event": event, "generations": generations, **fault, "_row": row})
        return True

    monkeypatch.setattr(signals, "publish_now", record)
    return sent


def events(sent) -> list[tuple[str, int]]:
    return [(m["event"], m["generations"]) for m in sent]


def test_submit_publishes_generation_then_done_after_commit(
    api, people, worker, published, django_capture_on_commit_callbacks
):
    requester, owner = people
    request = make_chat_request(requester.user)
    job = pop_chat_job(request, worker)[0]
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        assert submit(api, owner.key, job.id, reply()).status_code == 200
    assert published == []  # nothing before the commit
    for callback in callbacks:
        callback()
    assert events(published) == [("generation", 1), ("done", 1)]
    assert {m["id"] for m in published} == {str(request.pk)}


def test_done_waits_for_the_last_requested_result(
    api, people, worker, published, django_capture_on_commit_callbacks
):
    requester, owner = people
    request = make_chat_request(requester.user, n=2)
    first, second = pop_chat_job(request, worker, jobs=2)
    with django_capture_on_commit_callbacks(execute=True):
        submit(api, owner.key, first.id, reply())
    assert events(published) == [("generation", 1)]
    with django_capture_on_commit_callbacks(execute=True):
        submit(api, owner.key, second.id, reply())
    assert events(published) == [("generation", 1), ("generation", 2), ("done", 2)]


def test_cancel_publishes_cancelled_and_the_last_in_flight_result_done(
    api, people, worker, published, django_capture_on_commit_callbacks
):
    requester, owner = people
    request = make_chat_request(requester.user, n=2)
    job = pop_chat_job(request, worker)[0]
    with django_capture_on_commit_callbacks(execute=True):
        request_cancel(request=request)
        request_cancel(request=request)  # claimed once
    assert events(published) == [("cancelled", 0)]
    with django_capture_on_commit_callbacks(execute=True):
        assert submit(api, owner.key, job.id, reply()).status_code == 200
    # Cancelled with nothing waiting or processing: done without every requested result.
    assert events(published)[1:] == [("generation", 1), ("done", 1)]


def test_a_cancel_after_done_or_faulted_publishes_nothing(
    api, people, worker, published, django_capture_on_commit_callbacks
):
    """A settled request has nothing left to stop: its DELETE answers the status as it is, and its
    subscribers never hear a cancelled after its done (or faulted)."""
    requester, owner = people
    done = make_chat_request(requester.user)
    job = pop_chat_job(done, worker)[0]
    faulted = make_chat_request(requester.user)
    GenerationRequest.objects.filter(pk=faulted.pk).update(faulted=True, jobs_waiting=0)
    with django_capture_on_commit_callbacks(execute=True):
        assert submit(api, owner.key, job.id, reply()).status_code == 200
        answers = [api.delete(f"/api/v2/generate/chat/status/{r.pk}") for r in (done, faulted)]
    assert [(a.status_code, a.json()["done"], a.json()["faulted"]) for a in answers] == [(200, True, False), (200, True, True)]
    assert events(published) == [("generation", 1), ("done", 1)]
    assert not GenerationRequest.objects.filter(pk__in=[done.pk, faulted.pk], cancelled=True).exists()


def test_refused_reply_and_plain_fault_publish_nothing(
    api, people, worker, published, django_capture_on_commit_callbacks
):
    requester, owner = people
    job = pop_chat_job(make_chat_request(requester.user), worker)[0]
    with django_capture_on_commit_callbacks(execute=True):
        assert submit(api, owner.key, job.id, reply(model_id="x")).status_code == 400
        assert submit(api, owner.key, job.id, FAULT).status_code == 200
    assert published == []


def test_repeated_faults_publish_faulted_at_once_with_the_reason(
    api, people, worker, published, django_capture_on_commit_callbacks
):
    requester, owner = people
    request = make_chat_request(requester.user)
    for _ in range(3):
        job = pop_chat_job(request, worker)[0]
        with django_capture_on_commit_callbacks(execute=True):
            assert (
                submit(api, owner.key, job.id, {**FAULT, "fault_reason": "unbuildable_grammar"}).status_code
                == 200
            )
    assert published == [
        {
            "id": str(request.pk),
            "event": "faulted",
            "generations": 0,
            "fault_reason": CHAT_WORKER_FAULT_MESSAGES["unbuildable_grammar"],
            "fault_rc": "ChatWorkerFault",
            "_row": True,  # a request faulted by repeated faults keeps its row
        }
    ]
    assert GenerationRequest.objects.get(pk=request.pk).faulted


def test_repeated_refusals_then_faults_signal_the_refusal(
    api, people, worker, published, django_capture_on_commit_callbacks
):
    requester, owner = people
    request = make_chat_request(requester.user, extras={"response_format": {"type": "json_object"}})
    for _ in range(3):
        job = pop_chat_job(request, worker)[0]
        with django_capture_on_commit_callbacks(execute=True):
            refusal = submit(api, owner.key, job.id, reply("prose")).json()
            submit(api, owner.key, job.id, {**FAULT, "fault_reason": "reply_refused"})
    assert [(m["event"], m["fault_rc"], m["fault_reason"]) for m in published] == [
        ("faulted", "ChatSubmitNonconformant", refusal["message"])
    ]


def test_stale_sweep_crossing_the_limit_publishes_faulted(
    people, worker, published, django_capture_on_commit_callbacks
):
    requester, _ = people
    request = make_chat_request(requester.user)
    for _ in range(3):
        job = pop_chat_job(request, worker)[0]
        Generation.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
        with django_capture_on_commit_callbacks(execute=True):
            tasks.abort_stale_generations.apply()
    assert [(m["event"], "fault_rc" in m and m["fault_rc"]) for m in published] == [("faulted", None)]


def _expire(request):
    GenerationRequest.objects.filter(pk=request.pk).update(expires_at=timezone.now() - timedelta(seconds=1))


def test_expiry_publishes_faulted_after_the_deletion(
    api, people, worker, published, django_capture_on_commit_callbacks
):
    requester, owner = people
    request = make_chat_request(requester.user)
    job = pop_chat_job(request, worker)[0]
    submit(api, owner.key, job.id, reply(model_id="x"))  # a refusal the signal reports
    _expire(request)
    with django_capture_on_commit_callbacks(execute=True):
        assert tasks.expire_requests.apply().get() == 1
    [message] = published
    assert message["event"] == "faulted" and message["_row"] is False  # the row was gone when it went out
    assert message["fault_rc"] == "ChatModelMismatch"
    assert message["fault_reason"].startswith("'model_id': The job was assigned the model")


def test_expiry_of_a_done_or_text_request_publishes_nothing(
    api, horde, people, worker, published, django_capture_on_commit_callbacks
):
    requester, owner = people
    done = make_chat_request(requester.user)
    submit(api, owner.key, pop_chat_job(done, worker)[0].id, reply())
    published.clear()
    text_id = horde.text_async(requester.key, models=[CHAT_MODEL]).json()["id"]
    _expire(done)
    GenerationRequest.objects.filter(pk=text_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        assert tasks.expire_requests.apply().get() == 2
    assert published == []


def test_message_carries_fault_keys_only_when_present(settings, monkeypatch):
    captured = {}

    class Client:
        def publish(self, channel, payload):
            captured[channel] = json.loads(payload)

    settings.HORDE_CHAT_SIGNAL_REDIS_URL = "redis://127.0.0.1:6379/0"
    monkeypatch.setattr(signals, "_client", lambda url: Client())
    assert signals.publish_now("r1", "faulted", 0, fault_reason=None, fault_rc=None)
    assert signals.publish_now("r2", "faulted", 1, fault_reason="why", fault_rc="ChatWorkerFault")
    assert captured == {
        "horde:chat:r1": {"id": "r1", "event": "faulted", "generations": 0},
        "horde:chat:r2": {
            "id": "r2",
            "event": "faulted",
            "generations": 1,
            "fault_reason": "why",
            "fault_rc": "ChatWorkerFault",
        },
    }


def test_publisher_uses_the_signal_database_whatever_the_url_says():
    client = signals._client("redis://127.0.0.1:6379/15")
    assert client.connection_pool.connection_kwargs["db"] == signals.CHAT_SIGNAL_DB == 7


def test_redis_down_never_fails_submit_fault_or_cancel(
    api, people, worker, settings, caplog, django_capture_on_commit_callbacks
):
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = CLOSED_PORT
    requester, owner = people
    done = make_chat_request(requester.user)
    faulted = make_chat_request(requester.user)
    caplog.set_level(logging.WARNING, logger="chat.signals")
    with django_capture_on_commit_callbacks(execute=True):
        assert submit(api, owner.key, pop_chat_job(done, worker)[0].id, reply()).status_code == 200
        for _ in range(3):
            job = pop_chat_job(faulted, worker)[0]
            assert submit(api, owner.key, job.id, FAULT).status_code == 200
        request_cancel(request=make_chat_request(requester.user))
    assert GenerationRequest.objects.get(pk=faulted.pk).faulted
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "chat.signals"
    ]
    for event in ("generation", "done", "faulted", "cancelled"):
        assert any(f"completion signal {event} for" in w and "not published" in w for w in warnings), warnings


@pytest.mark.redis_only
def test_subscriber_receives_generation_then_done(api, people, worker, transactional_db):
    requester, owner = people
    request = make_chat_request(requester.user, kudos_quote=Decimal("20"))
    job = pop_chat_job(request, worker)[0]
    subscriber = redis.Redis.from_url(django_settings.REDIS_URL).pubsub()
    try:
        subscriber.subscribe(signals.chat_signal_channel(request.pk))
        assert subscriber.get_message(timeout=2)["type"] == "subscribe"
        assert submit(api, owner.key, job.id, reply()).status_code == 200
        received = []
        for _ in range(2):
            message = subscriber.get_message(ignore_subscribe_messages=True, timeout=3)
            assert message is not None, received
            received.append(json.loads(message["data"]))
    finally:
        subscriber.close()
    assert received == [
        {"id": str(request.pk), "event": "generation", "generations": 1},
        {"id": str(request.pk), "event": "done", "generations": 1},
    ]
