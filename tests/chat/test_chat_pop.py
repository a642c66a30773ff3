"""The chat declaration on pop, and the chat job a pop hands out (spec: chat_requests.md, "Chat
declaration on pop", "Chat job pop response")."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from chat.models import Generation
from contract.chat_limits import CHAT_SAMPLING_DEFAULTS
from tests.chat.pop_helpers import ALL_GUARANTEES, MODEL, OTHER, chat_pop, queue_chat
from tests.conftest import Horde
from tests.races import race
from workers.declarations import declaration_mask
from workers.models import Worker

LIMITS = {"max_context_length": 8192, "max_length": 1024}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOL_FEATURES = [*ALL_GUARANTEES, "tools", "json_object", "json_schema", "tools_with_response_format", "seed",
                 "reasoning_effort", "presence_penalty", "frequency_penalty"]


@pytest.fixture
def owner(make_user):
    return make_user("owner")


@pytest.fixture
def requester(make_user):
    return make_user("requester", kudos=1000)


# --- Chat declaration on pop -----------------------------------------------------------------


def test_pop_stores_the_chat_declaration(horde, owner):
    response = chat_pop(
        horde,
        owner.key,
        models=[MODEL, OTHER],
        features=["vision", "seed", "not-a-feature", "prompt_overflow_refused"],
        limits={**LIMITS, "tools_max_temperature": 0.7},
        transports=["url", "carrier-pigeon", "base64"],
        prompt_jobs=False,
    )
    assert response.status_code == 200, response.json()
    worker = Worker.objects.get(name="chat-worker")
    assert worker.accepts_chat_jobs is True and worker.accepts_prompt_jobs is False
    # Only the recognised names, sorted.
    assert worker.chat_features == ["prompt_overflow_refused", "seed", "vision"]
    assert worker.chat_feature_mask == declaration_mask(["prompt_overflow_refused", "seed", "vision"])
    assert (worker.chat_max_context_length, worker.chat_max_length) == (8192, 1024)
    assert worker.chat_tools_max_temperature == 0.7
    assert worker.chat_model_id == MODEL
    assert worker.image_transports == ["base64", "url"]


def test_pop_without_chat_jobs_withdraws_the_whole_declaration(horde, owner, requester):
    chat_pop(horde, owner.key, features=["vision", *ALL_GUARANTEES], transports=["url"])
    assert horde.pop(owner.key, name="chat-worker").status_code == 200
    worker = Worker.objects.get(name="chat-worker")
    assert worker.accepts_chat_jobs is False and worker.accepts_prompt_jobs is True
    assert worker.chat_features == [] and worker.chat_feature_mask == 0
    assert worker.chat_max_context_length is None and worker.chat_max_length is None
    assert worker.chat_model_id is None and worker.image_transports == []
    assert worker.chat_tools_max_temperature is None
    # ...and it no longer receives a chat job.
    queue_chat(requester.user)
    job = horde.pop(owner.key, name="chat-worker").json()
    assert job["id"] is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"chat_jobs": True, "model_id": MODEL}, "chat_limits"),
        ({"chat_jobs": True, "chat_limits": LIMITS}, "model_id"),
        ({"chat_jobs": True, "chat_limits": {"max_length": 512}, "model_id": MODEL}, "chat_limits.max_context_length"),
        ({"chat_jobs": True, "chat_limits": {"max_context_length": 4096}, "model_id": MODEL}, "chat_limits.max_length"),
        # Past the integer columns that store them: the pop's write failed with a 500.
        ({"chat_jobs": True, "chat_limits": {**LIMITS, "max_context_length": 2**31}, "model_id": MODEL},
         "chat_limits.max_context_length"),
        ({"chat_jobs": True, "chat_limits": {**LIMITS, "max_length": 10**30}, "model_id": MODEL}, "chat_limits.max_length"),
        (
            {"chat_jobs": True, "chat_limits": {**LIMITS, "tools_max_temperature": -0.1}, "model_id": MODEL},
            "chat_limits.tools_max_temperature",
        ),
        ({"chat_jobs": True, "chat_limits": LIMITS, "model_id": "not/served"}, "model_id"),
        ({"prompt_jobs": False}, "prompt_jobs"),
        ({"chat_jobs": False, "prompt_jobs": False}, "prompt_jobs"),
        ({"chat_jobs": "yes"}, "chat_jobs"),
        ({"chat_jobs": True, "chat_limits": LIMITS, "model_id": MODEL, "chat_features": "seed"}, "chat_features"),
    ],
)
def test_invalid_declarations_are_refused(horde, owner, extra, param):
    response = horde.pop(owner.key, name="bad", models=[MODEL], **extra)
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"message", "rc"}
    assert body["rc"] == "ChatDeclarationInvalid"
    assert body["message"].startswith(f"'{param}'")
    # A refused pop does not check the worker in.
    assert not Worker.objects.filter(name="bad").exists()


def test_the_largest_chat_limits_are_stored(horde, owner):
    largest = {"max_context_length": 2**31 - 1, "max_length": 2**31 - 1}
    response = horde.pop(owner.key, name="wide", models=[MODEL], chat_jobs=True, chat_limits=largest, model_id=MODEL)
    assert response.status_code == 200
    worker = Worker.objects.get(name="wide")
    assert worker.chat_max_context_length == worker.chat_max_length == 2**31 - 1


def test_model_id_is_opaque(horde, owner):
    odd = "koboldcpp/weird:model#1 with spaces?"
    assert chat_pop(horde, owner.key, model_id=odd).status_code == 200
    assert Worker.objects.get(name="chat-worker").chat_model_id == odd


# --- Chat job pop response -------------------------------------------------------------------


def test_chat_job_payload_with_defaults(horde, owner, requester):
    request = queue_chat(requester.user, {"messages": [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Hi"}]},
                         max_length=300, max_context_length=4096)
    job = chat_pop(horde, owner.key).json()
    assert job["chat"] is True
    assert job["ttl"] == 150 and job["model"] == MODEL and job["softprompt"] is None
    assert job["payload"] == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        **CHAT_SAMPLING_DEFAULTS,
        "max_length": 300,
        "max_context_length": 4096,
        "n": 1,
    }
    assert job["payload"]["temperature"] == 1.0 and job["payload"]["top_k"] == 0
    assert "prompt" not in job["payload"]
    gen = Generation.objects.get(pk=job["id"])
    assert gen.request_id == request.id
    assert (gen.model, gen.assigned_model) == (MODEL, MODEL)
    assert (gen.assigned_max_context_length, gen.assigned_max_length) == (8192, 1024)


def test_chat_job_payload_carries_what_the_client_sent(horde, owner, requester):
    body = {
        "temperature": 0.3,
        "top_p": 0.9,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "seed": 42,
        "reasoning_effort": "none",
        "stop": ["\n\n", "END"],
        "stream": True,
        "tools": [WEATHER],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "response_format": {"type": "json_object"},
    }
    queue_chat(requester.user, body)
    payload = chat_pop(horde, owner.key, features=TOOL_FEATURES).json()["payload"]
    assert payload["temperature"] == 0.3 and payload["top_p"] == 0.9
    assert (payload["frequency_penalty"], payload["presence_penalty"]) == (0.5, -0.5)
    assert (payload["rep_pen"], payload["top_k"], payload["min_p"]) == (1.0, 0, 0.0)
    assert payload["seed"] == 42 and payload["reasoning_effort"] == "none"
    assert payload["stop_sequence"] == ["\n\n", "END"]
    assert payload["stream_progress"] is True
    assert payload["tools"] == [WEATHER] and payload["tool_choice"] == "auto"
    assert payload["parallel_tool_calls"] is False
    assert payload["response_format"] == {"type": "json_object"}


def test_optional_keys_are_absent_when_not_sent(horde, owner, requester):
    queue_chat(requester.user)
    payload = chat_pop(horde, owner.key).json()["payload"]
    for key in ("stop_sequence", "seed", "reasoning_effort", "stream_progress", "tools", "tool_choice",
                "parallel_tool_calls", "response_format", "messages_url"):
        assert key not in payload


def test_tool_choice_none_sends_no_tools(horde, owner, requester):
    request = queue_chat(requester.user, {"tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": True,
                                          "response_format": {"type": "json_object"}})
    payload = chat_pop(horde, owner.key, features=TOOL_FEATURES).json()["payload"]
    assert "tools" not in payload and "tool_choice" not in payload and "parallel_tool_calls" not in payload
    assert payload["response_format"] == {"type": "json_object"}
    # The stored values stay the client's.
    request.refresh_from_db()
    assert request.chat_extras["tool_choice"] == "none" and request.chat_extras["tools"] == [WEATHER]


def test_function_choice_sends_only_that_function_as_required(horde, owner, requester):
    choice = {"type": "function", "function": {"name": "get_time"}}
    request = queue_chat(requester.user, {"tools": [WEATHER, TIME], "tool_choice": choice})
    payload = chat_pop(horde, owner.key, features=TOOL_FEATURES).json()["payload"]
    assert payload["tools"] == [TIME] and payload["tool_choice"] == "required"
    request.refresh_from_db()
    assert request.chat_extras["tool_choice"] == choice and request.chat_extras["tools"] == [WEATHER, TIME]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_auto_and_required_are_sent_as_stored(horde, owner, requester, choice):
    queue_chat(requester.user, {"tools": [WEATHER, TIME], "tool_choice": choice})
    payload = chat_pop(horde, owner.key, features=TOOL_FEATURES).json()["payload"]
    assert payload["tools"] == [WEATHER, TIME] and payload["tool_choice"] == choice


def test_text_job_is_unchanged_for_a_chat_worker(horde, owner, requester):
    horde.text_async(requester.key, prompt="Once", models=[MODEL], params={"max_length": 100, "temperature": 0.5})
    job = chat_pop(horde, owner.key, max_length=512).json()
    assert "chat" not in job
    assert set(job) == {"payload", "id", "ids", "messages", "ttl", "extra_source_images", "skipped", "softprompt",
                        "model"}
    assert job["payload"]["prompt"] == "Once" and job["payload"]["temperature"] == 0.5
    gen = Generation.objects.get(pk=job["id"])
    assert gen.assigned_model is None and gen.assigned_max_length is None


def test_the_assignment_snapshot_survives_a_changed_declaration(horde, owner, requester):
    queue_chat(requester.user)
    job = chat_pop(horde, owner.key).json()
    chat_pop(horde, owner.key, limits={"max_context_length": 16384, "max_length": 4096})
    gen = Generation.objects.get(pk=job["id"])
    assert (gen.assigned_max_context_length, gen.assigned_max_length) == (8192, 1024)


# --- Race ------------------------------------------------------------------------------------


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_two_chat_workers_racing_for_one_chat_job_get_it_once(make_user):
    requester, owner = make_user("r", kudos=100), make_user("o")
    for round_ in range(5):
        request = queue_chat(requester.user, {"messages": [{"role": "user", "content": f"round {round_}"}]})
        results = race([lambda n=n: chat_pop(Horde(APIClient()), owner.key, name=f"racer-{n}").json()
                         for n in range(4)])
        winners = [r for r in results if r["id"]]
        assert len(winners) == 1, results
        assert winners[0]["chat"] is True
        assert Generation.objects.filter(request=request).count() == 1
        request.refresh_from_db()
        assert request.jobs_waiting == 0
