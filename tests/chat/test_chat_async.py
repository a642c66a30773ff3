"""POST /api/v2/generate/chat/async: the submission order (steps 1-8), mapping, known models,
worker_max_length, context sizing, the flattened prompt, pricing and the refusals."""

from __future__ import annotations

import io
import json
from decimal import Decimal

import pytest

from accounts.models import KudosTransaction
from chat.models import GenerationRequest, RequestWorker
from chat.pricing import text_request_quote
from chat.services.create_chat import (
    estimate_chat_prompt_tokens,
    flatten_messages,
)
from contract.chat_limits import MAX_CHAT_BODY_BYTES
from contract.chat_policy import kudos_cap_message
from tests.chat.chat_route_helpers import (
    BIG_MODEL,
    CHAT_ASYNC,
    MODEL,
    SMALL_MODEL,
    chat_async,
    chat_body,
    chat_status,
    chat_worker,
)
from tests.chat.pop_helpers import chat_pop
from tests.chat.test_chat_submit import counter_points, metric_reader  # noqa: F401  (fixture)

TOOLS = [{"type": "function", "function": {"name": "lookup_weather", "parameters": {"type": "object"}}}]


@pytest.fixture
def owner(make_user):
    return make_user("owner")


@pytest.fixture
def served(owner):
    return chat_worker(owner)


# --- 202 and what is stored ---------------------------------------------------------------------


def test_chat_request_is_queued_with_its_mapping(horde, make_user, served):
    requester = make_user("r", kudos=50)
    response = chat_async(
        horde.client,
        requester.key,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        ],
        temperature=1,
        top_p=0.9,
        seed=7,
        stop="END",
        stream=True,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        horde={"conformance": "strict"},
    )
    assert response.status_code == 202, response.json()
    body = response.json()
    assert set(body) == {"id", "kudos", "message", "warnings"}
    assert body["message"] is None and body["warnings"] == []
    request = GenerationRequest.objects.get(pk=body["id"])
    assert request.is_chat and request.n == 1 and request.max_length == 512
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
    ]
    assert request.params == {"temperature": 1.0, "top_p": 0.9, "seed": 7, "stop_sequence": ["END"]}
    assert request.chat_extras == {
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stream_progress": True,
    }
    assert request.chat_required_features == sorted(
        ["seed", "tools", "prompt_overflow_refused", "tool_choice_enforced"]
    )
    assert request.chat_required_mask != 0
    assert request.chat_conformance == "strict" and request.chat_tools_temperature == 1.0
    assert request.chat_has_images is False and request.context_adjustments is None
    # Chat defaults: validated_backends and trusted_workers false, slow workers allowed.
    assert (request.validated_backends, request.trusted_workers, request.slow_workers) == (False, False, True)
    tools_json = json.dumps(TOOLS, separators=(",", ":"))
    assert request.prompt == f"system: Be brief.\nuser: Weather?\n{tools_json}"
    assert request.submitted_prompt == request.prompt
    assert Decimal(str(body["kudos"])) == request.kudos_quote
    tax = KudosTransaction.objects.get(user=requester.user, kind="horde_tax", request_id=request.id)
    assert tax.amount == Decimal("-1")


def test_horde_only_and_ignore_become_the_worker_list(horde, make_user, served):
    requester = make_user("r")
    ok = chat_async(horde.client, requester.key, horde={"only": [str(served.id)]})
    request = GenerationRequest.objects.get(pk=ok.json()["id"])
    assert (request.has_worker_list, request.worker_blacklist) == (True, False)
    assert list(RequestWorker.objects.filter(request=request).values_list("worker_id", flat=True)) == [served.id]
    ignored = chat_async(horde.client, requester.key, horde={"ignore": [str(served.id)]})
    request = GenerationRequest.objects.get(pk=ignored.json()["id"])
    assert (request.has_worker_list, request.worker_blacklist) == (True, True)
    # Nobody can serve it: the usual warning, and the status reports is_possible.
    warning = (  # upstream's WarningMessage.NoAvailableWorker, word for word
        "Warning: No available workers can fulfill this request. It will expire in 20 minutes unless a worker "
        "appears. Please confider reducing its size of the request or choosing a different model."
    )
    assert ignored.json()["message"] == warning
    assert ignored.json()["warnings"] == [{"code": "NoAvailableWorker", "message": warning}]


# --- step 1: body size --------------------------------------------------------------------------


def test_declared_length_over_the_cap_is_413_before_parsing(horde, make_user):
    requester = make_user("r")
    response = horde.client.generic(
        "POST",
        CHAT_ASYNC,
        b"{not even json",
        content_type="application/json",
        CONTENT_LENGTH=str(MAX_CHAT_BODY_BYTES + 1),
        HTTP_APIKEY=requester.key,
    )
    assert response.status_code == 413
    assert response.json() == {
        "message": f"The request body is over {MAX_CHAT_BODY_BYTES} bytes.",
        "rc": "RequestTooLarge",
    }


def test_chunked_body_is_read_only_one_byte_past_the_cap():
    from chat.api.chat_views import read_chat_request_body

    class Endless(io.RawIOBase):
        """A body without a declared length that never ends; counts what was read."""

        read_bytes = 0

        def read(self, size=-1):
            self.read_bytes += size
            return b"x" * size

    class ChunkedRequest:
        META: dict = {}
        stream = Endless()

        def read(self, size):
            return self.stream.read(size)

    request = ChunkedRequest()
    with pytest.raises(Exception) as refused:
        read_chat_request_body(request)
    assert refused.value.rc == "RequestTooLarge" and refused.value.status == 413
    assert request.stream.read_bytes == MAX_CHAT_BODY_BYTES + 1


def test_unparseable_body_is_a_validation_failure(horde):
    response = horde.client.post(CHAT_ASYNC, "{nope", content_type="application/json")
    assert response.status_code == 400 and response.json()["message"] == "Input payload validation failed"


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-" + "9" * 400 + ".5"])
def test_a_non_finite_number_is_a_validation_failure_and_queues_nothing(horde, make_user, number):
    """Where nothing else reads a number (a tool's parameters), it reached the worker as null."""
    requester = make_user("non-finite", kudos=100)
    tool = '{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": ' + number + "}}}"
    raw = '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "tools": [' + tool + "]}"
    response = horde.client.post(CHAT_ASYNC, raw, content_type="application/json", HTTP_APIKEY=requester.key)
    assert response.status_code == 400 and response.json()["message"] == "Input payload validation failed"
    assert response.json()["errors"]["payload"].startswith("The body is not valid JSON: ")
    assert not GenerationRequest.objects.filter(user=requester.user).exists()


# --- step 2: the contract's refusals, as {message, rc} ------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "rc", "message"),
    [
        (
            chat_body(logprobs=True),
            400,
            "UnsupportedChatParameter",
            "'logprobs': Unrecognized request argument supplied: logprobs",
        ),
        (chat_body(n=2), 400, "UnsupportedChatParameter", "'n': Unsupported value: 'n' is 2; only n=1 is supported."),
        (
            {"model": MODEL, "models": [MODEL], "messages": [{"role": "user", "content": "x"}]},
            400,
            "ChatRequestConflict",
            "'models': Send one of 'model' and 'models', not both.",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            400,
            "BadRequest",
            "'model': A chat request needs 'model' or 'models'.",
        ),
        (
            chat_body(max_tokens=100, max_completion_tokens=200),
            400,
            "ChatRequestConflict",
            "'max_completion_tokens': 'max_tokens' and 'max_completion_tokens' differ; send one of them.",
        ),
        (
            chat_body(horde={"models": ["x"]}),
            400,
            "UnsupportedChatParameter",
            "'horde.models': Unknown parameter: 'horde.models'.",
        ),
        (
            chat_body(tool_choice="auto"),
            400,
            "ChatRequestConflict",
            "'tool_choice': Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
            "specified.",
        ),
        (
            chat_body(
                tools=TOOLS,
                messages=[
                    {"role": "user", "content": "Weather?"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "call_1", "type": "function", "function": {"name": "lookup_weather", "arguments": "{}"}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                    {"role": "tool", "tool_call_id": "call_9", "content": "rain"},
                ],
            ),
            400,
            "UnsupportedChatParameter",
            "'messages[3].role': Invalid parameter: messages with role 'tool' must be a response to a preceding "
            "message with 'tool_calls'.",
        ),
        (
            chat_body(
                tools=TOOLS,
                messages=[
                    {"role": "user", "content": "Weather?"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "call_1", "type": "function", "function": {"name": "lookup_weather", "arguments": "{}"}},
                            {"id": "call_2", "type": "function", "function": {"name": "lookup_weather", "arguments": "{}"}},
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                    {"role": "tool", "tool_call_id": "call_9", "content": "rain"},
                ],
            ),
            400,
            "UnsupportedChatParameter",
            "'messages[3].tool_call_id': Invalid parameter: 'tool_call_id' of 'call_9' not found in 'tool_calls' "
            "of previous message.",
        ),
        # A content part outside its role's types names the role with its article.
        (
            chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "input_audio", "input_audio": {}}]}]),
            400,
            "UnsupportedChatParameter",
            "'messages[0].content[1].type': Unsupported value: messages[0].content[1].type=input_audio is not "
            "supported on a user message.",
        ),
        (
            chat_body(messages=[{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "https://example.org/a.png"}}]}]),
            400,
            "UnsupportedChatParameter",
            "'messages[1].content[0].type': Unsupported value: messages[1].content[0].type=image_url is not "
            "supported on an assistant message.",
        ),
    ],
)
def test_contract_refusals_use_the_native_body(horde, make_user, served, body, status, rc, message):
    requester = make_user("r")
    response = horde.client.post(CHAT_ASYNC, body, format="json", HTTP_APIKEY=requester.key)
    assert response.status_code == status
    assert response.json() == {"message": message, "rc": rc}
    assert not GenerationRequest.objects.exists()


def test_mapped_params_are_validated_as_text_params(horde, make_user, served):
    requester = make_user("r")
    response = chat_async(horde.client, requester.key, top_p=0)
    assert response.status_code == 400
    assert response.json()["message"] == "Input payload validation failed"
    assert "top_p" in response.json()["errors"]
    assert not GenerationRequest.objects.exists()


@pytest.mark.parametrize(
    "chat, native",
    [
        ({"temperature": 6}, {"temperature": 6}),
        ({"temperature": 5.5, "top_p": 0.0001}, {"temperature": 5.5, "top_p": 0.0001}),
    ],
)
def test_mapped_params_are_refused_as_the_text_route_refuses_them(horde, make_user, served, chat, native):
    """The chat route holds its mapped params to the text params' ranges (contract.text), with the
    text route's words, at the path the chat body has for them."""
    requester = make_user("r")
    text = horde.text_async(requester.key, params=native)
    assert text.status_code == 400
    expected = {key.removeprefix("params."): message for key, message in text.json()["errors"].items()}
    response = chat_async(horde.client, requester.key, **chat)
    assert response.status_code == 400
    assert response.json() == {"errors": expected, "message": "Input payload validation failed"}
    assert not GenerationRequest.objects.exists()


def test_stop_sequences_follow_upstreams_rule_on_the_text_route_and_openais_on_the_chat_route(
    horde, make_user, served
):
    """The text route takes what KoboldAI Lite and SillyTavern send, as upstream does: an empty
    instruct tag (dropped: it stops nothing) and a large group's names (up to 128 distinct, 2000
    characters in all). The chat route's `stop` keeps its OpenAI-shaped bound."""
    requester = make_user("r")
    group = [f"\nMember {i}:" for i in range(40)]
    accepted = horde.text_async(requester.key, params={"stop_sequence": ["", "### Response:", *group]})
    assert accepted.status_code == 202, accepted.json()
    stored = GenerationRequest.objects.get(pk=accepted.json()["id"]).params["stop_sequence"]
    assert stored == ["### Response:", *group]
    refusals = (
        ([f"s{i}" for i in range(129)], "TooManyStopSequences", "Too many stop sequences specified (max allowed is 128)."),
        (
            ["x" * 1500, "y" * 501],
            "ExcessiveStopSequence",
            "Your total stop sequence length exceeds the allowed limit (2000 chars).",
        ),
    )
    for stops, rc, message in refusals:
        refused = horde.text_async(requester.key, params={"stop_sequence": stops})
        assert refused.status_code == 400
        assert refused.json() == {"message": message, "rc": rc}
    # The same 128 under a repeat: upstream counts distinct sequences.
    assert horde.text_async(requester.key, params={"stop_sequence": ["a"] * 200}).status_code == 202
    for stop, errors in (
        (["", "ok"], {"stop_sequence[0]": "This field may not be blank."}),
        ([str(i) for i in range(33)], {"stop_sequence": "Ensure this field has no more than 32 elements."}),
    ):
        response = chat_async(horde.client, requester.key, stop=stop)
        assert response.status_code == 400
        assert response.json() == {"errors": errors, "message": "Input payload validation failed"}


def test_text_params_upstream_refuses_are_refused_with_its_rc(horde, make_user, served):
    """Upstream's validate_text_params: more tokens than the context, or a custom sampler order
    that leaves samplers out, is a 400 with its rc and message, dry run or not, and nothing is
    queued or charged."""
    requester = make_user("r", kudos=100)
    refusals = (
        (
            {"max_length": 4096},  # over the default context of 2048
            {"message": "You cannot request more tokens than your context length.", "rc": "TokenOverflow"},
        ),
        (
            {"max_length": 512, "max_context_length": 256},
            {"message": "You cannot request more tokens than your context length.", "rc": "TokenOverflow"},
        ),
        (
            {"sampler_order": [6, 0, 1, 3, 4, 2, 2]},  # six distinct of seven
            {
                "message": "When sending a custom sampler order, you need to specify all possible samplers in the order",
                "rc": "MissingFullSamplerOrder",
            },
        ),
    )
    for params, body in refusals:
        for dry_run in (False, True):
            refused = horde.text_async(requester.key, params=params, dry_run=dry_run)
            assert (refused.status_code, refused.json()) == (400, body)
    assert not GenerationRequest.objects.exists()
    requester.user.refresh_from_db()
    assert requester.user.kudos == 100
    # At the bound, and KoboldAI Lite's full order, are taken.
    for params in ({"max_length": 2048, "max_context_length": 2048}, {"sampler_order": [6, 0, 1, 3, 4, 2, 5]}):
        assert horde.text_async(requester.key, params=params).status_code == 202


def test_nul_in_text_is_replaced_not_a_500(horde, make_user, served):
    requester = make_user("r")
    response = chat_async(horde.client, requester.key, messages=[{"role": "user", "content": "a\x00b"}])
    assert response.status_code == 202
    assert GenerationRequest.objects.get().messages[0]["content"] == "a\ufffdb"


# --- steps 4-5: admission flag, maintenance, concurrency -----------------------------------------


def test_admission_flag_refuses_new_requests_and_dry_runs(horde, make_user, served, settings):
    settings.HORDE_CHAT_ADMISSION_ENABLED = False
    requester = make_user("r")
    for body in ({}, {"horde": {"dry_run": True}}):
        response = chat_async(horde.client, requester.key, **body)
        assert response.status_code == 503
        assert response.json() == {
            "message": "This horde is not accepting new chat requests at the moment.",
            "rc": "ChatAdmissionDisabled",
        }
    # The text route is not gated.
    assert horde.text_async(requester.key).status_code == 202


def test_maintenance_mode_refuses(horde, make_user, served, settings):
    settings.HORDE_MAINTENANCE = True
    response = chat_async(horde.client, make_user("r").key)
    assert response.status_code == 503 and response.json()["rc"] == "MaintenanceMode"


@pytest.mark.parametrize("key", ["no-such-key-0123", None])
def test_flag_and_maintenance_come_before_authentication(horde, served, settings, key):
    """Steps 4-5's order: the admission flag, then maintenance, then authentication (an unknown key,
    or no key where anonymous requests are not served)."""
    settings.HORDE_ALLOW_ANONYMOUS = False
    settings.HORDE_CHAT_ADMISSION_ENABLED = False
    settings.HORDE_MAINTENANCE = True
    assert chat_async(horde.client, key).json()["rc"] == "ChatAdmissionDisabled"
    settings.HORDE_CHAT_ADMISSION_ENABLED = True
    assert chat_async(horde.client, key).json()["rc"] == "MaintenanceMode"
    settings.HORDE_MAINTENANCE = False
    refused = chat_async(horde.client, key)
    assert refused.json()["rc"] == ("InvalidAPIKey" if key else "AnonForbidden")


def test_concurrency_comes_before_the_model_check(horde, make_user):
    requester = make_user("r")
    requester.user.concurrency = 0
    requester.user.save()
    response = chat_async(horde.client, requester.key, model="acme/unknown")
    assert response.status_code == 429
    assert response.json() == {"message": "Parallel requests (1) exceeded user limit (0).", "rc": "TooManyPrompts"}


def test_invalid_key_is_401(horde, served):
    assert chat_async(horde.client, "wrong").json()["rc"] == "InvalidAPIKey"


def test_anonymous_may_submit(horde, served):
    assert chat_async(horde.client, None).status_code == 202


# --- rate limits --------------------------------------------------------------------------------


def test_chat_rate_limit_is_its_own_budget(horde, make_user, served, settings):
    settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP = "1000/second"
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = "2/minute"
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["1000/second", "3/minute"]
    requester = make_user("r")
    codes = [chat_async(horde.client, requester.key).status_code for _ in range(4)]
    assert codes[0] == 202 and 429 in codes
    limited = chat_async(horde.client, requester.key)
    assert limited.status_code == 429 and limited.json()["rc"] == "RateLimited"
    # The chat submits did not spend the text budget.
    assert horde.text_async(requester.key).status_code == 202
    other = horde.client.post(
        CHAT_ASYNC, chat_body(), format="json", REMOTE_ADDR="10.1.2.3", HTTP_APIKEY=requester.key
    )
    assert other.status_code == 202


# --- step 6: known models ----------------------------------------------------------------------


def test_unknown_entry_refuses_the_whole_request_with_its_path(horde, make_user, served):
    requester = make_user("r")
    response = chat_async(horde.client, requester.key, models=[MODEL, "acme/unknown"])
    assert response.status_code == 404
    assert response.json() == {
        "message": "'models[1]': The model 'acme/unknown' is not known to this horde.",
        "rc": "UnknownChatModel",
    }
    single = chat_async(horde.client, requester.key, model="acme/unknown", horde={"dry_run": True})
    assert single.status_code == 404
    assert single.json()["message"] == "'model': The model 'acme/unknown' is not known to this horde."
    assert not GenerationRequest.objects.exists()
    assert not KudosTransaction.objects.filter(kind="horde_tax").exists()


def test_a_model_an_online_chat_worker_serves_is_known(horde, make_user, owner):
    chat_worker(owner, model="acme/private-model")
    response = chat_async(horde.client, make_user("r").key, model="acme/private-model")
    assert response.status_code == 202


def test_offline_worker_does_not_make_a_model_known(horde, make_user, owner):
    chat_worker(owner, model="acme/private-model", online=False)
    response = chat_async(horde.client, make_user("r").key, model="acme/private-model")
    assert response.status_code == 404 and response.json()["rc"] == "UnknownChatModel"


def test_known_model_without_chat_worker_is_no_eligible_worker(horde, make_user, owner):
    requester = make_user("r")
    huge = [{"role": "user", "content": "x" * 400_000}]  # would not fit any context: the 403 comes first
    for extra in ({}, {"horde": {"dry_run": True}}):
        response = chat_async(horde.client, requester.key, messages=huge, **extra)
        assert response.status_code == 403
        assert response.json() == {
            "message": f"No worker is currently serving the model '{MODEL}'.",
            "rc": "NoEligibleWorker",
        }
    many = chat_async(horde.client, requester.key, models=[MODEL, SMALL_MODEL])
    assert many.status_code == 403
    assert many.json() == {
        "message": f"No worker is currently serving any of the models '{MODEL}', '{SMALL_MODEL}'.",
        "rc": "NoEligibleWorker",
    }
    # A request with models reads "any of the models" with one entry as well.
    one = chat_async(horde.client, requester.key, models=[MODEL])
    assert one.json() == {"message": f"No worker is currently serving any of the models '{MODEL}'.", "rc": "NoEligibleWorker"}
    # A text-only worker does not serve chat requests.
    horde.pop(owner.key, models=[MODEL])
    assert chat_async(horde.client, requester.key).status_code == 403
    assert not GenerationRequest.objects.exists()


# --- step 7: worker_max_length -------------------------------------------------------------------


def test_max_tokens_above_every_worker_is_lowered(horde, make_user, owner, metric_reader):  # noqa: F811
    chat_worker(owner, max_length=1024)
    chat_worker(owner, max_length=700)
    requester = make_user("r", kudos=1000)
    response = chat_async(horde.client, requester.key, max_tokens=4096)
    assert response.status_code == 202
    request = GenerationRequest.objects.get(pk=response.json()["id"])
    assert request.max_length == 1024
    assert request.context_adjustments == [{"from": 4096, "to": 1024, "reason": "worker_max_length"}]
    dry = chat_async(horde.client, requester.key, max_completion_tokens=4096, horde={"dry_run": True})
    assert dry.json()["resolved"]["max_length"] == 1024
    assert dry.json()["context_adjustments"][0]["reason"] == "worker_max_length"
    # Each lowered request is counted once, by both lengths' buckets, the dry run apart; one within
    # the workers' length is not counted.
    assert chat_async(horde.client, requester.key, max_tokens=1024).status_code == 202
    lowered = {"horde.requested_bucket": "2049-4096", "horde.declared_bucket": "513-1024"}
    assert counter_points(metric_reader, "horde.chat.max_length_lowered") == {
        tuple(sorted({**lowered, "horde.dry_run": False}.items())): 1,
        tuple(sorted({**lowered, "horde.dry_run": True}.items())): 1,
    }


# --- step 8: context sizing ----------------------------------------------------------------------


def _long(n_chars: int) -> str:
    return "y" * n_chars


def test_grow_raises_the_context_up_to_the_largest_chat_context(horde, make_user, owner):
    chat_worker(owner, max_context_length=8192)
    requester = make_user("r")
    messages = [{"role": "user", "content": _long(12_000)}]
    response = chat_async(horde.client, requester.key, messages=messages, horde={"context_fit": "grow"})
    assert response.status_code == 202
    request = GenerationRequest.objects.get(pk=response.json()["id"])
    needed = estimate_chat_prompt_tokens(flatten_messages(messages), 0) + 512
    assert request.max_context_length == needed
    assert request.context_adjustments == [{"from": 2048, "to": needed, "reason": "grow"}]


def test_reject_and_grow_past_the_bound_are_prompt_exceeds_context(horde, make_user, owner):
    chat_worker(owner, max_context_length=4096)
    requester = make_user("r")
    tokens = estimate_chat_prompt_tokens(flatten_messages([{"role": "user", "content": _long(12_000)}]), 0)
    rejected = chat_async(
        horde.client, requester.key, messages=[{"role": "user", "content": _long(12_000)}], horde={"context_fit": "reject"}
    )
    assert rejected.status_code == 400
    assert rejected.json() == {
        "message": f"The messages are estimated at {tokens} tokens, which with max_length 512 do not fit a context "
        "of 2048 tokens.",
        "rc": "PromptExceedsContext",
    }
    grown = chat_async(
        horde.client, requester.key, messages=[{"role": "user", "content": _long(20_000)}], horde={"context_fit": "grow"}
    )
    assert grown.status_code == 400 and grown.json()["rc"] == "PromptExceedsContext"
    assert "a context of 4096 tokens" in grown.json()["message"]
    assert not GenerationRequest.objects.exists()


def test_truncate_oldest_drops_whole_turns_and_keeps_system_and_the_latest_user(
    horde, make_user, owner, metric_reader  # noqa: F811
):
    chat_worker(owner, max_context_length=4096)
    requester = make_user("r")
    turn = _long(4000)  # about 1000 tokens per message
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": turn},
        {"role": "assistant", "content": turn},
        {"role": "user", "content": turn},
        {"role": "assistant", "content": turn},
        {"role": "system", "content": "Mid-conversation note."},
        {"role": "user", "content": "Latest question"},
        {"role": "assistant", "content": "Partial"},
    ]
    response = chat_async(horde.client, requester.key, messages=messages)
    assert response.status_code == 202, response.json()
    request = GenerationRequest.objects.get(pk=response.json()["id"])
    kept = messages[:1] + messages[3:]
    assert request.messages == kept
    submitted_tokens = estimate_chat_prompt_tokens(flatten_messages(messages), 0)
    kept_tokens = estimate_chat_prompt_tokens(flatten_messages(kept), 0)
    assert request.context_adjustments == [
        {"from": 2048, "to": 4096, "reason": "grow"},
        {"from": submitted_tokens, "to": kept_tokens, "reason": "truncate_oldest", "dropped_messages": 2},
    ]
    assert request.max_context_length == 4096
    assert request.prompt == flatten_messages(kept)
    assert request.submitted_prompt == flatten_messages(messages)
    # A dry run is trimmed the same way; its text sizing ran as grow.
    dry = chat_async(horde.client, requester.key, messages=messages, horde={"dry_run": True})
    assert dry.status_code == 200
    assert dry.json()["estimated_prompt_tokens"] == kept_tokens
    assert dry.json()["resolved"]["context_fit"] == "grow"
    # Each trimmed request is counted as truncated under its mode, the dry run too; nothing was
    # counted as grown, though the context grew on the way.
    assert counter_points(metric_reader, "horde.text.context_fit") == {
        (("horde.mode", "truncate_oldest"), ("horde.outcome", "truncated")): 2
    }


def test_truncate_oldest_that_still_does_not_fit_is_refused(horde, make_user, owner):
    chat_worker(owner, max_context_length=4096)
    response = chat_async(horde.client, make_user("r").key, messages=[{"role": "user", "content": _long(40_000)}])
    assert response.status_code == 400 and response.json()["rc"] == "PromptExceedsContext"


def test_tool_rounds_are_dropped_with_their_answers(horde, make_user, owner):
    chat_worker(owner, max_context_length=4096)
    call = {"id": "c1", "type": "function", "function": {"name": "lookup_weather", "arguments": _long(10_000)}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": _long(6000)},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks, and tomorrow?"},
    ]
    response = chat_async(horde.client, make_user("r").key, messages=messages, tools=TOOLS)
    assert response.status_code == 202, response.json()
    request = GenerationRequest.objects.get(pk=response.json()["id"])
    # The user + tool-calling assistant turn goes with its tool message; the lone assistant stays.
    assert [m["role"] for m in request.messages] == ["assistant", "user"]
    assert request.context_adjustments[-1]["dropped_messages"] == 3


# --- flattened prompt and estimate ------------------------------------------------------------------


def test_flattened_prompt_and_image_estimate():
    messages = [
        {"role": "system", "content": "S"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "42"},
    ]
    prompt = flatten_messages(messages, TOOLS)
    calls = '[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]'
    assert prompt == (
        "system: S\nuser: Look:\n[image]\n"
        f"assistant: {calls}\n"
        "tool: 42\n" + json.dumps(TOOLS, separators=(",", ":"))
    )
    assert estimate_chat_prompt_tokens(prompt, 1) == -(-len(prompt) // 4) + 512


# --- pricing at admission ----------------------------------------------------------------------


# An 8x8 PNG, as a client sends an image inline.
_PNG_DATA_URL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAAEklEQVR4nGP4z8CAFWEXHbQSACj/P8Fu7N9hAAAAAElFTkSuQmCC"
)


def test_an_image_part_prices_the_context_at_the_estimate(horde, make_user, owner):
    """The quote's context follows the prompt estimate, 512 tokens per image part included: a dry
    run with an image quotes more than the same words without it, and the request stores that price."""
    from chat.pricing import context_multiplier

    chat_worker(owner)  # declares vision
    requester = make_user("r", kudos=5000)
    words = {"role": "user", "content": [{"type": "text", "text": "Look:"}]}
    image = {"type": "image_url", "image_url": {"url": _PNG_DATA_URL}}
    seen = {**words, "content": [*words["content"], image]}
    plain = chat_async(horde.client, requester.key, messages=[words], max_tokens=1024, horde={"dry_run": True})
    with_image = chat_async(horde.client, requester.key, messages=[seen], max_tokens=1024, horde={"dry_run": True})
    assert with_image.json()["estimated_prompt_tokens"] - plain.json()["estimated_prompt_tokens"] >= 512
    assert with_image.json()["kudos"] > plain.json()["kudos"]
    created = chat_async(horde.client, requester.key, messages=[seen], max_tokens=1024)
    assert created.status_code == 202 and created.json()["kudos"] == with_image.json()["kudos"]
    request = GenerationRequest.objects.get(pk=created.json()["id"])
    estimate = with_image.json()["estimated_prompt_tokens"]
    assert request.kudos_context == context_multiplier(request.prompt, 1024, prompt_tokens=estimate)
    assert request.kudos_context > context_multiplier(request.prompt, 1024)


def test_multi_model_quotes_the_first_and_holds_at_the_highest(allowance_at_the_floor, horde, make_user, owner):
    chat_worker(owner, model=SMALL_MODEL)
    requester = make_user("r", kudos=5000)
    response = chat_async(horde.client, requester.key, models=[SMALL_MODEL, BIG_MODEL], max_tokens=1024)
    assert response.status_code == 202, response.json()
    request = GenerationRequest.objects.get(pk=response.json()["id"])
    quote = text_request_quote(models=[SMALL_MODEL], prompt=request.prompt, max_length=1024, n=1) + 1
    hold = text_request_quote(models=[BIG_MODEL], prompt=request.prompt, max_length=1024, n=1) + 1
    assert Decimal(str(response.json()["kudos"])) == quote == request.kudos_quote
    assert hold > quote and request.kudos_held == hold
    assert requester.refresh().kudos_held == hold
    # Its one job settles the whole hold, whichever model served it: nothing stays held once done.
    popped = chat_pop(horde, owner.key, model_id=SMALL_MODEL)
    assert popped.status_code == 200 and popped.json()["id"]
    reply = {"message": {"role": "assistant", "content": "Hi."}, "finish_reason": "stop", "model_id": SMALL_MODEL}
    assert horde.chat_submit(owner.key, popped.json()["id"], **reply).status_code == 200
    request.refresh_from_db()
    assert request.kudos_held == 0 and request.consumed_kudos > 0
    assert chat_status(horde.client, request.pk, requester.key).json()["done"] is True
    assert requester.refresh().kudos_held == 0


def test_chat_requests_never_downgrade(allowance_at_the_floor, horde, make_user, served):
    poor = make_user("poor", kudos=1)
    response = chat_async(horde.client, poor.key, max_tokens=1024)
    assert response.status_code == 403
    upfront = text_request_quote(models=[MODEL], prompt="user: Hello", max_length=1024, n=1) + 1
    assert response.json() == {
        "message": "Due to heavy demand, for requests over 512 tokens, the client needs to already have the "
        f"required kudos. This request requires {upfront} kudos to fulfil.",
        "rc": "KudosUpfront",
    }
    assert not GenerationRequest.objects.exists()
    assert poor.refresh().kudos == Decimal("1") and poor.refresh().kudos_held == 0


def test_no_eligible_worker_replaces_a_kudos_refusal(horde, make_user, owner):
    chat_worker(owner, features=["prompt_overflow_refused"])  # serves the model, cannot serve seed
    poor = make_user("poor", kudos=1)
    response = chat_async(horde.client, poor.key, max_tokens=1024, seed=3)
    assert response.status_code == 403
    assert response.json() == {
        "message": "No online worker can serve this request: no online worker serving the model declares seed.",
        "rc": "NoEligibleWorker",
        "impossible_reason": {"kind": "declaration_gap", "missing_declarations": ["seed"], "exceeded_limits": []},
    }
    assert not GenerationRequest.objects.exists()
    # A request that fits the floor is queued whether or not a worker can serve it.
    queued = chat_async(horde.client, poor.key, seed=3)
    assert queued.status_code == 202 and queued.json()["warnings"]


def test_no_eligible_worker_states_an_exceeded_limit(horde, make_user, owner):
    chat_worker(owner, tools_max_temperature=0.5)  # applies at most 0.5 with tools
    poor = make_user("poor", kudos=1)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    response = chat_async(horde.client, poor.key, max_tokens=1024, temperature=0.9, tools=tools)
    assert response.status_code == 403
    assert response.json() == {
        "message": "No online worker can serve this request: the request exceeds the tools_max_temperature limit "
        "of every online worker serving the model.",
        "rc": "NoEligibleWorker",
        "impossible_reason": {
            "kind": "declaration_gap", "missing_declarations": [], "exceeded_limits": ["tools_max_temperature"]
        },
    }
    assert not GenerationRequest.objects.exists()


def test_each_chat_creation_records_how_the_allowance_admitted_it(
    allowance_at_the_floor, horde, make_user, served, metric_reader  # noqa: F811
):
    poor, rich = make_user("poor", kudos=1), make_user("rich", kudos=5000)
    assert chat_async(horde.client, poor.key, max_tokens=100).status_code == 202
    assert chat_async(horde.client, rich.key, max_tokens=1024).status_code == 202
    assert chat_async(horde.client, poor.key, max_tokens=1024).status_code == 403
    assert chat_async(horde.client, poor.key, max_tokens=1024, horde={"dry_run": True}).status_code == 200

    def key(outcome: str, requested: str) -> tuple:
        return tuple(
            sorted(
                {
                    "horde.requester": "registered", "horde.outcome": outcome, "horde.requested_bucket": requested,
                    "horde.allowance_bucket": "<=512", "horde.chat": True,
                }.items()
            )
        )

    assert counter_points(metric_reader, "horde.text.free_allowance.decisions") == {
        key("free", "<=512"): 1,
        key("funded", "513-1024"): 1,
        key("refused", "513-1024"): 1,
    }


def test_max_kudos_caps_the_estimate(horde, make_user, served):
    requester = make_user("r", kudos=1000)
    quote = chat_async(horde.client, requester.key, max_tokens=1024, horde={"dry_run": True})
    assert quote.status_code == 200
    kudos = quote.json()["kudos"]
    assert not GenerationRequest.objects.exists()
    for extra in ({}, {"dry_run": True}):
        refused = chat_async(horde.client, requester.key, max_tokens=1024, horde={"max_kudos": 1, **extra})
        assert refused.status_code == 400
        assert refused.json() == {"message": kudos_cap_message(kudos, 1), "rc": "ChatKudosCapExceeded"}
    assert not GenerationRequest.objects.exists()
    assert requester.refresh().kudos_held == 0
    allowed = chat_async(horde.client, requester.key, max_tokens=1024, horde={"max_kudos": int(kudos) + 1})
    assert allowed.status_code == 202


def test_openai_guards_refuse_a_json_object_format_without_json_in_the_messages(horde, make_user, served):
    """horde.openai_guards (spec: Request body): OpenAI's refusal of a json_object format when no
    message text says "json" (any case), on admission only, dry runs included; off by default."""
    requester = make_user("r", kudos=1000)
    json_object = {"type": "json_object"}
    plain = [{"role": "user", "content": "An object, please."}]
    refusal = {
        "message": "'messages': 'messages' must contain the word 'json' in some form, to use 'response_format' "
        "of type 'json_object'.",
        "rc": "ChatRequestConflict",
    }
    for horde_options in ({"openai_guards": True}, {"openai_guards": True, "dry_run": True}):
        refused = chat_async(
            horde.client, requester.key, messages=plain, response_format=json_object, horde=horde_options
        )
        assert refused.status_code == 400 and refused.json() == refusal
    assert not GenerationRequest.objects.exists()
    said_in_a_part = [{"role": "user", "content": [{"type": "text", "text": "Answer in Json."}]}]
    guarded = chat_async(
        horde.client, requester.key, messages=said_in_a_part, response_format=json_object,
        horde={"openai_guards": True},
    )
    assert guarded.status_code == 202, guarded.json()
    unguarded = chat_async(horde.client, requester.key, messages=plain, response_format=json_object)
    assert unguarded.status_code == 202, unguarded.json()
    # Not stored: the request keeps only what it applies.
    request = GenerationRequest.objects.get(pk=guarded.json()["id"])
    assert request.chat_extras == {"response_format": json_object}


def test_front_options_are_accepted_and_not_stored_and_reasoning_shows_either_way(horde, make_user, owner):
    """include_reasoning and availability_mode are the front's (spec: Request body): the native route
    accepts them and stores neither, and its status shows a submitted reasoning_content even when
    include_reasoning is false."""
    requester = make_user("r", kudos=1000)
    chat_pop(horde, owner.key)  # a chat worker, registered by its (empty) pop
    created = chat_async(
        horde.client, requester.key, horde={"include_reasoning": False, "availability_mode": "fail_fast"}
    )
    assert created.status_code == 202, created.json()
    request = GenerationRequest.objects.get(pk=created.json()["id"])
    assert request.chat_extras is None and "include_reasoning" not in request.params
    job = chat_pop(horde, owner.key).json()
    assert job["id"], job
    reply = {"role": "assistant", "content": "Hi.", "reasoning_content": "They greeted me."}
    submitted = horde.chat_submit(owner.key, job["id"], message=reply, finish_reason="stop", model_id=MODEL)
    assert submitted.status_code == 200, submitted.json()
    status = chat_status(horde.client, request.pk, requester.key).json()
    assert status["done"] is True
    assert status["generations"][0]["message"] == reply


def test_a_lone_surrogate_escape_is_400_and_queues_nothing(horde, make_user):
    requester = make_user("surrogate", kudos=100)
    raw = '{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 16}'
    answer = horde.client.post(
        "/api/v2/generate/chat/async", data=raw, content_type="application/json", HTTP_APIKEY=requester.key
    )
    assert answer.status_code == 400
    assert answer.json()["rc"] == "BadRequest" and "Unicode" in answer.json()["message"]
    assert not GenerationRequest.objects.filter(user=requester.user).exists()
