"""A kept response read again, its input items listed and deleted
(docs/adr/0103-kept-responses-read-and-deleted.md): the openai SDK's `responses.retrieve`,
`responses.input_items.list` and `responses.delete` against the live horde and its mounted front,
each body read by the SDK's own types."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response
from openai.types.responses.response_item_list import ResponseItemList

from tests.oai.conftest import MODEL, responses_sse, text_reply
from tests.oai.test_completions import calls_reply
from tests.oai.test_responses import WEATHER

pytestmark = pytest.mark.slow

def _get(front, key: str, path: str, **params: Any) -> httpx.Response:
    return httpx.get(
        f"{front.live.v1}/responses/{path}", params=params, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def test_a_kept_response_is_retrieved_as_it_was_delivered(front, client, start_worker):
    start_worker(reply=text_reply("Kept."))
    created = client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", metadata={"k": "v"})
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    raw = _get(front, client.api_key, created.id)
    assert raw.status_code == 200
    Response.model_validate(raw.json(), strict=True)


def test_a_streamed_response_is_retrieved_as_its_last_event_gave_it(front, client, start_worker):
    start_worker(reply=calls_reply("get_weather"))
    headers = {"Authorization": f"Bearer {client.api_key}"}
    body = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "stream": True}
    with httpx.stream("POST", f"{front.live.v1}/responses", json=body, headers=headers, timeout=30) as answer:
        events = list(responses_sse(answer))
    name, data = events[-1]
    assert name == "response.completed"
    assert _get(front, client.api_key, data["response"]["id"]).json() == data["response"]


def test_the_input_items_are_the_responses_own_input_newest_first_by_default(front, client, start_worker):
    worker = start_worker(reply=calls_reply("get_weather"))
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", instructions="Be brief.", tools=[WEATHER])
    worker.reply = text_reply("Sunny.")
    call = first.output[0]
    second = client.responses.create(
        model=MODEL,
        tools=[WEATHER],
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"},
            {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
        ],
    )
    first_items = client.responses.input_items.list(first.id)
    assert [(item.type, item.role) for item in first_items.data] == [("message", "user")]
    assert first_items.data[0].content[0].text == "Weather in Oslo?"  # the instructions are no input item
    newest_first = client.responses.input_items.list(second.id)
    assert [item.type for item in newest_first.data] == ["message", "function_call_output"]
    assert newest_first.data[1].call_id == call.call_id and newest_first.data[1].output == "21 C"
    oldest_first = client.responses.input_items.list(second.id, order="asc")
    assert [item.id for item in oldest_first.data] == [item.id for item in reversed(newest_first.data)]
    assert oldest_first.first_id == oldest_first.data[0].id and oldest_first.has_more is False
    raw = _get(front, client.api_key, f"{second.id}/input_items")
    ResponseItemList.model_validate(raw.json(), strict=True)


def test_the_input_items_page_by_limit_and_after(front, client, start_worker):
    start_worker()
    turns = [{"role": "user", "content": f"Line {i}"} for i in range(5)]
    response = client.responses.create(model=MODEL, input=turns)
    page = client.responses.input_items.list(response.id, limit=2, order="asc")
    assert [item.content[0].text for item in page.data] == ["Line 0", "Line 1"] and page.has_more is True
    # The SDK's own paging follows `after` to the end.
    every = [item.content[0].text for item in client.responses.input_items.list(response.id, limit=2, order="asc")]
    assert every == [f"Line {i}" for i in range(5)]
    last = client.responses.input_items.list(response.id, limit=2, order="asc", after=page.data[1].id)
    assert [item.content[0].text for item in last.data] == ["Line 2", "Line 3"]
    # `before` (OpenAI's older cursor, which the current SDK no longer sends): the page just before it.
    ids = [item.id for item in client.responses.input_items.list(response.id, order="asc", limit=5).data]
    earlier = _get(front, client.api_key, f"{response.id}/input_items", order="asc", limit=2, before=ids[3]).json()
    assert [item["content"][0]["text"] for item in earlier["data"]] == ["Line 1", "Line 2"]
    assert earlier["has_more"] is True and earlier["first_id"] == ids[1]
    window = _get(front, client.api_key, f"{response.id}/input_items", order="asc", after=ids[0], before=ids[2]).json()
    assert [item["id"] for item in window["data"]] == [ids[1]] and window["has_more"] is False


@pytest.mark.parametrize(
    ("params", "param"),
    [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
     ({"after": "msg_none"}, "after"), ({"before": "msg_none"}, "before"),
     # A digit str.isdigit takes and int() does not: a 400, not a 500 the SDKs would retry.
     ({"limit": "\u00b2"}, "limit")],
)
def test_a_bad_input_items_query_is_a_400_naming_it(front, client, start_worker, params, param):
    start_worker()
    response = client.responses.create(model=MODEL, input="Hi")
    answer = _get(front, client.api_key, f"{response.id}/input_items", **params)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param


def test_a_deleted_response_is_gone_with_its_items(client, start_worker):
    start_worker()
    first = client.responses.create(model=MODEL, input="Hi")
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(first.id)
    assert caught.value.body["code"] == "not_found"
    assert caught.value.body["message"] == (
        f"Response with id '{first.id}' not found. This AI Horde front keeps a response for 21600 s, for "
        "the API key that made it, unless it was sent with store: false."
    )
    with pytest.raises(openai.BadRequestError) as continued:
        client.responses.create(model=MODEL, input="Again", previous_response_id=first.id)
    assert continued.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as referred:
        client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": first.output[0].id}])
    assert referred.value.body["code"] == "item_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


def test_a_browser_may_delete_a_kept_response(front, client, requester, start_worker):
    """openai-node in a browser (dangerouslyAllowBrowser) deletes with DELETE, which is not a
    CORS-safelisted method: its preflight must allow DELETE, or the browser never sends it."""
    start_worker()
    created = client.responses.create(model=MODEL, input="Hi")
    url = f"{front.live.v1}/responses/{created.id}"
    preflight = httpx.options(
        url,
        headers={
            "Origin": "http://localhost:5173",
            "Access-Control-Request-Method": "DELETE",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "*"
    allowed = [method.strip() for method in preflight.headers["access-control-allow-methods"].split(",")]
    assert "DELETE" in allowed
    deleted = httpx.delete(url, headers={"Origin": "http://localhost:5173", "Authorization": f"Bearer {requester.key}"})
    assert deleted.status_code == 200 and deleted.json() == {"id": created.id, "object": "response", "deleted": True}
    assert deleted.headers["access-control-allow-origin"] == "*"


def test_another_keys_response_is_not_found_nor_deleted(front, client, start_worker, make_user):
    start_worker()
    mine = client.responses.create(model=MODEL, input="Hi")
    other = make_user("a-stranger", kudos=1000)
    stranger = openai.OpenAI(base_url=front.live.v1, api_key=other.key, max_retries=0, timeout=30)
    for call in (
        lambda: stranger.responses.retrieve(mine.id),
        lambda: stranger.responses.delete(mine.id),
        lambda: stranger.responses.input_items.list(mine.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    stranger.close()
    assert client.responses.retrieve(mine.id).id == mine.id


def test_a_response_with_store_false_is_not_kept(client, start_worker):
    start_worker()
    response = client.responses.create(model=MODEL, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_namespaced_call_in_a_kept_turn_stays_in_its_namespace(client, start_worker):
    """Codex's namespace tools: a function_call item with its namespace, kept and continued by
    previous_response_id, reaches the worker as the call of the same chat function."""
    worker = start_worker(reply=text_reply("Spawned."))
    tools = [{"type": "namespace", "name": "agents", "description": "Sub-agents", "tools": [dict(WEATHER, name="spawn")]}]
    first = client.responses.create(
        model=MODEL,
        tools=tools,
        input=[
            {"role": "user", "content": "Spawn one."},
            {"type": "function_call", "call_id": "call_9", "namespace": "agents", "name": "spawn", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_9", "output": "done"},
        ],
    )
    client.responses.create(model=MODEL, tools=tools, input="Thanks.", previous_response_id=first.id)
    call = worker.jobs[1]["payload"]["messages"][1]["tool_calls"][0]
    assert call["function"]["name"] == "agents__spawn"
    listed = client.responses.input_items.list(first.id, order="asc").data[1]
    assert (listed.type, listed.namespace, listed.name) == ("function_call", "agents", "spawn")


def test_a_response_kept_before_its_object_was_kept_is_not_found_but_still_continued(front, client, start_worker):
    """A record the previous release kept (its turn and output, no response object): GET is 404, as
    ADR 0103 says, not a 500; a continuation still reads it."""
    import json

    from oai.response_items import _owner, response_key

    worker = start_worker()
    old_id = "resp_00000000000000000000000000000001"
    output = [
        {
            "id": "msg_00000000000000000000000000000001",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Kept before.", "annotations": []}],
        }
    ]
    record = {
        "owner": _owner(client.api_key),
        "previous": None,
        "input": [{"type": "message", "role": "user", "content": "Hi"}],
        "output": output,
    }
    items = front.state().response_items
    front.live.run(items._write({response_key(old_id): json.dumps(record)}))
    answer = _get(front, client.api_key, old_id)
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["code"] == "not_found"
    client.responses.create(model=MODEL, input="Go on.", previous_response_id=old_id)
    assert worker.jobs[-1]["payload"]["messages"][1]["content"] == "Kept before."


# The front's keep in the test below, and how many times it is run before a loaded box is blamed.
KEEP_SECONDS = 3
KEEP_ATTEMPTS = 3


def _kept_past_the_keep_by_a_read(client, read: str) -> tuple[Response, float] | None:
    """A response read 2 s after its create, then its message referred to once the create's own keep
    has ended: (the response, when the reference was answered). None when a read or the reference
    failed after it came too late to prove anything (a stalled box: the read over KEEP_SECONDS after
    the create was sent, the reference over KEEP_SECONDS after the read was sent). Each keep starts
    after the call that made it was sent, so a failure that came before those bounds is a real one;
    and the reference is sent after the create's keep ended whatever the box does, so its success
    is the read's doing."""
    sent = time.monotonic()
    created = client.responses.create(model=MODEL, input="Hi")
    created_at = time.monotonic()
    time.sleep(2)
    read_sent = time.monotonic()
    try:
        if read == "get":
            assert client.responses.retrieve(created.id).id == created.id
        else:
            client.responses.create(model=MODEL, input="Go on.", previous_response_id=created.id)
    except (openai.NotFoundError, openai.BadRequestError):
        if time.monotonic() - sent >= KEEP_SECONDS:
            return None
        raise
    # Past the keep the create gave (it ended KEEP_SECONDS after the create was answered, at the latest).
    time.sleep(max(0.0, created_at + KEEP_SECONDS + 0.5 - time.monotonic()))
    reference = {"type": "item_reference", "id": created.output[0].id}
    try:
        referred = client.responses.create(model=MODEL, input=[reference, {"role": "user", "content": "And?"}])
    except openai.BadRequestError as refused:
        if refused.body.get("code") == "item_not_found" and time.monotonic() - read_sent >= KEEP_SECONDS:
            return None
        raise
    assert referred.status == "completed"
    return created, time.monotonic()


@pytest.mark.parametrize("read", ["get", "continue"])
def test_a_responses_items_live_as_long_as_the_response_that_holds_them(front, client, start_worker, read):
    """Reading a kept response (GET, or continuing it) keeps its output items as long as it: an
    `item_reference` to one resolves while the response is still readable; unread, all of it lapses
    (docs/adr/0110). A run a stalled box made inconclusive is run again with a new response."""
    front.configure(response_items_seconds=KEEP_SECONDS)
    worker = start_worker(reply=text_reply("Kept."))
    for _ in range(KEEP_ATTEMPTS):
        if (kept := _kept_past_the_keep_by_a_read(client, read)) is not None:
            break
    else:
        pytest.fail(f"each of {KEEP_ATTEMPTS} runs stalled past the keep of {KEEP_SECONDS} s")
    created, referred_at = kept
    assert worker.jobs[-1]["payload"]["messages"][0] == {"role": "assistant", "content": "Kept."}
    # Nothing read since the reference (which kept the item alone): the response and its items lapse.
    time.sleep(max(0.0, referred_at + KEEP_SECONDS + 0.5 - time.monotonic()))
    assert _get(front, client.api_key, created.id).status_code == 404
    reference = {"type": "item_reference", "id": created.output[0].id}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[reference])
    assert caught.value.body["code"] == "item_not_found"
