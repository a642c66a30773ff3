"""What a text pop refuses as upstream refuses it (docs/adr/0077-pop-and-user-parity-audit.md): a
worker declaring no model, another user's branded model, a priority user that is not "alias#id",
more than 50 threads. Each refusal is the {"message", "rc"} (or schema) body an upstream worker logs."""

from __future__ import annotations

import pytest

from workers.models import Worker

MODEL = "Gryphe/MythoMax-L2-13b"


@pytest.fixture
def owner(make_user):
    return make_user("owner")


@pytest.mark.parametrize("models", [[], None])
def test_a_worker_declaring_no_model_is_refused_and_never_handed_a_job(horde, make_user, owner, models):
    """It was registered and handed a request that names no model, which it served as model ""."""
    requester = make_user("r", kudos=100)
    assert horde.text_async(requester.key, prompt="any model will do", params={"max_length": 50}).status_code == 202
    body = {"models": models} if models is not None else {}
    if models is None:
        response = horde._call("post", "generate/text/pop", owner.key, {"name": "empty", "max_length": 512})
    else:
        response = horde.pop(owner.key, name="empty", **body)
    assert response.status_code == 400, response.content
    assert response.json() == {
        "message": "Unfortunately we cannot accept workers serving unrecognised models at this time",
        "rc": "BadRequest",
    }
    assert not Worker.objects.filter(name="empty").exists()
    # A worker with a model still takes it.
    assert horde.pop(owner.key, name="served").json()["payload"]["prompt"] == "any model will do"


def test_a_branded_model_is_hosted_only_by_its_user(horde, make_user, owner):
    """The scribe's branded_model declares `model::<its owner's alias>`; another user may not."""
    stranger = make_user("stranger")
    brand = f"{MODEL}::{owner.user.unique_alias}"
    impostor = horde.pop(stranger.key, name="impostor", models=[MODEL, brand])
    assert impostor.status_code == 400, impostor.content
    assert impostor.json() == {"message": f"This model can only be hosted by {owner.user.unique_alias}", "rc": "BadRequest"}
    assert not Worker.objects.filter(name="impostor").exists()

    requester = make_user("r", kudos=100)
    horde.text_async(requester.key, prompt="branded", models=[brand], params={"max_length": 50})
    own = horde.pop(owner.key, name="own", models=[brand]).json()
    assert own["payload"]["prompt"] == "branded" and own["model"] == brand
    # Only a name with one "::" is a brand, as upstream reads it.
    assert horde.pop(stranger.key, name="odd", models=["a::b::c"]).status_code == 200


@pytest.mark.parametrize("alias", ["db0", "db0#", "db0#abc", "db0#²", "db0#" + "9" * 30, ""])
def test_a_priority_user_not_given_as_alias_and_id_is_refused(horde, owner, alias):
    response = horde.pop(owner.key, priority_usernames=["friend#12", alias])
    assert response.status_code == 400, response.content
    assert response.json() == {
        "message": "Priority usernames need to be provided in the form of 'alias#number'. Example: 'db0#1'",
        "rc": "InvalidPriorityUsername",
    }


def test_a_priority_user_given_as_alias_and_id_is_taken(horde, owner):
    # A name may hold "#": the id is what follows the last one. Unknown ids name no one.
    response = horde.pop(owner.key, priority_usernames=["a#b#12", "friend#12", "friend#12", "x#0"])
    assert response.status_code == 200 and response.json()["id"] is None


def test_threads_are_at_most_fifty(horde, owner):
    assert horde.pop(owner.key, name="fifty", threads=50).status_code == 200
    refused = horde.pop(owner.key, name="sixty", threads=51)
    assert refused.status_code == 400, refused.content
    assert refused.json()["message"] == "Input payload validation failed" and "threads" in refused.json()["errors"]


def test_an_untrusted_owner_registers_at_most_four_workers_as_upstream(horde, make_user, owner):
    """Upstream refuses a new worker name to an untrusted owner who already has more than 3 (so the
    fifth); worker rows are never deleted but by their owner, so without it any key could add rows
    without end. The workers it has keep popping, and a deleted one frees its place."""
    for i in range(4):
        assert horde.pop(owner.key, name=f"mine-{i}").status_code == 200
    fifth = horde.pop(owner.key, name="mine-4")
    assert fifth.status_code == 403, fifth.content
    assert fifth.json() == {
        "message": "To avoid abuse, untrusted users can only have up to 3 distinct workers.",
        "rc": "TooManyWorkers",
    }
    assert not Worker.objects.filter(name="mine-4").exists()
    assert horde.pop(owner.key, name="mine-3").status_code == 200
    gone = Worker.objects.get(name="mine-0")
    assert horde.client.delete(f"/api/v2/workers/{gone.pk}", HTTP_APIKEY=owner.key).status_code == 200
    assert horde.pop(owner.key, name="mine-4").status_code == 200


def test_a_trusted_owner_registers_at_most_twenty_one_workers_as_upstream(horde, make_user):
    trusted = make_user("trusted-owner", trusted=True)
    for i in range(21):
        assert horde.pop(trusted.key, name=f"farm-{i}").status_code == 200
    refused = horde.pop(trusted.key, name="farm-21")
    assert refused.status_code == 403, refused.content
    assert refused.json()["rc"] == "TooManyWorkersTrusted"
    assert Worker.objects.filter(owner=trusted.user).count() == 21
