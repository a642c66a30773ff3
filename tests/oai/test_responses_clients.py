"""POST /v1/responses as the JavaScript clients send it, replayed byte for byte against the live horde
(daphne, the mounted /v1 front, Redis): the Vercel AI SDK (`ai` 6.0.333 with `@ai-sdk/openai`
3.0.141, whose default `openai(model)` is the Responses API) and the openai Node SDK 6.49.0
(`responses.create`, `.stream`, `.parse`).

The `vercel7/` and `openai-node7/` cases are the same calls from `ai` 7.0.185 with `@ai-sdk/openai`
4.0.126 and from openai-node 7.60.0, the newest on 2026-12-07 (ADR 0109), kept where their wire
differs from the older versions': ai 7's user agent (`ai/7.0.185 ai-sdk-provider-utils/5.0.86
node.js/v20.20.2`), `"strict": false` on each function tool, a store-false history's assistant
message as a plain string without its id; openai-node 7's x-stainless-helper-method before
authorization. Their other requests are the older versions' bodies, byte for byte.

The bodies and headers in data/responses_clients.json are what these clients sent, unchanged, to a
horde started as `make run` starts it (the demo worker on the scripted backend serves `scripted`;
the reference worker in front of a streaming llama-server serves `qwen-stream`), captured by a
logging relay: generateText, streamText (fullStream), a tool call and the step after its result,
generateObject / Output.object, multi-turn chats built from `response.messages` (store left at its
default: the message comes back as an `item_reference`; and store false), an unknown model, a
worker's fault; the openai Node SDK's create (whole and streamed), stream helper, parse, tool
turns and item references. Only the API key differs, and, in a later turn, the ids the horde
minted in the capture's earlier turns (output item ids, call ids): each is replaced by the one it
mints in the replay, as the client would have sent it.

What is asserted is what each client reads (docs/adr/0101-responses-api.md; the fields whose absence
broke them against a fake server: var/responses_captures of the capture helper):
- Vercel: `response.created` with the response's id, created_at and model; output_index and
  item.id on output_item.added/done; item_id on every delta; `status` on a function_call item of
  output_item.done; sequence_number on `error` and `response.failed`; a whole message's id, role,
  content and each part's annotations; usage with input and output tokens;
- openai-node's stream helper: output_index and content_index on each text event, the event's
  name equal to its data's type, response.completed last.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.oai.conftest import TEXT_OUTPUT_EVENTS, responses_sse
from tests.oai.test_relay import StreamingWorker
from workers.bridge.scripted import minimal_instance

pytestmark = pytest.mark.slow

CAPTURES: dict[str, list[dict[str, Any]]] = json.loads(
    (Path(__file__).parent / "data" / "responses_clients.json").read_text()
)
SCRIPTED = "scripted"  # the demo worker's model, in the captured bodies
STREAMED = "qwen-stream"  # the streaming reference worker's model, in the *-relayed captures


# --- the worker: the scripted backend's answers -----------------------------------------------------


def scripted_reply(job: dict[str, Any]) -> dict[str, Any]:
    """What the demo worker's scripted backend answers (workers/bridge/scripted.py): a call to the
    first tool until a tool result came back, a schema's minimal instance, else an echo; a fault
    on `[scripted:error]`."""
    payload = job["payload"]
    messages = payload["messages"]
    last_user = next(m for m in reversed(messages) if m["role"] == "user")
    content = last_user["content"]
    text = content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
    if "[scripted:error]" in text:
        return {"state": "faulted", "fault_reason": "generation_error"}
    usage = {"prompt_tokens": 5, "completion_tokens": 7}
    tools = payload.get("tools") or []
    if tools and payload.get("tool_choice") != "none" and messages[-1]["role"] != "tool":
        function = tools[0]["function"]
        arguments = json.dumps(minimal_instance(function.get("parameters") or {}), separators=(",", ":"))
        call = {
            "id": f"call_{job['id'][:8]}",
            "type": "function",
            "function": {"name": function["name"], "arguments": arguments},
        }
        return {
            "message": {"role": "assistant", "content": None, "tool_calls": [call]},
            "finish_reason": "tool_calls",
            **usage,
        }
    fmt = payload.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        reply = json.dumps(minimal_instance(fmt["json_schema"]["schema"]))
    elif messages[-1]["role"] == "tool":
        reply = f"The tool answered: {messages[-1]['content']}"
    else:
        reply = f"Scripted reply to: {text}"
    return {"message": {"role": "assistant", "content": reply}, "finish_reason": "stop", **usage}


@pytest.fixture
def scripted_worker(start_worker):
    return start_worker(model=SCRIPTED, reply=scripted_reply)


@pytest.fixture
def relaying_worker(live_horde, worker_owner):
    """The reference worker streaming a reply: its tokens posted as progress, then the reply."""
    worker = StreamingWorker(live_horde, worker_owner.key, model=STREAMED)
    worker.shape.check_in()
    yield worker
    worker.close()


# --- the client: the captured requests, replayed -----------------------------------------------------


class Replay:
    """One captured conversation replayed: each request's bytes as captured, with the API key and
    the ids minted in earlier turns replaced."""

    def __init__(self, front, requester, case: str):
        self.v1 = front.live.v1
        self.key = requester.key
        self.requests = CAPTURES[case]
        self.ids: dict[str, str] = {}  # captured id -> the id minted in this replay

    def body(self, index: int) -> bytes:
        body = self.requests[index]["body"]
        for captured, minted in self.ids.items():
            body = body.replace(captured, minted)
        return body.encode()

    def headers(self, index: int) -> list[tuple[str, str]]:
        return [(k, v.format(key=self.key)) for k, v in self.requests[index]["headers"]]

    def learn(self, index: int, response: dict[str, Any]) -> None:
        minted = [i for item in response["output"] for i in (item["id"], item.get("call_id")) if i]
        assert len(minted) == len(self.requests[index]["minted"]), (minted, self.requests[index]["minted"])
        self.ids.update(zip(self.requests[index]["minted"], minted, strict=True))

    def whole(self, index: int = 0) -> httpx.Response:
        answer = httpx.post(
            f"{self.v1}/responses", content=self.body(index), headers=self.headers(index), timeout=10
        )
        assert answer.status_code == self.requests[index]["status"], answer.text
        if answer.status_code == 200:
            check_whole(answer.json())
            self.learn(index, answer.json())
        return answer

    def stream(self, index: int = 0) -> list[dict[str, Any]]:
        events = read_stream(self.v1, self.body(index), self.headers(index))
        check_stream(events)
        if events[-1]["type"] != "response.failed":
            self.learn(index, events[-1]["response"])
        return events


def read_stream(
    v1: str, body: bytes, headers: list[tuple[str, str]], into: list | None = None
) -> list[dict[str, Any]]:
    """The data of each SSE event, checked to be named by its type."""
    events: list[dict[str, Any]] = [] if into is None else into
    with httpx.stream("POST", f"{v1}/responses", content=body, headers=headers, timeout=10) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for _, data in responses_sse(r):
            events.append(data)  # appended as they arrive: `into` is read while the stream runs
    return events


# --- what the clients read ---------------------------------------------------------------------------


def check_response(response: dict[str, Any]) -> None:
    assert re.fullmatch(r"resp_[0-9a-f]{32}", response["id"])
    assert (
        isinstance(response["created_at"], int) and response["created_at"] > 0
    )  # Vercel: new Date(created_at*1000)
    assert response["model"] and response["object"] == "response"
    for item in response["output"]:
        check_item(item)


def check_item(item: dict[str, Any]) -> None:
    assert item["id"] and item["status"] in ("completed", "incomplete")
    if item["type"] == "message":
        assert item["role"] == "assistant"
        for part in item["content"]:
            assert part["type"] == "output_text" and isinstance(part["text"], str)
            assert part["annotations"] == []
    elif item["type"] == "function_call":
        assert item["call_id"] and item["name"] and isinstance(item["arguments"], str)


def check_whole(response: dict[str, Any]) -> None:
    check_response(response)
    assert response["status"] == "completed"
    usage = response["usage"]
    assert usage["input_tokens"] >= 0 and usage["output_tokens"] >= 0
    assert usage["input_tokens_details"]["cached_tokens"] == 0
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0


def check_stream(events: list[dict[str, Any]]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    check_response(events[0]["response"])
    ids = {events[0]["response"]["id"]} | {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1
    items: dict[int, str] = {}
    for event in events:
        kind = event["type"]
        if kind in ("response.output_item.added", "response.output_item.done"):
            assert isinstance(event["output_index"], int) and event["item"]["id"]
            if kind == "response.output_item.added":
                items[event["output_index"]] = event["item"]["id"]
            else:
                assert items[event["output_index"]] == event["item"]["id"]
                check_item(event["item"])  # Vercel: a function_call without status is a type error
        elif kind.startswith("response.output_text.") or kind.startswith("response.content_part."):
            assert items[event["output_index"]] == event["item_id"]
            assert event["content_index"] == 0  # openai-node's stream helper indexes by it
        elif kind.startswith("response.function_call_arguments."):
            assert items[event["output_index"]] == event["item_id"]
    last = events[-1]
    if last["type"] == "response.failed":
        error = events[-2]
        assert error["type"] == "error" and error["code"] and error["message"]
        # The failed response's code is one of OpenAI's (the SDKs type it); the event has the horde's.
        failed = last["response"]["error"]
        assert failed["code"] in ("server_error", "rate_limit_exceeded") and failed["message"] == error["message"]
        assert isinstance(failed["type"], str)  # Vercel: a failed response's error needs a string type
    else:
        assert last["type"] == "response.completed"
        check_whole(last["response"])
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert last["response"]["output"] == done


def texts(events: list[dict[str, Any]]) -> list[str]:
    return [e["delta"] for e in events if e["type"] == "response.output_text.delta"]


def message_text(response: dict[str, Any]) -> str:
    return "".join(
        p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"]
    )


def job_messages(worker, index: int) -> list[dict[str, Any]]:
    return worker.jobs[index]["payload"]["messages"]


# --- Vercel AI SDK -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["vercel/generateText", "vercel7/generateText"])
def test_vercel_generate_text(front, requester, scripted_worker, case):
    answer = Replay(front, requester, case).whole()
    assert message_text(answer.json()) == "Scripted reply to: Say hi"
    assert job_messages(scripted_worker, 0) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi"},
    ]


def test_vercel_stream_text(front, requester, scripted_worker):
    events = Replay(front, requester, "vercel/streamText-fullStream").stream()
    assert "".join(texts(events)) == "Scripted reply to: Say hi"
    assert events[-1]["response"]["usage"]["output_tokens"] == 7


@pytest.mark.redis_only
def test_vercel_stream_text_receives_the_workers_tokens_as_they_come(front, requester, relaying_worker):
    """The worker's tokens are each a text delta, sent before the next is posted."""
    replay = Replay(front, requester, "vercel/streamText-fullStream-relayed")
    events: list[dict[str, Any]] = []
    thread = threading.Thread(target=read_stream, args=(replay.v1, replay.body(0), replay.headers(0), events))
    thread.start()
    job = relaying_worker.pop()
    tokens = ["Hell", "o fr", "om t", "he f", "ake ", "llam", "a.cp", "p."]
    for seq, token in enumerate(tokens, start=1):
        relaying_worker.post(job, seq, token)
        _wait(lambda n=seq: len(texts(events)) >= n, token)
    relaying_worker.submit(job, "".join(tokens), prompt_tokens=14, completion_tokens=36)
    thread.join(5)
    assert not thread.is_alive()
    check_stream(events)
    assert texts(events) == tokens
    assert events[-1]["response"]["usage"]["input_tokens"] == 14
    assert events[-1]["response"]["usage"]["output_tokens"] == 36


@pytest.mark.redis_only
def test_vercel_stream_text_failing_after_its_tokens_ends_failed(front, requester, relaying_worker):
    """A worker's fault after tokens were sent: `error` then `response.failed`, each with its
    sequence_number (Vercel's schema requires it), after the deltas already sent."""
    replay = Replay(front, requester, "vercel/streamText-fullStream-relayed")
    events: list[dict[str, Any]] = []
    thread = threading.Thread(target=read_stream, args=(replay.v1, replay.body(0), replay.headers(0), events))
    thread.start()
    job = relaying_worker.pop()
    relaying_worker.post(job, 1, "Hell")
    _wait(lambda: len(texts(events)) == 1, "the first token")
    relaying_worker.fault(job)
    thread.join(5)
    assert not thread.is_alive()
    check_stream(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
    assert texts(events) == ["Hell"]


@pytest.mark.parametrize(
    "case",
    [
        "vercel/tool-generateText-2steps",
        "vercel/tool-streamText-2steps",
        "vercel7/tool-generateText-2steps",  # ai 7: each function tool carries "strict": false
        "vercel7/tool-streamText-2steps",
    ],
)
def test_vercel_tool_call_and_the_step_after_its_result(front, requester, scripted_worker, case):
    replay = Replay(front, requester, case)
    streamed = "stream" in case
    first = replay.stream(0)[-1]["response"] if streamed else replay.whole(0).json()
    (call,) = first["output"]
    assert (
        call["type"] == "function_call" and call["name"] == "weather" and call["arguments"] == '{"city":""}'
    )
    assert call["status"] == "completed"
    second = replay.stream(1)[-1]["response"] if streamed else replay.whole(1).json()
    assert message_text(second) == 'The tool answered: {"city":"","temp":21.5}'
    messages = job_messages(scripted_worker, 1)
    assert messages[-2]["tool_calls"][0]["id"] == call["call_id"]
    assert messages[-1] == {
        "role": "tool",
        "tool_call_id": call["call_id"],
        "content": '{"city":"","temp":21.5}',
    }


def test_vercel_generate_object(front, requester, scripted_worker):
    answer = Replay(front, requester, "vercel/generateObject").whole()
    assert json.loads(message_text(answer.json())) == {"name": "", "population": 0, "landmarks": []}
    fmt = scripted_worker.jobs[0]["payload"]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "response"


def test_vercel_stream_text_with_output_object(front, requester, scripted_worker):
    events = Replay(front, requester, "vercel/streamText-output-object").stream()
    assert json.loads("".join(texts(events))) == {"name": "", "population": 0}


@pytest.mark.parametrize(
    ("case", "kept"),
    [
        ("vercel/multiturn-store-default", True),
        ("vercel/multiturn-store-false", False),
        # ai 7 sends the earlier answer back as {"role": "assistant", "content": "<text>"}, without its id
        ("vercel7/multiturn-store-false", False),
    ],
)
def test_vercel_multi_turn_from_response_messages(front, requester, scripted_worker, case, kept):
    """store left at its default: the SDK sends the first answer back as an item_reference, which the
    horde resolves to the message it kept; store false: the message itself."""
    replay = Replay(front, requester, case)
    first = replay.whole(0).json()
    assert first["store"] is kept
    body = replay.body(1).decode()
    assert ('"type":"item_reference"' in body) is kept
    second = replay.whole(1).json()
    assert message_text(second) == "Scripted reply to: And again"
    assert job_messages(scripted_worker, 1)[1] == {
        "role": "assistant",
        "content": "Scripted reply to: Hi there",
    }


@pytest.mark.redis_only
def test_vercel_multi_turn_after_a_relayed_stream_references_its_message(front, requester, relaying_worker):
    """streamText's reply, relayed token by token, is kept once completed: the next turn's
    item_reference to it is its whole text."""
    replay = Replay(front, requester, "vercel/multiturn-streamed-first-relayed")
    events: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: events.extend(replay.stream(0)))
    thread.start()
    job = relaying_worker.pop()
    for seq, token in enumerate(["Hel", "lo."], start=1):
        relaying_worker.post(job, seq, token)
    relaying_worker.submit(job, "Hello.")
    thread.join(5)
    assert not thread.is_alive() and events[-1]["type"] == "response.completed"
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(replay.whole(1)))
    thread.start()
    job = relaying_worker.pop()
    assert '"type":"item_reference"' in replay.body(1).decode()
    assert job["payload"]["messages"] == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And again"},
    ]
    relaying_worker.submit(job, "Hello again.")
    thread.join(5)
    assert message_text(answers[0].json()) == "Hello again."


def test_vercel_multi_turn_with_a_tool_step_and_a_referenced_message(front, requester, scripted_worker):
    replay = Replay(front, requester, "vercel/multiturn-store-default-tools")
    replay.whole(0)
    assert message_text(replay.whole(1).json()) == 'The tool answered: {"city":"","temp":21.5}'
    third = replay.whole(2).json()
    assert message_text(third) == "Scripted reply to: And Rome?"
    messages = job_messages(scripted_worker, 2)
    assert messages[-2] == {"role": "assistant", "content": 'The tool answered: {"city":"","temp":21.5}'}


@pytest.mark.parametrize(
    "case", ["vercel/bad-model-generateText", "vercel/bad-model-streamText", "openai-node/bad-model-create"]
)
def test_an_unknown_model_is_404_before_any_stream(front, requester, scripted_worker, case):
    answer = Replay(front, requester, case).whole()
    assert answer.headers["content-type"] == "application/json"
    assert answer.json()["error"] == {
        "message": "The model 'no-such-model' is not known to this horde.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert answer.headers["x-should-retry"] == "false"  # neither SDK retries it


def test_a_workers_fault_in_a_whole_response_is_an_error_the_clients_may_retry(
    front, requester, scripted_worker
):
    answer = Replay(front, requester, "vercel/error-generateText").whole()
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == "ChatRequestFaulted"


@pytest.mark.parametrize("case", ["vercel/error-streamText", "openai-node/error-create-stream"])
def test_a_workers_fault_in_a_stream_is_error_then_response_failed(front, requester, scripted_worker, case):
    events = Replay(front, requester, case).stream()
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert events[2]["code"] == "ChatRequestFaulted"


# --- openai Node SDK -----------------------------------------------------------------------------------


def test_openai_node_create(front, requester, scripted_worker):
    answer = Replay(front, requester, "openai-node/create").whole()
    assert message_text(answer.json()) == "Scripted reply to: Hi"
    assert answer.json()["instructions"] == "Be brief."


@pytest.mark.parametrize(
    "case", ["openai-node/create-stream", "openai-node/stream-helper", "openai-node7/stream-helper"]
)
def test_openai_node_streams(front, requester, scripted_worker, case):
    events = Replay(front, requester, case).stream()
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        *TEXT_OUTPUT_EVENTS,
        "response.completed",
    ]
    assert events[5]["text"] == "Scripted reply to: Hi"


@pytest.mark.redis_only
def test_openai_node_stream_receives_the_workers_tokens(front, requester, relaying_worker):
    replay = Replay(front, requester, "openai-node/create-stream-relayed")
    events: list[dict[str, Any]] = []
    thread = threading.Thread(target=read_stream, args=(replay.v1, replay.body(0), replay.headers(0), events))
    thread.start()
    job = relaying_worker.pop()
    for seq, token in enumerate(["Hel", "lo."], start=1):
        relaying_worker.post(job, seq, token)
        _wait(lambda n=seq: len(texts(events)) >= n, token)
    relaying_worker.submit(job, "Hello.")
    thread.join(5)
    assert not thread.is_alive()
    check_stream(events)
    assert texts(events) == ["Hel", "lo."]
    assert [e["text"] for e in events if e["type"] == "response.output_text.done"] == ["Hello."]


def test_openai_node_tool_turns(front, requester, scripted_worker):
    replay = Replay(front, requester, "openai-node/tools-two-turns")
    (call,) = replay.whole(0).json()["output"]
    assert call["type"] == "function_call" and call["arguments"] == '{"city":""}'
    assert message_text(replay.whole(1).json()) == "The tool answered: 21.5C"


@pytest.mark.parametrize("case", ["openai-node/tools-stream-helper", "openai-node7/tools-stream-helper"])
def test_openai_node_tool_call_streamed(front, requester, scripted_worker, case):
    events = Replay(front, requester, case).stream()
    assert [e["type"] for e in events[2:]] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[5]["item"]["status"] == "completed" and events[4]["arguments"] == '{"city":""}'


def test_openai_node_parse(front, requester, scripted_worker):
    answer = Replay(front, requester, "openai-node/parse-zod").whole()
    assert json.loads(message_text(answer.json())) == {"name": "", "population": 0}
    assert answer.json()["text"]["format"]["name"] == "city"


def test_openai_node_item_reference(front, requester, scripted_worker):
    replay = Replay(front, requester, "openai-node/multiturn-item-reference")
    replay.whole(0)
    assert message_text(replay.whole(1).json()) == "Scripted reply to: And again"
    assert job_messages(scripted_worker, 1)[1] == {
        "role": "assistant",
        "content": "Scripted reply to: Hi there",
    }


def _wait(predicate, what: str, timeout: float = 3) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")
