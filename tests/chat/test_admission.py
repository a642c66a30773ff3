"""Admission of text requests: validation, upfront kudos, concurrency, rate limits, errors."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from chat.models import GenerationRequest
from tests.chat.test_chat_submit import metric_reader  # noqa: F401  (fixture)

MODEL = "Gryphe/MythoMax-L2-13b"

KOBOLD_LITE_PARAMS = {
    "n": 1, "max_context_length": 2048, "max_length": 120, "rep_pen": 1.07, "temperature": 0.75, "top_p": 0.92,
    "top_k": 100, "top_a": 0, "typical": 1, "tfs": 1, "rep_pen_range": 360, "rep_pen_slope": 0.7,
    "sampler_order": [6, 0, 1, 3, 4, 2, 5], "use_default_badwordsids": False, "stop_sequence": ["You:", "\nYou "],
    "min_p": 0, "dynatemp_range": 0, "dynatemp_exponent": 1, "smoothing_factor": 0, "frmttriminc": True,
    "frmtrmblln": False, "singleline": False,
}


def test_kobold_lite_request_is_accepted_as_sent(horde, make_user):
    requester = make_user("lite")
    response = horde.client.post(
        "/api/v2/generate/text/async",
        {"prompt": "You: hi\nBot:", "params": KOBOLD_LITE_PARAMS, "models": [MODEL], "workers": []},
        format="json",
        HTTP_APIKEY=requester.key,
        HTTP_CLIENT_AGENT="KoboldAiLite:17",
    )
    assert response.status_code == 202
    request = GenerationRequest.objects.get(pk=response.json()["id"])
    assert request.client_agent == "KoboldAiLite:17"
    assert request.params["stop_sequence"] == ["You:", "\nYou "] and request.max_length == 120


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "prompt"),
        ({"prompt": "x", "params": {"n": 21}}, "params.n"),
        ({"prompt": "x", "params": {"max_length": 15}}, "params.max_length"),
        ({"prompt": "x", "params": {"max_length": 4097}}, "params.max_length"),
        ({"prompt": "x", "params": {"max_context_length": 79}}, "params.max_context_length"),
        ({"prompt": "x", "params": {"temperature": 6}}, "params.temperature"),
        ({"prompt": "x", "params": {"top_p": 0}}, "params.top_p"),
        ({"prompt": "x", "models": "not-a-list"}, "models"),
        ({"prompt": "x", "workers": ["not-a-uuid"]}, "workers[0]"),
        ({"prompt": 5, "params": []}, "params"),
    ],
)
def test_schema_failures_list_the_field(horde, make_user, body, field):
    requester = make_user("r")
    response = horde.client.post("/api/v2/generate/text/async", body, format="json", HTTP_APIKEY=requester.key)
    assert response.status_code == 400
    assert response.json()["message"] == "Input payload validation failed"
    assert field in response.json()["errors"]
    assert not GenerationRequest.objects.exists()


@pytest.mark.parametrize("dry_run", [False, True])
def test_an_empty_prompt_is_upstreams_missing_prompt(horde, make_user, dry_run):
    """Upstream's answer to `"prompt": ""` (a whitespace prompt is a prompt, as upstream's)."""
    requester = make_user("r")
    body = {"prompt": "", "dry_run": dry_run}
    response = horde.client.post("/api/v2/generate/text/async", body, format="json", HTTP_APIKEY=requester.key)
    assert (response.status_code, response.json()) == (
        400, {"message": "You cannot specify an empty prompt.", "rc": "MissingPrompt"}
    )
    assert not GenerationRequest.objects.exists()
    spaces = horde.client.post("/api/v2/generate/text/async", {"prompt": " "}, format="json", HTTP_APIKEY=requester.key)
    assert spaces.status_code == 202, spaces.content


def test_unparseable_body_is_a_validation_failure(horde):
    response = horde.client.post("/api/v2/generate/text/async", "{not json", content_type="application/json")
    assert response.status_code == 400 and response.json()["message"] == "Input payload validation failed"


def test_a_request_no_online_worker_can_serve_is_queued_with_upstreams_warning(horde, make_user):
    requester = make_user("r")
    queued = horde.text_async(requester.key, models=["koboldcpp/unserved-model"])
    assert queued.status_code == 202
    assert set(queued.json()) == {"id", "kudos", "message"}
    assert queued.json()["message"] == (
        "Warning: No available workers can fulfill this request. It will expire in 20 minutes. "
        "Consider reducing the amount of tokens to generate."
    )
    assert GenerationRequest.objects.filter(pk=queued.json()["id"], jobs_waiting=1).exists()
    _serving_worker(horde, make_user)
    served = horde.text_async(requester.key, models=[MODEL])
    assert served.status_code == 202 and set(served.json()) == {"id", "kudos"}


def test_defaults_match_upstream(horde, make_user):
    requester = make_user("r")
    request_id = horde.text_async(requester.key, prompt="x").json()["id"]
    request = GenerationRequest.objects.get(pk=request_id)
    assert (request.n, request.max_length, request.max_context_length) == (1, 80, 2048)
    # validated_backends defaults to false, as upstream's request parser has it (ADR 0012).
    assert (request.validated_backends, request.slow_workers, request.trusted_workers) == (False, True, False)


def test_anonymous_requests_work_without_a_key(horde):
    response = horde.text_async(None, models=[MODEL])
    assert response.status_code == 202
    assert horde.text_async("0000000000", models=[MODEL]).status_code == 202


def test_invalid_key_is_401(horde):
    response = horde.text_async("wrong-key")
    assert response.status_code == 401 and response.json()["rc"] == "InvalidAPIKey"


def _serving_worker(horde, make_user, **pop) -> str:
    """A worker online for MODEL up to 1024 tokens (registered by an empty pop); its id."""
    answer = horde.pop(make_user("serving-owner").key, name="serving", max_length=1024, **pop)
    assert answer.status_code == 200 and answer.json()["id"] is None, answer.json()
    from workers.models import Worker

    return str(Worker.objects.get(name="serving").id)


def test_request_above_the_free_output_floor_needs_kudos_upfront(allowance_at_the_floor, horde, make_user):
    poor = make_user("poor", kudos=5)
    _serving_worker(horde, make_user)
    refused = horde.text_async(poor.key, models=[MODEL], params={"max_length": 1024})
    assert refused.status_code == 403 and refused.json()["rc"] == "KudosUpfront"
    assert "512 tokens" in refused.json()["message"]
    assert not GenerationRequest.objects.exists()
    assert poor.refresh().kudos == Decimal("5")


def test_allow_downgrade_lowers_to_the_floor(allowance_at_the_floor, horde, make_user, caplog):
    poor = make_user("poor", kudos=5)
    _serving_worker(horde, make_user)  # without one, the answer's message is the no-worker warning
    with caplog.at_level("INFO", logger="chat.services.create_text"):
        response = horde.text_async(poor.key, models=[MODEL], params={"max_length": 1024}, allow_downgrade=True)
    assert response.status_code == 202
    assert "downgraded" in response.json()["message"]
    assert GenerationRequest.objects.get(pk=response.json()["id"]).max_length == 512
    # The downgrade log line beside the downgraded outcome.
    assert [r.getMessage() for r in caplog.records if "downgraded" in r.getMessage()] == [
        f"text request of user {poor.user.pk} downgraded from 1024 to 512 tokens: 5.00 kudos available"
    ]


@pytest.mark.parametrize("why", ["no_worker", "too_short", "slow_workers_false"])
def test_a_kudos_refusal_no_online_worker_could_serve_is_no_eligible_worker(horde, make_user, why):
    """Kudos do not help a request no online worker can serve: 403 NoEligibleWorker in place of
    KudosUpfront, and nothing created or charged."""
    poor = make_user("poor", kudos=5)
    if why == "too_short":
        horde.pop(make_user("o").key, name="short", max_length=512)  # online, but not for 1024 tokens
    body = {"params": {"max_length": 1024}} if why != "slow_workers_false" else {"slow_workers": False}
    refused = horde.text_async(poor.key, models=[MODEL], **body)
    assert refused.status_code == 403, refused.json()
    assert refused.json() == {"message": "No online worker can serve this request.", "rc": "NoEligibleWorker"}
    assert not GenerationRequest.objects.exists()
    user = poor.refresh()
    assert (user.kudos, user.kudos_held) == (Decimal("5"), Decimal("0"))


def test_a_listed_request_is_not_downgraded_when_worker_lists_hold_upfront(allowance_at_the_floor, horde, make_user, settings):
    """HORDE_UPFRONT_KUDOS_ON_WORKERLIST: a request that lists workers holds its kudos upfront and
    cannot be downgraded, allow_downgrade or not."""
    settings.HORDE_UPFRONT_KUDOS_ON_WORKERLIST = True
    poor = make_user("poor", kudos=5)
    worker_id = _serving_worker(horde, make_user)
    body = {"models": [MODEL], "params": {"max_length": 1024}, "allow_downgrade": True, "workers": [worker_id]}
    refused = horde.text_async(poor.key, **body)
    assert refused.status_code == 403 and refused.json()["rc"] == "KudosUpfront"
    assert not GenerationRequest.objects.exists()
    # A request at the floor that lists workers holds its kudos as well.
    rich = make_user("rich", kudos=1000)
    listed = horde.text_async(rich.key, models=[MODEL], params={"max_length": 64}, workers=[worker_id])
    assert listed.status_code == 202
    assert rich.refresh().kudos_held == Decimal(str(listed.json()["kudos"]))
    # Without the setting the same request is lowered to the floor.
    settings.HORDE_UPFRONT_KUDOS_ON_WORKERLIST = False
    lowered = horde.text_async(poor.key, **body)
    assert lowered.status_code == 202
    assert GenerationRequest.objects.get(pk=lowered.json()["id"]).max_length == 512


def test_upfront_kudos_are_held_and_released_as_generations_settle(horde, make_user):
    rich, owner = make_user("rich", kudos=1000), make_user("owner")
    response = horde.text_async(rich.key, models=[MODEL], params={"max_length": 1024})
    assert response.status_code == 202
    quote = Decimal(str(response.json()["kudos"]))
    assert rich.refresh().kudos_held == quote
    job = horde.pop(owner.key, max_length=1024).json()
    horde.submit(owner.key, job["id"], "short")
    assert rich.refresh().kudos_held == 0


def test_slow_workers_false_always_holds_upfront(horde, make_user):
    poor = make_user("poor", kudos=1)
    _serving_worker(horde, make_user)
    refused = horde.text_async(poor.key, models=[MODEL], slow_workers=False)
    assert refused.status_code == 403 and refused.json()["rc"] == "KudosUpfront"


def test_concurrency_limit_counts_waiting_jobs(horde, make_user):
    requester = make_user("r")
    assert horde.text_async(requester.key, params={"n": 20}).status_code == 202
    assert horde.text_async(requester.key, params={"n": 10}).status_code == 202
    refused = horde.text_async(requester.key, params={"n": 1})
    assert refused.status_code == 429 and refused.json()["rc"] == "TooManyPrompts"
    assert refused.json()["message"] == "Parallel requests (31) exceeded user limit (30)."


def test_anonymous_concurrency_counts_the_requests_for_the_models_asked(horde, settings):
    """The anonymous account is everyone without a key (KoboldAI Lite's default): as upstream, its
    limit counts its waiting jobs that ask for the same models, so one model's crowd does not lock
    anonymous users out of every model. The refusal says so."""
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["1000/second"]
    anonymous = "0000000000"
    assert horde.text_async(anonymous, models=[MODEL], params={"n": 20}).status_code == 202
    assert horde.text_async(anonymous, models=[MODEL, "other/model"], params={"n": 10}).status_code == 202
    refused = horde.text_async(anonymous, models=[MODEL], params={"n": 1})
    assert refused.status_code == 429, refused.content
    assert refused.json() == {
        "message": "Too many anonymous requests on using the horde currently (31/30). "
        "Please consider getting a personal API key, which will also provide higher priority.",
        "rc": "TooManyPrompts",
    }
    assert horde.text_async(anonymous, models=["other/model"], params={"n": 20}).status_code == 202
    assert horde.text_async(anonymous, models=["third/model"], params={"n": 20}).status_code == 202
    # A request naming no model counts every waiting anonymous job.
    assert horde.text_async(anonymous, params={"n": 1}).json()["rc"] == "TooManyPrompts"


def test_rate_limit_per_address(horde, make_user, settings):
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["2/second", "90/minute"]
    requester = make_user("r")
    responses = [horde.text_async(requester.key) for _ in range(5)]
    codes = [r.status_code for r in responses]
    # Five in well under a second: at most two per window, and a burst spans at most two windows.
    assert codes[0] == 202 and codes.count(202) <= 4 and set(codes) == {202, 429}
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.json()["rc"] == "RateLimited" and int(limited["Retry-After"]) >= 1
    other_address = horde.client.post(
        "/api/v2/generate/text/async", {"prompt": "x"}, format="json", REMOTE_ADDR="10.0.0.9", HTTP_APIKEY=requester.key
    )
    assert other_address.status_code == 202


def test_rate_limit_per_minute_is_settable(horde, make_user, settings):
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["1000/second", "3/minute"]
    requester = make_user("r")
    codes = [horde.text_async(requester.key).status_code for _ in range(7)]
    assert codes[0] == 202 and codes.count(202) <= 6 and 429 in codes


def test_find_user(horde, make_user):
    user = make_user("alice", kudos=42, trusted=True)
    body = horde.client.get("/api/v2/find_user", HTTP_APIKEY=user.key).json()
    assert body["username"] == f"alice#{user.user.pk}" and body["kudos"] == 42.0 and body["trusted"] is True
    anonymous = horde.client.get("/api/v2/find_user", HTTP_APIKEY="0000000000").json()
    assert anonymous["username"].startswith("Anonymous#")
    assert horde.client.get("/api/v2/find_user", HTTP_APIKEY="nope").status_code == 401


def test_status_routes(horde):
    assert horde.client.get("/api/v2/status/heartbeat").status_code == 200
    performance = horde.client.get("/api/v2/status/performance").json()
    assert performance["queued_text_requests"] == 0 and "text_worker_count" in performance
    assert horde.client.get("/api/v2/status/models").json() == []
    assert horde.client.get("/api/v2/status/models?type=sound").json()["rc"] == "BadRequest"


@pytest.mark.parametrize("value", ["--1", "-", "1.5", "x", "1e3", "--", "0x1"])
def test_status_models_count_filters_refuse_what_is_not_a_whole_number(horde, value):
    # "--1" passed a check that stripped every leading "-", then int() raised: a 500.
    for name in ("min_count", "max_count"):
        response = horde.client.get(f"/api/v2/status/models?type=text&{name}={value}")
        assert response.status_code == 400 and response.json()["rc"] == "BadRequest", (name, value)
    assert horde.client.get("/api/v2/status/models?type=text&min_count=-1&max_count=0").json() == []


def test_browser_preflight_and_cors_headers(horde):
    preflight = horde.client.options(
        "/api/v2/generate/text/async",
        HTTP_ORIGIN="null",
        HTTP_ACCESS_CONTROL_REQUEST_METHOD="POST",
        HTTP_ACCESS_CONTROL_REQUEST_HEADERS="apikey, client-agent, content-type",
    )
    assert preflight.status_code == 200
    assert preflight["Access-Control-Allow-Origin"] == "*"
    allowed = preflight["Access-Control-Allow-Headers"].lower()
    assert all(h in allowed for h in ("apikey", "client-agent", "content-type", "authorization"))
    # A header the policy does not list is allowed when asked for, and named once with the rest.
    asked = horde.client.options(
        "/api/v2/generate/text/async",
        HTTP_ORIGIN="null",
        HTTP_ACCESS_CONTROL_REQUEST_METHOD="POST",
        HTTP_ACCESS_CONTROL_REQUEST_HEADERS="ApiKey, X-Custom, x-custom",
    )
    assert asked["Access-Control-Allow-Headers"] == (
        "apikey, client-agent, content-type, authorization, x-stainless-retry-count, X-Custom"
    )
    assert "DELETE" in preflight["Access-Control-Allow-Methods"]
    assert horde.client.get("/api/v2/status/heartbeat", HTTP_ORIGIN="null")["Access-Control-Allow-Origin"] == "*"
    missing = horde.client.get("/api/v2/nothing-here", HTTP_ORIGIN="null")
    assert missing.status_code == 404 and missing.json()["message"]
    # Error answers carry the header too: a browser client reads their message.
    invalid = horde.client.post(
        "/api/v2/generate/text/async", {"prompt": ""}, format="json", HTTP_ORIGIN="null"
    )
    wrong_key = horde.client.post(
        "/api/v2/generate/text/async", {"prompt": "x"}, format="json", HTTP_ORIGIN="null", HTTP_APIKEY="wrong-key"
    )
    assert (invalid.status_code, wrong_key.status_code) == (400, 401)
    for answer in (missing, invalid, wrong_key):
        assert answer["Access-Control-Allow-Origin"] == "*"


def _lite_preflight(horde, path: str, method: str):
    """The preflight a browser sends before KoboldAI Lite's call (from file://, origin null)."""
    preflight = horde.client.options(
        path,
        HTTP_ORIGIN="null",
        HTTP_ACCESS_CONTROL_REQUEST_METHOD=method,
        HTTP_ACCESS_CONTROL_REQUEST_HEADERS="apikey, client-agent, content-type",
    )
    assert preflight.status_code == 200
    assert preflight["Access-Control-Allow-Origin"] == "*"
    methods = {m.strip().upper() for m in preflight["Access-Control-Allow-Methods"].split(",")}
    assert method in methods
    named = [h.strip().lower() for h in preflight["Access-Control-Allow-Headers"].split(",")]
    assert {"apikey", "client-agent", "content-type"} <= set(named)
    assert len(named) == len(set(named))  # each header named once


def test_kobold_lite_find_user_preflight(horde, make_user):
    user = make_user("lite")
    _lite_preflight(horde, "/api/v2/find_user", "GET")
    answer = horde.client.get("/api/v2/find_user", HTTP_ORIGIN="null", HTTP_APIKEY=user.key)
    assert answer.status_code == 200 and answer["Access-Control-Allow-Origin"] == "*"


def test_kobold_lite_abort_preflight(horde, make_user):
    requester = make_user("lite", kudos=100)
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    path = f"/api/v2/generate/text/status/{request_id}"
    _lite_preflight(horde, path, "DELETE")
    answer = horde.client.delete(path, HTTP_ORIGIN="null", HTTP_APIKEY=requester.key, HTTP_CLIENT_AGENT="KoboldAiLite:17")
    assert answer.status_code == 200 and answer["Access-Control-Allow-Origin"] == "*"
    assert GenerationRequest.objects.get(pk=request_id).cancelled


def test_a_horde_without_anonymous_access_refuses_keyless_requests(horde, settings):
    settings.HORDE_ALLOW_ANONYMOUS = False
    refused = horde.text_async(None)
    assert refused.status_code == 403 and refused.json()["rc"] == "AnonForbidden"
    assert horde.text_async("0000000000").status_code == 403


def test_new_users_get_the_default_concurrency(make_user, settings):
    settings.HORDE_DEFAULT_CONCURRENCY = 5
    assert make_user("limited").user.concurrency == 5


def _points(reader, name: str) -> dict[tuple, object]:
    """{sorted attribute items: the point} of one instrument."""
    data = reader.get_metrics_data()
    points: dict[tuple, object] = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        points[tuple(sorted(point.attributes.items()))] = point
    return points


def _decision(outcome: str, requested: str, *, requester: str = "registered", chat: bool = False) -> tuple:
    return tuple(
        sorted(
            {
                "horde.requester": requester,
                "horde.outcome": outcome,
                "horde.requested_bucket": requested,
                "horde.allowance_bucket": "<=512",
                "horde.chat": chat,
            }.items()
        )
    )


def test_each_creation_records_how_the_allowance_admitted_it(allowance_at_the_floor, horde, make_user, metric_reader):  # noqa: F811
    poor, rich = make_user("poor", kudos=5), make_user("rich", kudos=1000)
    _serving_worker(horde, make_user)
    assert horde.text_async(None, models=[MODEL], params={"max_length": 80}).status_code == 202
    assert horde.text_async(rich.key, models=[MODEL], params={"max_length": 1024}).status_code == 202
    assert horde.text_async(poor.key, models=[MODEL], params={"max_length": 2048}).status_code == 403
    lowered = horde.text_async(poor.key, models=[MODEL], params={"max_length": 1024}, allow_downgrade=True)
    assert lowered.status_code == 202
    assert horde.text_async(poor.key, models=[MODEL], params={"max_length": 1024}, dry_run=True).status_code == 200
    counts = {key: point.value for key, point in _points(metric_reader, "horde.text.free_allowance.decisions").items()}
    assert counts == {
        _decision("free", "<=512", requester="anonymous"): 1,
        _decision("funded", "513-1024"): 1,
        _decision("refused", "1025-2048"): 1,
        _decision("downgraded", "513-1024"): 1,  # the bucket it asked for, before the downgrade
    }


def test_each_assignment_records_its_wait_from_the_request_creation(horde, make_user, metric_reader):  # noqa: F811
    owner = make_user("owner")
    request_id = horde.text_async(None, models=[MODEL], params={"max_length": 200, "n": 2}).json()["id"]
    GenerationRequest.objects.filter(pk=request_id).update(created=timezone.now() - timedelta(seconds=30))
    job = horde.pop(owner.key, max_length=1024, amount=2).json()
    assert len(job["ids"]) == 2
    points = _points(metric_reader, "horde.text.queue_wait_seconds")
    key = tuple(
        sorted({"horde.requester": "anonymous", "horde.chat": False, "horde.requested_bucket": "<=512"}.items())
    )
    assert list(points) == [key]
    assert points[key].count == 2 and 60 <= points[key].sum < 70


def test_performance_counts_the_tokens_generated_in_the_last_minute(horde, make_user):
    """KoboldAI Lite shows "A total of N tokens were generated in the last minute" from it."""
    from datetime import timedelta

    from django.core.cache import cache
    from django.utils import timezone

    from chat.models import Generation
    from chat.selectors.models import PAST_MINUTE_TOKENS_CACHE_KEY
    from chat.services.pop_cache import queue_grew

    requester, owner = make_user("r", kudos=1000), make_user("o")
    for _ in range(2):
        assert horde.text_async(requester.key, models=[MODEL]).status_code == 202
    queue_grew()
    first, second = (horde.pop(owner.key).json()["id"] for _ in range(2))
    assert horde.submit(owner.key, first, "x" * 400).status_code == 200  # 100 tokens by the estimate
    assert horde.submit(owner.key, second, "y" * 81).status_code == 200  # 21
    assert horde.client.get("/api/v2/status/performance").json()["past_minute_tokens"] == 121
    # Read at most every few seconds; a worker's own count is not taken; a minute later none counts.
    Generation.objects.filter(pk=second).update(completion_tokens=100_000)
    Generation.objects.filter(pk=first).update(finished_at=timezone.now() - timedelta(seconds=61))
    assert horde.client.get("/api/v2/status/performance").json()["past_minute_tokens"] == 121
    cache.delete(PAST_MINUTE_TOKENS_CACHE_KEY)
    assert horde.client.get("/api/v2/status/performance").json()["past_minute_tokens"] == 21


def test_user_details_by_id_show_private_ids_to_the_user_and_moderators(horde, make_user):
    alice, bob, moderator = make_user("alice", kudos=42), make_user("bob"), make_user("mod", moderator=True)
    assert horde.pop(alice.key, name="alice-worker").status_code == 200
    path = f"/api/v2/users/{alice.user.pk}"
    public = horde.client.get(path).json()
    assert public["username"] == f"alice#{alice.user.pk}" and public["kudos"] == 42.0
    assert public["worker_count"] == 1 and "worker_ids" not in public and "sharedkey_ids" not in public
    assert "worker_ids" not in horde.client.get(path, HTTP_APIKEY=bob.key).json()
    for key in (alice.key, moderator.key):
        private = horde.client.get(path, HTTP_APIKEY=key).json()
        own = horde.client.get("/api/v2/find_user", HTTP_APIKEY=alice.key).json()
        assert abs(private.pop("account_age") - own.pop("account_age")) <= 1 and private == own
        assert len(private["worker_ids"]) == 1
    for missing, message in (
        ("99999999", "User with ID '99999999' not found."),
        ("alice#1", "Please use only the numerical part of the userID. E.g. the '1' in 'db0#1'"),
        ("9" * 30, f"User with ID '{'9' * 30}' not found."),
        ("%C2%B2", "Please use only the numerical part of the userID. E.g. the '1' in 'db0#1'"),  # "²"
        ("%D9%A1", "Please use only the numerical part of the userID. E.g. the '1' in 'db0#1'"),  # Arabic "1"
    ):
        answer = horde.client.get(f"/api/v2/users/{missing}")
        assert (answer.status_code, answer.json()) == (404, {"message": message, "rc": "UserNotFound"})
    assert horde.client.get(path, HTTP_APIKEY="not-a-key").status_code == 401


def test_user_details_by_id_stay_public_where_anonymous_requests_are_refused(horde, make_user, settings):
    settings.HORDE_ALLOW_ANONYMOUS = False
    alice = make_user("alice")
    assert horde.client.get("/api/v2/find_user").status_code == 403
    public = horde.client.get(f"/api/v2/users/{alice.user.pk}")
    assert public.status_code == 200 and "worker_ids" not in public.json()
    assert horde.client.get("/api/v2/users/99999999").json()["rc"] == "UserNotFound"


def test_the_users_list_pages_through_everyone_richest_or_oldest_first(horde, make_user):
    from django.core.cache import cache

    from accounts.models import HordeUser

    made = [make_user(f"u{i}", kudos=i * 10) for i in range(30)]
    assert horde.pop(made[29].key, name="richest-worker").status_code == 200
    everyone = HordeUser.objects.count()
    first = horde.client.get("/api/v2/users").json()
    assert len(first) == 25 and first[0]["username"] == f"u29#{made[29].user.pk}"
    assert first[0]["kudos"] == 290.0 and first[0]["worker_count"] == 1
    assert [u["kudos"] for u in first] == sorted((u["kudos"] for u in first), reverse=True)
    assert set(first[0]) == {
        "username", "id", "kudos", "trusted", "moderator", "concurrency", "worker_count", "account_age"
    }
    second = horde.client.get("/api/v2/users?page=2").json()
    assert len(second) == everyone - 25 and not {u["id"] for u in first} & {u["id"] for u in second}
    by_age = horde.client.get("/api/v2/users?sort=age").json()
    assert [u["id"] for u in by_age] == sorted(u["id"] for u in by_age)  # made in id order
    assert horde.client.get("/api/v2/users?page=0&sort=nonsense").json() == first  # upstream's reading
    assert horde.client.get("/api/v2/users?page=10001").json() == []
    assert horde.client.get("/api/v2/users?page=two").json()["rc"] == "BadRequest"
    # A page is read at most every 10 s, as upstream caches it.
    HordeUser.objects.filter(pk=made[0].user.pk).update(kudos=10_000)
    assert horde.client.get("/api/v2/users").json() == first
    cache.clear()
    assert horde.client.get("/api/v2/users").json()[0]["id"] == made[0].user.pk
