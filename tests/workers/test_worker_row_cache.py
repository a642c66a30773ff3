"""A process reuses the worker row its pop read for HORDE_WORKER_CACHE_SECONDS; the owner's switch
through the API applies at once, a change made elsewhere within that time."""

from __future__ import annotations

import time

import pytest

from workers.models import Worker

MODEL = "Gryphe/MythoMax-L2-13b"


def test_maintenance_through_the_api_stops_the_next_pop(horde, make_user, settings):
    settings.HORDE_WORKER_CACHE_SECONDS = 60
    owner = make_user("owner")
    assert horde.pop(owner.key).status_code == 200
    worker = Worker.objects.get(name="worker-1")
    put = horde.client.put(f"/api/v2/workers/{worker.id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key)
    assert put.status_code == 200
    refused = horde.pop(owner.key)
    assert refused.status_code == 403 and refused.json()["rc"] == "WorkerMaintenance"


def test_a_change_made_elsewhere_reaches_the_pop_within_the_setting(horde, make_user, settings):
    settings.HORDE_WORKER_CACHE_SECONDS = 0.3
    owner, requester = make_user("owner"), make_user("requester", kudos=100)
    assert horde.pop(owner.key).json()["id"] is None
    # As an operator in the admin, or another web process, would.
    Worker.objects.filter(name="worker-1").update(paused=True)
    time.sleep(0.35)
    horde.text_async(requester.key, models=[MODEL])
    paused = horde.pop(owner.key).json()
    assert paused["id"] is None and paused["skipped"] == {}
    Worker.objects.filter(name="worker-1").update(paused=False)
    time.sleep(0.35)
    assert horde.pop(owner.key).json()["id"] is not None


def test_the_check_in_keeps_writing_the_declaration_it_is_sent(horde, make_user, settings):
    settings.HORDE_WORKER_CACHE_SECONDS = 60
    owner = make_user("owner")
    horde.pop(owner.key, max_length=256)
    horde.pop(owner.key, max_length=512, models=[MODEL, "other/model"])
    stored = Worker.objects.get(name="worker-1")
    assert stored.max_length == 512 and stored.served_models == [MODEL, "other/model"]


def test_another_owner_cannot_pop_as_a_cached_worker(horde, make_user, settings):
    settings.HORDE_WORKER_CACHE_SECONDS = 60
    owner, intruder = make_user("owner"), make_user("intruder")
    assert horde.pop(owner.key).status_code == 200
    refused = horde.pop(intruder.key)
    assert refused.status_code == 403 and refused.json()["rc"] == "WrongCredentials"


# Committed writes: the generation's foreign key to the worker is checked at commit.
@pytest.mark.django_db(transaction=True)
def test_a_worker_deleted_behind_the_cache_registers_again_on_its_next_pop(horde, make_user, settings):
    settings.HORDE_WORKER_CACHE_SECONDS = 60
    owner, requester = make_user("owner"), make_user("requester", kudos=100)
    assert horde.pop(owner.key).json()["id"] is None
    Worker.objects.filter(name="worker-1").delete()  # an operator, in the admin
    horde.text_async(requester.key, models=[MODEL])
    job = horde.pop(owner.key)
    assert job.status_code == 200 and job.json()["id"] is not None
    assert Worker.objects.filter(name="worker-1", owner=owner.user).count() == 1
