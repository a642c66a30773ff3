"""Worker lists name workers by id (spec: chat_requests.md, horde.only / horde.ignore "non-empty
array of worker ids"; the text request's `workers`): a worker's name, or any other value that is
not a worker id, is refused with the validation error instead of being ignored (ADR 0012)."""

from __future__ import annotations

import pytest

from accounts.models import KudosTransaction
from chat.models import GenerationRequest
from tests.chat.chat_route_helpers import ALL_DECLARATIONS, MODEL, chat_async, chat_worker
from workers.models import Worker

NAME_MESSAGE = "'{name}' is not a worker id: workers are named by their id (a UUID)"


@pytest.fixture
def served(make_user):
    return chat_worker(make_user("owner"))


@pytest.mark.parametrize("key", ["ignore", "only"])
def test_chat_worker_list_by_name_is_refused(horde, make_user, served, key):
    requester = make_user("r", kudos=50)
    response = chat_async(horde.client, requester.key, horde={key: [served.name]})
    assert response.status_code == 400
    path = f"horde.{key}[0]"
    assert response.json() == {
        "message": f"'{path}': Invalid value for '{path}': {NAME_MESSAGE.format(name=served.name)}.",
        "rc": "BadRequest",
    }
    assert not GenerationRequest.objects.exists()
    assert not KudosTransaction.objects.filter(user=requester.user, kind="horde_tax").exists()


def test_chat_worker_list_refuses_a_name_among_ids(horde, make_user, served):
    requester = make_user("r", kudos=50)
    response = chat_async(horde.client, requester.key, horde={"ignore": [str(served.id), served.name]})
    assert response.status_code == 400 and response.json()["message"].startswith("'horde.ignore[1]': ")
    assert not GenerationRequest.objects.exists()


def test_chat_ignore_by_id_keeps_the_worker_off_the_request(horde, make_user):
    owner, requester = make_user("owner"), make_user("r", kudos=50)
    declaration = {
        "chat_jobs": True,
        "model_id": MODEL,
        "chat_limits": {"max_context_length": 8192, "max_length": 2048},
        "chat_features": ALL_DECLARATIONS,
    }
    assert horde.pop(owner.key, name="ignored", **declaration).json()["id"] is None  # registers it
    ignored = Worker.objects.get(name="ignored")
    assert chat_async(horde.client, requester.key, horde={"ignore": [str(ignored.id)]}).status_code == 202
    assert horde.pop(owner.key, name="ignored", **declaration).json()["skipped"] == {"worker_id": 1}


@pytest.mark.parametrize("blacklist", [True, False])
def test_text_worker_list_by_name_is_a_schema_failure(horde, make_user, blacklist):
    owner, requester = make_user("owner"), make_user("r", kudos=50)
    horde.pop(owner.key, name="named-worker")
    response = horde.text_async(requester.key, models=[MODEL], workers=["named-worker"], worker_blacklist=blacklist)
    assert response.status_code == 400
    assert response.json() == {
        "errors": {"workers[0]": f"{NAME_MESSAGE.format(name='named-worker')}."},
        "message": "Input payload validation failed",
    }
    assert not GenerationRequest.objects.exists()
    # Nothing was queued, so the worker named finds no job either way.
    assert horde.pop(owner.key, name="named-worker").json()["id"] is None


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ([5], "5 is not of type 'string'"),
        ([None], "This field may not be null."),
        (["named-worker", "00000000-0000-0000-0000-00000000000g"], None),
    ],
)
def test_text_worker_list_holds_only_id_strings(horde, make_user, workers, message):
    requester = make_user("r", kudos=50)
    response = horde.text_async(requester.key, models=[MODEL], workers=workers)
    assert response.status_code == 400
    errors = response.json()["errors"]
    assert "workers[0]" in errors
    if message is not None:
        assert errors == {"workers[0]": message}
    else:
        assert set(errors) == {"workers[0]", "workers[1]"}
    assert not GenerationRequest.objects.exists()


def test_text_worker_list_by_id_still_works(horde, make_user):
    owner, requester = make_user("owner"), make_user("r", kudos=50)
    horde.pop(owner.key, name="listed")
    listed = Worker.objects.get(name="listed")
    response = horde.text_async(requester.key, models=[MODEL], workers=[str(listed.id)], worker_blacklist=True)
    assert response.status_code == 202
    assert horde.pop(owner.key, name="listed").json()["skipped"] == {"worker_id": 1}
    assert horde.pop(owner.key, name="other").json()["id"] is not None
