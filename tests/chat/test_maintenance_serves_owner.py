"""A worker in maintenance keeps serving its owner's own requests, as upstream's does, so an
operator can test it privately; everyone else's requests skip it. With none of its owner's
waiting, its pop is refused with 403 WorkerMaintenance, as upstream refuses it only when it found
nothing (docs/adr/0083-a-worker-in-maintenance-serves-its-owner.md)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from chat.models import GenerationRequest
from chat.selectors import snapshots
from chat.services.create_text import TEXT_NO_AVAILABLE_WORKER_WARNING
from contract.text import ABORTED_JOBS_PER_HOUR_LIMIT
from tests.chat.pop_helpers import MODEL, chat_pop, queue_chat
from tests.chat.test_status_queue_wait import _queued
from workers.models import Worker
from workers.services import aborted_jobs_maintenance_message


def _maintenance(horde, owner, name: str, **body) -> Worker:
    """The owner's worker, registered by its first pop and put in maintenance as Lite does."""
    assert horde.pop(owner.key, name=name, **body).status_code == 200
    worker = Worker.objects.get(name=name)
    put = horde.client.put(f"/api/v2/workers/{worker.id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key)
    assert put.json() == {"maintenance": True}
    return worker


def _refused(response, message: str | None = None) -> bool:
    body = response.json()
    return response.status_code == 403 and body["rc"] == "WorkerMaintenance" and (message is None or body["message"] == message)


def test_a_text_worker_in_maintenance_pops_its_owners_request_and_not_another_users(horde, make_user):
    owner, stranger = make_user("owner", kudos=100), make_user("stranger", kudos=100)
    worker = _maintenance(horde, owner, "attic")
    theirs = horde.text_async(stranger.key, models=[MODEL], prompt="theirs").json()["id"]
    mine = horde.text_async(owner.key, models=[MODEL], prompt="mine").json()["id"]
    job = horde.pop(owner.key, name="attic").json()
    assert job["payload"]["prompt"] == "mine"
    assert horde.submit(owner.key, job["id"]).status_code == 200
    assert horde.status(mine).json()["done"] is True
    # Only another user's request is left: it is not handed out, and the pop says why.
    assert _refused(horde.pop(owner.key, name="attic"))
    assert GenerationRequest.objects.get(pk=theirs).jobs_waiting == 1
    # Lifted: the worker serves everyone again.
    horde.client.put(f"/api/v2/workers/{worker.id}", {"maintenance": False}, format="json", HTTP_APIKEY=owner.key)
    assert horde.pop(owner.key, name="attic").json()["payload"]["prompt"] == "theirs"


def test_an_empty_maintenance_pop_is_the_owners_message(horde, make_user):
    owner = make_user("owner")
    worker = _maintenance(horde, owner, "attic")
    assert _refused(
        horde.pop(owner.key, name="attic"),
        "Worker attic is in maintenance mode: it takes only its owner's requests until the owner lifts it.",
    )
    horde.client.put(
        f"/api/v2/workers/{worker.id}", {"maintenance": True, "maintenance_msg": "Testing a new model."},
        format="json", HTTP_APIKEY=owner.key,
    )
    assert _refused(horde.pop(owner.key, name="attic"), "Testing a new model.")


def test_a_chat_worker_in_maintenance_pops_its_owners_chat_request_and_not_another_users(horde, make_user):
    owner, stranger = make_user("owner"), make_user("stranger")
    assert chat_pop(horde, owner.key, name="chatty").status_code == 200
    worker = Worker.objects.get(name="chatty")
    horde.client.put(f"/api/v2/workers/{worker.id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key)
    theirs = queue_chat(stranger.user, priority=5)  # ahead in the queue
    mine = queue_chat(owner.user)
    job = chat_pop(horde, owner.key, name="chatty").json()
    assert job["id"] is not None and GenerationRequest.objects.get(pk=mine.pk).jobs_waiting == 0
    assert _refused(chat_pop(horde, owner.key, name="chatty"))
    assert GenerationRequest.objects.get(pk=theirs.pk).jobs_waiting == 1


def test_priority_users_do_not_reach_a_worker_in_maintenance(horde, make_user):
    """Upstream's priority walk admits the worker's priority users, and its can_generate then
    keeps only the owner's requests: in maintenance, priority_usernames give nobody else a job."""
    owner, friend = make_user("owner"), make_user("friend", kudos=100)
    priority = [f"{friend.user.username}#{friend.user.pk}"]
    _maintenance(horde, owner, "attic", priority_usernames=priority)
    horde.text_async(friend.key, models=[MODEL])
    assert _refused(horde.pop(owner.key, name="attic", priority_usernames=priority))


def test_the_owners_request_only_their_maintenance_worker_serves_is_possible(horde, make_user):
    owner, stranger = make_user("owner", kudos=100), make_user("stranger", kudos=100)
    _maintenance(horde, owner, "attic")
    mine = horde.text_async(owner.key, models=[MODEL])
    theirs = horde.text_async(stranger.key, models=[MODEL])
    # Upstream's wp_has_valid_workers counts a worker in maintenance for its owner's request only.
    assert "message" not in mine.json()
    assert theirs.json()["message"] == TEXT_NO_AVAILABLE_WORKER_WARNING
    assert horde.status(mine.json()["id"]).json()["is_possible"] is True
    assert horde.status(theirs.json()["id"]).json()["is_possible"] is False


def test_the_owners_chat_request_only_their_maintenance_worker_serves_is_possible(horde, make_user):
    owner, stranger = make_user("owner"), make_user("stranger")
    assert chat_pop(horde, owner.key, name="chatty").status_code == 200
    worker = Worker.objects.get(name="chatty")
    horde.client.put(f"/api/v2/workers/{worker.id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key)
    mine, theirs = queue_chat(owner.user), queue_chat(stranger.user)
    assert horde.client.get(f"/api/v2/generate/chat/status/{mine.pk}", HTTP_APIKEY=owner.key).json()["is_possible"] is True
    assert horde.client.get(f"/api/v2/generate/chat/status/{theirs.pk}", HTTP_APIKEY=stranger.key).json()["is_possible"] is False


def test_an_idle_maintenance_worker_finds_its_owners_new_request_at_once(horde, make_user):
    """The empty pops' memory (ADRs 0051, 0057) never answers a worker in maintenance: after
    refusals, and after an empty pop remembered before the maintenance, the owner's new request
    is handed out on the next pop."""
    owner, stranger = make_user("owner", kudos=100), make_user("stranger", kudos=100)
    assert horde.pop(owner.key, name="attic").json()["id"] is None  # remembered empty
    worker = Worker.objects.get(name="attic")
    horde.client.put(f"/api/v2/workers/{worker.id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key)
    assert _refused(horde.pop(owner.key, name="attic"))
    horde.text_async(stranger.key, models=[MODEL])
    assert _refused(horde.pop(owner.key, name="attic"))
    assert _refused(horde.pop(owner.key, name="attic"))
    horde.text_async(owner.key, models=[MODEL], prompt="mine")
    assert horde.pop(owner.key, name="attic").json()["payload"]["prompt"] == "mine"


def test_a_worker_not_in_maintenance_still_serves_everyone_its_owners_first(horde, make_user):
    owner, stranger = make_user("owner", kudos=100), make_user("stranger", kudos=100)
    assert horde.pop(owner.key, name="attic").status_code == 200
    horde.text_async(stranger.key, models=[MODEL], prompt="theirs")
    horde.text_async(owner.key, models=[MODEL], prompt="mine")
    assert horde.pop(owner.key, name="attic").json()["payload"]["prompt"] == "mine"
    assert horde.pop(owner.key, name="attic").json()["payload"]["prompt"] == "theirs"
    empty = horde.pop(owner.key, name="attic")
    assert empty.status_code == 200 and empty.json()["id"] is None


def _drop(horde, owner, name: str, requester) -> None:
    """A job the worker pops and hands back faulted: a dropped job (upstream's log_aborted_job)."""
    horde.text_async(requester.key, models=[MODEL], prompt="to drop")
    job = horde.pop(owner.key, name=name).json()
    assert job["id"] is not None
    assert horde.submit(owner.key, job["id"], state="faulted").status_code == 200


@pytest.mark.django_db(transaction=True)  # the switch reaches the readers when its drop commits
def test_too_many_dropped_jobs_in_an_hour_put_the_worker_in_maintenance_where_it_serves_its_owner(horde, make_user):
    owner, stranger = make_user("owner", kudos=100), make_user("stranger", kudos=1000)
    assert horde.pop(owner.key, name="attic").status_code == 200
    worker = Worker.objects.get(name="attic")
    # 19 dropped half an hour ago; the 20th leaves it serving, the 21st crosses upstream's limit.
    Worker.objects.filter(pk=worker.pk).update(
        aborted_in_window=ABORTED_JOBS_PER_HOUR_LIMIT - 1, aborted_window_started_at=timezone.now() - timedelta(minutes=30)
    )
    _drop(horde, owner, "attic", stranger)
    assert horde.client.get(f"/api/v2/workers/{worker.id}").json()["maintenance_mode"] is False
    _drop(horde, owner, "attic", stranger)
    assert horde.client.get(f"/api/v2/workers/{worker.id}").json()["maintenance_mode"] is True
    # Other users' requests are waiting (the dropped ones came back): none is handed out.
    assert _refused(horde.pop(owner.key, name="attic"), aborted_jobs_maintenance_message(ABORTED_JOBS_PER_HOUR_LIMIT))
    # The owner tests the worker on a request of their own, which is possible and served.
    mine = horde.text_async(owner.key, models=[MODEL], prompt="mine").json()
    assert "message" not in mine and horde.status(mine["id"]).json()["is_possible"] is True
    assert horde.pop(owner.key, name="attic").json()["payload"]["prompt"] == "mine"


def test_dropped_jobs_count_towards_maintenance_only_within_the_hour(horde, make_user):
    owner, stranger = make_user("owner"), make_user("stranger", kudos=1000)
    assert horde.pop(owner.key, name="attic").status_code == 200
    Worker.objects.filter(name="attic").update(
        aborted_in_window=ABORTED_JOBS_PER_HOUR_LIMIT, aborted_window_started_at=timezone.now() - timedelta(minutes=61)
    )
    _drop(horde, owner, "attic", stranger)
    worker = Worker.objects.get(name="attic")
    assert (worker.maintenance, worker.aborted_in_window, worker.aborted_jobs) == (False, 1, 1)


def test_a_kudos_refusal_of_the_owner_stays_a_kudos_refusal(horde, make_user):
    """No online worker but the owner's, in maintenance: kudos would help the owner's request
    (KudosUpfront), not a stranger's (NoEligibleWorker in its place). The owner's own backlog on
    the worker holds their allowance to the floor (docs/adr/0089)."""
    owner, stranger = make_user("owner", kudos=5), make_user("stranger", kudos=5)
    _maintenance(horde, owner, "attic", max_length=2048)
    for _ in range(3):
        _queued(owner.user, max_length=1000, score=1_000_000)
    snapshots.reset_snapshots()
    mine = horde.text_async(owner.key, models=[MODEL], params={"max_length": 1024})
    theirs = horde.text_async(stranger.key, models=[MODEL], params={"max_length": 1024})
    assert (mine.status_code, mine.json()["rc"]) == (403, "KudosUpfront")
    assert (theirs.status_code, theirs.json()["rc"]) == (403, "NoEligibleWorker")


def test_the_dropped_jobs_limit_is_a_setting_and_zero_turns_it_off(horde, make_user, settings):
    """HORDE_WORKER_DROPPED_JOBS_PER_HOUR: a smaller bound switches sooner, with its number in the
    message; 0 leaves a worker that drops every job serving (make run's demo worker faults each
    `[scripted:error]` request three times, by design)."""
    owner, stranger = make_user("owner"), make_user("stranger", kudos=1000)
    assert horde.pop(owner.key, name="attic").status_code == 200
    settings.HORDE_WORKER_DROPPED_JOBS_PER_HOUR = 0
    Worker.objects.filter(name="attic").update(aborted_in_window=500, aborted_window_started_at=timezone.now())
    _drop(horde, owner, "attic", stranger)
    assert Worker.objects.get(name="attic").maintenance is False
    settings.HORDE_WORKER_DROPPED_JOBS_PER_HOUR = 1
    _drop(horde, owner, "attic", stranger)
    worker = Worker.objects.get(name="attic")
    assert worker.maintenance is True and worker.maintenance_msg == aborted_jobs_maintenance_message(1)
    assert "more than 1 jobs" in worker.maintenance_msg
