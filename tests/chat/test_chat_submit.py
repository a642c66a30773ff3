"""Structured submit of chat jobs: storage, reasoning, verification, refusal record, worker
counters, worker fault reasons and their metric, the fault limit and pricing (chat_requests.md)."""

from __future__ import annotations

import json
import logging
import math
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from chat import metrics, tasks
from chat.models import Generation, GenerationRequest
from chat.pricing import text_generation_kudos
from contract.chat_declaration import CHAT_WORKER_FAULT_MESSAGES
from contract.chat_limits import MAX_CHAT_FAULT_REASON_LENGTH, MAX_CHAT_TEXT_BYTES
from contract.chat_verify import SCHEMA_CANNOT_COMPILE_MESSAGE, SCHEMA_PATTERN_TIMEOUT_MESSAGE
from tests.chat.chat_jobs import (
    CHAT_MODEL,
    CHEAP_MODEL,
    SUBMIT,
    call,
    make_chat_request,
    make_chat_worker,
    pop_chat_job,
    reply,
    submit,
    tool,
)
from workers.models import Worker


@pytest.fixture
def people(make_user):
    return make_user("requester", kudos=1000), make_user("owner")


@pytest.fixture
def chat_job(people):
    """make(extras=..., conformance=...) -> (request, generation); the worker is made once."""
    requester, owner = people
    worker = make_chat_worker(owner.user)

    def make(**kwargs):
        request = make_chat_request(requester.user, **kwargs)
        return request, pop_chat_job(request, worker)[0]

    return make


@pytest.fixture
def metric_reader():
    """The horde's instruments recorded on an in-memory reader, for this test only."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.use_meter_provider(provider)
    yield reader
    metrics.use_meter_provider(None)
    provider.shutdown()


def counter_points(reader, name: str) -> dict[tuple, int]:
    """{sorted attribute items: value} of one counter."""
    data = reader.get_metrics_data()
    points: dict[tuple, int] = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        points[tuple(sorted(point.attributes.items()))] = point.value
    return points


def refused(response, rc: str, message: str | None = None, *, startswith: str | None = None):
    body = response.json()
    assert response.status_code == 400, body
    assert body["rc"] == rc, body
    if message is not None:
        assert body["message"] == message
    if startswith is not None:
        assert body["message"].startswith(startswith), body["message"]
    return body


def expected_reward(request, generation, characters: int) -> Decimal:
    tokens = min(max(math.ceil(characters / 4), 20), request.max_length)
    return text_generation_kudos(
        model=generation.assigned_model,
        prompt=request.prompt,
        generation=None,
        max_length=request.max_length,
        owner_trusted=False,
        tokens=tokens,
    )


# --- storage and pricing ------------------------------------------------------------------------


def test_reply_with_tool_calls_and_reasoning_is_stored_charged_and_rewarded(api, people, chat_job):
    requester, owner = people
    request, job = chat_job(extras={"tools": [tool("lookup_weather")], "tool_choice": "auto"})
    calls = [call("lookup_weather", '{"city": "Oslo"}')]
    body = reply(
        "Checking.",
        finish_reason="tool_calls",
        tool_calls=calls,
        reasoning_content="The user wants weather, so call the tool.",
        native_finish_reason="tool_use",
        prompt_tokens=31,
        completion_tokens=12,
        reasoning_tokens=9,
    )
    response = submit(api, owner.key, job.id, body)
    assert response.status_code == 200, response.json()
    job.refresh_from_db()
    assert job.state == "ok" and job.text == "Checking."
    assert job.message == {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": calls,
        "reasoning_content": "The user wants weather, so call the tool.",
    }
    assert (job.finish_reason, job.native_finish_reason) == ("tool_calls", "tool_use")
    assert (job.prompt_tokens, job.completion_tokens, job.reasoning_tokens) == (31, 12, 9)
    assert job.charge_basis == "output_estimate"
    # content + reasoning + each call's name and arguments
    characters = len("Checking.") + len("The user wants weather, so call the tool.") + len("lookup_weather")
    characters += len('{"city": "Oslo"}')
    reward = expected_reward(request, job, characters)
    assert Decimal(str(response.json()["reward"])) == reward == job.kudos
    assert requester.refresh().kudos == Decimal("1000") - reward
    assert owner.refresh().kudos == reward
    worker = Worker.objects.get(pk=job.worker_id)
    assert worker.fulfilments == 1 and worker.tokens_generated == max(math.ceil(characters / 4), 20)
    assert len(worker.speed_samples) == 1


def test_plain_reply_stores_only_submitted_keys_and_null_counts(api, people, chat_job):
    _, owner = people
    _, job = chat_job()
    assert submit(api, owner.key, job.id, reply("Hello!")).status_code == 200
    job.refresh_from_db()
    assert job.message == {"role": "assistant", "content": "Hello!"}
    assert (job.prompt_tokens, job.completion_tokens, job.reasoning_tokens, job.native_finish_reason) == (
        None,
        None,
        None,
        None,
    )


def test_null_content_with_tool_calls_stores_an_empty_generation(api, people, chat_job):
    _, owner = people
    _, job = chat_job(extras={"tools": [tool("f")], "tool_choice": "required"})
    response = submit(api, owner.key, job.id, reply(None, finish_reason="tool_calls", tool_calls=[call("f")]))
    assert response.status_code == 200, response.json()
    job.refresh_from_db()
    assert job.text == "" and job.message["content"] is None


def test_empty_content_completes_and_is_charged_the_floor(api, people, chat_job):
    requester, owner = people
    request, job = chat_job()
    response = submit(api, owner.key, job.id, reply(""))
    assert response.status_code == 200
    assert Decimal(str(response.json()["reward"])) == expected_reward(request, job, 0) > 0
    job.refresh_from_db()
    assert job.state == "ok" and job.text == ""


def test_nul_is_replaced_in_every_stored_string(api, people, chat_job):
    _, owner = people
    _, job = chat_job(extras={"tools": [tool("f")]})
    body = reply(
        "a\x00b",
        finish_reason="tool_calls",
        tool_calls=[call("f", '{"x": "\x00"}')],
        reasoning_content="r\x00",
        native_finish_reason="n\x00",
    )
    assert submit(api, owner.key, job.id, body).status_code == 200
    job.refresh_from_db()
    stored = json.dumps(job.message) + job.text + job.native_finish_reason
    assert "\x00" not in stored and "\\u0000" not in stored
    assert job.text == "a\ufffdb" and job.message["reasoning_content"] == "r\ufffd"


def test_reported_token_counts_never_change_the_charge(api, people, chat_job):
    _, owner = people
    _, first = chat_job()
    _, second = chat_job()
    a = submit(api, owner.key, first.id, reply("Same reply.", completion_tokens=1)).json()["reward"]
    b = submit(api, owner.key, second.id, reply("Same reply.", completion_tokens=9_999_999)).json()["reward"]
    assert a == b


def test_output_estimate_is_capped_at_the_requested_max_length(api, people, chat_job):
    _, owner = people
    request, job = chat_job(max_length=64)
    response = submit(api, owner.key, job.id, reply("x" * 1000, reasoning_content="y" * 1000))
    assert Decimal(str(response.json()["reward"])) == expected_reward(request, job, 64 * 4)
    assert Worker.objects.get(pk=job.worker_id).tokens_generated == 64


def test_reasoning_is_counted_in_the_charge_and_speed_sample(api, people, chat_job):
    _, owner = people
    request, job = chat_job()
    # Started ten seconds ago, so the sample (tokens over seconds) is far from a 1-token one.
    Generation.objects.filter(pk=job.pk).update(created=timezone.now() - timedelta(seconds=10))
    response = submit(api, owner.key, job.id, reply("ok", reasoning_content="r" * 398))
    assert Decimal(str(response.json()["reward"])) == expected_reward(request, job, 400)
    worker = Worker.objects.get(pk=job.worker_id)
    assert worker.tokens_generated == 100
    # The speed sample counts the reasoning's tokens too: 100 tokens over the job's seconds, from
    # its start to the finish the submit stored (rounded to 3 places as stored).
    job.refresh_from_db()
    seconds = (job.finished_at - job.created).total_seconds()
    assert 10 <= seconds < 60
    assert worker.speed_samples == [pytest.approx(100 / seconds, abs=0.001)]
    assert worker.speed == pytest.approx(100 / seconds, abs=0.001)


def test_generation_is_charged_at_the_model_that_served_it(api, people):
    requester, owner = people
    worker = make_chat_worker(owner.user, model=CHEAP_MODEL)
    request = make_chat_request(requester.user, models=(CHAT_MODEL, CHEAP_MODEL))
    job = pop_chat_job(request, worker)[0]
    response = submit(api, owner.key, job.id, reply("x" * 400, model_id=CHEAP_MODEL))
    assert Decimal(str(response.json()["reward"])) == expected_reward(request, job, 400)
    expensive = text_generation_kudos(
        model=CHAT_MODEL,
        prompt=request.prompt,
        generation=None,
        max_length=512,
        owner_trusted=False,
        tokens=100,
    )
    assert Decimal(str(response.json()["reward"])) < expensive


def test_a_censored_reply_is_neither_charged_nor_paid(api, people, chat_job):
    requester, owner = people
    _, job = chat_job()
    response = submit(api, owner.key, job.id, reply("[censored]", state="censored"))
    assert response.status_code == 200 and response.json()["reward"] == 0
    assert requester.refresh().kudos == Decimal("1000")
    assert owner.refresh().kudos == 0
    assert Generation.objects.get(pk=job.pk).state == "censored"


# --- refusals of the submit ---------------------------------------------------------------------

BIG_REASONING = "r" * (MAX_CHAT_TEXT_BYTES + 1)

REFUSALS = [
    (
        "no message",
        {"model_id": CHAT_MODEL, "finish_reason": "stop"},
        "ChatSubmitInvalid",
        "'message': A chat submit needs message, an assistant reply object.",
    ),
    (
        "bad finish_reason",
        reply(finish_reason="done"),
        "ChatSubmitInvalid",
        "'finish_reason': A chat submit needs finish_reason: stop, length, content_filter or tool_calls.",
    ),
    (
        "no finish_reason",
        {"message": {"role": "assistant", "content": "x"}, "model_id": CHAT_MODEL},
        "ChatSubmitInvalid",
        "'finish_reason': A chat submit needs finish_reason: stop, length, content_filter or tool_calls.",
    ),
    (
        "tool_calls finish without calls",
        reply(finish_reason="tool_calls"),
        "ChatSubmitInvalid",
        "'finish_reason': finish_reason tool_calls needs a non-empty message.tool_calls.",
    ),
    (
        "null content without calls",
        reply(None),
        "ChatSubmitInvalid",
        "'message.content': message.content may be null only with tool_calls.",
    ),
    (
        "generation beside message",
        reply(generation="text"),
        "ChatSubmitInvalid",
        "'generation': A chat submit sends message, not generation.",
    ),
    (
        "no model_id",
        {"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"},
        "ChatSubmitInvalid",
        "'model_id': A chat submit needs model_id, the model that served the job.",
    ),
    (
        "count out of range",
        reply(prompt_tokens=10_000_001),
        "ChatSubmitInvalid",
        "'prompt_tokens': prompt_tokens has to be an integer from 0 to 10000000.",
    ),
    (
        "native_finish_reason too long",
        reply(native_finish_reason="n" * 33),
        "ChatSubmitInvalid",
        "'native_finish_reason': native_finish_reason is a string of at most 32 characters.",
    ),
    (
        "reasoning over 1 MiB",
        reply(reasoning_content=BIG_REASONING),
        "ChatSubmitInvalid",
        f"'message.reasoning_content': message.reasoning_content is over {MAX_CHAT_TEXT_BYTES} bytes.",
    ),
    (
        "bad state",
        reply(state="great"),
        "ChatSubmitInvalid",
        "'state': state is ok, censored, csam or faulted.",
    ),
    (
        "text-shaped reply to a chat job",
        {"generation": "plain text"},
        "ChatSubmitInvalid",
        "'message': A chat job's submit needs message, finish_reason and model_id.",
    ),
    (
        "another model",
        reply(model_id="other/model"),
        "ChatModelMismatch",
        f"'model_id': The job was assigned the model '{CHAT_MODEL}', not 'other/model'.",
    ),
]


@pytest.mark.parametrize(("case", "body", "rc", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_reply_is_recorded_and_leaves_the_job_pending(api, people, chat_job, case, body, rc, message):
    _, owner = people
    request, job = chat_job()
    refused(submit(api, owner.key, job.id, body), rc, message)
    job.refresh_from_db()
    request.refresh_from_db()
    assert job.state == "processing" and job.chat_refusal_rc == rc and job.message is None
    assert (request.chat_fault_reason, request.chat_fault_rc) == (message, rc)


def test_refusal_record_is_committed_on_its_own(api, people, transactional_db):
    """The 400 follows a commit of its own, so the record survives the refused request."""
    requester, owner = people
    worker = make_chat_worker(owner.user)
    request = make_chat_request(requester.user)
    job = pop_chat_job(request, worker)[0]
    refused(submit(api, owner.key, job.id, reply(model_id="x")), "ChatModelMismatch")
    assert GenerationRequest.objects.get(pk=request.pk).chat_fault_rc == "ChatModelMismatch"
    assert Generation.objects.get(pk=job.pk).chat_refusal_rc == "ChatModelMismatch"


def test_refusal_reason_is_cut_and_a_later_refusal_overwrites(api, people, chat_job):
    _, owner = people
    long_name = "f" * 2000  # echoed in the message, which is cut to MAX_CHAT_FAULT_REASON_LENGTH
    request, job = chat_job(extras={"tools": [tool("g")]})
    body = refused(
        submit(api, owner.key, job.id, reply(finish_reason="tool_calls", tool_calls=[call(long_name)])),
        "ChatSubmitInvalid",
    )
    request.refresh_from_db()
    assert request.chat_fault_reason == body["message"][:MAX_CHAT_FAULT_REASON_LENGTH]
    assert len(request.chat_fault_reason) == MAX_CHAT_FAULT_REASON_LENGTH
    refused(submit(api, owner.key, job.id, reply(model_id="x")), "ChatModelMismatch")
    request.refresh_from_db()
    assert request.chat_fault_rc == "ChatModelMismatch"


def test_text_job_submit_carrying_message_is_refused(api, horde, people):
    requester, owner = people
    horde.text_async(requester.key, models=[CHAT_MODEL])
    job = horde.pop(owner.key).json()
    refused(
        submit(api, owner.key, job["id"], reply()),
        "ChatSubmitInvalid",
        "'message': A text job's submit sends generation, not message.",
    )
    assert Generation.objects.get(pk=job["id"]).state == "processing"


def test_text_job_ignores_fault_reason_and_model_id(api, horde, people):
    requester, owner = people
    horde.text_async(requester.key, models=[CHAT_MODEL])
    job = horde.pop(owner.key).json()
    body = {"generation": "", "state": "faulted", "fault_reason": "prompt_overflow", "model_id": "m"}
    assert submit(api, owner.key, job["id"], body).json() == {"reward": 0}
    gen = Generation.objects.select_related("request").get(pk=job["id"])
    assert gen.state == "faulted" and gen.request.chat_fault_reason is None


def test_text_job_chat_shaped_submit_with_generation_is_stored_as_text(api, horde, people):
    requester, owner = people
    horde.text_async(requester.key, models=[CHAT_MODEL])
    job = horde.pop(owner.key).json()
    assert submit(api, owner.key, job["id"], {"generation": "A story.", "model_id": "m"}).json()["reward"] > 0
    assert Generation.objects.get(pk=job["id"]).text == "A story."


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "assistant", "content": "abc\ud800def"}, "message.content"),
        ({"role": "assistant", "content": "ok", "reasoning_content": "\udfff"}, "message.reasoning_content"),
    ],
)
def test_a_lone_surrogate_in_a_reply_is_an_invalid_reply(api, people, chat_job, message, param):
    """JSON's \\ud800 escape parses to text UTF-8 cannot encode: a refused reply, not a 500."""
    _, owner = people
    request, job = chat_job()
    body = json.dumps({"id": str(job.id), **reply(), "message": message})  # ensure_ascii: the escape as sent
    response = api.post(SUBMIT, body, content_type="application/json", HTTP_APIKEY=owner.key)
    refused(response, "ChatSubmitInvalid", f"'{param}': The text holds a lone surrogate, which is not valid Unicode.")
    request.refresh_from_db()
    assert request.chat_fault_rc == "ChatSubmitInvalid" and Generation.objects.get(pk=job.pk).state == "processing"


def test_reply_for_a_faulted_generation_is_aborted_before_it_is_checked(api, people, chat_job):
    _, owner = people
    request, job = chat_job()
    Generation.objects.filter(pk=job.pk).update(state="faulted")
    refused(submit(api, owner.key, job.id, reply(model_id="wrong")), "AbortedGen")
    request.refresh_from_db()
    assert request.chat_fault_rc is None and Generation.objects.get(pk=job.pk).chat_refusal_rc is None


def test_a_text_shaped_reply_for_a_faulted_chat_job_is_aborted_too(api, people, chat_job):
    """Before the reply's shape is checked: AbortedGen, not ChatSubmitInvalid, and nothing recorded."""
    _, owner = people
    request, job = chat_job()
    Generation.objects.filter(pk=job.pk).update(state="faulted")
    refused(submit(api, owner.key, job.id, {"generation": "plain text"}), "AbortedGen")
    request.refresh_from_db()
    assert request.chat_fault_rc is None and Generation.objects.get(pk=job.pk).chat_refusal_rc is None


def test_second_reply_is_a_duplicate(api, people, chat_job):
    _, owner = people
    _, job = chat_job()
    assert submit(api, owner.key, job.id, reply()).status_code == 200
    refused(submit(api, owner.key, job.id, reply()), "DuplicateGen")


def test_unknown_job_and_wrong_owner(api, people, chat_job, make_user):
    _, owner = people
    _, job = chat_job()
    response = submit(api, owner.key, "00000000-0000-0000-0000-000000000000", reply())
    assert response.status_code == 404 and response.json()["rc"] == "InvalidJobID"
    other = make_user("other")
    response = submit(api, other.key, job.id, reply())
    assert response.status_code == 403 and response.json()["rc"] == "WrongCredentials"


def test_malformed_id_is_a_schema_failure(api, people):
    _, owner = people
    response = submit(api, owner.key, "not-a-uuid", reply())
    assert response.status_code == 400 and response.json()["message"] == "Input payload validation failed"


# --- reply verification -------------------------------------------------------------------------

TOOLS_FG = [tool("f"), tool("g")]
DRAFT7_TUPLE = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {"a": {"type": "array", "items": [{"type": "string"}]}},
}
LOCAL_REF = {
    "type": "object",
    "$defs": {"colour": {"type": "string"}},
    "properties": {"c": {"$ref": "#/$defs/colour"}},
    "required": ["c"],
    "additionalProperties": False,
}

PATTERNED = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"}},
    "required": ["code"],
    "additionalProperties": False,
}
# Exponential for a backtracking engine: 60 characters would keep Python's re busy for days.
BACKTRACKING = {
    "type": "object",
    "properties": {"x": {"type": "string", "pattern": "^(a|aa)+$"}},
    "required": ["x"],
    "additionalProperties": False,
}
PATTERN_KEYS = {"type": "object", "patternProperties": {"^x_[0-9]+$": {"type": "integer"}}, "additionalProperties": False}


def schema_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": strict}}


def calls_reply(*calls_, content=None):
    return reply(content, finish_reason="tool_calls", tool_calls=list(calls_))


INVALID_NO_TOOLS = (
    "ChatSubmitInvalid",
    "'message.tool_calls': The reply carries tool calls, but the request has no tools.",
)
NC = "ChatSubmitNonconformant"
PASS = None

# (case, extras, body, strict outcome, best_effort outcome); an outcome is None (stored) or (rc, message).
VERIFICATION = [
    ("call with no tools", None, calls_reply(call("f")), INVALID_NO_TOOLS, INVALID_NO_TOOLS),
    (
        "call to an undefined function",
        {"tools": TOOLS_FG},
        calls_reply(call("h")),
        (
            "ChatSubmitInvalid",
            "'message.tool_calls': The reply calls the function 'h', which the request's tools do not define.",
        ),
        (
            "ChatSubmitInvalid",
            "'message.tool_calls': The reply calls the function 'h', which the request's tools do not define.",
        ),
    ),
    (
        "two calls with one id",
        {"tools": TOOLS_FG},
        calls_reply(call("f"), call("g")),
        ("ChatSubmitInvalid", "'message.tool_calls': The reply carries two tool calls with the id 'call_1'."),
        ("ChatSubmitInvalid", "'message.tool_calls': The reply carries two tool calls with the id 'call_1'."),
    ),
    (
        "call under tool_choice none",
        {"tools": TOOLS_FG, "tool_choice": "none"},
        calls_reply(call("f")),
        (NC, "'message': The reply calls a tool under tool_choice none."),
        PASS,
    ),
    (
        "no call under required",
        {"tools": TOOLS_FG, "tool_choice": "required"},
        reply("text only"),
        (NC, "'message': The reply does not call a tool under tool_choice required."),
        PASS,
    ),
    (
        "no call under a function choice",
        {"tools": TOOLS_FG, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        reply("text only"),
        (NC, "'message': The reply does not call only the function 'f' the tool_choice forces."),
        PASS,
    ),
    (
        "another function under a function choice",
        {"tools": TOOLS_FG, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        calls_reply(call("g")),
        (NC, "'message': The reply does not call only the function 'f' the tool_choice forces."),
        PASS,
    ),
    (
        "json_object: not JSON",
        {"response_format": {"type": "json_object"}},
        reply("not json"),
        (NC, "'message': The reply's content is not JSON, as the response format requires."),
        PASS,
    ),
    (
        "json_object: NaN refused",
        {"response_format": {"type": "json_object"}},
        reply('{"a": NaN}'),
        (NC, "'message': The reply's content is not JSON, as the response format requires."),
        PASS,
    ),
    (
        "json_object: Infinity refused",
        {"response_format": {"type": "json_object"}},
        reply('{"a": Infinity}'),
        (NC, "'message': The reply's content is not JSON, as the response format requires."),
        PASS,
    ),
    (
        "json_object: an array",
        {"response_format": {"type": "json_object"}},
        reply("[1, 2]"),
        (NC, "'message': The reply's content is not a JSON object, as the response format requires."),
        PASS,
    ),
    ("json_object: an object", {"response_format": {"type": "json_object"}}, reply('{"a": 1}'), PASS, PASS),
    (
        "json_schema without strict: not an object",
        {"response_format": schema_format({"type": "object", "required": ["z"]}, strict=False)},
        reply('"text"'),
        (NC, "'message': The reply's content is not a JSON object, as the response format requires."),
        PASS,
    ),
    (
        "json_schema without strict: the schema is not applied",
        {"response_format": schema_format({"type": "object", "required": ["z"]}, strict=False)},
        reply('{"a": 1}'),
        PASS,
        PASS,
    ),
    (
        "strict schema: mismatch",
        {"response_format": schema_format(LOCAL_REF)},
        reply('{"c": 3}'),
        (
            NC,
            "'message': The reply does not match the response format schema at c: 3 is not of type 'string'",
        ),
        PASS,
    ),
    (
        "strict schema: local ref match",
        {"response_format": schema_format(LOCAL_REF)},
        reply('{"c": "red"}'),
        PASS,
        PASS,
    ),
    (
        "strict schema: draft-07 by $schema, mismatch",
        {"response_format": schema_format(DRAFT7_TUPLE)},
        reply('{"a": [1]}'),
        (
            NC,
            "'message': The reply does not match the response format schema at a/0: 1 is not of type 'string'",
        ),
        PASS,
    ),
    (
        "strict schema: draft-07 by $schema, match",
        {"response_format": schema_format(DRAFT7_TUPLE)},
        reply('{"a": ["x"]}'),
        PASS,
        PASS,
    ),
    (
        "strict schema: 2020-12 by default cannot compile a draft-07 tuple",
        {"response_format": schema_format({k: v for k, v in DRAFT7_TUPLE.items() if k != "$schema"})},
        reply('{"a": ["x"]}'),
        (NC, f"'message': {SCHEMA_CANNOT_COMPILE_MESSAGE}"),
        PASS,
    ),
    (
        "strict schema: remote ref",
        {"response_format": schema_format({"$ref": "https://example.org/s.json"})},
        reply("{}"),
        (NC, f"'message': {SCHEMA_CANNOT_COMPILE_MESSAGE}"),
        PASS,
    ),
    (
        "strict schema: unresolvable local ref",
        {"response_format": schema_format({"$ref": "#/$defs/missing"})},
        reply("{}"),
        (NC, f"'message': {SCHEMA_CANNOT_COMPILE_MESSAGE}"),
        PASS,
    ),
    (
        "strict schema: a pattern matched",
        {"response_format": schema_format(PATTERNED)},
        reply('{"code": "AB-12"}'),
        PASS,
        PASS,
    ),
    (
        "strict schema: a pattern not matched",
        {"response_format": schema_format(PATTERNED)},
        reply('{"code": "ab-12"}'),
        (
            NC,
            "'message': The reply does not match the response format schema at code: 'ab-12' does not match "
            "'^[A-Z]{2}-[0-9]+$'",
        ),
        PASS,
    ),
    (
        "strict schema: a requester's backtracking pattern is given up on, not run for hours",
        {"response_format": schema_format(BACKTRACKING)},
        reply(json.dumps({"x": "a" * 60 + "!"})),
        (NC, f"'message': {SCHEMA_PATTERN_TIMEOUT_MESSAGE}"),
        PASS,
    ),
    (
        "strict schema: patternProperties keys and the additional ones",
        {"response_format": schema_format(PATTERN_KEYS)},
        reply('{"x_1": 1, "y": 2}'),
        (
            NC,
            "'message': The reply does not match the response format schema at (root): 'y' does not match any "
            "of the regexes: '^x_[0-9]+$'",
        ),
        PASS,
    ),
    ("strict schema: patternProperties matched", {"response_format": schema_format(PATTERN_KEYS)}, reply('{"x_1": 1}'), PASS, PASS),
    (
        "strict schema: a backtracking patternProperties key",
        {"response_format": schema_format({**PATTERN_KEYS, "patternProperties": {"^(a|aa)+$": {}}})},
        reply(json.dumps({"a" * 60 + "!": 1})),
        (NC, f"'message': {SCHEMA_PATTERN_TIMEOUT_MESSAGE}"),
        PASS,
    ),
    (
        "strict schema: patternProperties with unevaluatedProperties cannot be checked in bounded time",
        {"response_format": schema_format({"patternProperties": {"^x": {}}, "unevaluatedProperties": False})},
        reply("{}"),
        (NC, f"'message': {SCHEMA_CANNOT_COMPILE_MESSAGE}"),
        PASS,
    ),
    (
        "strict schema: a $schema below the root (checked by the draft's own class) cannot be checked in bounded time",
        {"response_format": schema_format({
            **BACKTRACKING,
            "properties": {"x": {"$schema": "https://json-schema.org/draft/2020-12/schema", **BACKTRACKING["properties"]["x"]}},
        })},
        reply(json.dumps({"x": "a" * 60 + "!"})),
        (NC, f"'message': {SCHEMA_CANNOT_COMPILE_MESSAGE}"),
        PASS,
    ),
    (
        "strict schema: a POSIX class, which re reads as a set and a bracket, is not read another way",
        {"response_format": schema_format({**PATTERNED, "properties": {"code": {"type": "string", "pattern": "^[[:alpha:]]$"}}})},
        reply('{"code": "b"}'),
        (NC, f"'message': {SCHEMA_CANNOT_COMPILE_MESSAGE}"),
        PASS,
    ),
    (
        "strict schema: a fuzzy constraint, which re reads as a literal, is not read another way",
        {"response_format": schema_format({**PATTERNED, "properties": {"code": {"type": "string", "pattern": "^x{e<=1}$"}}})},
        reply('{"code": "y"}'),
        (NC, f"'message': {SCHEMA_CANNOT_COMPILE_MESSAGE}"),
        PASS,
    ),
    (
        "strict schema: a property named patternProperties beside unevaluatedProperties is only a name",
        {"response_format": schema_format({
            "type": "object",
            "properties": {"patternProperties": {"type": "string", "pattern": "^[a-z]+$"}},
            "required": ["patternProperties"],
            "unevaluatedProperties": False,
        })},
        reply('{"patternProperties": "ok"}'),
        PASS,
        PASS,
    ),
    (
        "strict schema: an empty patternProperties key matches every key",
        {"response_format": schema_format({"type": "object", "patternProperties": {"": {"type": "integer"}}, "additionalProperties": False})},
        reply('{"any": 1}'),
        PASS,
        PASS,
    ),
    (
        "tool call reply is exempt from the response format",
        {"tools": TOOLS_FG, "response_format": {"type": "json_object"}},
        calls_reply(call("f"), content=""),
        PASS,
        PASS,
    ),
]


@pytest.mark.parametrize("conformance", ["strict", "best_effort"])
@pytest.mark.parametrize(
    ("case", "extras", "body", "strict", "best_effort"), VERIFICATION, ids=[v[0] for v in VERIFICATION]
)
def test_verification_table(api, people, chat_job, conformance, case, extras, body, strict, best_effort):
    _, owner = people
    _, job = chat_job(extras=extras, conformance=conformance)
    outcome = strict if conformance == "strict" else best_effort
    response = submit(api, owner.key, job.id, body)
    if outcome is None:
        assert response.status_code == 200, response.json()
        assert Generation.objects.get(pk=job.pk).state == "ok"
    else:
        rc, message = outcome
        refused(response, rc, message)
        assert Generation.objects.get(pk=job.pk).chat_refusal_rc == rc


def _two_calls():
    return calls_reply(call("f", call_id="a"), call("g", call_id="b"))


def _submit_done_records(caplog) -> list:
    return [r for r in caplog.records if r.getMessage().startswith("horde.job_submit.done ")]


def test_single_call_reduction_keeps_the_first_call_under_strict(api, people, chat_job, caplog):
    _, owner = people
    _, job = chat_job(extras={"tools": TOOLS_FG, "parallel_tool_calls": False})
    with caplog.at_level(logging.INFO, logger="chat.services.submit"):
        assert submit(api, owner.key, job.id, _two_calls()).status_code == 200
    job.refresh_from_db()
    assert [c["id"] for c in job.message["tool_calls"]] == ["a"]
    assert job.finish_reason == "tool_calls"  # kept as submitted
    # "The submit's horde.job_submit.done log record then carries dropped_tool_calls."
    [record] = _submit_done_records(caplog)
    assert (record.generation_id, record.dropped_tool_calls) == (str(job.id), 1)


def test_best_effort_keeps_every_call(api, people, chat_job, caplog):
    _, owner = people
    _, job = chat_job(extras={"tools": TOOLS_FG, "parallel_tool_calls": False}, conformance="best_effort")
    with caplog.at_level(logging.INFO, logger="chat.services.submit"):
        assert submit(api, owner.key, job.id, _two_calls()).status_code == 200
    job.refresh_from_db()
    assert [c["id"] for c in job.message["tool_calls"]] == ["a", "b"]
    [record] = _submit_done_records(caplog)
    assert record.dropped_tool_calls == 0


def test_single_call_reduction_runs_before_the_checks(api, people, chat_job):
    _, owner = people
    body = calls_reply(call("f", call_id="a"), call("undefined", call_id="b"))
    _, strict_job = chat_job(extras={"tools": TOOLS_FG, "parallel_tool_calls": False})
    assert submit(api, owner.key, strict_job.id, body).status_code == 200  # the dropped call is not checked
    _, loose_job = chat_job(
        extras={"tools": TOOLS_FG, "parallel_tool_calls": False}, conformance="best_effort"
    )
    refused(submit(api, owner.key, loose_job.id, body), "ChatSubmitInvalid")


@pytest.mark.parametrize("conformance", ["strict", "best_effort"])
def test_tool_calls_finish_under_a_function_choice_is_stored_as_stop(api, people, chat_job, conformance):
    _, owner = people
    extras = {"tools": TOOLS_FG, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    _, job = chat_job(extras=extras, conformance=conformance)
    assert submit(api, owner.key, job.id, calls_reply(call("f"))).status_code == 200
    job.refresh_from_db()
    assert job.finish_reason == "stop"


# --- refusal record, worker counters and fault reasons --------------------------------------------


def fault(reason=None, model_id=CHAT_MODEL):
    body = {"state": "faulted", "model_id": model_id}
    if reason is not None:
        body["fault_reason"] = reason
    return body


def counters(generation) -> tuple[int, int]:
    worker = Worker.objects.get(pk=generation.worker_id)
    return worker.aborted_jobs, worker.nonconformant_replies


def test_fault_after_a_nonconformant_refusal_counts_a_nonconformant_reply(api, people, chat_job):
    _, owner = people
    _, job = chat_job(extras={"response_format": {"type": "json_object"}})
    refused(submit(api, owner.key, job.id, reply("prose")), NC)
    assert submit(api, owner.key, job.id, fault("reply_refused")).json() == {"reward": 0}
    assert counters(job) == (0, 1)


def test_fault_after_an_invalid_refusal_counts_an_aborted_job(api, people, chat_job):
    _, owner = people
    _, job = chat_job()
    refused(submit(api, owner.key, job.id, reply(None)), "ChatSubmitInvalid")
    assert submit(api, owner.key, job.id, fault("reply_refused")).status_code == 200
    assert counters(job) == (1, 0)


def test_fault_without_a_refusal_counts_an_aborted_job(api, people, chat_job):
    _, owner = people
    request, job = chat_job()
    assert submit(api, owner.key, job.id, fault()).status_code == 200
    assert counters(job) == (1, 0)
    request.refresh_from_db()
    assert request.jobs_waiting == 1  # restarted


def test_stale_abort_after_a_nonconformant_refusal_counts_a_nonconformant_reply(api, people, chat_job):
    _, owner = people
    _, job = chat_job(extras={"response_format": {"type": "json_object"}})
    refused(submit(api, owner.key, job.id, reply("prose")), NC)
    Generation.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert tasks.abort_stale_generations.apply().get() == 1
    assert counters(job) == (0, 1)


@pytest.mark.parametrize("reason", sorted(CHAT_WORKER_FAULT_MESSAGES))
def test_known_fault_reason_stores_the_horde_message(api, people, chat_job, reason):
    _, owner = people
    request, job = chat_job()
    assert submit(api, owner.key, job.id, fault(reason)).status_code == 200
    request.refresh_from_db()
    assert (request.chat_fault_reason, request.chat_fault_rc) == (
        CHAT_WORKER_FAULT_MESSAGES[reason],
        "ChatWorkerFault",
    )
    assert counters(job) == (1, 0)  # a reason does not exempt the fault


@pytest.mark.parametrize("reason", [None, "cosmic_rays", 42])
def test_unknown_or_missing_fault_reason_is_not_stored(api, people, chat_job, reason):
    _, owner = people
    request, job = chat_job()
    assert submit(api, owner.key, job.id, fault(reason)).status_code == 200
    request.refresh_from_db()
    assert (request.chat_fault_reason, request.chat_fault_rc) == (None, None)
    assert Generation.objects.get(pk=job.pk).state == "faulted"


def test_fault_reason_does_not_replace_a_refusal_of_the_same_generation(api, people, chat_job):
    _, owner = people
    request, job = chat_job()
    body = refused(submit(api, owner.key, job.id, reply(model_id="x")), "ChatModelMismatch")
    assert submit(api, owner.key, job.id, fault("reply_refused")).status_code == 200
    request.refresh_from_db()
    assert (request.chat_fault_reason, request.chat_fault_rc) == (body["message"], "ChatModelMismatch")


def test_fault_reason_on_a_generation_no_longer_pending_is_not_stored(api, people, chat_job):
    _, owner = people
    request, job = chat_job()
    Generation.objects.filter(pk=job.pk).update(state="faulted")
    refused(submit(api, owner.key, job.id, fault("prompt_overflow")), "AbortedGen")
    request.refresh_from_db()
    assert request.chat_fault_reason is None


def test_faulted_chat_submit_needs_the_assigned_model(api, people, chat_job):
    _, owner = people
    _, job = chat_job()
    refused(
        submit(api, owner.key, job.id, {"state": "faulted", "fault_reason": "prompt_overflow"}),
        "ChatSubmitInvalid",
        "'model_id': A chat submit needs model_id, the model that served the job.",
    )
    refused(submit(api, owner.key, job.id, fault(model_id="x")), "ChatModelMismatch")
    assert Generation.objects.get(pk=job.pk).chat_refusal_rc is None  # a fault is not a reply


def test_text_shaped_fault_of_a_chat_job_still_lands(api, people, chat_job):
    _, owner = people
    _, job = chat_job()
    assert submit(api, owner.key, job.id, {"generation": "", "state": "faulted"}).json() == {"reward": 0}
    assert Generation.objects.get(pk=job.pk).state == "faulted"


def test_worker_faults_metric_counts_each_faulted_chat_submit(
    api, people, chat_job, make_user, metric_reader
):
    _, owner = people
    for reason in ("prompt_overflow", "cosmic_rays", None):
        _, job = chat_job()
        assert submit(api, owner.key, job.id, fault(reason)).status_code == 200
    # A repeated fault for a job already faulted is counted again, before it is refused.
    refused(submit(api, owner.key, job.id, fault()), "AbortedGen")
    trusted = make_user("trusted-owner", trusted=True)
    trusted_job = pop_chat_job(make_chat_request(people[0].user), make_chat_worker(trusted.user, name="t"))[0]
    assert submit(api, trusted.key, trusted_job.id, fault("generation_error")).status_code == 200
    # A refusal the horde stored is not counted; only the worker's fault is.
    _, refused_job = chat_job()
    refused(submit(api, owner.key, refused_job.id, reply(None)), "ChatSubmitInvalid")
    assert submit(api, owner.key, refused_job.id, fault("reply_refused")).status_code == 200

    assert counter_points(metric_reader, "horde.chat.worker_faults") == {
        (("horde.reason", "prompt_overflow"), ("horde.worker_trusted", False)): 1,
        (("horde.reason", "unknown"), ("horde.worker_trusted", False)): 1,
        (("horde.reason", "none"), ("horde.worker_trusted", False)): 2,
        (("horde.reason", "generation_error"), ("horde.worker_trusted", True)): 1,
        (("horde.reason", "reply_refused"), ("horde.worker_trusted", False)): 1,
    }


def test_empty_generations_are_counted_per_model(api, horde, people, chat_job, metric_reader):
    """A stored reply without text counts (chat and text, on either submit path); a chat reply of
    tool calls alone is a complete reply and does not."""
    requester, owner = people
    _, job = chat_job()
    assert submit(api, owner.key, job.id, reply("")).status_code == 200
    _, calls_job = chat_job(extras={"tools": [tool("f")], "tool_choice": "required"})
    calls = reply(None, finish_reason="tool_calls", tool_calls=[call("f")])
    assert submit(api, owner.key, calls_job.id, calls).status_code == 200
    _, worded_job = chat_job()
    assert submit(api, owner.key, worded_job.id, reply("Words.")).status_code == 200
    for text in ("", "A story."):
        horde.text_async(requester.key, models=[CHAT_MODEL])
        text_job = horde.pop(owner.key, models=[CHAT_MODEL]).json()
        assert horde.submit(owner.key, text_job["id"], text).status_code == 200
    assert counter_points(metric_reader, "horde.text.empty_generations") == {
        (("horde.chat", True), ("horde.model", CHAT_MODEL)): 1,
        (("horde.chat", False), ("horde.model", CHAT_MODEL)): 1,
    }


def test_text_faults_are_not_counted_as_chat_worker_faults(api, horde, people, metric_reader):
    requester, owner = people
    horde.text_async(requester.key, models=[CHAT_MODEL])
    job = horde.pop(owner.key).json()
    assert horde.submit(owner.key, job["id"], "", state="faulted").status_code == 200
    assert counter_points(metric_reader, "horde.chat.worker_faults") == {}


# --- faulting after FAULTED_GENERATIONS_LIMIT -------------------------------------------------------


def test_request_faults_on_the_submit_that_crosses_the_limit(api, people):
    requester, owner = people
    worker = make_chat_worker(owner.user)
    request = make_chat_request(requester.user, kudos_quote=Decimal("30"))
    for attempt in range(3):
        request.refresh_from_db()
        assert not request.faulted and request.jobs_waiting == 1, attempt
        job = pop_chat_job(request, worker)[0]
        assert submit(api, owner.key, job.id, fault("prompt_overflow")).status_code == 200
    request.refresh_from_db()
    assert request.faulted and request.jobs_waiting == 0
    assert request.chat_fault_reason == CHAT_WORKER_FAULT_MESSAGES["prompt_overflow"]
    assert Worker.objects.get(pk=worker.pk).aborted_jobs == 3


@pytest.mark.postgres_only
def test_a_chat_reply_is_stored_and_settled_in_one_statement(people, chat_job):
    """On PostgreSQL: the job read, its state, the claim with its whole settlement, and the
    request's results and done: four statements, and the rows are the ORM path's."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from accounts.models import KudosTransaction
    from chat.services.submit import job_submit

    requester, owner = people
    request, job = chat_job()
    with CaptureQueriesContext(connection) as queries:
        reward = job_submit(user=owner.user, generation_id=job.id, text=None, chat_body=reply("Hello from the bench."))
    statements = [q["sql"] for q in queries.captured_queries if not q["sql"].startswith(("SAVEPOINT", "RELEASE"))]
    assert len(statements) == 4, statements
    job.refresh_from_db()
    assert job.state == "ok" and job.kudos == reward == expected_reward(request, job, len("Hello from the bench."))
    assert requester.refresh().kudos == Decimal("1000") - reward and owner.refresh().kudos == reward
    assert sorted(KudosTransaction.objects.filter(generation_id=job.id).values_list("amount", flat=True)) == [-reward, reward]
    request.refresh_from_db()
    assert request.consumed_kudos == reward and request.kudos_held == Decimal("0")
    worker = Worker.objects.get(pk=job.worker_id)
    assert worker.fulfilments == 1 and len(worker.speed_samples) == 1 and worker.kudos_earned == reward


def test_a_chat_reply_is_priced_as_its_pop_stored(people, chat_job):
    """The pop stores the job's price (ADR 0026): a change to the model reference or the owner's
    trust between pop and submit does not change what the reply earns."""
    from chat.pricing import kudos_amount
    from chat.services.submit import job_submit

    requester, owner = people
    request, job = chat_job()
    # The price a pop stores (chat/services/pop.py), unlike what the formula gives today.
    Generation.objects.filter(pk=job.pk).update(
        price_rate=0.5, price_flat=1.0, price_max_length=request.max_length, price_owner_trusted=False
    )
    job.refresh_from_db()
    content = "A reply long enough to pass the floor of twenty tokens, counted by characters. " * 2
    reward = job_submit(user=owner.user, generation_id=job.id, text=None, chat_body=reply(content))
    tokens = math.ceil(len(content) / 4)
    assert reward == kudos_amount(tokens * 0.5 + 1.0) == Generation.objects.get(pk=job.pk).kudos
    assert owner.refresh().kudos == reward
