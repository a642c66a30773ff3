"""The upstream text worker (AI-Horde-Worker "scribe", bridge version 24) and KoboldAI Lite against
the live routes, with their own bodies and headers (spec: existing-clients.md; ADR 0012).

The scribe sends only `apikey`, pops with the same eight keys about once a second, and names its
engine in `bridge_agent` (`~unknown~kai`, `~aphrodite~kai`, `~oai`), one more `~kai` after every
config reload. Lite never sends `validated_backends`: its requests must reach every one of them.
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from chat.models import Generation
from tests.chat.live_stack import REQUESTS_HEADERS, LiveStack
from workers.models import Worker

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "koboldcpp/Fimbulvetr-11B-v2"
SCRIBE_URL = "https://github.com/db0/AI-Horde-Worker"


def scribe_agent(engine: str) -> str:
    return f"AI Horde Worker{engine}:24:{SCRIBE_URL}"


UNVALIDATED_ENGINES = ["~unknown~kai", "~oai", "~unknown~kai~kai~kai", "~kai~kai~kai"]
VALIDATED_ENGINES = ["~aphrodite~kai", "~aphrodite~oai", "~aphrodite~kai~kai~kai"]

# KoboldAI Lite's request as it sends it (Client-Agent, workers: [], its sampler params), at the
# lengths a scribe with max_length 80 and max_context_length 1024 serves.
LITE_PARAMS = {
    "n": 1, "max_context_length": 1024, "max_length": 80, "rep_pen": 1.07, "temperature": 0.75, "top_p": 0.92,
    "top_k": 100, "top_a": 0, "typical": 1, "tfs": 1, "rep_pen_range": 360, "rep_pen_slope": 0.7,
    "sampler_order": [6, 0, 1, 3, 4, 2, 5], "use_default_badwordsids": False, "stop_sequence": ["You:", "\nYou "],
    "min_p": 0, "dynatemp_range": 0, "dynatemp_exponent": 1, "smoothing_factor": 0, "frmttriminc": True,
    "frmtrmblln": False, "singleline": False,
}


@pytest.fixture
def live():
    stack = LiveStack()
    yield stack
    stack.close()


def scribe_pop(live: LiveStack, key: str, name: str, engine: str):
    body = {
        "name": name,
        "models": [MODEL],
        "max_length": 80,
        "max_context_length": 1024,
        "priority_usernames": [],
        "softprompts": [],
        "bridge_agent": scribe_agent(engine),
        "threads": 1,
    }
    response = live.request("POST", "/api/v2/generate/text/pop", headers={**REQUESTS_HEADERS, "apikey": key}, body=body)
    assert response.status_code == 200, response.text
    return response.json()


def scribe_submit(live: LiveStack, key: str, body: dict):
    """Its submit as requests posts it (the scribe's headers)."""
    return live.request("POST", "/api/v2/generate/text/submit", headers={**REQUESTS_HEADERS, "apikey": key}, body=body)


def lite_request(live: LiveStack, key: str, prompt: str, **extra) -> str:
    headers = {"apikey": key, "Client-Agent": "KoboldAiLite:17", "Origin": "null"}
    body = {"prompt": prompt, "params": LITE_PARAMS, "models": [MODEL], "workers": [], **extra}
    response = live.request("POST", "/api/v2/generate/text/async", headers=headers, body=body)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def lite_status(live: LiveStack, request_id: str) -> dict:
    response = live.request("GET", f"/api/v2/generate/text/status/{request_id}", headers={"Origin": "null"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
    return response.json()


def assert_scribe_job(job: dict, prompt: str) -> None:
    assert job["id"] is not None, job
    payload = job["payload"]
    assert payload["prompt"] == prompt
    assert (payload["max_length"], payload["max_context_length"]) == (80, 1024)
    assert not {"width", "length", "steps"} & payload.keys()  # keys that make the scribe fault the job


@pytest.mark.parametrize("engine", UNVALIDATED_ENGINES + VALIDATED_ENGINES)
def test_every_scribe_engine_gets_an_ordinary_request_and_is_paid(live, make_user, engine):
    owner, requester = make_user("scribe-owner"), make_user("lite-user", kudos=50)
    idle = scribe_pop(live, owner.key, "scribe", engine)  # its first pop registers it
    assert idle["id"] is None and idle["skipped"] == {}
    request_id = lite_request(live, requester.key, "You: Hello\nBot:")
    # Lite gives up on a poll with is_possible false: the online scribe can serve it.
    first_poll = lite_status(live, request_id)
    assert (first_poll["is_possible"], first_poll["waiting"], first_poll["faulted"]) == (True, 1, False)
    job = scribe_pop(live, owner.key, "scribe", engine)
    assert_scribe_job(job, "You: Hello\nBot:")
    # Its submit: {id, generation, seed: 0}; it needs 200 with a numeric reward.
    submitted = scribe_submit(live, owner.key, {"id": job["id"], "generation": " Hi there!", "seed": 0})
    assert submitted.status_code == 200 and type(submitted.json()["reward"]) in (int, float)
    assert submitted.json()["reward"] > 0
    status = lite_status(live, request_id)
    assert status["done"] is True and status["faulted"] is False
    assert status["generations"][0]["text"] == " Hi there!"
    assert status["generations"][0]["worker_name"] == "scribe"
    assert Generation.objects.get(pk=job["id"]).worker.bridge_agent == scribe_agent(engine)


def test_the_engine_name_growing_on_every_reload_keeps_the_jobs_coming(live, make_user):
    owner, requester = make_user("reloading-owner"), make_user("lite-user", kudos=50)
    for reloads in range(4):
        engine = "~unknown~kai" + "~kai" * reloads  # 69, 73, 77, 81 characters of program name and url
        lite_request(live, requester.key, f"Prompt {reloads}")
        assert_scribe_job(scribe_pop(live, owner.key, "reloading-scribe", engine), f"Prompt {reloads}")


def test_a_bridge_agent_of_upstreams_longest_is_kept_and_a_longer_one_refused(horde, make_user):
    """Upstream accepts a bridge_agent up to 1,000 characters; so do we, whole."""
    owner = make_user("long-agent-owner")
    prefix = "AI Horde Worker~aphrodite~kai:24:https://github.com/db0/AI-Horde-Worker#"
    agent = prefix + "k" * (1000 - len(prefix))
    assert horde.pop(owner.key, name="long-agent", bridge_agent=agent).status_code == 200
    assert Worker.objects.get(name="long-agent").bridge_agent == agent
    refused = horde.pop(owner.key, name="long-agent", bridge_agent=agent + "x")
    assert refused.status_code == 400 and "bridge_agent" in refused.json()["errors"]


@pytest.mark.parametrize("engine", UNVALIDATED_ENGINES)
def test_a_validated_only_request_skips_the_unvalidated_engines(live, make_user, engine):
    owner, requester = make_user("scribe-owner"), make_user("careful-user", kudos=50)
    scribe_pop(live, owner.key, "scribe", engine)
    request_id = lite_request(live, requester.key, "Only vetted backends.", validated_backends=True)
    skipped = scribe_pop(live, owner.key, "scribe", engine)
    assert skipped["id"] is None and skipped["skipped"] == {"bridge_version": 1}
    # A validated program beside it takes the request.
    other = live.request(
        "POST",
        "/api/v2/generate/text/pop",
        headers={"apikey": owner.key},
        body={"name": "embedded", "models": [MODEL], "max_length": 80, "max_context_length": 1024,
              "bridge_agent": "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"},
    ).json()
    assert_scribe_job(other, "Only vetted backends.")
    assert lite_status(live, request_id)["processing"] == 1


@pytest.mark.parametrize("engine", VALIDATED_ENGINES)
def test_a_validated_only_request_goes_to_the_validated_engines(live, make_user, engine):
    owner, requester = make_user("scribe-owner"), make_user("careful-user", kudos=50)
    scribe_pop(live, owner.key, "scribe", engine)
    lite_request(live, requester.key, "Only vetted backends.", validated_backends=True)
    assert_scribe_job(scribe_pop(live, owner.key, "scribe", engine), "Only vetted backends.")


def test_a_job_in_flight_keeps_the_request_possible_for_lite(live, make_user):
    """Lite gives up on the first poll with is_possible false. Upstream's status reads a request
    with a generation in flight as possible whatever its worker does meanwhile: here the scribe's
    owner puts it in maintenance from Lite's "my workers" panel (PUT {maintenance: true}) while it
    generates. The scribe still submits, the requester is charged, and Lite must still be polling."""
    owner, requester = make_user("scribe-owner"), make_user("lite-user", kudos=50)
    scribe_pop(live, owner.key, "scribe", "~aphrodite~kai")
    request_id = lite_request(live, requester.key, "You: Hello\nBot:")
    job = scribe_pop(live, owner.key, "scribe", "~aphrodite~kai")
    assert_scribe_job(job, "You: Hello\nBot:")
    worker_id = str(Worker.objects.get(name="scribe").pk)
    put = live.request(
        "PUT", f"/api/v2/workers/{worker_id}", headers={"apikey": owner.key, "Origin": "null"}, body={"maintenance": True}
    )
    assert put.status_code == 200, put.text
    polled = lite_status(live, request_id)
    assert (polled["processing"], polled["waiting"]) == (1, 0)
    assert polled["is_possible"] is True and polled["faulted"] is False and "message" not in polled
    submitted = scribe_submit(live, owner.key, {"id": job["id"], "generation": " Hi there!", "seed": 0})
    assert submitted.status_code == 200 and submitted.json()["reward"] > 0
    status = lite_status(live, request_id)
    assert status["done"] is True and status["generations"][0]["text"] == " Hi there!"


def test_the_scribes_faulted_submit_is_paid_nothing_and_the_job_restarts(live, make_user):
    """When its backend fails, the scribe submits {id, state: faulted, generation: "faulted",
    seed: -1} and reads `reward` from a 200 (worker/jobs/framework.py); a 400 or 404 would make it
    abandon the job, an error without `message` would kill its submit thread. Lite keeps polling."""
    owner, requester = make_user("scribe-owner"), make_user("lite-user", kudos=50)
    scribe_pop(live, owner.key, "scribe", "~unknown~kai")
    request_id = lite_request(live, requester.key, "You: Hello\nBot:")
    job = scribe_pop(live, owner.key, "scribe", "~unknown~kai")
    assert_scribe_job(job, "You: Hello\nBot:")
    submitted = scribe_submit(live, owner.key, {"id": job["id"], "state": "faulted", "generation": "faulted", "seed": -1})
    assert submitted.status_code == 200 and submitted.json() == {"reward": 0.0}
    polled = lite_status(live, request_id)
    assert (polled["restarted"], polled["waiting"], polled["processing"]) == (1, 1, 0)
    assert polled["is_possible"] is True and polled["faulted"] is False and "message" not in polled
    assert_scribe_job(scribe_pop(live, owner.key, "scribe", "~unknown~kai"), "You: Hello\nBot:")


def test_a_scribe_running_for_hours_keeps_getting_jobs(live, make_user):
    """The scribe appends "~kai" to its engine on every config reload, once a minute, and never drops
    one: after about 233 reloads (four hours) its bridge_agent passes the 1,000 characters upstream's
    schema bounds, and every pop was refused with 400 (the scribe logs it and pops again 2 s later,
    forever). The pop reads it with the repeated segments collapsed (ADR 0097). This is the body the
    scribe sent after 240 reloads (reproduced with backend_engine in its bridgeData.yaml)."""
    owner, requester = make_user("scribe-owner"), make_user("lite-user", kudos=50)
    engine = "~unknown" + "~kai" * 241
    assert len(scribe_agent(engine)) == 1029
    assert scribe_pop(live, owner.key, "old-scribe", engine) == {
        "payload": {}, "id": None, "ids": [], "messages": None, "ttl": None, "extra_source_images": [],
        "skipped": {}, "softprompt": None, "model": None,
    }
    worker = Worker.objects.get(name="old-scribe")
    assert worker.bridge_agent == scribe_agent("~unknown~kai") and worker.validated_bridge is False
    request_id = lite_request(live, requester.key, "You: Still there?\nBot:")
    job = scribe_pop(live, owner.key, "old-scribe", engine)
    assert_scribe_job(job, "You: Still there?\nBot:")
    submitted = scribe_submit(live, owner.key, {"id": job["id"], "generation": " Yes.", "seed": 0})
    assert submitted.status_code == 200 and submitted.json()["reward"] > 0
    assert lite_status(live, request_id)["generations"][0]["text"] == " Yes."
    # An aphrodite backend stays validated however long it runs.
    scribe_pop(live, owner.key, "old-aphrodite", "~aphrodite" + "~kai" * 241)
    assert Worker.objects.get(name="old-aphrodite").validated_bridge is True


def test_a_long_bridge_agent_without_repeated_engines_is_still_refused(live, make_user):
    """Only the scribe's repeated segments are collapsed: a name that is long for another reason, or
    still over the bound after the collapse, is refused as upstream refuses it."""
    owner = make_user("scribe-owner")
    for engine in ("~unknown" + "~kai~oai" * 130, "~" + "k" * 990):
        body = {"name": "long", "models": [MODEL], "bridge_agent": scribe_agent(engine)}
        response = live.request(
            "POST", "/api/v2/generate/text/pop", headers={**REQUESTS_HEADERS, "apikey": owner.key}, body=body
        )
        assert response.status_code == 400
        assert response.json() == {
            "errors": {"bridge_agent": "Ensure this field has no more than 1000 characters."},
            "message": "Input payload validation failed",
        }
    assert not Worker.objects.filter(name="long").exists()


def test_lites_cancel_while_the_scribe_generates_still_pays_the_scribe(live, make_user):
    """Lite's abort sends DELETE while the scribe generates; the scribe never looks at the request
    again and submits when its backend answers. The submit is taken and paid (ADR 0003): a 400 or
    404 would make it abandon the job, and the reply it generated would be lost."""
    owner, requester = make_user("scribe-owner"), make_user("lite-user", kudos=50)
    scribe_pop(live, owner.key, "scribe", "~unknown~kai~kai~kai")
    request_id = lite_request(live, requester.key, "You: Cancel me\nBot:")
    job = scribe_pop(live, owner.key, "scribe", "~unknown~kai~kai~kai")
    assert_scribe_job(job, "You: Cancel me\nBot:")
    cancelled = live.request("DELETE", f"/api/v2/generate/text/status/{request_id}", headers={"Origin": "null"})
    assert cancelled.status_code == 200 and cancelled.headers["access-control-allow-origin"] == "*"
    assert (cancelled.json()["processing"], cancelled.json()["waiting"], cancelled.json()["done"]) == (1, 0, False)
    submitted = scribe_submit(live, owner.key, {"id": job["id"], "generation": " generated by the backend.", "seed": 0})
    assert submitted.status_code == 200, submitted.text
    reward = submitted.json()["reward"]
    assert reward > 0
    status = lite_status(live, request_id)
    assert status["done"] is True and status["generations"][0]["text"] == " generated by the backend."
    assert owner.refresh().kudos == Decimal(str(reward))
    assert requester.refresh().kudos == Decimal("50") - Decimal(str(reward)) - 1  # and the horde tax


def test_the_scribes_null_generation_is_refused_with_a_message(live, make_user):
    """When its backend answers five times without `results` (a 500 with a JSON body, say), the
    scribe gives up on generating but still submits, with `generation: null` (seed 0). Upstream's
    schema refuses it with 400 as here; the scribe logs the `message` ("... Aborting job!") and
    drops the job, which its lease then gives back. Lite keeps polling meanwhile."""
    owner, requester = make_user("scribe-owner"), make_user("lite-user", kudos=50)
    scribe_pop(live, owner.key, "scribe", "~unknown~kai~kai~kai")
    request_id = lite_request(live, requester.key, "You: Hello\nBot:")
    job = scribe_pop(live, owner.key, "scribe", "~unknown~kai~kai~kai")
    refused = scribe_submit(live, owner.key, {"id": job["id"], "generation": None, "seed": 0})
    assert refused.status_code == 400 and refused.headers["content-type"] == "application/json"
    assert refused.json() == {
        "errors": {"generation": "This field may not be null."}, "message": "Input payload validation failed"
    }
    polled = lite_status(live, request_id)
    assert (polled["processing"], polled["faulted"], polled["is_possible"]) == (1, False, True)
    assert "message" not in polled and owner.refresh().kudos == 0


@pytest.mark.parametrize(
    ("params", "skipped"),
    [
        ({**LITE_PARAMS, "max_length": 200}, {"max_length": 1}),
        ({**LITE_PARAMS, "max_context_length": 4096}, {"max_context_length": 1}),
    ],
)
def test_a_request_the_scribe_cannot_serve(live, make_user, params, skipped):
    """Past the scribe's max_length 80 or max_context_length 1024: Lite is told at once (the async's
    warning, then is_possible false, on which it gives up), and the scribe's pop says why it was
    skipped, which it logs ("Skipped Info: {'max_length': 1}")."""
    owner, requester = make_user("scribe-owner"), make_user("lite-user", kudos=50)
    scribe_pop(live, owner.key, "scribe", "~unknown~kai~kai~kai")
    created = live.request(
        "POST",
        "/api/v2/generate/text/async",
        headers={"apikey": requester.key, "Client-Agent": "KoboldAiLite:17", "Origin": "null"},
        body={"prompt": "You: Hello\nBot:", "params": params, "models": [MODEL], "workers": []},
    )
    assert created.status_code == 202 and created.json()["message"].startswith("Warning: No available workers")
    assert lite_status(live, created.json()["id"])["is_possible"] is False
    idle = scribe_pop(live, owner.key, "scribe", "~unknown~kai~kai~kai")
    assert idle["id"] is None and idle["skipped"] == skipped


def test_every_refusal_the_scribe_meets_on_pop_and_submit_is_json_with_a_message(live, make_user):
    """An error answer to its pop or submit without a `message` key makes the scribe's process exit
    (it reads `response.json()["message"]`): each refusal it can meet, with its own headers."""
    from tests.oai.conftest import _restore_anonymous_user

    _restore_anonymous_user()  # a keyless pop is the anonymous user's, which an earlier flush removed
    owner, stranger, requester = make_user("scribe-owner"), make_user("stranger"), make_user("lite-user", kudos=50)
    scribe_pop(live, owner.key, "scribe", "~unknown~kai")
    lite_request(live, requester.key, "You: Hello\nBot:")
    job = scribe_pop(live, owner.key, "scribe", "~unknown~kai")
    assert_scribe_job(job, "You: Hello\nBot:")
    pop_body = {
        "name": "scribe", "models": [MODEL], "max_length": 80, "max_context_length": 1024, "priority_usernames": [],
        "softprompts": [], "bridge_agent": scribe_agent("~unknown~kai"), "threads": 1,
    }
    unknown_job = "00000000-0000-0000-0000-000000000000"
    refusals = {
        "pop with a key this horde does not know": ("pop", "0123456789abcdefghijkl", pop_body, 401),
        "pop as a worker name another user owns": ("pop", stranger.key, pop_body, 403),
        "pop without a key": ("pop", None, pop_body, 403),
        "submit of a job no worker holds": ("submit", owner.key, {"id": unknown_job, "generation": "x", "seed": 0}, 404),
        "submit of another's job": ("submit", stranger.key, {"id": job["id"], "generation": "x", "seed": 0}, 403),
    }
    for what, (route, key, body, status) in refusals.items():
        headers = {**REQUESTS_HEADERS, **({"apikey": key} if key else {})}
        answer = live.request("POST", f"/api/v2/generate/text/{route}", headers=headers, body=body)
        assert answer.status_code == status, (what, answer.text)
        assert answer.headers["content-type"] == "application/json", what
        assert isinstance(answer.json()["message"], str) and answer.json()["message"], (what, answer.text)
    assert scribe_submit(live, owner.key, {"id": job["id"], "generation": " Hi.", "seed": 0}).status_code == 200
    # Its submit sent again (its 60 s timeout ran out before the first answer came back).
    again = scribe_submit(live, owner.key, {"id": job["id"], "generation": " Hi.", "seed": 0})
    assert again.status_code == 400 and again.json()["rc"] == "DuplicateGen" and again.json()["message"]


def test_lites_reads_at_load_are_answered_to_a_page_of_any_origin(live, make_user):
    """At load Lite reads the text models, the performance, all models and the text workers, and
    find_user with a saved key, from file:// (origin null): each answered with the header a browser
    needs to hand the page the answer."""
    owner, requester = make_user("scribe-owner"), make_user("lite-user", kudos=50)
    scribe_pop(live, owner.key, "scribe", "~unknown~kai")
    page = {"Origin": "null", "Client-Agent": "KoboldAiLite:17"}
    answers = {
        path: live.request("GET", path, headers=page)
        for path in (
            "/api/v2/status/models?type=text", "/api/v2/status/performance", "/api/v2/status/models",
            "/api/v2/workers?type=text",
        )
    }
    answers["/api/v2/find_user"] = live.request("GET", "/api/v2/find_user", headers={**page, "apikey": requester.key})
    for path, answer in answers.items():
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*", (path, answer.text)
    (text_model,) = answers["/api/v2/status/models?type=text"].json()
    assert (text_model["name"], text_model["count"], text_model["type"]) == (MODEL, 1, "text")
    assert {"performance", "queued", "eta"} <= text_model.keys()
    assert answers["/api/v2/status/models"].json() == []  # upstream's default type is image: none here
    performance = answers["/api/v2/status/performance"].json()
    assert performance["text_worker_count"] == 1 and performance["queued_text_requests"] == 0
    (worker,) = answers["/api/v2/workers?type=text"].json()
    assert (worker["name"], worker["models"], worker["max_length"]) == ("scribe", [MODEL], 80)
    assert answers["/api/v2/find_user"].json()["username"] == f"lite-user#{requester.user.pk}"


def test_at_the_default_rate_limits_the_scribes_pops_and_lites_polls_are_never_refused(live, make_user, settings):
    """The scribe pops about once a second per thread (several scribes often share one key); Lite
    polls each request every 500 ms without a key, as every other Lite page does. Neither route
    counts against the generate routes' limits, restored here to their defaults."""
    from accounts.ratelimit import reset_local_counts

    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["2/second", "90/minute"]
    settings.HORDE_API_KEY_RATE_LIMITS = ["2/second"]
    settings.HORDE_ANONYMOUS_KEY_RATE_LIMITS = ["60/second"]
    reset_local_counts()
    owner, requester = make_user("scribe-owner"), make_user("lite-user", kudos=50)
    request_id = lite_request(live, requester.key, "You: Hello\nBot:")
    for thread in range(6):  # three scribes of two threads each, within a second
        scribe_pop(live, owner.key, f"scribe-{thread % 3}", "~unknown~kai")
    for _ in range(10):
        assert lite_status(live, request_id)["faulted"] is False
