"""Queue order and the eligibility rules of the pop, seen through pops and their `skipped` counts."""

from __future__ import annotations

from datetime import timedelta

import pytest

from chat.models import GenerationRequest
from chat.selectors.snapshots import reset_snapshots
from chat.services.admission import queue_score
from contract.text import MAX_TEXT_REQUEST_MODELS

MODEL = "Gryphe/MythoMax-L2-13b"
OTHER = "koboldcpp/Pernicious_Prophecy_70B"


@pytest.fixture
def owner(make_user):
    return make_user("owner")


def test_richer_requester_goes_first_then_fifo(horde, make_user, owner):
    poor, rich = make_user("poor", kudos=10), make_user("rich", kudos=500)
    first_poor = horde.text_async(poor.key, prompt="poor 1", models=[MODEL]).json()["id"]
    second_poor = horde.text_async(poor.key, prompt="poor 2", models=[MODEL]).json()["id"]
    rich_id = horde.text_async(rich.key, prompt="rich", models=[MODEL]).json()["id"]
    popped = [horde.pop(owner.key).json()["payload"]["prompt"] for _ in range(3)]
    assert popped == ["rich", "poor 1", "poor 2"]
    assert {first_poor, second_poor, rich_id}


def test_waiting_raises_priority_by_fifty_every_ten_seconds(horde, make_user, owner):
    """A request waiting 100 s gains 500 priority: it overtakes a new one from a user 400 kudos richer."""
    old, rich = make_user("old", kudos=100), make_user("rich", kudos=500)
    old_id = horde.text_async(old.key, prompt="old", models=[MODEL]).json()["id"]
    request = GenerationRequest.objects.get(pk=old_id)
    earlier = request.created - timedelta(seconds=100)
    GenerationRequest.objects.filter(pk=old_id).update(
        created=earlier, queue_score=queue_score(request.priority, earlier.timestamp())
    )
    horde.text_async(rich.key, prompt="rich", models=[MODEL])
    assert horde.pop(owner.key).json()["payload"]["prompt"] == "old"


def test_queue_position_counts_requests_ahead(horde, make_user):
    a, b = make_user("a", kudos=50), make_user("b", kudos=10)
    first = horde.text_async(a.key, models=[MODEL]).json()["id"]
    second = horde.text_async(b.key, models=[MODEL]).json()["id"]
    assert horde.status(first).json()["queue_position"] == 0
    assert horde.status(second).json()["queue_position"] == 1


def test_owner_and_priority_users_are_served_first(horde, make_user, owner):
    rich, friend = make_user("rich", kudos=1000), make_user("friend")
    horde.text_async(rich.key, prompt="rich", models=[MODEL])
    horde.text_async(friend.key, prompt="friend", models=[MODEL])
    horde.text_async(owner.key, prompt="own", models=[MODEL])
    alias = f"friend#{friend.user.pk}"
    assert horde.pop(owner.key, priority_usernames=[alias]).json()["payload"]["prompt"] in {"own", "friend"}
    assert horde.pop(owner.key, priority_usernames=[alias]).json()["payload"]["prompt"] in {"own", "friend"}
    assert horde.pop(owner.key, priority_usernames=[alias]).json()["payload"]["prompt"] == "rich"


def test_models_and_limits_decide_and_skipped_says_why(horde, make_user, owner):
    requester = make_user("r", kudos=10_000)
    horde.text_async(requester.key, models=[OTHER])
    horde.text_async(requester.key, models=[MODEL], params={"max_length": 400})
    horde.text_async(requester.key, models=[MODEL], params={"max_context_length": 8192})
    idle = horde.pop(owner.key, models=[MODEL], max_length=256, max_context_length=4096).json()
    assert idle["id"] is None and idle["payload"] == {} and idle["ids"] == []
    assert idle["skipped"] == {"models": 1, "max_length": 1, "max_context_length": 1}
    assert horde.pop(owner.key, models=[MODEL], max_length=512, max_context_length=4096).json()["id"]
    assert horde.pop(owner.key, models=[MODEL], max_length=512, max_context_length=8192).json()["id"]
    job = horde.pop(owner.key, models=[OTHER, MODEL]).json()
    assert job["model"] == OTHER


def test_a_pop_without_its_limits_declares_upstreams_defaults(horde, make_user, owner):
    """Upstream's pop reads an absent max_length as 512 and max_context_length as 2048 (its parser
    and its PopInputKobold model), so a worker that leaves them out serves a request of KoboldAI
    Lite's size (120 tokens of a 2048 context) there, and must here too."""
    requester = make_user("r", kudos=100)
    horde.text_async(requester.key, models=[MODEL], params={"max_length": 120, "max_context_length": 2048})
    job = horde._call("post", "generate/text/pop", owner.key, {"name": "minimal", "models": [MODEL]}).json()
    assert job["id"] is not None, job
    assert (job["payload"]["max_length"], job["payload"]["max_context_length"]) == (120, 2048)
    worker = horde.client.get("/api/v2/workers?type=text").json()[0]
    assert (worker["name"], worker["max_length"], worker["max_context_length"]) == ("minimal", 512, 2048)


def test_request_without_models_takes_the_workers_first_model(horde, make_user, owner):
    requester = make_user("r")
    horde.text_async(requester.key)
    assert horde.pop(owner.key, models=[OTHER, MODEL]).json()["model"] == OTHER


def test_worker_whitelist_and_blacklist(horde, make_user, owner):
    requester = make_user("r")
    listed = horde.pop(owner.key, name="listed").json()
    assert listed["id"] is None
    from workers.models import Worker

    listed_id = str(Worker.objects.get(name="listed").id)
    horde.text_async(requester.key, prompt="only listed", models=[MODEL], workers=[listed_id])
    assert horde.pop(owner.key, name="other").json()["skipped"] == {"worker_id": 1}
    assert horde.pop(owner.key, name="listed").json()["payload"]["prompt"] == "only listed"

    horde.text_async(requester.key, prompt="not listed", models=[MODEL], workers=[listed_id], worker_blacklist=True)
    assert horde.pop(owner.key, name="listed").json()["skipped"] == {"worker_id": 1}
    assert horde.pop(owner.key, name="other").json()["payload"]["prompt"] == "not listed"


def test_trusted_workers_only(horde, make_user, owner):
    requester, trusted_owner = make_user("r"), make_user("t", trusted=True)
    horde.text_async(requester.key, models=[MODEL], trusted_workers=True)
    assert horde.pop(owner.key).json()["skipped"] == {"untrusted": 1}
    assert horde.pop(trusted_owner.key, name="trusted-worker").json()["id"]


def test_validated_backends(horde, make_user, owner):
    requester = make_user("r")
    horde.text_async(requester.key, models=[MODEL], validated_backends=True)
    unvalidated = horde.pop(owner.key, name="homebrew", bridge_agent="my-own-bridge:1:x").json()
    assert unvalidated["skipped"] == {"bridge_version": 1}
    horde.text_async(requester.key, models=[MODEL])  # the default: any backend
    assert horde.pop(owner.key, name="homebrew", bridge_agent="my-own-bridge:1:x").json()["id"]


def test_slow_workers_opt_out(horde, make_user, owner, settings):
    from workers.models import Worker

    settings.HORDE_WORKER_CACHE_SECONDS = 0  # the speed is written behind the process's back
    requester = make_user("r", kudos=10_000)
    horde.pop(owner.key, name="slowpoke")
    Worker.objects.filter(name="slowpoke").update(speed=0.5, speed_samples=[0.5])
    horde.text_async(requester.key, models=[MODEL], slow_workers=False)
    assert horde.pop(owner.key, name="slowpoke").json()["skipped"] == {"performance": 1}
    assert horde.pop(owner.key, name="fast").json()["id"]


def test_first_pop_registers_and_name_belongs_to_its_owner(horde, make_user, owner):
    thief = make_user("thief")
    assert horde.pop(owner.key, name="mine").status_code == 200
    stolen = horde.pop(thief.key, name="mine")
    assert stolen.status_code == 403 and stolen.json()["rc"] == "WrongCredentials"
    anonymous = horde.pop("0000000000", name="anon")
    assert anonymous.status_code == 403 and anonymous.json()["rc"] == "AnonForbiddenWorker"
    bad_key = horde.pop("not-a-key", name="anon")
    assert bad_key.status_code == 401 and bad_key.json()["rc"] == "InvalidAPIKey"


def test_status_models_reports_threads_queue_and_eta(horde, make_user, owner):
    requester = make_user("r", kudos=10_000)
    horde.pop(owner.key, name="a", models=[MODEL], threads=2)
    horde.pop(owner.key, name="b", models=[MODEL, OTHER])
    horde.text_async(requester.key, models=[MODEL], params={"max_length": 100, "n": 2})
    from django.core.cache import cache

    cache.clear()

    reset_snapshots()
    models = {m["name"]: m for m in horde.client.get("/api/v2/status/models?type=text").json()}
    assert models[MODEL]["count"] == 3 and models[OTHER]["count"] == 1
    assert models[MODEL]["queued"] == 200 and models[MODEL]["jobs"] == 2
    assert models[MODEL]["eta"] > 0 and models[MODEL]["performance"] == 10.0
    assert models[MODEL]["type"] == "text"


def test_a_pop_names_at_most_a_hundred_priority_users_and_odd_aliases_are_refused(horde, make_user):
    """Each pop matches every priority user's queue, so the list is bounded as `models` is; an
    alias whose id is not ASCII digits within a bigint was a 500, and is now refused as upstream
    refuses an alias without an id (tests/chat/test_pop_refusals.py)."""
    owner = make_user("owner")
    too_many = horde.pop(owner.key, priority_usernames=[f"user#{n}" for n in range(101)])
    assert too_many.status_code == 400 and "priority_usernames" in too_many.json()["errors"]
    for odd in ("x#²", "y#" + "9" * 30, "z#abc"):
        refused = horde.pop(owner.key, priority_usernames=[odd, "w#12", "w#12"])
        assert refused.status_code == 400 and refused.json()["rc"] == "InvalidPriorityUsername"
    twice = horde.pop(owner.key, priority_usernames=["w#12", "w#12"])
    assert twice.status_code == 200 and twice.json()["id"] is None
    softprompts = horde.pop(owner.key, softprompts=["s"] * 101)
    assert softprompts.status_code == 400 and "softprompts" in softprompts.json()["errors"]


def test_a_request_may_name_every_model_of_a_large_horde(horde, make_user, owner):
    """KoboldAI Lite names every listed model when its user picks none, so a request takes the
    model list of a horde serving far more than 100 text models (docs/adr/0124); past
    MAX_TEXT_REQUEST_MODELS it is a 400 naming the field."""
    requester = make_user("lite", kudos=100)
    listed = [f"org/model-{n}" for n in range(MAX_TEXT_REQUEST_MODELS - 1)] + [MODEL]
    created = horde.text_async(requester.key, prompt="any model", models=listed)
    assert created.status_code == 202, created.json()
    popped = horde.pop(owner.key).json()
    assert popped["id"] is not None and popped["payload"]["prompt"] == "any model" and popped["model"] == MODEL
    too_many = horde.text_async(requester.key, models=[*listed, "org/one-more"])
    assert too_many.status_code == 400 and "models" in too_many.json()["errors"]
