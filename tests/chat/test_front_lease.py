"""The native side of the front lease (docs/adr/0020-front-lease.md): the lease taken at submit,
renewed by a status read's header, the sweep that cancels requests whose lease lapsed (and leaves
live, done and unleased ones alone), and the text route's operation key."""

from __future__ import annotations

import time
import uuid
from decimal import Decimal

import pytest
import redis
from django.conf import settings as django_settings
from rest_framework.test import APIClient

from accounts.models import KudosTransaction
from chat.models import Generation, GenerationRequest
from chat.services.front_lease import cancel_lapsed_front_leases
from contract.front_lease import FRONT_LEASE_HEADER, FRONT_LEASE_REDIS_DB, front_lease_key
from tests.chat.chat_route_helpers import MODEL, chat_worker
from tests.races import race

LEASE_KEY = f"HTTP_{FRONT_LEASE_HEADER.upper().replace('-', '_')}"
LEASE = {LEASE_KEY: "1"}  # a one-second lease


def text_async(client, key: str, headers: dict | None = None, **body):
    body.setdefault("prompt", "Once upon a time")
    body.setdefault("params", {"max_length": 64})
    body.setdefault("models", [MODEL])
    return client.post("/api/v2/generate/text/async", body, format="json", HTTP_APIKEY=key, **(headers or {}))


def chat_post(client, key: str, headers: dict):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    return client.post("/api/v2/generate/chat/async", body, format="json", HTTP_APIKEY=key, **headers)


def lease_of(request_id):
    return GenerationRequest.objects.values_list("front_lease_expires_at", flat=True).get(pk=request_id)


# --- taking and renewing the lease --------------------------------------------------------------------


def test_a_submit_with_the_header_takes_a_lease_and_one_without_takes_none(horde, make_user):
    requester = make_user("r", kudos=1000)
    chat_worker(make_user("owner"))
    leased = text_async(horde.client, requester.key, LEASE)
    unleased = text_async(horde.client, requester.key)
    malformed = text_async(horde.client, requester.key, {LEASE_KEY: "soon"})
    too_long = text_async(horde.client, requester.key, {LEASE_KEY: "601"})
    superscript = text_async(horde.client, requester.key, {LEASE_KEY: "\u00b2"})  # isdigit, not int
    chat = chat_post(horde.client, requester.key, {LEASE_KEY: "30"})
    assert [r.status_code for r in (leased, unleased, malformed, too_long, superscript, chat)] == [202] * 6
    assert lease_of(leased.json()["id"]) is not None
    assert [lease_of(r.json()["id"]) for r in (unleased, malformed, too_long, superscript)] == [None] * 4
    chat_lease = lease_of(chat.json()["id"])
    assert 25 < (chat_lease - GenerationRequest.objects.get(pk=chat.json()["id"]).created).total_seconds() <= 31


@pytest.mark.parametrize("route", ["text", "chat"])
def test_a_status_read_with_the_header_renews_a_leased_request_only(horde, make_user, route):
    requester = make_user("r", kudos=1000)
    chat_worker(make_user("owner"))
    if route == "text":
        leased, unleased = text_async(horde.client, requester.key, LEASE), text_async(horde.client, requester.key)
    else:
        leased = chat_post(horde.client, requester.key, LEASE)
        unleased = chat_post(horde.client, requester.key, {})
    first = lease_of(leased.json()["id"])
    for created in (leased, unleased):
        status = horde.client.get(f"/api/v2/generate/{route}/status/{created.json()['id']}", **{LEASE_KEY: "60"})
        assert status.status_code == 200
    assert (lease_of(leased.json()["id"]) - first).total_seconds() > 50
    assert lease_of(unleased.json()["id"]) is None  # a status read never puts a request under a lease


# --- the sweep ----------------------------------------------------------------------------------------


def test_the_sweep_cancels_a_lapsed_lease_releases_the_hold_and_charges_nothing(horde, make_user):
    requester = make_user("r", kudos=1000)
    chat_worker(make_user("owner"))
    lapsed = text_async(horde.client, requester.key, LEASE, params={"max_length": 1024}).json()["id"]
    live = text_async(horde.client, requester.key, {LEASE_KEY: "120"}).json()["id"]
    unleased = text_async(horde.client, requester.key).json()["id"]
    assert requester.refresh().kudos_held > 0  # the 1024-token request holds its quote
    kudos = requester.refresh().kudos
    time.sleep(1.1)
    assert cancel_lapsed_front_leases() == 1
    rows = {str(r.id): r for r in GenerationRequest.objects.all()}
    assert rows[lapsed].cancelled and rows[lapsed].jobs_waiting == 0 and rows[lapsed].front_lease_expires_at is None
    assert not rows[live].cancelled and not rows[unleased].cancelled
    user = requester.refresh()
    assert (user.kudos, user.kudos_held) == (kudos, Decimal("0"))
    assert not KudosTransaction.objects.filter(kind=KudosTransaction.Kind.GENERATION_CHARGE).exists()
    assert horde.status(lapsed).json()["done"] is True
    assert cancel_lapsed_front_leases() == 0  # handled once


def test_the_sweep_leaves_a_done_request_alone(horde, make_user):
    requester = make_user("r", kudos=1000)
    owner = make_user("owner", trusted=True)
    created = text_async(horde.client, requester.key, LEASE).json()["id"]
    job = horde.pop(owner.key, models=[MODEL]).json()
    assert horde.submit(owner.key, job["id"], " The end.").status_code == 200
    time.sleep(1.1)
    assert cancel_lapsed_front_leases() == 0
    request = GenerationRequest.objects.get(pk=created)
    assert not request.cancelled and request.front_lease_expires_at is None


def test_a_job_in_flight_when_the_sweep_cancels_still_submits_and_is_paid(horde, make_user):
    """As the spec's cancel: no more jobs are handed out; a non-streamed job in flight submits and is
    paid for the work its worker did."""
    requester = make_user("r", kudos=1000)
    owner = make_user("owner", trusted=True)
    created = text_async(horde.client, requester.key, LEASE).json()["id"]
    job = horde.pop(owner.key, models=[MODEL]).json()
    time.sleep(1.1)
    assert cancel_lapsed_front_leases() == 1
    assert horde.submit(owner.key, job["id"], " Late.").status_code == 200
    assert Generation.objects.get(pk=job["id"]).state == Generation.State.OK
    assert GenerationRequest.objects.get(pk=created).cancelled


@pytest.mark.redis_only
def test_a_lease_renewed_in_redis_keeps_the_request_and_moves_the_row(horde, make_user):
    requester = make_user("r", kudos=1000)
    chat_worker(make_user("owner"))
    renewed = text_async(horde.client, requester.key, LEASE).json()["id"]
    forgotten = text_async(horde.client, requester.key, LEASE).json()["id"]
    pool = redis.ConnectionPool.from_url(django_settings.REDIS_URL)
    pool.connection_kwargs["db"] = FRONT_LEASE_REDIS_DB
    lease_db = redis.Redis(connection_pool=pool)
    lease_db.set(front_lease_key(renewed), b"1", ex=30)  # as a front renews it
    try:
        time.sleep(1.1)
        assert cancel_lapsed_front_leases() == 1
        assert not GenerationRequest.objects.get(pk=renewed).cancelled
        assert GenerationRequest.objects.get(pk=forgotten).cancelled
        carried = (lease_of(renewed) - GenerationRequest.objects.get(pk=renewed).created).total_seconds()
        assert carried > 20  # the key's expiry, so the next sweeps skip the row
        assert cancel_lapsed_front_leases() == 0
    finally:
        lease_db.delete(front_lease_key(renewed))


@pytest.mark.redis_only
def test_with_the_horde_redis_down_the_sweep_cancels_nothing(horde, make_user, settings):
    requester = make_user("r", kudos=1000)
    chat_worker(make_user("owner"))
    created = text_async(horde.client, requester.key, LEASE).json()["id"]
    time.sleep(1.1)
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    assert cancel_lapsed_front_leases() == 0  # a live front's Redis lease cannot be told from none
    assert not GenerationRequest.objects.get(pk=created).cancelled
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = None
    assert cancel_lapsed_front_leases() == 1


def test_the_sweep_is_a_beat_task(db):
    from hordesite.celery import app

    schedule = {entry["task"]: entry["schedule"] for entry in app.conf.beat_schedule.values()}
    assert schedule["chat.tasks.cancel_lapsed_front_leases"] == 10.0
    from chat import tasks

    assert tasks.cancel_lapsed_front_leases() == 0


# --- the text route's operation key ---------------------------------------------------------------------


def test_a_repeated_text_key_answers_the_first_request_without_charging(horde, make_user):
    requester = make_user("r", kudos=1000)
    key = str(uuid.uuid4())
    first = text_async(horde.client, requester.key, operation_key=key, models=[MODEL, "other"])
    assert first.status_code == 202
    kudos = requester.refresh().kudos
    again = text_async(horde.client, requester.key, operation_key=key, models=["other", MODEL])
    assert again.status_code == 200
    assert again.json() == {"id": first.json()["id"], "kudos": first.json()["kudos"]}
    assert GenerationRequest.objects.count() == 1 and requester.refresh().kudos == kudos
    assert str(GenerationRequest.objects.get().operation_key) == key
    conflict = text_async(horde.client, requester.key, operation_key=key, prompt="Another story")
    assert conflict.status_code == 400 and conflict.json()["rc"] == "OperationKeyConflict"
    other_user = text_async(horde.client, make_user("o", kudos=1000).key, operation_key=key)
    assert other_user.status_code == 202 and other_user.json()["id"] != first.json()["id"]
    dry = text_async(horde.client, requester.key, operation_key=key, dry_run=True)
    assert dry.status_code == 200 and "id" not in dry.json()


def test_a_text_key_must_be_a_uuid(horde, make_user):
    response = text_async(horde.client, make_user("r").key, operation_key="nope")
    assert response.status_code == 400
    assert response.json()["message"] == "Input payload validation failed"
    assert "operation_key" in response.json()["errors"]


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_two_concurrent_text_submits_with_one_key_create_one_request_and_one_tax(make_user, settings):
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["10000/second"]
    requester = make_user("r", kudos=1000)
    key = str(uuid.uuid4())
    results = race([lambda: text_async(APIClient(), requester.key, operation_key=key) for _ in range(4)])
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 200, 202]
    assert len({r.json()["id"] for r in results}) == 1
    assert GenerationRequest.objects.count() == 1
    assert KudosTransaction.objects.filter(kind=KudosTransaction.Kind.HORDE_TAX).count() == 1
