"""OpenAI's Codex CLI (`@openai/codex` 0.171.0, `codex exec`, wire_api = "responses") against the live
horde: its exact request bodies and headers, captured by a logging relay between the unchanged CLI
and a live horde (tests/oai/data/codex/), replayed byte for byte. The reference worker serves MODEL
from the fake llama-server, scripted as a model that calls Codex's `exec_command` tool when asked
about files and answers in text once the tool's output comes back (docs/adr/0101-responses-api.md,
"Codex CLI").

What Codex sends on every turn: `store: false`, `stream: true`, `include:
["reasoning.encrypted_content"]`, `reasoning: {"summary": "auto"}`, `parallel_tool_calls: true`,
`prompt_cache_key` (its session id), `client_metadata` (its thread, turn and installation ids), and
its tools: plain function tools, the `multi_agent_v1` namespace of function tools (unless
`[agents] enabled = false`), and `web_search` (unless `web_search = "disabled"`). The second turn of
a tool loop carries the whole conversation again (no previous_response_id): its `function_call`
item as the horde answered it and a `function_call_output`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.bridge.conftest import MODEL, running_bridge
from tests.bridge.conftest import LiveHorde as BridgeHorde
from tests.bridge.fake_backend import FakeLlamaCpp, chat_completion

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

DATA = Path(__file__).parent / "data" / "codex"
ANSWER = "Paris is the capital of France."
CALL_ID = "call_ls_1"


def codex_body(name: str) -> bytes:
    """A captured body with its model set to the fixtures' MODEL (Codex sent "codex-fake")."""
    raw = (DATA / f"{name}.json").read_bytes()
    return raw.replace(b'"model":"codex-fake"', f'"model":"{MODEL}"'.encode(), 1)


def codex_headers(key: str) -> dict[str, str]:
    headers = json.loads((DATA / "headers.json").read_text())
    return {**headers, "authorization": f"Bearer {key}"}


def scripted_model(fake_backend: FakeLlamaCpp) -> None:
    """A call of exec_command {"cmd": "ls"} when the user asks about files, a text answer naming
    the tool output's last line once it comes back, else ANSWER."""

    def chat(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        names = [tool["function"]["name"] for tool in body.get("tools") or ()]
        if last["role"] == "tool":
            listed = str(last["content"]).strip().splitlines()[-1]
            return chat_completion({"role": "assistant", "content": f"The directory holds: {listed}"})
        if "exec_command" in names and "files" in str(last["content"]):
            call = {"id": CALL_ID, "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'}}
            return chat_completion({"role": "assistant", "content": "", "tool_calls": [call]}, "tool_calls")
        return chat_completion({"role": "assistant", "content": ANSWER})

    fake_backend.chat_handler = chat


@pytest.fixture
def codex_horde(front, live_horde, make_user) -> Iterator[tuple[str, str, FakeLlamaCpp]]:
    """(the front's /v1 URL, a requester's key, the fake llama-server), with the reference worker
    serving MODEL from the fake (a context large enough for Codex's ~10k-token prompt)."""
    fake_backend = FakeLlamaCpp(n_ctx=131072, n_ctx_train=131072)
    fake_backend.chunk_chars, fake_backend.chunk_delay = 3, 0.03
    scripted_model(fake_backend)
    fake_backend.start()
    owner = make_user(f"codex-owner-{uuid.uuid4().hex[:6]}", trusted=True)
    requester = make_user(f"codex-req-{uuid.uuid4().hex[:6]}", kudos=100_000)
    bridge_horde = BridgeHorde(live_horde.url, owner.key, requester.key)
    with running_bridge(bridge_horde, fake_backend.url, progress_interval=0.05, pop_wait=0):
        yield front.live.v1, requester.key, fake_backend
    bridge_horde.client.close()
    fake_backend.stop()


def post(v1: str, key: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{v1}/responses", content=body, headers=codex_headers(key), timeout=60)


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """The SSE events' data, each checked against its `event:` line (Codex reads `data` by its type)."""
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            data = json.loads(lines["data"])
            assert lines.get("event") == data["type"]
            out.append(data)
    return out


def completed(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    stream = events(response)
    assert [e["type"] for e in stream][:2] == ["response.created", "response.in_progress"]
    assert stream[-1]["type"] == "response.completed"
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    return stream[-1]["response"]


def test_codex_question_is_answered_in_a_streamed_message(codex_horde):
    """`codex exec "What is the capital of France?"` with web_search disabled and no sub-agents:
    Codex's client_metadata, include, store: false and reasoning summary are accepted, and it
    reads the answer from the completed message item (it prints 'Paris is the capital...')."""
    v1, key, fake_backend = codex_horde
    response = completed(post(v1, key, codex_body("question")))
    (message,) = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["text"] == ANSWER
    assert response["store"] is False and response["usage"]["output_tokens"] > 0
    assert response["prompt_cache_key"] == json.loads(codex_body("question"))["prompt_cache_key"]
    sent = fake_backend.chat_requests()[-1]
    assert [m["role"] for m in sent["messages"]][-1] == "user"
    assert sent["messages"][-1]["content"] == "What is the capital of France?"


def test_codex_tool_loop_runs_its_shell_call_then_answers(codex_horde):
    """`codex exec "Which files are in this directory? ..."`: the first turn is answered with a
    function_call of exec_command that Codex runs; the second (the whole conversation again, with
    the call and its output) is answered in text."""
    v1, key, fake_backend = codex_horde
    first = completed(post(v1, key, codex_body("tool_first")))
    (call,) = first["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert (call["name"], call["call_id"], json.loads(call["arguments"])) == ("exec_command", CALL_ID, {"cmd": "ls"})

    second = completed(post(v1, key, codex_body("tool_second")))
    assert second["output"][-1]["content"][0]["text"] == "The directory holds: notes.txt"
    sent = fake_backend.chat_requests()[-1]["messages"]
    assert sent[-2]["tool_calls"][0]["id"] == CALL_ID
    assert sent[-2]["tool_calls"][0]["function"] == {"name": "exec_command", "arguments": '{"cmd": "ls"}'}
    assert sent[-1]["role"] == "tool" and sent[-1]["tool_call_id"] == CALL_ID
    assert sent[-1]["content"].endswith("notes.txt\n")


def test_codex_namespace_tools_reach_the_worker_as_functions(codex_horde):
    """With sub-agents on (Codex's default), its `multi_agent_v1` namespace of function tools is
    served: each function reaches the worker as `multi_agent_v1__<name>`, and the echoed tools keep
    the namespace."""
    v1, key, fake_backend = codex_horde
    response = completed(post(v1, key, codex_body("namespace_question")))
    assert response["output"][0]["content"][0]["text"] == ANSWER
    names = [tool["function"]["name"] for tool in fake_backend.chat_requests()[-1]["tools"]]
    assert "exec_command" in names and "multi_agent_v1__spawn_agent" in names
    (namespace,) = [tool for tool in response["tools"] if tool["type"] == "namespace"]
    assert namespace["name"] == "multi_agent_v1" and "spawn_agent" in [t["name"] for t in namespace["tools"]]


def test_codex_namespaced_call_loop(codex_horde):
    """`codex exec "Close the sub agent agent-x."`: the model's call of the namespaced function
    comes back as `close_agent` with `namespace: "multi_agent_v1"` (what Codex dispatches by: it ran
    its close_agent and sent the error as the output), and Codex's next turn, which sends that item
    back, is the same chat call for the worker."""
    v1, key, fake_backend = codex_horde

    def call_close(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last["role"] == "tool":
            return chat_completion({"role": "assistant", "content": f"Codex said: {last['content']}"})
        function = {"name": "multi_agent_v1__close_agent", "arguments": '{"target": "agent-x"}'}
        call = {"id": "call_close_1", "type": "function", "function": function}
        return chat_completion({"role": "assistant", "content": "", "tool_calls": [call]}, "tool_calls")

    fake_backend.chat_handler = call_close
    stream = post(v1, key, codex_body("namespace_call_first"))
    first = completed(stream)
    (call,) = first["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "close_agent", "multi_agent_v1")
    (done,) = [e for e in events(stream) if e["type"] == "response.function_call_arguments.done"]
    assert done["name"] == "close_agent"

    second = completed(post(v1, key, codex_body("namespace_call_second")))
    assert second["output"][0]["content"][0]["text"].startswith("Codex said: invalid agent id agent-x")
    sent = fake_backend.chat_requests()[-1]["messages"]
    assert sent[-2]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__close_agent"
    assert sent[-1] == {"role": "tool", "tool_call_id": "call_close_1", "content": sent[-1]["content"]}


def test_codex_default_web_search_tool_is_refused_naming_it(codex_horde):
    """Codex's default tools include the built-in `web_search`, which runs on OpenAI's servers: a
    400 names it and says what Codex users set (`web_search = "disabled"`)."""
    v1, key, _ = codex_horde
    response = post(v1, key, codex_body("default_first"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools[8].type" and error["code"] == "UnsupportedChatParameter"
    assert "tools[8].type=web_search" in error["message"] and "function tools" in error["message"]


def test_codex_sends_a_reasoning_item_back_in_its_tool_loop(codex_horde):
    """With a thinking model: the first turn's reasoning is a reasoning item with its summary
    (Codex prints it), and Codex's next turn sends it back with `content` and `encrypted_content`
    null beside the call and its output: accepted, and the reasoning is not shown to the model."""
    v1, key, fake_backend = codex_horde
    scripted = fake_backend.chat_handler
    assert scripted is not None

    def thinking(body: dict[str, Any]) -> dict[str, Any]:
        reply = scripted(body)
        reply["choices"][0]["message"]["reasoning_content"] = "I should list the files."
        return reply

    fake_backend.chat_handler = thinking
    first = completed(post(v1, key, codex_body("reasoning_tool_first")))
    reasoning, call = first["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["summary"] == [{"type": "summary_text", "text": "I should list the files."}]
    assert call["name"] == "exec_command"

    second_body = codex_body("reasoning_tool_second")
    (sent_back,) = [item for item in json.loads(second_body)["input"] if item["type"] == "reasoning"]
    assert sent_back["encrypted_content"] is None and sent_back["content"] is None
    second = completed(post(v1, key, second_body))
    assert second["output"][-1]["content"][0]["text"] == "The directory holds: notes.txt"
    sent = fake_backend.chat_requests()[-1]["messages"]
    assert "I should list the files." not in json.dumps(sent)


@pytest.mark.redis_only
@pytest.mark.parametrize("relay_with_tools", [False, True])
def test_codex_answer_streams_in_deltas_only_when_the_front_relays_with_tools(front, codex_horde, relay_with_tools):
    """Codex sends tools on every turn: its answer is one delta at the end on a default front, and
    the worker's deltas as they come on a front set to relay requests with tools (ADR 0098)."""
    v1, key, _ = codex_horde
    front.configure(relay_with_tools=relay_with_tools)
    response = post(v1, key, codex_body("question"))
    assert completed(response)["output"][0]["content"][0]["text"] == ANSWER
    deltas = [e["delta"] for e in events(response) if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == ANSWER
    assert (len(deltas) > 1) is relay_with_tools, deltas
