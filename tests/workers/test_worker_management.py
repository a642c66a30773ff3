"""An owner manages a worker as KoboldAI Lite's "My workers" panel does, with upstream's rules:
PUT /api/v2/workers/{id} with maintenance (and its message), info, name and (moderators) paused,
answering what changed; DELETE /api/v2/workers/{id} while no stored job references it."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from chat.models import Generation
from tests.chat.pop_helpers import MODEL
from tests.conftest import Horde
from tests.races import race
from workers.models import Worker


def _put(horde, worker_id, key, body):
    return horde.client.put(f"/api/v2/workers/{worker_id}", body, format="json", HTTP_APIKEY=key)


def _delete(horde, worker_id, key):
    return horde.client.delete(f"/api/v2/workers/{worker_id}", HTTP_APIKEY=key, content_type="application/json")


def _registered(horde, owner, name="scribe") -> Worker:
    assert horde.pop(owner.key, name=name).status_code == 200
    return Worker.objects.get(name=name)


def test_lite_puts_maintenance_and_info_and_reads_them_back(horde, make_user):
    owner = make_user("owner")
    worker = _registered(horde, owner)
    assert "info" not in horde.client.get(f"/api/v2/workers/{worker.id}").json()  # none set
    # Lite's body: {"maintenance": <checkbox>, "info": <description>}; the answer names the changes.
    answer = _put(horde, worker.id, owner.key, {"maintenance": True, "info": "A 3090 in my attic."})
    assert (answer.status_code, answer.json()) == (200, {"maintenance": True, "info": "A 3090 in my attic."})
    details = horde.client.get(f"/api/v2/workers/{worker.id}").json()
    assert details["maintenance_mode"] is True and details["info"] == "A 3090 in my attic."
    # Cleared by an empty note, as Lite sends it.
    assert _put(horde, worker.id, owner.key, {"maintenance": False, "info": ""}).json() == {"maintenance": False, "info": ""}
    assert horde.client.get(f"/api/v2/workers/name/{worker.name}").json()["info"] == ""


def test_a_maintenance_message_is_what_the_workers_pops_are_told(horde, make_user):
    owner = make_user("owner")
    worker = _registered(horde, owner)
    _put(horde, worker.id, owner.key, {"maintenance": True, "maintenance_msg": "Swapping the GPU, back at 6."})
    refused = horde.pop(owner.key, name=worker.name)
    assert (refused.status_code, refused.json()) == (
        403, {"message": "Swapping the GPU, back at 6.", "rc": "WorkerMaintenance"}
    )
    # Lifted and set again without one: the default message, not the stale one.
    _put(horde, worker.id, owner.key, {"maintenance": False})
    assert horde.pop(owner.key, name=worker.name).status_code == 200
    _put(horde, worker.id, owner.key, {"maintenance": True})
    assert horde.pop(owner.key, name=worker.name).json()["message"] == (
        f"Worker {worker.name} is in maintenance mode: it takes only its owner's requests until the owner lifts it."
    )
    too_long = _put(horde, worker.id, owner.key, {"maintenance": True, "maintenance_msg": "x" * 301})
    assert too_long.status_code == 400


def test_who_may_change_what(horde, make_user):
    owner, stranger, moderator = make_user("owner"), make_user("stranger"), make_user("mod", moderator=True)
    worker = _registered(horde, owner)
    for body, rc in (({"maintenance": True}, "NotOwner"), ({"info": "mine now"}, "NotOwner"),
                     ({"name": "stolen"}, "NotModerator"), ({"paused": True}, "NotModerator")):
        refused = _put(horde, worker.id, stranger.key, body)
        assert (refused.status_code, refused.json()["rc"]) == (403, rc), body
    assert _put(horde, worker.id, owner.key, {"paused": True}).json()["rc"] == "NotModerator"
    assert _put(horde, worker.id, moderator.key, {"paused": True}).json() == {"paused": True}
    assert _put(horde, worker.id, moderator.key, {"maintenance": True}).json() == {"maintenance": True}
    nothing = _put(horde, worker.id, owner.key, {"team": ""})
    assert (nothing.status_code, nothing.json()) == (
        400, {"message": "No worker modification selected!", "rc": "NoWorkerModSelected"}
    )
    anonymous = _put(horde, worker.id, None, {"maintenance": False})
    assert anonymous.status_code in (401, 403)
    worker.refresh_from_db()
    assert (worker.maintenance, worker.paused, worker.info) == (True, True, None)


def test_info_and_name_bounds_and_a_rename(horde, make_user):
    owner = make_user("owner")
    worker = _registered(horde, owner)
    _registered(horde, owner, name="taken")
    long_info = _put(horde, worker.id, owner.key, {"info": "x" * 1001})
    assert (long_info.status_code, long_info.json()["rc"]) == (400, "TooLongWorkerName")
    long_name = _put(horde, worker.id, owner.key, {"name": "x" * 101})
    assert (long_name.status_code, long_name.json()["rc"]) == (400, "TooLongWorkerName")
    taken = _put(horde, worker.id, owner.key, {"name": "taken"})
    assert (taken.status_code, taken.json()) == (
        400, {"message": "The specified worker name 'taken' is already taken!", "rc": "WorkerNameAlreadyExists"}
    )
    assert _put(horde, worker.id, owner.key, {"name": "  "}).status_code == 400
    renamed = _put(horde, worker.id, owner.key, {"name": "scribe-2"})
    assert renamed.json() == {"name": "scribe-2"}
    assert horde.client.get("/api/v2/workers/name/scribe-2").json()["id"] == str(worker.id)
    assert horde.client.get("/api/v2/workers/name/scribe").status_code == 404
    # A pop under the old name registers a worker of that name again, as upstream's does.
    assert horde.pop(owner.key, name="scribe").status_code == 200
    assert Worker.objects.filter(owner=owner.user).count() == 3


def test_delete_a_worker_no_stored_job_references(horde, make_user):
    owner, stranger = make_user("owner"), make_user("stranger")
    worker = _registered(horde, owner)
    assert (_delete(horde, worker.id, stranger.key).json()["rc"]) == "NotModerator"
    deleted = _delete(horde, worker.id, owner.key)
    assert (deleted.status_code, deleted.json()) == (200, {"deleted_id": str(worker.id), "deleted_name": "scribe"})
    assert not Worker.objects.filter(pk=worker.id).exists()
    gone = horde.client.get(f"/api/v2/workers/{worker.id}")
    assert (gone.status_code, gone.json()["rc"]) == (404, "WorkerNotFound")
    assert _delete(horde, worker.id, owner.key).status_code == 404


def test_a_worker_whose_job_is_stored_is_locked_against_delete(horde, make_user):
    owner, requester = make_user("owner"), make_user("requester", kudos=1000)
    worker = _registered(horde, owner)
    assert horde.text_async(requester.key, models=[MODEL]).status_code == 202
    from chat.services.pop_cache import queue_grew

    queue_grew()
    job = horde.pop(owner.key, name=worker.name).json()
    assert job["id"] is not None
    assert horde.submit(owner.key, job["id"], "Done.").status_code == 200
    locked = _delete(horde, worker.id, owner.key)
    assert locked.status_code == 423 and locked.json()["rc"] == "Locked"
    assert Worker.objects.filter(pk=worker.id).exists()
    assert Generation.objects.get(pk=job["id"]).text == "Done."  # the requester's result is kept


def test_a_stranger_cannot_rename_a_worker_even_to_its_own_name(horde, make_user):
    owner, stranger = make_user("owner"), make_user("stranger")
    worker = _registered(horde, owner)
    from workers.serving_version import current_serving_version

    before = current_serving_version()
    refused = _put(horde, worker.id, stranger.key, {"name": worker.name})
    assert (refused.status_code, refused.json()["rc"]) == (403, "NotModerator")
    # The owner's "rename" to the same name, or a note, changes nothing any reader serves from.
    assert _put(horde, worker.id, owner.key, {"name": worker.name}).json() == {"name": worker.name}
    assert _put(horde, worker.id, owner.key, {"info": "note"}).json() == {"info": "note"}
    assert current_serving_version() == before
    assert _put(horde, worker.id, owner.key, {"name": "  spaced  "}).json() == {"name": "spaced"}  # trimmed as the pop trims


@pytest.mark.django_db(transaction=True)
def test_two_changes_at_once_both_land(make_user):
    owner, moderator = make_user("owner"), make_user("mod", moderator=True)
    horde = Horde(APIClient())
    worker = _registered(horde, owner)
    answers = race([
        lambda: _put(Horde(APIClient()), worker.id, moderator.key, {"paused": True}).status_code,
        lambda: _put(Horde(APIClient()), worker.id, owner.key, {"info": "racing", "maintenance": True}).status_code,
    ])
    assert answers == [200, 200]
    worker.refresh_from_db()
    assert (worker.paused, worker.info, worker.maintenance) == (True, "racing", True)


def test_kobold_lite_my_workers_panel_replayed(horde, make_user):
    """Lite from file:// (origin null): find_user's worker_ids, GET each worker, PUT the changed
    ones with {"maintenance", "info"}, DELETE one, each preflighted with apikey and content-type."""
    owner = make_user("owner")
    _registered(horde, owner, name="attic")
    _registered(horde, owner, name="basement")
    ids = horde.client.get("/api/v2/find_user", HTTP_APIKEY=owner.key, HTTP_ORIGIN="null").json()["worker_ids"]
    workers = [horde.client.get(f"/api/v2/workers/{worker_id}", HTTP_ORIGIN="null").json() for worker_id in ids]
    assert sorted(w["name"] for w in workers) == ["attic", "basement"]
    for method in ("PUT", "DELETE"):
        preflight = horde.client.options(
            f"/api/v2/workers/{ids[0]}",
            HTTP_ORIGIN="null",
            HTTP_ACCESS_CONTROL_REQUEST_METHOD=method,
            HTTP_ACCESS_CONTROL_REQUEST_HEADERS="apikey,content-type",
        )
        assert preflight.status_code == 200 and method in preflight["Access-Control-Allow-Methods"]
    attic = next(w for w in workers if w["name"] == "attic")
    updated = horde.client.put(
        f"/api/v2/workers/{attic['id']}",
        '{"maintenance":true,"info":"Back tonight"}',
        content_type="application/json",
        HTTP_APIKEY=owner.key,
        HTTP_ORIGIN="null",
    )
    assert updated.json() == {"maintenance": True, "info": "Back tonight"}
    assert updated["Access-Control-Allow-Origin"] == "*"
    basement = next(w for w in workers if w["name"] == "basement")
    deleted = horde.client.delete(
        f"/api/v2/workers/{basement['id']}", content_type="application/json", HTTP_APIKEY=owner.key, HTTP_ORIGIN="null"
    )
    assert deleted.json() == {"deleted_id": basement["id"], "deleted_name": "basement"}
    assert horde.client.get("/api/v2/find_user", HTTP_APIKEY=owner.key).json()["worker_ids"] == [attic["id"]]
    shown = horde.client.get(f"/api/v2/workers/{attic['id']}").json()
    assert (shown["maintenance_mode"], shown["info"]) == (True, "Back tonight")
