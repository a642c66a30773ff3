"""POST /v1/responses (docs/adr/0101-responses-api.md): the real openai SDK's Responses client
against the live horde and its mounted front, whole and streamed, with a scripted chat worker;
what the worker receives, what the client reads, and the refusals, by the Responses API's paths."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.oai.conftest import MODEL, TEXT_OUTPUT_EVENTS, responses_sse, text_reply, wait_for
from tests.oai.test_completions import calls_reply
from tests.oai.test_images import image_store, png_data_url  # noqa: F401 (image_store: a fixture)

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def _requests():
    from chat.models import GenerationRequest

    return list(GenerationRequest.objects.filter(is_chat=True))


def _events(front, requester, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed answer, read as SSE."""
    events: list[tuple[str, dict[str, Any]]] = []
    headers = {"Authorization": f"Bearer {requester.key}"}
    with httpx.stream("POST", f"{front.live.v1}/responses", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events.extend(responses_sse(r))
    return events


# --- whole -----------------------------------------------------------------------------------------


def test_a_string_input_with_instructions_is_answered_whole(client, start_worker):
    worker = start_worker()
    response = client.responses.create(
        model=MODEL, input="Hello?", instructions="Answer briefly.", max_output_tokens=64, store=False
    )
    assert response.output_text == "Hello from the horde."
    assert response.status == "completed" and response.error is None
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.instructions == "Answer briefly."
    assert response.max_output_tokens == 64 and response.store is False
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and item.content[0].type == "output_text"
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    payload = worker.jobs[0]["payload"]
    assert payload["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello?"},
    ]
    assert payload["max_length"] == 64
    (row,) = _requests()
    assert response.id == "resp_" + str(row.id).replace("-", "")


@pytest.mark.usefixtures("image_store")
def test_message_items_with_parts_and_an_image_reach_the_worker(client, start_worker):
    worker = start_worker(image_transports=["url"])
    image = png_data_url(8, 8)
    client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Describe images."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": image, "detail": "low"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_earlier",
                "status": "completed",
                "content": [{"type": "output_text", "text": "A pixel.", "annotations": []}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": "Sure?"}]},
        ],
    )
    messages = worker.jobs[0]["payload"]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]  # developer is sent as system
    assert messages[1]["content"][0] == {"type": "text", "text": "What is this?"}
    assert messages[1]["content"][1]["type"] == "image_url"
    assert messages[2]["content"] == "A pixel." and messages[3]["content"] == "Sure?"


def test_a_tool_call_and_its_output_make_a_turn(client, start_worker):
    worker = start_worker(reply=calls_reply("get_weather"))
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER])
    (call,) = first.output
    assert call.type == "function_call" and call.status == "completed"
    assert (call.call_id, call.name, call.arguments) == ("call_0", "get_weather", '{"city": "Oslo"}')
    assert call.id.startswith("fc_") and first.status == "completed"
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    sent = worker.jobs[0]["payload"]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent["tools"][0]["function"]["parameters"] == WEATHER["parameters"]

    worker.reply = text_reply("It is sunny in Oslo.")
    second = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            call.model_dump(exclude_none=True),  # the SDK's own item, sent back as agents do
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."},
        ],
        tools=[WEATHER],
    )
    assert second.output_text == "It is sunny in Oslo."
    messages = worker.jobs[1]["payload"]["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    } or messages[1]["tool_calls"][0]["id"] == "call_0"
    assert messages[2] == {"role": "tool", "tool_call_id": "call_0", "content": "Sunny, 21 C."}


def test_a_named_tool_choice_is_the_chat_routes_function_choice(client, start_worker):
    worker = start_worker(reply=calls_reply("get_weather"))
    response = client.responses.create(
        model=MODEL,
        input="Weather?",
        tools=[WEATHER, {"type": "function", "name": "get_time", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert response.output[0].type == "function_call"
    payload = worker.jobs[0]["payload"]
    # As the chat route sends a named function: "required", with that function alone.
    assert payload["tool_choice"] == "required"
    assert [tool["function"]["name"] for tool in payload["tools"]] == ["get_weather"]


class City(BaseModel):
    name: str
    population: int


def test_parse_with_a_text_format_gives_the_parsed_object(client, start_worker):
    worker = start_worker(reply=text_reply('{"name": "Oslo", "population": 709000}'))
    response = client.responses.parse(model=MODEL, input="Biggest city of Norway?", text_format=City)
    assert response.output_parsed == City(name="Oslo", population=709000)
    sent = worker.jobs[0]["payload"]["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["name"] == "City"
    assert sent["json_schema"]["strict"] is True


def test_a_reply_cut_at_its_length_is_incomplete(client, start_worker):
    start_worker(reply=text_reply("Once upon a", finish_reason="length"))
    response = client.responses.create(model=MODEL, input="A story.", max_output_tokens=16)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "Once upon a"
    # The cut message is itself incomplete, as OpenAI marks it.
    assert [(item.type, item.status) for item in response.output] == [("message", "incomplete")]


def test_the_workers_reasoning_is_a_reasoning_item_before_the_message(client, start_worker):
    def reply(job):
        return {
            "message": {"role": "assistant", "content": "42.", "reasoning_content": "Six times seven."},
            "finish_reason": "stop",
            "reasoning_tokens": 3,
            "completion_tokens": 5,
        }

    worker = start_worker(reply=reply)
    response = client.responses.create(
        model=MODEL, input="6*7?", reasoning={"effort": "low", "summary": "auto"}
    )
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary[0].text == "Six times seven."
    assert message.type == "message" and response.output_text == "42."
    assert response.usage.output_tokens_details.reasoning_tokens == 3
    assert worker.jobs[0]["payload"]["reasoning_effort"] == "low"


# --- streamed, delivered whole ---------------------------------------------------------------------


def test_a_streamed_reply_delivered_whole_is_the_responses_event_sequence(front, requester, start_worker):
    start_worker(reply=calls_reply("get_weather"))
    events = _events(
        front, requester, {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "stream": True}
    )
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    created = events[0][1]["response"]
    completed = events[-1][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == completed["id"]
    assert completed["status"] == "completed" and completed["usage"]["output_tokens"] > 0
    assert completed["output"] == [events[5][1]["item"]]
    assert completed["output"][0]["arguments"] == '{"city": "Oslo"}'


@pytest.mark.redis_only
def test_a_relayed_streams_tokens_are_each_an_output_text_delta(front, requester, streaming_worker):
    """The tokens the worker posts reach the client as they come, each an output_text.delta (the
    relay sends the chunks it read together as one write: each of them is rewritten)."""
    events: list[dict[str, Any]] = []
    body = {"model": MODEL, "input": "Say hi", "stream": True}
    thread = threading.Thread(target=lambda: events.extend(d for _, d in _events(front, requester, body)))
    thread.start()
    job = streaming_worker.pop()
    tokens = ["Hel", "lo", ", wor", "ld."]
    for seq, token in enumerate(tokens, start=1):
        assert streaming_worker.post(job, seq, token) == {"accepted_seq": seq, "cancelled": False}
    streaming_worker.submit(job, "".join(tokens), completion_tokens=4, prompt_tokens=7)
    thread.join(10)
    assert not thread.is_alive()
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Hello, world." and len(deltas) >= 2
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    completed = events[-1]
    assert completed["type"] == "response.completed"
    assert completed["response"]["output"][0]["content"][0]["text"] == "Hello, world."
    assert completed["response"]["usage"]["output_tokens"] == 4


def test_the_sdks_stream_helper_gives_the_text_and_the_final_response(client, start_worker):
    start_worker(reply=text_reply("Hello there."))
    with client.responses.stream(model=MODEL, input="Hi", tools=[WEATHER]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == "Hello there." and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:8] == TEXT_OUTPUT_EVENTS
    assert kinds[-1] == "response.completed"


# --- refusals --------------------------------------------------------------------------------------


_NS_TOOL = {"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "function", "name": "f"}]}


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "previous_response_not_found"),
        ({"conversation": "conv_1"}, "conversation", "UnsupportedChatParameter"),
        ({"background": "yes"}, "background", "BadRequest"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "UnsupportedChatParameter"),
        ({"tools": [_NS_TOOL, {"type": "function", "name": "ns__f"}]}, "tools[1].name", "ChatRequestConflict"),
        ({"tools": [{**_NS_TOOL, "tools": [{"type": "custom", "name": "g"}]}]}, "tools[0].tools[0].type", "UnsupportedChatParameter"),
        ({"client_metadata": {"turn": 1}}, "client_metadata", "BadRequest"),
        ({"tools": [_NS_TOOL, {**_NS_TOOL, "name": "n2", "tools": [{"type": "function", "name": "g", "parameters": "x"}]}]}, "tools[1].tools[0].parameters", "BadRequest"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].id", "item_not_found"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type", "UnsupportedChatParameter"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0].file_id", "UnsupportedChatParameter"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role", "UnsupportedChatParameter"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "BadRequest"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]", "UnsupportedChatParameter"),
        ({"top_logprobs": 3}, "top_logprobs", "UnsupportedChatParameter"),
        ({"text": {"verbosity": "high"}}, "text.verbosity", "UnsupportedChatParameter"),
        ({"temperature": 3}, "temperature", "UnsupportedChatParameter"),
        ({"max_output_tokens": 5}, "max_output_tokens", "UnsupportedChatParameter"),
        ({"seed": 1}, "seed", "UnsupportedChatParameter"),
        ({"tool_choice": "required"}, "tool_choice", "ChatRequestConflict"),
        ({"input": []}, "input", "BadRequest"),
    ],
)
def test_refusals_name_the_responses_path(client, start_worker, extra, param, code):
    start_worker()
    body = {"model": MODEL, "input": "Hi", **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", body=body, cast_to=httpx.Response)
    error = caught.value.body
    assert (error["param"], error["code"]) == (param, code), error
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert "messages" not in error["message"] and "max_completion_tokens" not in error["message"]
    assert _requests() == []


def test_a_bad_message_in_a_history_names_its_input_item(client, start_worker):
    start_worker()
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": "Hi"},
                {"type": "function_call_output", "call_id": "call_9", "output": "orphan"},
            ],
        )
    assert caught.value.body["param"].startswith("input[1]"), caught.value.body


def test_refusals_the_horde_makes_at_submit_name_the_responses_path(client, start_worker):
    """The native route refuses an unreadable image and an input no context holds when the request
    is submitted, naming the chat body's path; the client sent input items, so that is the path."""
    start_worker(image_transports=["url"])
    unreadable = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    cases = [
        (
            {
                "instructions": "Describe images.",
                "input": [
                    {"role": "user", "content": "Hi"},
                    {"role": "user", "content": [{"type": "input_text", "text": "This:"}, unreadable]},
                ],
            },
            "input[1].content[1].image_url",
            "SourceImageUnreadable",
        ),
        ({"input": "word " * 10_000}, "input", "PromptExceedsContext"),
    ]
    for extra, param, code in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.post("/responses", body={"model": MODEL, **extra}, cast_to=httpx.Response)
        assert (caught.value.body["param"], caught.value.body["code"]) == (param, code), caught.value.body


def test_an_unknown_model_is_openais_404(client, start_worker):
    start_worker()
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="no-such/model", input="Hi")
    assert caught.value.body["code"] in ("model_not_found", "no_worker_for_model"), caught.value.body


# --- a client that goes away -----------------------------------------------------------------------


def test_a_stream_the_client_closes_ends_its_request_cancelled(front, requester, start_worker):
    worker = start_worker(reply=lambda job: None)  # pops, never answers
    headers = {"Authorization": f"Bearer {requester.key}"}
    body = {"model": MODEL, "input": "Hi", "stream": True}
    with httpx.stream("POST", f"{front.live.v1}/responses", json=body, headers=headers, timeout=10) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: response.created"
        deadline = time.monotonic() + 5
        while not worker.jobs and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.jobs
    assert wait_for(lambda: [r.cancelled for r in _requests()] == [True], 5), "the request was not cancelled"


def test_responses_route_answers_only_post(front, requester):
    answer = httpx.get(f"{front.live.v1}/responses", headers={"Authorization": f"Bearer {requester.key}"})
    assert answer.status_code == 405 and answer.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("call", ["compact", "input_tokens"])
def test_the_sdks_responses_endpoints_the_front_does_not_serve_are_unknown_urls(client, call):
    """`responses.compact` (openai 3.63 adds its safety_identifier) and `responses.input_tokens.count`
    post to /v1/responses/compact and /v1/responses/input_tokens: not response ids, so the client
    gets the 404 every endpoint the front does not serve gets, not a 405 saying POST is not allowed
    on a response (docs/adr/0109-client-versions-and-unserved-response-endpoints.md)."""
    with pytest.raises(openai.NotFoundError) as caught:
        if call == "compact":
            client.responses.compact(model=MODEL, input="Hi", safety_identifier="user-1")
        else:
            client.responses.input_tokens.count(model=MODEL, input="Hi")
    assert caught.value.body["code"] == "unknown_url"
    assert caught.value.body["message"] == (
        f"Invalid URL (POST /v1/responses/{call}): the AI Horde serves /v1/chat/completions, "
        "/v1/completions, /v1/responses and /v1/models."
    )
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_many_streams_at_once_each_get_their_own_response(front, requester, start_worker):
    start_worker(reply=text_reply("Same."))
    results: list[list[tuple[str, dict[str, Any]]]] = []

    def one() -> None:
        results.append(_events(front, requester, {"model": MODEL, "input": "Hi", "stream": True, "tools": [WEATHER]}))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 4
    ids = {events[-1][1]["response"]["id"] for events in results}
    assert len(ids) == 4
    assert all(events[-1][0] == "response.completed" for events in results)


# --- item references -------------------------------------------------------------------------------


def _vercel_second_turn(first_id: str) -> list[dict[str, Any]]:
    """The Vercel AI SDK's second turn with `store` left at its default: the earlier assistant turn
    is sent as a reference to its message item."""
    return [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "item_reference", "id": first_id},
        {"role": "user", "content": [{"type": "input_text", "text": "And then?"}]},
    ]


def test_an_item_reference_is_the_kept_message_of_an_earlier_response(client, start_worker):
    worker = start_worker(reply=text_reply("First answer."))
    first = client.responses.create(model=MODEL, input="Hi")
    assert first.store is True
    worker.reply = text_reply("Second answer.")
    second = client.responses.create(model=MODEL, input=_vercel_second_turn(first.output[0].id))
    assert second.output_text == "Second answer."
    assert worker.jobs[1]["payload"]["messages"][1] == {"role": "assistant", "content": "First answer."}


def test_a_streamed_responses_items_are_kept_once_it_completes(front, client, start_worker):
    worker = start_worker(reply=calls_reply("get_weather"))
    events = _events(front, client_key(client), {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "stream": True})
    call = events[-1][1]["response"]["output"][0]
    worker.reply = text_reply("Sunny.")
    client.responses.create(
        model=MODEL,
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "Weather?"},
            {"type": "item_reference", "id": call["id"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"},
        ],
    )
    sent = worker.jobs[1]["payload"]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == call["call_id"] and sent[2]["role"] == "tool"


def test_items_of_a_response_with_store_false_are_not_kept(client, start_worker):
    start_worker()
    first = client.responses.create(model=MODEL, input="Hi", store=False)
    assert first.store is False
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=_vercel_second_turn(first.output[0].id))
    assert caught.value.body["code"] == "item_not_found" and caught.value.body["param"] == "input[1].id"


def test_another_keys_items_are_not_found(front, client, start_worker, make_user):
    start_worker()
    first = client.responses.create(model=MODEL, input="Hi")
    other = make_user("someone-else", kudos=1000)
    stranger = openai.OpenAI(base_url=front.live.v1, api_key=other.key, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as caught:
        stranger.responses.create(model=MODEL, input=_vercel_second_turn(first.output[0].id))
    stranger.close()
    assert caught.value.body["code"] == "item_not_found"
    assert len(_requests()) == 1  # the refused request was never submitted


class _Key:
    def __init__(self, key: str):
        self.key = key


def client_key(client) -> _Key:
    return _Key(client.api_key)


# --- previous_response_id --------------------------------------------------------------------------


def test_previous_response_id_continues_the_kept_conversation(client, start_worker):
    worker = start_worker(reply=text_reply("One."))
    first = client.responses.create(model=MODEL, input="Count.", instructions="Be brief.")
    worker.reply = text_reply("Two.")
    second = client.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    worker.reply = text_reply("Three.")
    third = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "More."}], previous_response_id=second.id
    )
    assert third.output_text == "Three."
    # The instructions are not carried over (as OpenAI); every turn's input and output are.
    assert worker.jobs[2]["payload"]["messages"] == [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": "One."},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": "Two."},
        {"role": "user", "content": "More."},
    ]


def test_a_tool_loop_by_previous_response_id_sends_only_the_output(client, start_worker):
    """What openai-agents sends with previous_response_id: only the function_call_output."""
    worker = start_worker(reply=calls_reply("get_weather"))
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER])
    worker.reply = text_reply("Sunny.")
    client.responses.create(
        model=MODEL,
        tools=[WEATHER],
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": first.output[0].call_id, "output": "21 C"}],
    )
    messages = worker.jobs[1]["payload"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == "call_0" and messages[2]["tool_call_id"] == "call_0"


def test_a_previous_response_of_another_key_or_not_stored_is_not_found(front, client, start_worker, make_user):
    start_worker()
    unstored = client.responses.create(model=MODEL, input="Hi", store=False)
    stored = client.responses.create(model=MODEL, input="Hi")
    other = make_user("another-user", kudos=1000)
    stranger = openai.OpenAI(base_url=front.live.v1, api_key=other.key, max_retries=0, timeout=30)
    for sdk, previous in ((client, unstored.id), (stranger, stored.id)):
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.responses.create(model=MODEL, input="Again", previous_response_id=previous)
        assert caught.value.body["code"] == "previous_response_not_found"
        assert caught.value.body["param"] == "previous_response_id"
    stranger.close()
    assert len(_requests()) == 2


def test_a_kept_turn_holds_what_its_items_say_not_the_keys_the_front_ignores(front, client, start_worker):
    """Keys that an input item may carry and the front ignores (clients echo `id`, `status`...) are
    not kept: else one request could park its whole body (36 MiB) in the store for hours, and a
    chain of them would be read whole into the front by each continuation."""
    from oai.response_items import response_key
    from oai.state import get_front_state

    worker = start_worker(reply=text_reply("One."))
    padding = "x" * 1_000_000
    first = client.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "id": "msg_client",
                "padding": padding,
                "content": [{"type": "input_text", "text": "Hi", "padding": padding}],
            },
            {"type": "reasoning", "id": "rs_client", "summary": [{"type": "summary_text", "text": padding}]},
        ],
    )
    state = front.live.run(get_front_state())
    (record,) = front.live.run(state.response_items._read(client.api_key, [response_key(first.id)]))
    assert len(json.dumps(record)) < 2_000
    worker.reply = text_reply("Two.")
    client.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id)
    assert worker.jobs[1]["payload"]["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "One."},
        {"role": "user", "content": "Go on."},
    ]
