"""Leases, re-queue, the fault limit, expiry and maintenance."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from chat import tasks
from chat.models import Generation, GenerationRequest
from workers.models import Worker

MODEL = "Gryphe/MythoMax-L2-13b"


@pytest.fixture
def people(make_user):
    return make_user("requester", kudos=1000), make_user("owner")


def _lapse(job_id):
    Generation.objects.filter(pk=job_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def test_lapsed_lease_is_faulted_requeued_and_late_submit_is_aborted(horde, people):
    requester, owner = people
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    job = horde.pop(owner.key).json()
    assert tasks.abort_stale_generations.apply().get() == 0  # lease still running
    _lapse(job["id"])
    assert tasks.abort_stale_generations.apply().get() == 1
    status = horde.status(request_id).json()
    assert (status["restarted"], status["waiting"], status["processing"]) == (1, 1, 0)
    late = horde.submit(owner.key, job["id"])
    assert late.status_code == 400 and late.json()["rc"] == "AbortedGen"
    assert Worker.objects.get(name="worker-1").aborted_jobs == 1
    retry = horde.pop(owner.key, name="worker-2").json()
    assert retry["id"] and retry["id"] != job["id"]
    assert horde.submit(owner.key, retry["id"], "second try").json()["reward"] > 0
    assert horde.status(request_id).json()["done"] is True


def test_three_faulted_jobs_fault_the_request(horde, people):
    requester, owner = people
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    for attempt in range(3):
        job = horde.pop(owner.key).json()
        assert job["id"], f"attempt {attempt} found no job"
        assert horde.submit(owner.key, job["id"], "", state="faulted").json() == {"reward": 0}
    status = horde.status(request_id).json()
    # Done, as upstream's is_completed() and the spec's rule say: a client that waits only for
    # `done` stops polling (ADR 0006, amended).
    assert status["faulted"] is True and status["restarted"] == 3 and status["done"] is True
    assert horde.pop(owner.key).json()["id"] is None
    assert requester.refresh().kudos == Decimal("999")  # the tax only: nothing was delivered


def test_stale_sweep_applies_the_same_fault_limit(horde, people):
    requester, owner = people
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    for _ in range(3):
        _lapse(horde.pop(owner.key).json()["id"])
        tasks.abort_stale_generations.apply()
    assert horde.status(request_id).json()["faulted"] is True


@pytest.mark.parametrize("drop", ["fault submit", "lapsed lease"])
def test_a_cancelled_request_is_not_faulted_by_a_later_fault(horde, people, drop):
    """A soak found it: a job still in flight when its request was cancelled (a front's client
    disconnected) became the third to fault, and the fault limit faulted the cancelled request,
    which then read done and faulted, its chat subscribers hearing `faulted` after `cancelled`.
    Nothing is handed out after a cancel, so the limit has nothing left to stop (ADR 0064)."""
    requester, owner = people
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    for _ in range(2):
        assert horde.submit(owner.key, horde.pop(owner.key).json()["id"], "", state="faulted").status_code == 200
    job = horde.pop(owner.key).json()
    assert horde.cancel(request_id, requester.key).json()["processing"] == 1
    if drop == "fault submit":
        assert horde.submit(owner.key, job["id"], "", state="faulted").json() == {"reward": 0}
    else:
        _lapse(job["id"])
        assert tasks.abort_stale_generations.apply().get() == 1
    status = horde.status(request_id).json()
    assert (status["done"], status["faulted"], status["processing"]) == (True, False, 0)
    assert GenerationRequest.objects.values_list("cancelled", "faulted").get(pk=request_id) == (True, False)


def test_expired_request_is_deleted_and_its_hold_released(horde, make_user):
    requester = make_user("r", kudos=1000)
    request_id = horde.text_async(requester.key, models=[MODEL], params={"max_length": 1024}).json()["id"]
    held = requester.refresh().kudos_held
    assert held > 0
    GenerationRequest.objects.filter(pk=request_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert tasks.expire_requests.apply().get() == 1
    assert horde.status(request_id).status_code == 404
    assert requester.refresh().kudos_held == 0


def test_pop_extends_the_expiry(horde, people):
    requester, owner = people
    request_id = horde.text_async(requester.key, models=[MODEL], params={"n": 2}).json()["id"]
    soon = timezone.now() + timedelta(seconds=30)
    GenerationRequest.objects.filter(pk=request_id).update(expires_at=soon)
    horde.pop(owner.key)
    assert GenerationRequest.objects.get(pk=request_id).expires_at > soon + timedelta(minutes=15)


def test_horde_maintenance_refuses_new_requests_but_lets_workers_finish(horde, people, make_user):
    requester, owner = people
    moderator = make_user("mod", moderator=True)
    horde.text_async(requester.key, models=[MODEL])
    job = horde.pop(owner.key).json()
    refused = horde.client.put("/api/v2/status/modes", {"maintenance": True}, format="json", HTTP_APIKEY=requester.key)
    assert refused.status_code == 403 and refused.json()["rc"] == "NotModerator"
    assert horde.client.put(
        "/api/v2/status/modes", {"maintenance": True}, format="json", HTTP_APIKEY=moderator.key
    ).status_code == 200
    blocked = horde.text_async(requester.key, models=[MODEL])
    assert blocked.status_code == 503 and blocked.json()["rc"] == "MaintenanceMode"
    # The job in flight settles (waiting requests are aborted: test_maintenance_and_stale_aborts).
    assert horde.submit(owner.key, job["id"]).status_code == 200
    horde.client.put("/api/v2/status/modes", {"maintenance": False}, format="json", HTTP_APIKEY=moderator.key)
    assert horde.text_async(requester.key, models=[MODEL]).status_code == 202


def test_worker_maintenance_stops_its_pops(horde, people, make_user):
    requester, owner = people
    horde.pop(owner.key)
    worker_id = Worker.objects.get(name="worker-1").id
    other = make_user("other")
    denied = horde.client.put(f"/api/v2/workers/{worker_id}", {"maintenance": True}, format="json", HTTP_APIKEY=other.key)
    assert denied.status_code == 403
    assert horde.client.put(
        f"/api/v2/workers/{worker_id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key
    ).json() == {"maintenance": True}  # what changed, as upstream answers
    horde.text_async(requester.key, models=[MODEL])
    paused = horde.pop(owner.key)
    assert paused.status_code == 403 and paused.json()["rc"] == "WorkerMaintenance"
    assert horde.client.get(f"/api/v2/workers/{worker_id}").json()["maintenance_mode"] is True


def test_the_lease_and_the_request_time_to_live_are_settings(horde, people, settings):
    settings.HORDE_TEXT_JOB_LEASE_SECONDS = 30
    settings.HORDE_TEXT_REQUEST_TTL_SECONDS = 90
    requester, owner = people
    before = timezone.now()
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    job = horde.pop(owner.key).json()
    after = timezone.now()
    assert job["ttl"] == 30
    lease = Generation.objects.get(pk=job["id"]).lease_expires_at
    assert before + timedelta(seconds=30) <= lease <= after + timedelta(seconds=30)
    expiry = GenerationRequest.objects.get(pk=request_id).expires_at
    assert before + timedelta(seconds=90) <= expiry <= after + timedelta(seconds=90)
