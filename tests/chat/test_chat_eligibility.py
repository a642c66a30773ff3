"""Eligibility rules 1-4 for chat and text requests, seen through pops, the Python twin, the
availability pass (impossible_reason) and the chat model list (spec: chat_requests.md)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from chat.models import Generation, GenerationRequest, RequestWorker
from chat.selectors.availability import availability_cache_key, chat_request_availability
from chat.selectors.queue import worker_may_take
from chat.selectors.snapshots import reset_snapshots
from tests.chat.pop_helpers import ALL_GUARANTEES, MODEL, OTHER, chat_pop, queue_chat
from workers.models import Worker

IMAGE = {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                      {"type": "image_url", "image_url": {"url": "horde-r2://x_chat_0.jpg"}}]}
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
UNVALIDATED = "SomeHomebrewBridge:1:https://example.com"


@pytest.fixture
def owner(make_user):
    return make_user("owner")


@pytest.fixture
def requester(make_user):
    return make_user("requester", kudos=1000)


def _python_twin(name: str, request: GenerationRequest) -> bool:
    worker = Worker.objects.select_related("owner").get(name=name)
    request.refresh_from_db()
    listed = set(RequestWorker.objects.filter(request=request).values_list("worker_id", flat=True))
    return worker_may_take(worker, request, listed)


def assert_takes(horde, key, request, expected: bool, *, name="chat-worker", chat=True, **pop):
    """The pop (SQL) and the Python twin agree on whether the worker may take the request."""
    response = (chat_pop(horde, key, name=name, **pop) if chat else horde.pop(key, name=name, **pop))
    assert response.status_code == 200, response.json()
    job = response.json()
    assert bool(job["id"]) is expected, job
    if expected:
        assert job["ids"] and str(request.id) == str(GenerationRequest.objects.get(generations__id=job["id"]).id)
        # The twin is read with the job handed back, as availability would see the request.
        GenerationRequest.objects.filter(pk=request.pk).update(jobs_waiting=1)
    assert _python_twin(name, request) is expected
    return job


# --- Rule 1: chat_jobs and the model ---------------------------------------------------------


def test_a_worker_without_chat_jobs_never_sees_a_chat_request(horde, owner, requester):
    request = queue_chat(requester.user)
    job = assert_takes(horde, owner.key, request, False, name="text-only", chat=False, models=[MODEL])
    assert job["skipped"] == {}  # a chat request is not a text worker's business


def test_the_chat_model_id_has_to_be_one_of_the_request_models(horde, owner, requester):
    request = queue_chat(requester.user, models=[OTHER])
    job = assert_takes(horde, owner.key, request, False, models=[MODEL, OTHER], model_id=MODEL)
    assert job["skipped"] == {"models": 1}
    assert_takes(horde, owner.key, request, True, models=[MODEL, OTHER], model_id=OTHER)


def test_any_listed_model_serves_a_multi_model_request(horde, owner, requester):
    request = queue_chat(requester.user, models=[OTHER, MODEL])
    job = assert_takes(horde, owner.key, request, True, model_id=MODEL)
    assert job["model"] == MODEL


def test_a_chat_only_worker_gets_no_text_request(horde, owner, requester):
    horde.text_async(requester.key, models=[MODEL])
    job = chat_pop(horde, owner.key, prompt_jobs=False).json()
    assert job["id"] is None and job["skipped"] == {}
    # With prompt_jobs it takes the text job, under its text limits.
    assert chat_pop(horde, owner.key).json()["payload"]["prompt"]


def test_text_limits_bound_text_jobs_and_chat_limits_chat_jobs(horde, owner, requester):
    horde.text_async(requester.key, models=[MODEL], params={"max_length": 600})
    chat = queue_chat(requester.user, max_length=900)
    job = chat_pop(horde, owner.key, max_length=512, limits={"max_context_length": 8192, "max_length": 1024}).json()
    assert job.get("chat") is True and job["id"]
    assert GenerationRequest.objects.get(generations__id=job["id"]).id == chat.id
    follow_up = chat_pop(horde, owner.key, max_length=512).json()
    assert follow_up["id"] is None and follow_up["skipped"] == {"max_length": 1}


# --- Rule 2: features, guarantees, images ----------------------------------------------------


def test_every_required_feature_has_to_be_declared(horde, owner, requester):
    request = queue_chat(requester.user, {"seed": 7, "presence_penalty": 0.4})
    job = assert_takes(horde, owner.key, request, False, features=[*ALL_GUARANTEES, "seed"])
    assert job["skipped"] == {"chat_features": 1}
    assert_takes(horde, owner.key, request, True, features=[*ALL_GUARANTEES, "seed", "presence_penalty"])


def test_a_strict_request_needs_its_guarantees_and_best_effort_does_not(horde, owner, requester):
    strict = queue_chat(requester.user, {"tools": [WEATHER], "tool_choice": "required"})
    assert_takes(horde, owner.key, strict, False, features=["tools", "prompt_overflow_refused"])
    assert_takes(horde, owner.key, strict, True, features=["tools", "prompt_overflow_refused", "tool_choice_enforced"])
    loose = queue_chat(requester.user, {"tools": [WEATHER], "tool_choice": "required",
                                        "horde": {"conformance": "best_effort"}})
    assert_takes(horde, owner.key, loose, True, features=["tools"])


@pytest.mark.parametrize(
    ("transports", "expected"),
    [([], False), (["messages_url"], False), (["url"], True), (["base64"], True)],
)
def test_images_need_vision_and_an_image_transport(horde, owner, requester, transports, expected, settings, tmp_path):
    # The referenced image is in the store, so a base64 worker's pop can read it.
    folder = tmp_path / "chat-images"
    folder.mkdir()
    (folder / "x_chat_0.jpg").write_bytes(b"\xff\xd8\xff stored image")
    settings.STORAGES = {**settings.STORAGES, "chat_images": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(folder)}}}
    request = queue_chat(requester.user, {"messages": [IMAGE]})
    assert request.chat_has_images
    assert_takes(horde, owner.key, request, False, features=ALL_GUARANTEES, transports=["url"])
    assert_takes(horde, owner.key, request, expected, features=[*ALL_GUARANTEES, "vision"], transports=transports)


def test_a_worker_without_a_transport_still_takes_requests_without_images(horde, owner, requester):
    request = queue_chat(requester.user)
    assert_takes(horde, owner.key, request, True, features=[*ALL_GUARANTEES, "vision"], transports=[])


# --- Rule 3: chat limits ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "reason"),
    [({"max_length": 2048}, "max_length"), ({"max_context_length": 16384}, "max_context_length")],
)
def test_sizes_have_to_fit_the_chat_limits(horde, owner, requester, sizes, reason):
    request = queue_chat(requester.user, **sizes)
    job = assert_takes(horde, owner.key, request, False)
    assert job["skipped"] == {reason: 1}
    assert_takes(horde, owner.key, request, True, limits={"max_context_length": 16384, "max_length": 2048})


def test_the_tool_temperature_has_to_fit_tools_max_temperature(horde, owner, requester):
    features = [*ALL_GUARANTEES, "tools"]
    request = queue_chat(requester.user, {"tools": [WEATHER], "temperature": 1.2})
    assert request.chat_tools_temperature == 1.2
    low = {"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 1.0}
    job = assert_takes(horde, owner.key, request, False, features=features, limits=low)
    assert job["skipped"] == {"tools_max_temperature": 1}
    assert_takes(horde, owner.key, request, True, features=features, limits={**low, "tools_max_temperature": 1.2})
    # A worker without the limit applies every temperature as sent.
    assert_takes(horde, owner.key, request, True, features=features)


def test_the_tool_temperature_limit_ignores_requests_without_tools(horde, owner, requester):
    request = queue_chat(requester.user, {"temperature": 1.8})
    assert request.chat_tools_temperature is None
    low = {"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 0.5}
    assert_takes(horde, owner.key, request, True, limits=low)


def test_tool_choice_none_forwards_no_tools_so_needs_no_tool_temperature(horde, owner, requester):
    request = queue_chat(requester.user, {"tools": [WEATHER], "tool_choice": "none", "temperature": 1.5})
    assert request.chat_tools_temperature is None and "tools" not in request.chat_required_features
    low = {"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 0.5}
    assert_takes(horde, owner.key, request, True, limits=low)


# --- Rule 4: the usual restrictions ----------------------------------------------------------


def test_only_and_ignore(horde, owner, requester):
    chat_pop(horde, owner.key, name="listed")
    listed = Worker.objects.get(name="listed")
    only = queue_chat(requester.user, only=[listed.id])
    job = assert_takes(horde, owner.key, only, False, name="other")
    assert job["skipped"] == {"worker_id": 1}
    assert_takes(horde, owner.key, only, True, name="listed")
    GenerationRequest.objects.filter(pk=only.pk).update(jobs_waiting=0)
    ignore = queue_chat(requester.user, ignore=[listed.id])
    assert_takes(horde, owner.key, ignore, False, name="listed")
    assert_takes(horde, owner.key, ignore, True, name="other")


def test_trusted_workers(horde, make_user, requester):
    untrusted, trusted = make_user("untrusted"), make_user("trusted", trusted=True)
    request = queue_chat(requester.user, trusted_workers=True)
    assert_takes(horde, untrusted.key, request, False, name="u")
    assert_takes(horde, trusted.key, request, True, name="t")


def test_validated_backends(horde, owner, requester):
    request = queue_chat(requester.user, validated_backends=True)
    job = assert_takes(horde, owner.key, request, False, bridge_agent=UNVALIDATED)
    assert job["skipped"] == {"bridge_version": 1}
    assert_takes(horde, owner.key, request, True)


def test_slow_workers(horde, owner, requester, settings):
    settings.HORDE_WORKER_CACHE_SECONDS = 0  # the speed is written behind the process's back
    chat_pop(horde, owner.key, name="slowpoke")
    Worker.objects.filter(name="slowpoke").update(speed=0.5, speed_samples=[0.5])
    request = queue_chat(requester.user, slow_workers=False)
    assert_takes(horde, owner.key, request, False, name="slowpoke")
    assert_takes(horde, owner.key, request, True, name="quick")


# --- Availability and impossible_reason ------------------------------------------------------


def _declare(horde, key, name, **pop):
    assert chat_pop(horde, key, name=name, **pop).status_code == 200
    cache.clear()  # the online workers and availability caches
    reset_snapshots()


def test_availability_counts_eligible_threads(horde, owner, requester):
    request = queue_chat(requester.user)
    _declare(horde, owner.key, "a", threads=3)
    _declare(horde, owner.key, "b", threads=2, features=[])  # lacks prompt_overflow_refused
    availability = chat_request_availability(request)
    assert availability.eligible_worker_threads == 3
    assert availability.is_possible is True and availability.impossible_reason is None


def test_no_online_worker_serving_the_model_gives_no_reason(horde, owner, requester):
    request = queue_chat(requester.user, models=[OTHER])
    _declare(horde, owner.key, "a")
    availability = chat_request_availability(request)
    assert (availability.is_possible, availability.eligible_worker_threads) == (False, 0)
    assert availability.impossible_reason is None


@pytest.mark.parametrize(
    ("body", "sizes", "pop", "missing", "exceeded"),
    [
        ({"messages": [IMAGE]}, {}, {}, ["vision"], []),
        ({"messages": [IMAGE]}, {}, {"features": [*ALL_GUARANTEES, "vision"]}, ["image_transports"], []),
        ({"tools": [WEATHER], "tool_choice": "required"}, {}, {"features": ["tools", "prompt_overflow_refused"]},
         ["tool_choice_enforced"], []),
        ({}, {"max_length": 2048}, {}, [], ["max_length"]),
        ({}, {"max_context_length": 16384}, {}, [], ["max_context_length"]),
        ({"tools": [WEATHER], "temperature": 1.0}, {},
         {"features": [*ALL_GUARANTEES, "tools"],
          "limits": {"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 0.2}},
         [], ["tools_max_temperature"]),
    ],
)
def test_impossible_reason_names_the_declaration_gap(horde, owner, requester, body, sizes, pop, missing, exceeded):
    request = queue_chat(requester.user, body, **sizes)
    _declare(horde, owner.key, "a", **pop)
    availability = chat_request_availability(request)
    assert availability.is_possible is False and availability.eligible_worker_threads == 0
    assert availability.impossible_reason == {
        "kind": "declaration_gap", "missing_declarations": missing, "exceeded_limits": exceeded,
    }


def test_impossible_reason_merges_the_refused_workers_gaps(horde, owner, requester):
    request = queue_chat(requester.user, {"seed": 1}, max_length=2048)
    _declare(horde, owner.key, "a", features=[*ALL_GUARANTEES, "seed"])  # too short
    _declare(horde, owner.key, "b", limits={"max_context_length": 8192, "max_length": 4096})  # no seed
    reason = chat_request_availability(request).impossible_reason
    assert reason == {"kind": "declaration_gap", "missing_declarations": ["seed"], "exceeded_limits": ["max_length"]}


def test_no_reason_while_a_generation_is_processing(horde, owner, requester):
    request = queue_chat(requester.user, {"seed": 1})
    _declare(horde, owner.key, "a")
    assert chat_request_availability(request, processing=1).impossible_reason is None
    assert chat_request_availability(request, processing=0).impossible_reason is not None


def test_workers_failing_the_usual_restrictions_are_not_candidates(horde, make_user, requester):
    untrusted = make_user("untrusted")
    request = queue_chat(requester.user, {"seed": 1}, trusted_workers=True)
    _declare(horde, untrusted.key, "a")
    assert chat_request_availability(request).impossible_reason is None


def test_offline_and_maintenance_workers_do_not_count(horde, owner, requester):
    request = queue_chat(requester.user)
    _declare(horde, owner.key, "a")
    _declare(horde, owner.key, "b")
    Worker.objects.filter(name="a").update(last_check_in=timezone.now() - timedelta(seconds=301))
    Worker.objects.filter(name="b").update(maintenance=True)
    cache.clear()
    reset_snapshots()
    assert chat_request_availability(request).is_possible is False


def test_availability_is_cached_for_a_minute_between_check_ins(horde, owner, requester):
    request = queue_chat(requester.user, {"seed": 1})
    _declare(horde, owner.key, "a", features=[*ALL_GUARANTEES, "seed"])
    assert chat_request_availability(request).is_possible is True
    # A change no check-in announces (a direct write) waits for the cached pass to lapse.
    Worker.objects.filter(name="a").update(chat_features=ALL_GUARANTEES, chat_feature_mask=0)
    reset_snapshots()
    assert chat_request_availability(request).is_possible is True  # still the cached pass
    cache.delete(availability_cache_key(request.pk))
    assert chat_request_availability(request).is_possible is False


def _check_in(horde, key, name, request, **pop):
    """A pop that leaves every cache as it is; a job it took goes back to the queue, so the
    request stays waiting with nothing processing."""
    assert chat_pop(horde, key, name=name, **pop).status_code == 200
    Generation.objects.filter(request=request).delete()
    GenerationRequest.objects.filter(pk=request.pk).update(jobs_waiting=1)


def test_a_first_pop_shows_in_the_cached_availability_at_once(horde, owner, requester):
    request = queue_chat(requester.user, {"seed": 1})
    assert chat_request_availability(request).is_possible is False  # cached: nobody online
    _check_in(horde, owner.key, "late", request, features=[*ALL_GUARANTEES, "seed"], threads=2)
    assert chat_request_availability(request).eligible_worker_threads == 2


def test_a_changed_declaration_shows_in_the_cached_availability_at_once(horde, owner, requester):
    request = queue_chat(requester.user, {"seed": 1})
    _check_in(horde, owner.key, "a", request, features=[*ALL_GUARANTEES, "seed"])
    assert chat_request_availability(request).is_possible is True
    _check_in(horde, owner.key, "a", request)  # withdraws seed
    availability = chat_request_availability(request)
    assert availability.is_possible is False
    assert availability.impossible_reason == {
        "kind": "declaration_gap", "missing_declarations": ["seed"], "exceeded_limits": []
    }


def test_text_requests_share_the_pass_without_a_reason(horde, owner, requester):
    _declare(horde, owner.key, "chat-only", prompt_jobs=False, max_length=1024)
    _declare(horde, owner.key, "text", max_length=1024, threads=2)
    request_id = horde.text_async(requester.key, models=[MODEL], params={"max_length": 600}).json()["id"]
    request = GenerationRequest.objects.get(pk=request_id)
    availability = chat_request_availability(request)
    assert availability.eligible_worker_threads == 2 and availability.impossible_reason is None
    cache.clear()
    reset_snapshots()
    Worker.objects.filter(name="text").update(max_length=512)
    assert horde.status(request_id).json()["is_possible"] is False
    assert chat_request_availability(request).impossible_reason is None


# --- Chat model list -------------------------------------------------------------------------


def test_chat_model_list(horde, owner, requester):
    horde.pop(owner.key, name="text", models=[MODEL, OTHER], threads=4)
    chat_pop(horde, owner.key, name="a", threads=2, features=["seed", "prompt_overflow_refused"])
    chat_pop(horde, owner.key, name="b", features=["vision"],
             limits={"max_context_length": 16384, "max_length": 512})
    chat_pop(horde, owner.key, name="only-chat", prompt_jobs=False, model_id="solo/model")
    Worker.objects.filter(name="a").update(created=timezone.now() - timedelta(days=2))
    earliest = int(Worker.objects.get(name="a").created.timestamp())
    queue_chat(requester.user, max_length=100)
    cache.clear()
    reset_snapshots()

    plain = {m["name"]: m for m in horde.client.get("/api/v2/status/models?type=text").json()}
    assert set(plain) == {MODEL, OTHER, "solo/model"}
    assert all("chat" not in m for m in plain.values())
    assert plain[MODEL]["count"] == 4 + 2 + 1  # chat workers that take text jobs count
    assert plain["solo/model"]["count"] == 0  # prompt_jobs: false threads are left out
    assert plain[MODEL]["jobs"] == 1 and plain[MODEL]["queued"] == 100  # chat requests share the queue
    # One model's entry, its slash and all, as a list (upstream's status/models/{model_name}).
    assert horde.client.get(f"/api/v2/status/models/{MODEL}").json() == [plain[MODEL]]
    assert horde.client.get("/api/v2/status/models/nobody/serves-this").json() == []

    listed = {m["name"]: m for m in horde.client.get("/api/v2/status/models?type=text&chat=true").json()}
    assert set(listed) == {MODEL, "solo/model"}
    assert listed[MODEL]["count"] == 7 and listed[MODEL]["type"] == "text"
    assert listed[MODEL]["chat"] == {
        "workers": 2,
        "max_context_length": 16384,
        "max_length": 1024,
        "features": ["prompt_overflow_refused", "seed", "vision"],
        "created": earliest,
    }
    assert listed["solo/model"]["count"] == 0 and listed["solo/model"]["chat"]["workers"] == 1


@pytest.mark.parametrize("switch", ["maintenance", "paused"])
def test_chat_model_list_leaves_out_maintenance_and_paused_workers(horde, owner, switch):
    """A worker in maintenance or paused receives no job: its chat model is not offered."""
    chat_pop(horde, owner.key, name="a")
    # An online text-only worker keeps the model served, so only the chat list can drop it.
    horde.pop(owner.key, name="text", models=[MODEL])
    Worker.objects.filter(name="a").update(**{switch: True})
    cache.clear()
    reset_snapshots()
    plain = {m["name"]: m for m in horde.client.get("/api/v2/status/models?type=text").json()}
    assert set(plain) == {MODEL} and plain[MODEL]["count"] == 1
    assert horde.client.get("/api/v2/status/models?type=text&chat=true").json() == []


@pytest.mark.parametrize("query", ["chat=true", "type=image&chat=true", "type=text&chat=maybe"])
def test_chat_model_list_refuses_other_types(horde, query):
    response = horde.client.get(f"/api/v2/status/models?{query}")
    assert response.status_code == 400 and response.json()["rc"] == "BadRequest"
