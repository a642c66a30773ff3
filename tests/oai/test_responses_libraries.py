"""The Responses API (POST /v1/responses, docs/adr/0101-responses-api.md) as real client libraries
use it, unchanged, against the live horde: LangChain's `ChatOpenAI(use_responses_api=True)` and the
openai SDK's helpers (`responses.stream`, `responses.parse`, `responses.create(stream=True)`), with
the reference worker in front of the fake llama-server (its reply streamed in small pieces, relayed
with Redis). Every event and every `response` object is also read by openai's own pydantic types in
strict mode: a field of a wrong type or a missing required one is what a typed client trips on.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from tests.bridge.conftest import MODEL, running_bridge
from tests.bridge.conftest import LiveHorde as BridgeHorde
from tests.bridge.fake_backend import DEFAULT_REPLY, FakeLlamaCpp, chat_completion

pytestmark = pytest.mark.django_db(transaction=True)

REASONING = "The user greets me; I greet back."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class City(BaseModel):
    name: str
    population: int


class CityWeather(BaseModel):  # the fake's tool call's arguments are {"city": "Paris"}
    city: str


@pytest.fixture
def lib_horde(front, live_horde, make_user) -> Iterator[tuple[str, str, FakeLlamaCpp]]:
    """(the front's /v1 URL, a requester's key, the fake llama-server), with the reference worker
    serving MODEL from the fake, which streams its reply three characters at a time."""
    fake_backend = FakeLlamaCpp()
    fake_backend.chunk_chars, fake_backend.chunk_delay = 3, 0.02
    fake_backend.start()
    owner = make_user(f"rlib-owner-{uuid.uuid4().hex[:6]}", trusted=True)
    requester = make_user(f"rlib-req-{uuid.uuid4().hex[:6]}", kudos=100_000)
    bridge_horde = BridgeHorde(live_horde.url, owner.key, requester.key)
    bridge = running_bridge(
        bridge_horde, fake_backend.url, progress_interval=0.05, pop_wait=0, add_features={"reasoning_effort"}
    )
    with bridge:
        yield front.live.v1, requester.key, fake_backend
    bridge_horde.client.close()
    fake_backend.stop()


def reasoning_backend(fake_backend: FakeLlamaCpp) -> None:
    """The fake answers with reasoning before its text, as a thinking model does."""

    def chat(body: dict[str, Any]) -> dict[str, Any]:
        message = {"role": "assistant", "content": DEFAULT_REPLY, "reasoning_content": REASONING}
        usage = {"prompt_tokens": 12, "completion_tokens": 20, "total_tokens": 32}
        return chat_completion(message, model=fake_backend.model, usage=usage)

    fake_backend.chat_handler = chat


def chat_model(v1: str, key: str, **options: Any):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=v1, api_key=key, model=MODEL, max_retries=0, timeout=30, use_responses_api=True, **options
    )


def sdk(v1: str, key: str):
    import openai

    return openai.OpenAI(base_url=v1, api_key=key, max_retries=0, timeout=30)


# --- strict reading by openai's own types ----------------------------------------------------------


def event_types() -> dict[str, type[BaseModel]]:
    """openai's class of each stream event, by its `type` (the SDK picks the class by it too)."""
    from typing import get_args

    from openai.types.responses import ResponseStreamEvent

    union = get_args(ResponseStreamEvent)[0]
    return {cls.model_fields["type"].annotation.__args__[0]: cls for cls in get_args(union)}


def strict_errors(data: dict[str, Any], *, event: bool = False) -> list[str]:
    """What openai's types, in strict mode, find wrong in a `response` object or a stream event."""
    from openai.types.responses import Response
    from pydantic import ValidationError

    try:
        if event:
            event_types()[data["type"]].model_validate(data, strict=True)
        else:
            Response.model_validate(data, strict=True)
    except ValidationError as error:
        name = data.get("type") or data.get("object")
        return [f"{name}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()]
    return []


def raw_events(v1: str, key: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "POST",
        f"{v1}/responses",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    return events


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"input": "Say hello."}, id="text"),
        pytest.param(
            {"input": "Weather in Paris?", "tools": [{"type": "function", **WEATHER["function"]}]}, id="tools"
        ),
        pytest.param({"input": "Say hello.", "reasoning": {"summary": "auto"}}, id="reasoning"),
        pytest.param({"input": "Say hello.", "max_output_tokens": 16, "store": False}, id="options"),
        pytest.param({"input": "Say hello.", "max_output_tokens": 17}, id="incomplete"),
    ],
)
def test_every_event_and_response_is_valid_for_openais_types_in_strict_mode(lib_horde, body):
    v1, key, fake_backend = lib_horde
    if "reasoning" in body:
        reasoning_backend(fake_backend)
    terminal = "response.completed"
    if body.get("max_output_tokens") == 17:  # the reply is cut at its length
        terminal = "response.incomplete"
        message = {"role": "assistant", "content": "Hello from"}
        fake_backend.chat_handler = lambda _: chat_completion(message, "length", model=fake_backend.model)
    body = {"model": MODEL, **body}
    whole = httpx.post(f"{v1}/responses", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert whole.status_code == 200, whole.text
    errors = strict_errors(whole.json())
    events = raw_events(v1, key, body)
    assert events[-1]["type"] == terminal
    for event in events:
        errors += strict_errors(event, event=True)
    assert errors == []


def test_a_failed_streams_events_are_valid_for_openais_types_in_strict_mode(lib_horde):
    v1, key, fake_backend = lib_horde
    fake_backend.fail_with = (500, {"error": {"code": 500, "message": "boom", "type": "server_error"}})
    events = raw_events(v1, key, {"model": MODEL, "input": "Say hello."})
    error, failed = events[-2:]
    assert (error["type"], failed["type"]) == ("error", "response.failed"), events
    assert error["code"] and error["message"]
    assert failed["response"]["error"]["code"] == "server_error"
    assert failed["response"]["error"]["message"] == error["message"]
    assert [error for event in events for error in strict_errors(event, event=True)] == []


# --- LangChain's ChatOpenAI over the Responses API ------------------------------------------------


def test_langchain_responses_invoke_gives_the_reply_and_usage(lib_horde):
    v1, key, _ = lib_horde
    message = chat_model(v1, key).invoke("Say hello.")
    assert message.text == DEFAULT_REPLY
    assert message.response_metadata["model_name"] == MODEL
    assert message.response_metadata["id"].startswith("resp_")
    usage = message.usage_metadata
    assert (
        usage["output_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    )


@pytest.mark.redis_only
def test_langchain_responses_stream_yields_the_workers_tokens_in_order(lib_horde):
    v1, key, _ = lib_horde
    chunks = list(chat_model(v1, key).stream("Say hello."))
    texts = [chunk.text for chunk in chunks if chunk.text]
    assert "".join(texts) == DEFAULT_REPLY
    assert len(texts) > 1, texts  # relayed as the worker posted it
    usages = [chunk.usage_metadata for chunk in chunks if chunk.usage_metadata]
    assert len(usages) == 1 and usages[0]["output_tokens"] > 0


def test_langchain_responses_astream_adds_up_to_the_reply(lib_horde):
    import httpx2

    v1, key, _ = lib_horde

    async def texts() -> list[str]:
        # Its own client: langchain-openai's default async client is one per process, bound to the
        # event loop of its first use, which asyncio.run closes (a later asyncio.run fails with it).
        async with httpx2.AsyncClient() as http:
            model = chat_model(v1, key, http_async_client=http)
            return [chunk.text async for chunk in model.astream("Say hello.") if chunk.text]

    assert "".join(asyncio.run(texts())) == DEFAULT_REPLY


def test_langchain_responses_tool_call_then_its_tool_message_make_a_second_turn(lib_horde):
    from langchain_core.messages import HumanMessage, ToolMessage

    v1, key, fake_backend = lib_horde
    model = chat_model(v1, key).bind_tools([WEATHER])
    question = HumanMessage("What is the weather in Paris?")
    first = model.invoke([question])
    (call,) = first.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"} and call["id"]
    second = model.invoke([question, first, ToolMessage("21.5 C, sunny.", tool_call_id=call["id"])])
    assert second.text == DEFAULT_REPLY and not second.tool_calls
    messages = fake_backend.chat_requests()[-1]["messages"]
    assert messages[-2]["tool_calls"][0]["id"] == call["id"]
    assert messages[-1] == {"role": "tool", "tool_call_id": call["id"], "content": "21.5 C, sunny."}


def test_langchain_responses_streamed_tool_call(lib_horde):
    v1, key, _ = lib_horde
    chunks = list(chat_model(v1, key).bind_tools([WEATHER]).stream("What is the weather in Paris?"))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    (call,) = whole.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"} and call["id"]


@pytest.mark.parametrize("method", [None, "json_schema", "function_calling"])
def test_langchain_responses_structured_output(lib_horde, method):
    v1, key, _ = lib_horde
    options = {} if method is None else {"method": method}
    schema = CityWeather if method == "function_calling" else City
    answer = chat_model(v1, key).with_structured_output(schema, **options).invoke("Which city?")
    assert isinstance(answer, schema)


def test_langchain_responses_reasoning_is_a_reasoning_block(lib_horde):
    v1, key, fake_backend = lib_horde
    reasoning_backend(fake_backend)
    model = chat_model(v1, key, output_version="responses/v1", reasoning={"effort": "low", "summary": "auto"})
    message = model.invoke("Say hello.")
    reasoning, text = message.content
    assert reasoning["type"] == "reasoning" and reasoning["summary"][0]["text"] == REASONING
    assert text["type"] == "text" and text["text"] == DEFAULT_REPLY
    assert fake_backend.chat_requests()[-1]["reasoning_effort"] == "low"

    chunks = list(model.stream("Say hello."))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    kinds = [block["type"] for block in whole.content]
    assert kinds == ["reasoning", "text"], whole.content
    assert whole.content[0]["summary"][0]["text"] == REASONING and whole.content[1]["text"] == DEFAULT_REPLY


def test_langchain_responses_multi_turn_sends_the_history(lib_horde):
    from langchain_core.messages import HumanMessage, SystemMessage

    v1, key, fake_backend = lib_horde
    model = chat_model(v1, key)
    history = [SystemMessage("Be brief."), HumanMessage("Say hello.")]
    first = model.invoke(history)
    second = model.invoke([*history, first, HumanMessage("Again.")])
    assert second.text == DEFAULT_REPLY
    messages = fake_backend.chat_requests()[-1]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == DEFAULT_REPLY and messages[3]["content"] == "Again."


# --- the openai SDK's helpers ----------------------------------------------------------------------


def test_openai_responses_stream_helper_with_tools(lib_horde):
    v1, key, _ = lib_horde
    with sdk(v1, key) as client:
        tools = [{"type": "function", **WEATHER["function"]}]
        with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=tools) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_openai_responses_stream_with_a_text_format_parses_the_reply(lib_horde):
    v1, key, _ = lib_horde
    with sdk(v1, key) as client:
        with client.responses.stream(model=MODEL, input="Which city?", text_format=City) as stream:
            deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
            final = stream.get_final_response()
        parsed = client.responses.parse(model=MODEL, input="Which city?", text_format=City)
    assert isinstance(final.output_parsed, City) and "".join(deltas) == final.output_text
    assert isinstance(parsed.output_parsed, City)


def test_openai_responses_create_stream_with_reasoning(lib_horde):
    v1, key, fake_backend = lib_horde
    reasoning_backend(fake_backend)
    with sdk(v1, key) as client:
        events = list(
            client.responses.create(
                model=MODEL, input="Say hello.", reasoning={"summary": "auto"}, stream=True
            )
        )
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert summary == REASONING and text == DEFAULT_REPLY
    final = events[-1]
    assert final.type == "response.completed"
    reasoning, message = final.response.output
    assert reasoning.type == "reasoning" and reasoning.summary[0].text == REASONING
    assert message.type == "message" and final.response.output_text == DEFAULT_REPLY
    assert [e.sequence_number for e in events] == list(range(len(events)))


# --- openai-agents' own requests, replayed -------------------------------------------------------
# What openai-agents 0.24 (unchanged, with its default Responses model) sent to a horde started as a
# user starts one (scripts/run.py web and the reference worker): its tool loop, streamed and not,
# structured output, reasoning. Its Runner needs back: a completed response with output, each
# function_call item with its call_id, and on a failure the error event's code and message.

AGENTS = json.loads((Path(__file__).parent / "data" / "agents_responses_requests.json").read_text())["cases"]


def agents_request(case: str, index: int) -> bytes:
    """The exact bytes openai-agents sent, but for the model's name (the recorded horde's)."""
    raw = base64.b64decode(AGENTS[case]["requests"][index])
    return raw.replace(b'"helper-c/qwen3-8b"', json.dumps(MODEL).encode())


def replay(v1: str, key: str, raw: bytes) -> Any:
    """The whole `response` of a replayed request, or its stream's events; each strictly typed."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if not json.loads(raw).get("stream"):
        answer = httpx.post(f"{v1}/responses", content=raw, headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        assert strict_errors(answer.json()) == []
        return answer.json()
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{v1}/responses", content=raw, headers=headers, timeout=30) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    assert [error for event in events for error in strict_errors(event, event=True)] == []
    return events


def completed(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert events[-1]["type"] == "response.completed", events[-1]
    return events[-1]["response"]


def test_agents_tool_loop_gets_a_function_call_with_its_call_id_then_the_reply(lib_horde):
    v1, key, fake_backend = lib_horde
    first = replay(v1, key, agents_request("run_tool", 0))
    assert first["status"] == "completed"
    (call,) = first["output"]
    assert call["type"] == "function_call" and call["status"] == "completed" and call["name"] == "get_weather"
    assert call["call_id"] and json.loads(call["arguments"]) == {"city": "Paris"}
    second = replay(v1, key, agents_request("run_tool", 1))
    assert second["status"] == "completed"
    assert [item["type"] for item in second["output"]] == ["message"]
    assert second["output"][0]["content"][0]["text"] == DEFAULT_REPLY
    messages = fake_backend.chat_requests()[-1]["messages"]
    recorded_call = json.loads(agents_request("run_tool", 1))["input"][1]["call_id"]
    assert messages[-2]["tool_calls"][0]["id"] == recorded_call
    assert messages[-1] == {"role": "tool", "tool_call_id": recorded_call, "content": "21.5C in Paris"}


def test_agents_streamed_tool_loop_gets_the_call_items_and_a_completed_response(lib_horde):
    v1, key, _ = lib_horde
    events = replay(v1, key, agents_request("streamed_tool", 0))
    (done,) = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done["type"] == "function_call" and done["call_id"] and done["name"] == "get_weather"
    assert completed(events)["output"] == [done]
    events = replay(v1, key, agents_request("streamed_tool", 1))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == DEFAULT_REPLY
    assert completed(events)["output"][0]["content"][0]["text"] == DEFAULT_REPLY


def test_agents_structured_output_is_json_of_its_schema(lib_horde):
    v1, key, _ = lib_horde
    response = replay(v1, key, agents_request("structured", 0))
    answer = json.loads(response["output"][0]["content"][0]["text"])
    assert set(answer) == {"city", "temp"} and response["text"]["format"]["name"] == "final_output"


def test_agents_reasoning_model_gets_reasoning_items_and_takes_them_back(lib_horde):
    v1, key, fake_backend = lib_horde
    reasoning_backend(fake_backend)
    first = replay(v1, key, agents_request("reasoning", 0))
    assert [item["type"] for item in first["output"]] == ["reasoning", "message"]
    assert first["output"][0]["summary"][0]["text"] == REASONING
    second = replay(v1, key, agents_request("reasoning", 1))  # its reasoning item among the input
    assert [item["type"] for item in second["output"]] == ["reasoning", "message"]
    assert fake_backend.chat_requests()[-1]["reasoning_effort"] == "low"
    events = replay(v1, key, agents_request("reasoning_streamed", 0))
    summary = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta")
    assert summary == REASONING
    assert [item["type"] for item in completed(events)["output"]] == ["reasoning", "message"]


def test_agents_second_turn_from_its_input_list(lib_horde):
    v1, key, _ = lib_horde
    answers = [
        replay(v1, key, agents_request("second_turn", i))
        for i in range(len(AGENTS["second_turn"]["requests"]))
    ]
    assert all(answer["status"] == "completed" for answer in answers)
    assert answers[-1]["output"][-1]["content"][0]["text"] == DEFAULT_REPLY


def test_agents_stream_that_fails_ends_in_an_error_event_then_response_failed(lib_horde):
    v1, key, fake_backend = lib_horde
    fake_backend.fail_with = (500, {"error": {"code": 500, "message": "boom", "type": "server_error"}})
    events = replay(v1, key, agents_request("streamed_plain", 0))
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] and error["message"]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {
        "code": "server_error",
        "message": error["message"],
        "type": failed["response"]["error"]["type"],
    }


def test_agents_previous_response_id_continues_the_kept_conversation(lib_horde):
    """Its second run names the first's last response; the ids it names (the responses', the calls')
    are the recorded horde's, so each is replaced by the one this horde answered in its place."""
    v1, key, fake_backend = lib_horde
    case = AGENTS["previous_response_id"]
    live: dict[str, str] = {}
    answers = []
    for index, recorded in enumerate(case["answers"]):
        raw = agents_request("previous_response_id", index)
        for old, new in live.items():
            raw = raw.replace(old.encode(), new.encode())
        answer = replay(v1, key, raw)
        answers.append(answer)
        live[recorded["id"]] = answer["id"]
        calls = [item["call_id"] for item in answer["output"] if item["type"] == "function_call"]
        live.update(zip(recorded["call_ids"], calls, strict=True))
    assert [answer["status"] for answer in answers] == ["completed"] * 4
    assert answers[-1]["output"][0]["content"][0]["text"] == DEFAULT_REPLY
    assert answers[-1]["previous_response_id"] == answers[-2]["id"]
    # The last turn's chat request holds the whole conversation: both runs' turns.
    messages = fake_backend.chat_requests()[-1]["messages"]
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
        "tool",
    ]


def test_langchain_use_previous_response_id_sends_only_the_new_turn(lib_horde):
    import httpx2  # the openai SDK's own HTTP client; its hook only records what LangChain sends
    from langchain_core.messages import HumanMessage

    v1, key, fake_backend = lib_horde
    sent: list[dict[str, Any]] = []
    recorder = httpx2.Client(
        event_hooks={"request": [lambda request: sent.append(json.loads(request.read()))]}
    )
    model = chat_model(v1, key, use_previous_response_id=True, http_client=recorder)
    first = model.invoke([HumanMessage("Say hello.")])
    second = model.invoke([HumanMessage("Say hello."), first, HumanMessage("Again.")])
    assert second.text == DEFAULT_REPLY
    assert sent[1]["previous_response_id"] == first.response_metadata["id"]
    assert [item.get("role") for item in sent[1]["input"]] == ["user"]
    messages = fake_backend.chat_requests()[-1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[-1]["content"] == "Again."


# --- LiteLLM's Responses client ---------------------------------------------------------------------


@pytest.mark.redis_only
def test_litellm_responses_whole_streamed_and_continued(lib_horde):
    """`litellm.responses` with an OpenAI-compatible base URL calls /v1/responses itself."""
    import litellm

    v1, key, _ = lib_horde
    call = {"model": f"openai/{MODEL}", "api_base": v1, "api_key": key}
    whole = litellm.responses(input="Say hello.", **call)
    assert whole.id.startswith("resp_") and whole.output[0].content[0].text == DEFAULT_REPLY
    deltas = [
        event.delta
        for event in litellm.responses(input="Say hello.", stream=True, **call)
        if event.type == "response.output_text.delta"
    ]
    assert "".join(deltas) == DEFAULT_REPLY and len(deltas) > 1  # the worker's tokens, relayed
    continued = litellm.responses(input="Again.", previous_response_id=whole.id, **call)
    assert continued.output[0].content[0].text == DEFAULT_REPLY


def test_litellm_reads_lists_and_deletes_a_kept_response(lib_horde):
    """`litellm.get_responses`, `list_input_items` and `delete_responses` on the id that
    `litellm.responses` gave (ADR 0103)."""
    import litellm

    v1, key, _ = lib_horde
    call = {"custom_llm_provider": "openai", "api_base": v1, "api_key": key}
    created = litellm.responses(input="Say hello.", model=f"openai/{MODEL}", api_base=v1, api_key=key)
    read = litellm.get_responses(response_id=created.id, **call)
    assert read.id == created.id and read.output[0].content[0].text == DEFAULT_REPLY
    listed = litellm.list_input_items(response_id=created.id, **call)
    assert [item["content"][0]["text"] for item in listed["data"]] == ["Say hello."]
    deleted = litellm.delete_responses(response_id=created.id, **call)
    # LiteLLM hands out its own encoding of the horde's id, and answers the delete with the horde's.
    from litellm.responses.utils import ResponsesAPIRequestUtils

    horde_id = ResponsesAPIRequestUtils.decode_responses_api_response_id(created.id)["response_id"]
    assert deleted.deleted is True and deleted.id == horde_id and horde_id.startswith("resp_")
    with pytest.raises(litellm.NotFoundError):
        litellm.get_responses(response_id=created.id, **call)
