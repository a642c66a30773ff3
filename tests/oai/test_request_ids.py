"""x-request-id on every /v1/ answer, as OpenAI sends it (docs/adr/0128-x-request-id.md): what the
OpenAI SDK reads as `_request_id` and `APIStatusError.request_id`, what a browser may read, and
the log lines of the request that carry it (with a client's X-Client-Request-Id beside it)."""

from __future__ import annotations

import logging
import logging.config
import re

import httpx
import openai
import pytest
from django.conf import settings

from tests.oai.conftest import MODEL, wait_for

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hello?"}]
REQUEST_ID = re.compile(r"^req_[0-9a-f]{32}$")


def _request_id(response: httpx.Response) -> str:
    request_id = response.headers.get("x-request-id", "")
    assert REQUEST_ID.match(request_id), (response.status_code, dict(response.headers))
    return request_id


# --- what the OpenAI SDK reads ----------------------------------------------------------------------


def test_a_whole_completion_has_its_own_request_id(front, client, start_worker):
    start_worker()
    first = client.chat.completions.create(model=MODEL, messages=USER)
    second = client.chat.completions.create(model=MODEL, messages=USER)
    assert REQUEST_ID.match(first._request_id or ""), first._request_id
    assert REQUEST_ID.match(second._request_id or ""), second._request_id
    assert first._request_id != second._request_id


def test_a_streamed_completion_names_its_request_id_in_its_headers(front, client, start_worker):
    start_worker()
    with client.chat.completions.create(model=MODEL, messages=USER, stream=True) as stream:
        request_id = stream.response.headers.get("x-request-id", "")
        chunks = list(stream)
    assert REQUEST_ID.match(request_id), request_id
    assert chunks and chunks[-1].choices[0].finish_reason == "stop"


def test_text_completions_responses_and_models_have_request_ids(front, client, start_worker, start_text_worker):
    start_worker()
    start_text_worker()
    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20)
    response = client.responses.create(model=MODEL, input="Hello", store=False)
    models = client.models.with_raw_response.list()
    ids = [text._request_id, response._request_id, models.request_id]
    assert all(REQUEST_ID.match(request_id or "") for request_id in ids), ids
    assert len(set(ids)) == 3


def test_an_api_error_carries_the_request_id(front, client, start_worker):
    start_worker()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError) as not_found:
        client.models.retrieve("no-such/model")
    assert not_found.value.code == "model_not_found"
    assert REQUEST_ID.match(refused.value.request_id or ""), refused.value.request_id
    assert REQUEST_ID.match(not_found.value.request_id or ""), not_found.value.request_id
    assert refused.value.request_id != not_found.value.request_id


# --- on the wire -----------------------------------------------------------------------------------


def test_an_event_stream_carries_the_request_id(front, requester, start_worker):
    start_worker()
    with httpx.stream(
        "POST",
        f"{front.live.v1}/responses",
        json={"model": MODEL, "input": "Hello", "stream": True, "store": False},
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=20,
    ) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        _request_id(answer)
        assert "event: response.completed" in answer.read().decode()


def test_refusals_before_and_inside_the_views_carry_a_request_id(front, requester):
    front.configure(allow_anonymous=False, max_body_bytes=1000)
    v1 = front.live.v1
    auth = {"Authorization": f"Bearer {requester.key}"}
    answers = {
        "unknown path": httpx.post(f"{v1}/embeddings", json={"input": "x"}, headers=auth),
        "no key": httpx.post(f"{v1}/chat/completions", json={"model": MODEL, "messages": USER}),
        "too large": httpx.post(
            f"{v1}/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]}, headers=auth
        ),
        "not kept": httpx.get(f"{v1}/responses/resp_0123456789abcdef", headers=auth),
    }
    assert {name: answer.status_code for name, answer in answers.items()} == {
        "unknown path": 404,
        "no key": 401,
        "too large": 413,
        "not kept": 404,
    }
    ids = {name: _request_id(answer) for name, answer in answers.items()}
    assert len(set(ids.values())) == len(ids)
    # The bodies are as they were: the id is a header only.
    assert answers["no key"].json()["error"]["code"] == "invalid_api_key"
    assert "request_id" not in answers["unknown path"].json()["error"].get("metadata", {})


def test_a_browser_may_read_the_request_id(front, requester):
    preflight = httpx.options(
        f"{front.live.v1}/chat/completions",
        headers={"Origin": "null", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"},
    )
    answer = httpx.get(f"{front.live.v1}/models", headers={"Origin": "null", "Authorization": f"Bearer {requester.key}"})
    for response in (preflight, answer):
        exposed = [name.strip().lower() for name in response.headers["access-control-expose-headers"].split(",")]
        assert "x-request-id" in exposed
    _request_id(answer)


# --- the logs ----------------------------------------------------------------------------------------


def _formatted(record: logging.LogRecord) -> str:
    """The record as the horde's console handler writes it (settings.LOGGING)."""
    formatter = logging.config.DictConfigurator({}).configure_formatter(dict(settings.LOGGING["formatters"]["plain"]))
    return formatter.format(record)


def test_a_requests_log_lines_carry_its_request_id_and_the_clients(front, client, start_worker, caplog):
    """The finished line links the horde's request id to the x-request-id; the client's own id is
    logged beside them."""
    start_worker()
    caplog.set_level("INFO")
    completion = client.chat.completions.create(
        model=MODEL, messages=USER, extra_headers={"X-Client-Request-Id": "my-trace 42"}
    )
    finished = wait_for(lambda: [r for r in caplog.records if r.name == "oai.requests"])
    (record,) = finished
    assert completion.id == f"chatcmpl-{record.request_id}"
    assert record.x_request_id == completion._request_id
    assert record.client_request_id == "my-trace 42"
    line = _formatted(record)
    assert f' x_request_id={completion._request_id} client_request_id="my-trace 42" Chat request {record.request_id} finished:' in line, line
    # The message still ends the line, as the spec's finished line ends.
    assert line.endswith(record.getMessage()) and "first_read_eligible_worker_threads=" in line.rsplit(" ", 1)[-1], line


def test_a_refusals_log_line_carries_its_request_id(front, requester, caplog):
    """Django's warning of a 4xx answer, and the front's own line of a refusal before Django."""
    front.configure(max_body_bytes=1000)
    caplog.set_level("INFO")
    auth = {"Authorization": f"Bearer {requester.key}"}
    refused = httpx.post(f"{front.live.v1}/chat/completions", json={"model": MODEL, "messages": []}, headers=auth)
    too_large = httpx.post(
        f"{front.live.v1}/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]}, headers=auth
    )
    assert (refused.status_code, too_large.status_code) == (400, 413)
    for answer in (refused, too_large):
        request_id = _request_id(answer)
        lines = wait_for(lambda request_id=request_id: [r for r in caplog.records if getattr(r, "x_request_id", None) == request_id])
        assert lines, [r.getMessage() for r in caplog.records]
        assert all(f" x_request_id={request_id} {r.getMessage()}" in _formatted(r) for r in lines)
    assert any(r.name == "django.request" and r.getMessage() == "Bad Request: /v1/chat/completions" for r in caplog.records)


@pytest.mark.parametrize(
    "client_id", ["x" * 513, "caf\u00e9", "tab\there", ""], ids=["too-long", "not-ascii", "control", "empty"]
)
def test_a_client_request_id_not_printable_ascii_up_to_512_is_not_logged(front, requester, caplog, client_id):
    """Nothing refused for it (the front only logs it); OpenAI's bound of 512 ASCII characters."""
    caplog.set_level("INFO")
    answer = httpx.post(
        f"{front.live.v1}/chat/completions",
        json={"model": MODEL, "messages": []},
        headers={"Authorization": f"Bearer {requester.key}", "X-Client-Request-Id": client_id.encode("utf-8")},
    )
    assert answer.status_code == 400
    request_id = _request_id(answer)
    lines = wait_for(lambda: [r for r in caplog.records if getattr(r, "x_request_id", None) == request_id])
    assert lines and all(getattr(r, "client_request_id", None) is None for r in lines)
    assert all("client_request_id" not in _formatted(r) for r in lines)


def test_a_client_request_id_of_512_characters_is_logged(front, requester, caplog):
    caplog.set_level("INFO")
    client_id = "a" * 512
    answer = httpx.post(
        f"{front.live.v1}/chat/completions",
        json={"model": MODEL, "messages": []},
        headers={"Authorization": f"Bearer {requester.key}", "X-Client-Request-Id": client_id},
    )
    request_id = _request_id(answer)
    lines = wait_for(lambda: [r for r in caplog.records if getattr(r, "x_request_id", None) == request_id])
    assert lines and all(r.client_request_id == client_id for r in lines)
    assert "x-request-id" in answer.headers and answer.headers.get("x-client-request-id") is None


def test_the_processs_own_tasks_started_by_a_request_log_without_its_id(front, client, start_worker, own_redis, caplog):
    """The completion-signal listener (and the other tasks of the process a first request starts)
    serve every request after it: their lines name none."""
    process, url = own_redis
    front.configure(redis_url=url)
    start_worker()
    caplog.set_level("INFO")
    completion = client.chat.completions.create(model=MODEL, messages=USER)
    process.terminate()
    process.wait(10)
    lost = wait_for(lambda: [r for r in caplog.records if r.name == "oai.waiter" and "connection lost" in r.getMessage()])
    assert lost, [r.getMessage() for r in caplog.records if r.name.startswith("oai")]
    assert all(getattr(r, "x_request_id", None) is None for r in lost), completion._request_id


def test_the_native_apis_lines_of_an_in_process_call_carry_the_front_requests_id(front, caplog):
    """The mounted front calls the native API on a thread of its own: Django's warning of the native
    401 (an unknown key's check) names the front request that made the call, and the thread's next
    call, for another request, names that one."""
    caplog.set_level("INFO")
    answers = [
        httpx.post(
            f"{front.live.v1}/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer not-a-key-{n}"},
        )
        for n in range(2)
    ]
    assert [answer.status_code for answer in answers] == [401, 401]
    for answer in answers:
        request_id = _request_id(answer)
        native = wait_for(
            lambda request_id=request_id: [
                r
                for r in caplog.records
                if r.name == "django.request"
                and r.getMessage().startswith("Unauthorized: /api/v2/")
                and getattr(r, "x_request_id", None) == request_id
            ]
        )
        assert len(native) == 1, [(r.getMessage(), getattr(r, "x_request_id", None)) for r in caplog.records]
        assert native[0].threadName.startswith("oai-native")
