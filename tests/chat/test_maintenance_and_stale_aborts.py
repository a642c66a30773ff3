"""Maintenance mode aborts the waiting requests and publishes `cancelled` for chat ones (spec:
chat_requests.md, "Completion signal"); jobs in flight still settle. And horde.text.stale_aborts
counts the text and chat jobs the stale-generation sweep aborts ("Job lease")."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from decimal import Decimal

import pytest
import redis
from django.utils import timezone

from chat import metrics, tasks
from chat.models import Generation, GenerationRequest
from chat.signals import CHAT_SIGNAL_DB, chat_signal_channel
from tests.chat.chat_route_helpers import MODEL, chat_async, chat_status, chat_worker
from tests.chat.pop_helpers import chat_pop

MODES = "/api/v2/status/modes"


@pytest.fixture
def people(make_user):
    return make_user("client", kudos=10_000), make_user("volunteer"), make_user("mod", moderator=True)


def _switch(horde, key, maintenance: bool):
    response = horde.client.put(MODES, {"maintenance": maintenance}, format="json", HTTP_APIKEY=key)
    assert response.status_code == 200, response.json()


def test_maintenance_aborts_waiting_requests_and_lets_jobs_in_flight_settle(horde, people):
    requester, owner, moderator = people
    in_flight = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    job = horde.pop(owner.key).json()
    assert job["id"]
    waiting = horde.text_async(requester.key, models=[MODEL], params={"max_length": 1024}).json()["id"]
    assert requester.refresh().kudos_held > 0  # above the free output floor: held upfront
    chat_worker(owner)
    chat_id = chat_async(horde.client, requester.key).json()["id"]
    _switch(horde, moderator.key, True)
    for status in (horde.status(waiting).json(), chat_status(horde.client, chat_id).json()):
        assert status["done"] is True and status["waiting"] == 0 and status["processing"] == 0, status
        assert status["finished"] == 0 and status["faulted"] is False
    assert requester.refresh().kudos_held == Decimal("0")
    assert GenerationRequest.objects.filter(pk__in=[waiting, chat_id], cancelled=True).count() == 2
    # The job handed out before the switch is not aborted: its submit is stored and paid.
    assert horde.status(in_flight).json()["processing"] == 1
    assert horde.submit(owner.key, job["id"], "The end.").json()["reward"] > 0
    assert horde.status(in_flight).json()["done"] is True
    assert horde.pop(owner.key).json()["id"] is None  # nothing left to hand out
    blocked = horde.text_async(requester.key, models=[MODEL])
    assert blocked.status_code == 503 and blocked.json()["rc"] == "MaintenanceMode"
    _switch(horde, moderator.key, False)
    assert horde.text_async(requester.key, models=[MODEL]).status_code == 202


def test_switching_maintenance_off_aborts_nothing(horde, people):
    requester, _, moderator = people
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    _switch(horde, moderator.key, False)
    assert horde.status(request_id).json()["waiting"] == 1


def test_the_modes_read_and_switched_as_upstreams_admin_tools_do(horde, people):
    """Upstream's GET /status/modes (no key needed) and its PUT key `maintenance_mode`; this horde
    has no invite-only mode, so it reads false."""
    requester, _, moderator = people
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    read = horde.client.get(MODES)
    assert (read.status_code, read.json()) == (200, {"maintenance_mode": False, "invite_only_mode": False})
    switched = horde.client.put(MODES, {"maintenance_mode": True}, format="json", HTTP_APIKEY=moderator.key)
    assert (switched.status_code, switched.json()) == (200, {"maintenance_mode": True})
    assert horde.client.get(MODES).json() == {"maintenance_mode": True, "invite_only_mode": False}
    assert horde.status(request_id).json()["done"] is True  # aborted, as the `maintenance` key does
    refused = horde.client.put(MODES, {"maintenance_mode": False}, format="json", HTTP_APIKEY=requester.key)
    assert (refused.status_code, refused.json()["rc"]) == (403, "NotModerator")
    both = horde.client.put(
        MODES, {"maintenance_mode": False, "maintenance": True}, format="json", HTTP_APIKEY=moderator.key
    )
    assert (both.status_code, both.json()["rc"]) == (400, "BadRequest")
    for body in ({"maintenance_mode": []}, {"maintenance": {}}, {"maintenance_mode": 1}, {"invite_only_mode": True}):
        odd = horde.client.put(MODES, body, format="json", HTTP_APIKEY=moderator.key)
        assert (odd.status_code, odd.json()["rc"]) == (400, "BadRequest"), body
    _switch(horde, moderator.key, False)
    assert horde.client.get(MODES).json()["maintenance_mode"] is False


def test_the_sweep_aborts_what_still_waits_in_maintenance(horde, people, settings):
    requester, _, _ = people
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    assert tasks.sweep_maintenance.apply().get() == 0  # not in maintenance: nothing
    settings.HORDE_MAINTENANCE = True  # a horde started in maintenance mode
    assert tasks.sweep_maintenance.apply().get() == 1
    assert horde.status(request_id).json()["done"] is True
    assert tasks.sweep_maintenance.apply().get() == 0


def _subscribe(redis_url, request_id):
    client = redis.Redis.from_url(redis_url, db=CHAT_SIGNAL_DB)
    pubsub = client.pubsub()
    pubsub.subscribe(chat_signal_channel(request_id))
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    return client, pubsub


def _next_message(pubsub, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.2)
        if message and message["type"] == "message":
            return json.loads(message["data"])
    return None


@pytest.mark.redis_only
@pytest.mark.django_db(transaction=True)
def test_maintenance_publishes_cancelled_for_a_waiting_chat_request(horde, people, redis_url):
    requester, owner, moderator = people
    chat_worker(owner)
    request_id = chat_async(horde.client, requester.key).json()["id"]
    client, pubsub = _subscribe(redis_url, request_id)
    try:
        _switch(horde, moderator.key, True)
        assert _next_message(pubsub) == {"id": request_id, "event": "cancelled", "generations": 0}
        assert _next_message(pubsub, timeout=0.5) is None  # once
    finally:
        pubsub.close()
        client.close()


# --- horde.text.stale_aborts --------------------------------------------------------------------


@pytest.fixture
def metric_reader():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.use_meter_provider(provider)
    yield reader
    metrics.use_meter_provider(None)
    provider.shutdown()


def _points(reader, name: str) -> dict[tuple, int]:
    data = reader.get_metrics_data()
    points: dict[tuple, int] = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        points[tuple(sorted(point.attributes.items()))] = point.value
    return points


def _lapse(job_id):
    Generation.objects.filter(pk=job_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def test_stale_aborts_are_counted_by_trust_and_kind(horde, make_user, metric_reader):
    requester = make_user("client", kudos=10_000)
    trusted, untrusted = make_user("trusted", trusted=True), make_user("untrusted")
    horde.text_async(requester.key, models=[MODEL])
    text_job = horde.pop(trusted.key, name="text-worker").json()
    chat_worker(untrusted)  # the model has a chat worker; the popping one follows
    chat_async(horde.client, requester.key)
    chat_job = chat_pop(horde, untrusted.key, name="chat-popper").json()
    assert text_job["id"] and chat_job["chat"] is True
    assert tasks.abort_stale_generations.apply().get() == 0
    assert _points(metric_reader, "horde.text.stale_aborts") == {}  # nothing lapsed yet
    _lapse(text_job["id"])
    _lapse(chat_job["id"])
    assert tasks.abort_stale_generations.apply().get() == 2
    assert _points(metric_reader, "horde.text.stale_aborts") == {
        (("horde.chat", False), ("horde.worker_trusted", True)): 1,
        (("horde.chat", True), ("horde.worker_trusted", False)): 1,
    }
    # A job its worker submitted in time is not an abort.
    again = horde.pop(trusted.key, name="text-worker").json()
    _lapse(again["id"])
    assert horde.submit(trusted.key, again["id"], "In time.").status_code == 200
    assert tasks.abort_stale_generations.apply().get() == 0
    assert sum(_points(metric_reader, "horde.text.stale_aborts").values()) == 2
