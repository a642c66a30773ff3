"""Haidra-Org's Python SDK, horde_sdk 0.18.0 (the newest on Python 3.11), against the live routes:
the bytes and headers its manual and simple clients send for the text exchanges it models, and the
fields its pydantic response models require of each answer.

It sends its own `client_agent` header (underscore: upstream's waitress drops such a header, so
neither horde records the agent), `accept: application/json` and `apikey` only where its request
model carries a key (the anonymous key on the workers list). It parses every 2xx answer with its
model; a missing required field makes the call return an error instead of the answer. Its tests run
the models with extra fields forbidden: the answers below carry only fields it knows, except the
pop's `messages` (upstream's GenerationPayloadKobold has it, the SDK predates it) and the worker
details' chat declaration (chat_requests.md, "Worker details").
"""

from __future__ import annotations

import uuid

import pytest

from tests.chat.live_stack import LiveStack
from tests.oai.conftest import _restore_anonymous_user

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "sdk/model"
AGENT = "horde_sdk:v0.18.0:https://github.com/haidra-org/horde-sdk"
BRIDGE_AGENT = "horde-sdk-test:1:https://example.invalid"

# Required (no default) and known fields of the SDK's response models, by alias.
ASYNC_REQUIRED, ASYNC_FIELDS = {"id"}, {"id", "kudos", "message", "warnings"}
STATUS_REQUIRED = {"done", "finished", "kudos", "processing", "queue_position", "restarted", "wait_time", "waiting"}
STATUS_FIELDS = STATUS_REQUIRED | {"faulted", "generations", "is_possible"}
GENERATION_REQUIRED = {"model", "state", "worker_id", "worker_name"}
GENERATION_FIELDS = GENERATION_REQUIRED | {"gen_metadata", "id", "seed", "text"}
POP_REQUIRED = {"ids", "payload"}
POP_FIELDS = POP_REQUIRED | {"extra_source_images", "id", "model", "skipped", "softprompt", "ttl"}
SKIPPED_FIELDS = {"blacklist", "bridge_version", "kudos", "matching_softprompt", "max_context_length", "max_length",
                  "models", "nsfw", "performance", "untrusted", "worker_id"}
WORKER_REQUIRED = {"bridge_agent", "id", "maintenance_mode", "name", "type"}
WORKER_FIELDS = WORKER_REQUIRED | {
    "contact", "controlnet", "flagged", "forms", "img2img", "info", "ipaddr", "kudos_details", "kudos_rewards",
    "lora", "max_context_length", "max_length", "max_pixels", "megapixelsteps_generated", "models", "nsfw", "online",
    "owner", "painting", "paused", "performance", "post_processing", "requests_fulfilled", "sdxl_controlnet",
    "suspicious", "team", "threads", "tokens_generated", "trusted", "uncompleted_jobs", "uptime",
}
# This horde's worker fields beyond upstream's (chat_requests.md, "Worker details").
WORKER_CHAT_FIELDS = {"nonconformant_replies", "accepts_chat_jobs", "accepts_prompt_jobs", "chat"}
ACTIVE_MODEL_REQUIRED, ACTIVE_MODEL_FIELDS = {"type"}, {"count", "eta", "jobs", "name", "performance", "queued", "type"}
USER_FIELDS = {
    "account_age", "active_generations", "admin_comment", "concurrency", "contact", "contributions", "customizer",
    "education", "evaluating_kudos", "flagged", "id", "kudos", "kudos_details", "moderator", "monthly_kudos",
    "pseudonymous", "records", "service", "sharedkey_ids", "special", "styles", "suspicious", "trusted", "usage",
    "username", "vpn", "worker_count", "worker_ids", "worker_invited",
}


def sdk_headers(key: str | None = None, *, body: bool = False) -> dict[str, str]:
    """The headers of its requests.get/post/delete calls, in their order."""
    headers = {
        "User-Agent": "python-requests/2.34.2",
        "Accept-Encoding": "gzip, deflate",
        "accept": "application/json",
        "Connection": "keep-alive",
        "client_agent": AGENT,
    }
    if key is not None:
        headers["apikey"] = key
    if body:
        headers["Content-Type"] = "application/json"
    return headers


def has_model_fields(answer: dict, required: set[str], known: set[str]) -> None:
    assert required <= set(answer), f"missing {required - set(answer)} in {answer}"
    assert set(answer) <= known, f"unknown to the SDK: {set(answer) - known}"


@pytest.fixture
def live():
    _restore_anonymous_user()  # the workers list carries the anonymous key
    stack = LiveStack()
    yield stack
    stack.close()


def sdk_pop(live: LiveStack, key: str, name: str = "sdk-worker", model: str = MODEL, threads: int = 1) -> dict:
    """TextGenerateJobPopRequest(name, models, max_length, max_context_length, bridge_agent, threads), dumped
    as its client dumps it."""
    body = {"bridge_agent": BRIDGE_AGENT, "models": [model], "name": name, "threads": threads, "max_length": 512,
            "max_context_length": 2048}
    response = live.request(
        "POST", "/api/v2/generate/text/pop", headers=sdk_headers(key, body=True), body=body, exact_headers=True
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    has_model_fields(answer, POP_REQUIRED, POP_FIELDS | {"messages"})
    assert answer["messages"] is None and set(answer["skipped"]) <= SKIPPED_FIELDS
    return answer


def test_the_sdk_client_and_worker_exchange_parses(live, make_user):
    """text_generate_request's async and status polls, the manual client's dry run, and a worker's pop and
    submit through its manual client."""
    requester = make_user("sdk-client", kudos=100)
    owner = make_user("sdk-owner", trusted=True)
    body = {"models": [MODEL], "params": {"max_context_length": 1024, "max_length": 64, "n": 1, "rep_pen": 1.1,
                                          "stop_sequence": ["\n\n"], "temperature": 0.7, "top_k": 40, "top_p": 0.9},
            "prompt": "Once upon a time"}
    dry = live.request("POST", "/api/v2/generate/text/async", headers=sdk_headers(requester.key, body=True),
                       body={"models": [MODEL], "dry_run": True, "prompt": "x"}, exact_headers=True)
    # TextGenerateAsyncDryRunResponse, on a 200: {kudos} and nothing else.
    assert dry.status_code == 200 and set(dry.json()) == {"kudos"}, dry.text
    sdk_pop(live, owner.key)  # registers the worker so that the request is possible
    queued = live.request("POST", "/api/v2/generate/text/async", headers=sdk_headers(requester.key, body=True),
                          body=body, exact_headers=True)
    assert queued.status_code == 202, queued.text
    has_model_fields(queued.json(), ASYNC_REQUIRED, ASYNC_FIELDS)
    request_id = queued.json()["id"]

    def status() -> dict:
        response = live.request("GET", f"/api/v2/generate/text/status/{request_id}", headers=sdk_headers(),
                                exact_headers=True)
        assert response.status_code == 200, response.text
        has_model_fields(response.json(), STATUS_REQUIRED, STATUS_FIELDS)
        return response.json()

    assert status()["waiting"] == 1
    job = sdk_pop(live, owner.key)
    assert job["ids"] == [job["id"]] and job["model"] == MODEL and job["payload"]["prompt"] == "Once upon a time"
    submitted = live.request(
        "POST", "/api/v2/generate/text/submit", headers=sdk_headers(owner.key, body=True),
        body={"id": job["id"], "generation": " a generated text", "state": "ok",
              "gen_metadata": [{"type": "information", "value": "see_ref", "ref": "note"}]},
        exact_headers=True,
    )
    # JobSubmitResponse: {reward}.
    assert submitted.status_code == 200 and set(submitted.json()) == {"reward"}, submitted.text
    done = status()
    # is_job_complete(1): one generation in the list.
    assert done["done"] is True and len(done["generations"]) == 1
    generation = done["generations"][0]
    has_model_fields(generation, GENERATION_REQUIRED, GENERATION_FIELDS)
    assert generation["text"] == " a generated text" and generation["state"] == "ok"
    assert generation["gen_metadata"] == [{"type": "information", "value": "see_ref", "ref": "note"}]
    # No job left: ids empty, id null, and still the fields its model requires.
    empty = sdk_pop(live, owner.key)
    assert (empty["id"], empty["ids"], empty["payload"]) == (None, [], {})


def test_the_sdk_cancel_answers_a_status(live, make_user):
    """DeleteTextGenerateRequest: a DELETE with no body and no key, parsed as TextGenerateStatusResponse."""
    requester = make_user("sdk-client", kudos=100)
    queued = live.request("POST", "/api/v2/generate/text/async", headers=sdk_headers(requester.key, body=True),
                          body={"models": ["nobody/model"], "params": {"max_length": 32}, "prompt": "Hello"},
                          exact_headers=True)
    assert queued.status_code == 202, queued.text
    request_id = queued.json()["id"]
    cancelled = live.request("DELETE", f"/api/v2/generate/text/status/{request_id}",
                             headers={**sdk_headers(), "Content-Length": "0"}, exact_headers=True)
    assert cancelled.status_code == 200, cancelled.text
    has_model_fields(cancelled.json(), STATUS_REQUIRED, STATUS_FIELDS)
    # As upstream: a cancelled request is done, with no generation and nothing left waiting.
    assert (cancelled.json()["done"], cancelled.json()["waiting"], cancelled.json()["generations"]) == (True, 0, [])


def test_the_sdk_status_and_user_lookups_parse(live, make_user):
    """heartbeat_request, HordeStatusModelsAllRequest(type=text) and ...SingleRequest, FindUserRequest."""
    owner = make_user("sdk-owner", trusted=True)
    sdk_pop(live, owner.key)
    heartbeat = live.request("GET", "/api/v2/status/heartbeat", headers=sdk_headers(), exact_headers=True)
    assert heartbeat.status_code == 200 and "version" in heartbeat.json()
    has_model_fields(heartbeat.json(), {"version"}, {"message", "version"})
    for path in ("/api/v2/status/models?type=text&model_state=all", f"/api/v2/status/models/{MODEL}"):
        models = live.request("GET", path, headers=sdk_headers(), exact_headers=True)
        assert models.status_code == 200, models.text
        assert [m["name"] for m in models.json()] == [MODEL]
        for model in models.json():
            has_model_fields(model, ACTIVE_MODEL_REQUIRED, ACTIVE_MODEL_FIELDS)
    user = live.request("GET", "/api/v2/find_user", headers=sdk_headers(owner.key), exact_headers=True)
    assert user.status_code == 200 and user.json()["username"] == owner.user.unique_alias, user.text
    assert set(user.json()) <= USER_FIELDS


def test_the_sdk_workers_list_is_every_worker_or_the_one_named(live, make_user):
    """workers_all_details() sends `?type=` (WORKER_TYPE.all is the empty string) and, with a name,
    `?type=&name=<name>`: upstream reads an empty type as no filter and a name as the one worker of that
    name in any case. This horde answered `[]` to the first and every worker to the second."""
    owner = make_user("sdk-owner", trusted=True)
    sdk_pop(live, owner.key, name="sdk-worker")
    sdk_pop(live, owner.key, name="other-worker")

    def listed(query: str) -> list[dict]:
        response = live.request("GET", f"/api/v2/workers?{query}", headers=sdk_headers("0000000000"),
                                exact_headers=True)
        assert response.status_code == 200, response.text
        for worker in response.json():
            has_model_fields(worker, WORKER_REQUIRED, WORKER_FIELDS | WORKER_CHAT_FIELDS)
        return [worker["name"] for worker in response.json()]

    assert listed("type=") == ["other-worker", "sdk-worker"]
    assert listed("type=&name=SDK-Worker") == ["sdk-worker"]
    assert listed("type=&name=nobody") == []
    assert listed("type=text") == ["other-worker", "sdk-worker"]
    assert listed("type=image") == []
    assert listed("type=image&name=sdk-worker") == ["sdk-worker"]  # upstream: the name before the type
    assert listed("type=text&type=image") == ["other-worker", "sdk-worker"]  # upstream: the first value
    by_name = live.request("GET", "/api/v2/workers/name/sdk-worker", headers=sdk_headers("0000000000"),
                           exact_headers=True)
    assert by_name.status_code == 200, by_name.text
    # worker_details_by_name() of an unknown (or differently cased) name: upstream's WorkerNotFound,
    # which names an ID; the SDK returns it as its RequestErrorResponse (message, rc).
    unknown = live.request("GET", "/api/v2/workers/name/SDK-Worker", headers=sdk_headers("0000000000"),
                           exact_headers=True)
    assert unknown.status_code == 404
    assert unknown.json() == {"message": "Worker with ID 'SDK-Worker' not found.", "rc": "WorkerNotFound"}
    worker_id = uuid.UUID(by_name.json()["id"])
    by_id = live.request("GET", f"/api/v2/workers/{worker_id}", headers=sdk_headers("0000000000"), exact_headers=True)
    assert by_id.status_code == 200 and by_id.json()["name"] == "sdk-worker"
    has_model_fields(by_id.json(), WORKER_REQUIRED, WORKER_FIELDS | WORKER_CHAT_FIELDS)


def test_the_sdk_models_filters_are_upstreams(live, make_user):
    """HordeStatusModelsAllRequest's model_state (known: in the text model reference; custom: not in
    it) and min_count/max_count (serving threads), in the query order it sends. This horde ignored all
    three and listed every model."""
    owner = make_user("sdk-owner", trusted=True)
    known = "Gryphe/MythoMax-L2-13b"
    sdk_pop(live, owner.key, name="known-worker", model=known, threads=2)
    sdk_pop(live, owner.key)

    def listed(query: str) -> list[str]:
        response = live.request("GET", f"/api/v2/status/models?{query}", headers=sdk_headers(), exact_headers=True)
        assert response.status_code == 200, response.text
        for model in response.json():
            has_model_fields(model, ACTIVE_MODEL_REQUIRED, ACTIVE_MODEL_FIELDS)
        return sorted(model["name"] for model in response.json())

    assert listed("type=text&model_state=all") == [known, MODEL]
    assert listed("type=text&model_state=known") == [known]
    assert listed("type=text&model_state=custom") == [MODEL]
    assert listed("type=text&min_count=2&max_count=5&model_state=all") == [known]
    assert listed("type=text&max_count=1&model_state=all") == [MODEL]
    assert listed("type=text&min_count=1&max_count=5&model_state=custom") == [MODEL]
    refused = live.request("GET", "/api/v2/status/models?type=text&model_state=popular", headers=sdk_headers(),
                           exact_headers=True)
    assert (refused.status_code, refused.json()) == (
        400, {"message": "'model_state' needs to be one of ['known', 'custom', 'all']", "rc": "BadRequest"}
    )


def test_the_sdk_text_stats_parse(live, make_user):
    """text_stats_totals() and text_stats_models(): TextStatsModelsTotalRequest and TextStatsModelsRequest
    (no query, no key), parsed as TextStatsModelsTotalResponse (minute, hour, day, month, total: each a
    dict[str, int]) and TextStatsModelResponse (day, month, total: dict[str, int]). This horde answered
    404 to both."""
    owner = make_user("sdk-owner", trusted=True)
    requester = make_user("sdk-requester", kudos=1000)
    queued = live.request("POST", "/api/v2/generate/text/async", headers=sdk_headers(requester.key, body=True),
                          body={"prompt": "Hi", "models": [MODEL], "params": {"max_length": 64}}, exact_headers=True)
    assert queued.status_code == 202, queued.text
    job = sdk_pop(live, owner.key)
    submitted = live.request("POST", "/api/v2/generate/text/submit", headers=sdk_headers(owner.key, body=True),
                             body={"id": job["id"], "generation": "Hello."}, exact_headers=True)
    assert submitted.status_code == 200, submitted.text
    totals = live.request("GET", "/api/v2/stats/text/totals", headers=sdk_headers(), exact_headers=True)
    assert totals.status_code == 200, totals.text
    assert totals.json() == {period: {"requests": 1, "tokens": 64} for period in ("minute", "hour", "day", "month", "total")}
    models = live.request("GET", "/api/v2/stats/text/models", headers=sdk_headers(), exact_headers=True)
    assert models.status_code == 200, models.text
    assert models.json() == {"day": {MODEL: 1}, "month": {MODEL: 1}, "total": {MODEL: 1}}
