"""Background streams (`background: true, stream: true`) and their resumption by
`GET /v1/responses/{id}?stream=true&starting_after=N` (docs/adr/0106-resumable-background-streams.md),
against the live horde and its mounted front, read with the real openai SDK: the sequence is
`response.created` (queued), `response.queued`, `response.in_progress` once a worker took the
request (or with the rest), then the output's events and the terminal event, numbered 0, 1, 2, ... the same for every reader; a
client that leaves does not cancel the request; a reader resumes after any sequence number."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.oai.conftest import MODEL, TEXT_OUTPUT_EVENTS, text_reply, wait_for
from tests.oai.test_responses_background import _idle_worker, _poll, _requests
from tests.oai.test_responses_libraries import strict_errors

pytestmark = pytest.mark.slow

NAMESPACE_TOOL = {"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "function", "name": "f"}]}


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _sse_data(lines) -> Any:
    """Each event's data, as it arrives, checked to be named by its type and valid for openai's types
    in strict mode."""
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
            assert data["type"] == name, (name, data)
            assert strict_errors(data, event=True) == [], data
            yield data


def _read_stream(front, key: str, path: str, **params: Any) -> list[dict[str, Any]]:
    with httpx.stream("GET", f"{front.live.v1}{path}", params=params, headers=_headers(key), timeout=30) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        return list(_sse_data(answer.iter_lines()))


def test_a_background_stream_is_queued_then_the_whole_reply_in_order(client, live_horde, worker_owner, workers):
    worker = _idle_worker(live_horde, worker_owner)
    with client.responses.create(model=MODEL, input="Hello?", background=True, stream=True) as stream:
        events = iter(stream)
        created, queued = next(events), next(events)
        assert (created.type, created.response.status, created.response.background) == ("response.created", "queued", True)
        assert (queued.type, queued.response.status) == ("response.queued", "queued")
        assert created.response.output == [] and created.response.usage is None
        workers.append(worker.start())  # the rest comes once a worker served it
        rest = list(events)
    sent = [created, queued, *rest]
    assert [event.type for event in sent] == [
        "response.created",
        "response.queued",
        "response.in_progress",
        *TEXT_OUTPUT_EVENTS,
        "response.completed",
    ]
    assert [event.sequence_number for event in sent] == list(range(len(sent)))
    completed = sent[-1].response
    assert completed.output_text == "Hello from the horde." and completed.background is True
    assert rest[0].response.status == "in_progress" and rest[0].response.output == []
    assert rest[3].delta == "Hello from the horde."
    assert len({event.response.id for event in (created, queued, rest[0], sent[-1])}) == 1
    # Kept as its last event gave it; a GET reads it whole.
    assert client.responses.retrieve(completed.id).model_dump() == completed.model_dump()
    (row,) = _requests()
    assert row.front_lease_expires_at is None  # a background request: no client's lease


def test_a_client_that_leaves_does_not_cancel_it_and_resumes_after_a_sequence_number(
    front, client, requester, live_horde, worker_owner, workers
):
    worker = _idle_worker(live_horde, worker_owner)
    body = {"model": MODEL, "input": "Hello?", "background": True, "stream": True}
    seen: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{front.live.v1}/responses", json=body, headers=_headers(requester.key), timeout=30) as answer:
        assert answer.status_code == 200
        for data in _sse_data(answer.iter_lines()):
            seen.append(data)
            if data["type"] == "response.queued":
                break  # the client goes away
    response_id = seen[0]["response"]["id"]
    assert wait_for(lambda: front.state().background_streams == 0, 5)  # its reader noticed, and stopped
    (row,) = _requests()
    assert not row.cancelled  # a background request runs on without its reader
    workers.append(worker.start())
    assert _poll(client, response_id, ("completed",)).output_text == "Hello from the horde."
    assert len(worker.jobs) == 1

    full = _read_stream(front, requester.key, f"/responses/{response_id}", stream="true")
    assert full[:2] == seen  # the same events, the same numbers, for every reader
    assert [event["sequence_number"] for event in full] == list(range(len(full)))
    resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=1))
    assert [event.model_dump(mode="json", exclude_unset=True) for event in resumed] == full[2:]
    assert resumed[0].type == "response.in_progress" and resumed[-1].type == "response.completed"
    assert resumed[-1].response.model_dump() == client.responses.retrieve(response_id).model_dump()
    assert _read_stream(front, requester.key, f"/responses/{response_id}", stream="true", starting_after=len(full) - 1) == []


def test_in_progress_is_sent_once_a_worker_took_the_request_and_a_later_reader_sees_the_same(
    front, client, requester, live_horde, worker_owner, workers
):
    """`response.in_progress` comes while the worker still generates (at the reader's next wake), not
    with the reply; it is event 2 either way, so a reader after the end gets the same sequence."""
    release = threading.Event()

    def reply(job: dict[str, Any]) -> dict[str, Any]:
        release.wait(20)
        return text_reply("Worth the wait.")(job)

    worker = _idle_worker(live_horde, worker_owner, reply=reply)
    body = {"model": MODEL, "input": "Hello?", "background": True, "stream": True}
    live: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{front.live.v1}/responses", json=body, headers=_headers(requester.key), timeout=30) as answer:
        assert answer.status_code == 200
        for data in _sse_data(answer.iter_lines()):
            live.append(data)
            if data["type"] == "response.queued":
                workers.append(worker.start())
            if data["type"] == "response.in_progress":
                # Taken, not answered yet (the pop's answer may reach the worker's thread after
                # the front saw the job processing).
                assert wait_for(lambda: worker.jobs, 10) and not worker.submits
                assert data["sequence_number"] == 2 and data["response"]["status"] == "in_progress"
                release.set()
    assert [event["type"] for event in live] == [
        "response.created", "response.queued", "response.in_progress", *TEXT_OUTPUT_EVENTS, "response.completed"
    ]
    assert [event["sequence_number"] for event in live] == list(range(len(live)))
    assert live[-1]["response"]["output"][0]["content"][0]["text"] == "Worth the wait."
    assert _read_stream(front, requester.key, f"/responses/{live[0]['response']['id']}", stream="true") == live


def test_the_sdks_stream_helper_resumes_a_pending_response(client, live_horde, worker_owner, workers):
    """`responses.stream(response_id=..., starting_after=N)` reads the whole stream and drops the
    events up to N itself; the GET waits for the request to end, sending keepalives meanwhile."""
    worker = _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hello?", background=True)
    timer = threading.Timer(1.0, lambda: workers.append(worker.start()))
    timer.start()
    try:
        with client.responses.stream(response_id=created.id, starting_after=2) as stream:
            events = list(stream)
            final = stream.get_final_response()
    finally:
        timer.cancel()
    assert events[0].sequence_number == 3 and events[0].type == "response.output_item.added"
    assert [event.sequence_number for event in events] == list(range(3, 3 + len(events)))
    assert final.output_text == "Hello from the horde." and final.status == "completed"
    assert final.id == created.id
    assert client.responses.retrieve(created.id).output_text == final.output_text


def test_the_async_client_creates_and_resumes_a_background_stream(front, requester, start_worker):
    start_worker()

    async def read() -> tuple[list[Any], list[Any]]:
        async with openai.AsyncOpenAI(base_url=front.live.v1, api_key=requester.key, max_retries=0, timeout=30) as sdk:
            stream = await sdk.responses.create(model=MODEL, input="Hello?", background=True, stream=True)
            created = [event async for event in stream]
            again = await sdk.responses.retrieve(created[0].response.id, stream=True, starting_after=2)
            return created, [event async for event in again]

    created, resumed = asyncio.run(read())
    assert created[-1].type == "response.completed" and created[-1].response.output_text == "Hello from the horde."
    assert [event.model_dump() for event in resumed] == [event.model_dump() for event in created[3:]]


def test_a_reply_with_reasoning_and_tool_calls_streams_as_a_whole_reply_does(front, client, requester, start_worker):
    """The output's events are the whole (non-relayed) stream's: a reasoning item, the message, a
    namespaced function call; only the lifecycle's start differs."""

    def reply(job: dict[str, Any]) -> dict[str, Any]:
        call = {"id": "call_0", "type": "function", "function": {"name": "ns__f", "arguments": "{}"}}
        message = {"role": "assistant", "content": "Let me see.", "reasoning_content": "Think.", "tool_calls": [call]}
        return {"message": message, "finish_reason": "tool_calls", "reasoning_tokens": 1, "completion_tokens": 4}

    start_worker(reply=reply)
    body = {"model": MODEL, "input": "Go?", "tools": [NAMESPACE_TOOL], "reasoning": {"effort": "low", "summary": "auto"}}
    with httpx.stream(
        "POST", f"{front.live.v1}/responses", json={**body, "stream": True}, headers=_headers(requester.key), timeout=30
    ) as answer:
        whole = list(_sse_data(answer.iter_lines()))
    background_id = client.responses.create(**body, background=True).id
    assert _poll(client, background_id, ("completed",)).status == "completed"
    replayed = _read_stream(front, requester.key, f"/responses/{background_id}", stream="true")

    def output_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The output's events, numbers dropped and the response's own id (in its items' ids) aliased."""
        suffix = events[-1]["response"]["id"][len("resp_") :]
        lifecycle = ("response.created", "response.queued", "response.in_progress", "response.completed")
        output = [{k: v for k, v in e.items() if k != "sequence_number"} for e in events if e["type"] not in lifecycle]
        return json.loads(json.dumps(output).replace(suffix, "ID"))

    assert [e["type"] for e in replayed[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert output_events(replayed) == output_events(whole)
    assert [e["type"] for e in whole[:2]] == ["response.created", "response.in_progress"]
    assert replayed[-1]["response"]["output"][2] == {**replayed[-1]["response"]["output"][2], "name": "f", "namespace": "ns"}
    assert replayed[-1]["response"] == client.responses.retrieve(background_id).model_dump(mode="json", exclude_unset=True)


def test_a_cancelled_response_streamed_by_get_ends_with_the_cancelled_response(
    front, client, requester, live_horde, worker_owner
):
    _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    read: list[dict[str, Any]] = []
    reader = threading.Thread(
        target=lambda: read.extend(_read_stream(front, requester.key, f"/responses/{created.id}", stream="true"))
    )
    reader.start()  # a reader waiting when the cancel comes
    time.sleep(0.5)
    assert client.responses.cancel(created.id).status == "cancelled"
    reader.join(10)
    assert not reader.is_alive()
    assert [event["type"] for event in read] == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.failed",
    ]
    assert read[-1]["response"]["status"] == "cancelled" and read[-1]["response"]["output"] == []
    assert read[-1]["response"] == client.responses.retrieve(created.id).model_dump(mode="json", exclude_unset=True)
    assert _read_stream(front, requester.key, f"/responses/{created.id}", stream="true") == read


def test_a_failed_response_stream_ends_with_response_failed(front, client, requester, start_worker):
    start_worker(reply=lambda job: {"message": {"role": "assistant", "content": "not json"}, "finish_reason": "stop"})
    colour = {
        "type": "json_schema",
        "name": "colour",
        "strict": True,
        "schema": {"type": "object", "properties": {"shade": {"type": "string"}}, "required": ["shade"], "additionalProperties": False},
    }
    with client.responses.create(model=MODEL, input="Colour?", text={"format": colour}, background=True, stream=True) as stream:
        events = list(stream)
    assert [event.type for event in events] == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.error.message
    assert events[3].message == failed.error.message
    assert failed.model_dump() == client.responses.retrieve(failed.id).model_dump()


def test_a_reply_cut_at_its_length_ends_with_response_incomplete(client, start_worker):
    start_worker(reply=text_reply("Once upon a", finish_reason="length"))
    created = client.responses.create(model=MODEL, input="A story.", max_output_tokens=16, background=True)
    assert _poll(client, created.id, ("incomplete",)).status == "incomplete"
    events = list(client.responses.retrieve(created.id, stream=True))
    assert [event.type for event in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    incomplete = events[-1].response
    assert incomplete.incomplete_details.reason == "max_output_tokens" and incomplete.output_text == "Once upon a"
    assert events[-2].item.status == "incomplete" and incomplete.output[0].status == "incomplete"
    assert incomplete.model_dump() == client.responses.retrieve(created.id).model_dump()


def test_a_stopping_front_ends_its_waiting_readers_and_the_request_runs_on(
    front, client, requester, live_horde, worker_owner
):
    """A process that stops ends the streams waiting on it (their clients resume elsewhere), without
    an end event and without cancelling the request."""
    _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)

    async def stop() -> None:
        from oai.state import get_front_state

        (await get_front_state()).stop(time.monotonic() + 10)

    with httpx.stream(
        "GET", f"{front.live.v1}/responses/{created.id}", params={"stream": "true"}, headers=_headers(requester.key), timeout=30
    ) as answer:
        lines = answer.iter_lines()
        assert "event: response.queued" in (next(lines), next(lines), next(lines), next(lines))
        started = time.monotonic()
        front.live.run(stop())
        rest = [line for line in lines if line.startswith("event: ")]
    assert rest == [] and time.monotonic() - started < 5
    (row,) = _requests()
    assert not row.cancelled


# --- refusals ----------------------------------------------------------------------------------------


def test_another_keys_stream_is_not_found(front, client, make_user, live_horde, worker_owner):
    _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    other = make_user("other-stream-reader", kudos=100)
    answer = httpx.get(
        f"{front.live.v1}/responses/{created.id}", params={"stream": "true"}, headers=_headers(other.key), timeout=30
    )
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["message"].startswith(f"Response with id '{created.id}' not found.")


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"stream": "true", "starting_after": "-1"}, "starting_after"),
        ({"stream": "true", "starting_after": "two"}, "starting_after"),
        ({"stream": "true", "starting_after": "1.5"}, "starting_after"),
        ({"stream": "maybe"}, "stream"),
        ({"stream": "2"}, "stream"),
        ({"stream": ""}, "stream"),
    ],
)
def test_a_bad_stream_parameter_is_refused(front, client, requester, live_horde, worker_owner, params, param):
    _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    answer = httpx.get(f"{front.live.v1}/responses/{created.id}", params=params, headers=_headers(requester.key), timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert answer.headers["x-should-retry"] == "false"


def test_stream_one_and_zero_read_as_true_and_false(front, client, requester, start_worker):
    """The openai SDKs send `true`/`false`; a hand-written query or a form sends `1`/`0` (docs/adr/0110)."""
    start_worker()
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    assert _poll(client, created.id, ("completed",)).status == "completed"
    path = f"/responses/{created.id}"
    assert _read_stream(front, requester.key, path, stream="1") == _read_stream(front, requester.key, path, stream="true")
    assert _read_stream(front, requester.key, path, stream="1", starting_after="3")[0]["sequence_number"] == 4
    whole = httpx.get(f"{front.live.v1}{path}", params={"stream": "0"}, headers=_headers(requester.key), timeout=30)
    plain = httpx.get(f"{front.live.v1}{path}", headers=_headers(requester.key), timeout=30)
    assert whole.status_code == 200 and whole.headers["content-type"] == "application/json"
    assert whole.json() == plain.json() and whole.json()["status"] == "completed"


def test_a_response_not_made_in_background_is_not_streamed_again(client, start_worker):
    """As OpenAI: its events were not the background sequence, so a resume would skip the wrong ones."""
    start_worker()
    whole = client.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.retrieve(whole.id, stream=True)
    assert caught.value.body["param"] == "stream"
    assert caught.value.body["message"] == "This response cannot be streamed because it was not created with background=true."
    assert client.responses.retrieve(whole.id, stream=False).output_text == "Hello from the horde."


def test_a_front_without_redis_streams_its_background_responses(front, client, requester, start_worker):
    """The embedded default keeps the record in its process: the same process streams and resumes it."""
    front.configure(redis_url=None)
    start_worker()
    with client.responses.create(model=MODEL, input="Hello?", background=True, stream=True) as stream:
        events = list(stream)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Hello from the horde."
    again = _read_stream(front, requester.key, f"/responses/{events[0].response.id}", stream="true", starting_after=0)
    assert again == [event.model_dump(mode="json", exclude_unset=True) for event in events[1:]]


def test_waiting_readers_notice_a_disconnect(front, client, requester, live_horde, worker_owner):
    """A GET stream of a pending response ends when its client goes: nothing is cancelled, and the
    process holds no reader for it."""
    _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    with httpx.stream(
        "GET", f"{front.live.v1}/responses/{created.id}", params={"stream": "true"}, headers=_headers(requester.key), timeout=30
    ) as answer:
        assert answer.status_code == 200
        lines = answer.iter_lines()
        assert "event: response.queued" in (next(lines), next(lines), next(lines), next(lines))
        assert front.state().background_streams == 1  # a reader waits
    assert wait_for(lambda: front.state().background_streams == 0, 5)
    (row,) = _requests()
    assert not row.cancelled


@pytest.mark.redis_only
def test_a_stream_whose_record_redis_cannot_read_is_the_retryable_503(front, client, requester, live_horde, worker_owner):
    _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    front.configure(redis_url="redis://127.0.0.1:1/0")
    answer = httpx.get(
        f"{front.live.v1}/responses/{created.id}", params={"stream": "true"}, headers=_headers(requester.key), timeout=30
    )
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "ResponseItemsUnavailable"
    assert answer.headers["x-should-retry"] == "true"


def test_a_caller_without_a_key_is_401_before_its_stream_parameters_are_read(front):
    """As every kept-response route: the key first, then the query (a bad one is not told to a stranger)."""
    front.configure(allow_anonymous=False)
    answer = httpx.get(f"{front.live.v1}/responses/resp_unknown", params={"stream": "maybe"}, timeout=30)
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "invalid_api_key"


def test_a_stopping_front_refuses_a_new_stream_with_the_retryable_503(front, client, requester, live_horde, worker_owner):
    """A reader that came during the stop would get the start and then an end without its end; the
    503 sends the SDK's own retry (and a resume) to a process that stays."""
    _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)

    async def stop() -> None:
        from oai.state import get_front_state

        (await get_front_state()).stop(time.monotonic() + 10)

    front.live.run(stop())
    answer = httpx.get(
        f"{front.live.v1}/responses/{created.id}", params={"stream": "true"}, headers=_headers(requester.key), timeout=30
    )
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "FrontStopping"
    assert "cancelled" not in answer.json()["error"]["message"]  # nothing was: the request runs on
    assert answer.headers["x-should-retry"] == "true"
    (row,) = _requests()
    assert not row.cancelled
