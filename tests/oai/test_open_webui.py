"""Open WebUI 0.12.4 (its server, unchanged) against the horde: the exchanges it sent, captured on the
wire and replayed here byte for byte (the model name aside) against the live horde and its mounted
front, the worker side driven over the real native routes (pop, progress, submit).

Its server (backend/open_webui/routers/openai.py, aiohttp) lists `GET {base}/models`, then posts
`{base}/chat/completions`. With ENABLE_FORWARD_USER_INFO_HEADERS it adds its `X-OpenWebUI-*` headers.
Since native function calling became its default, a chat from its page carries its built-in tools
(28 of them, 20 kB: `tests/oai/data/open_webui_0_12_4_tools.json`, as sent) and no `tool_choice`;
after a tool call it posts the call and the tool's answer with the same tools. It sends no
`stream_options` by default, so it reads no usage. Its stream reader shows `delta.reasoning_content`
as the model's thinking and `delta.content` as the reply, as they arrive, and runs `delta.tool_calls`.

As chat_front.md says, a streamed request with tools is delivered whole, so by default its users see
nothing until the reply is complete. A front set with HORDE_OAI_RELAY_WITH_TOOLS relays such a request
under tool_choice auto, none or absent, and the checked calls follow the text (ADR 0098).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.oai.conftest import MODEL
from tests.oai.test_relay import _wait

pytestmark = pytest.mark.redis_only

TOOLS = (Path(__file__).parent / "data" / "open_webui_0_12_4_tools.json").read_bytes()
USER_ID = "3e954703-b826-4cb6-a511-c3cfe7aaee3c"
CHAT_ID = "d8a9d47c-2bf3-496d-bfbc-58942a89af2b"
AIOHTTP_AGENT = "Python/3.11 aiohttp/3.14.5"
FIRST_MESSAGES = b'[{"role":"user","content":"Tell me a long story"}]'
TOOL_MESSAGES = (
    b'[{"role":"user","content":"Tell me a long story"},{"role":"assistant","content":"","tool_calls":'
    b'[{"id":"call_1","type":"function","function":{"name":"get_current_timestamp","arguments":"{}"}}]},'
    b'{"role":"tool","tool_call_id":"call_1","content":"{\\"current_timestamp\\":1796595537,'
    b'\\"current_iso\\":\\"2026-12-06T22:18:57.318374+00:00\\"}"}]'
)


def chat_body(messages: bytes) -> bytes:
    return b'{"stream":true,"model":"' + MODEL.encode() + b'","messages":' + messages + b',"tools":' + TOOLS + b"}"


def user_headers() -> list[tuple[str, str]]:
    return [
        ("X-OpenWebUI-Auth-Type", "jwt"),
        ("X-OpenWebUI-User-Name", "User"),
        ("X-OpenWebUI-User-Id", USER_ID),
        ("X-OpenWebUI-User-Email", "admin@localhost"),
        ("X-OpenWebUI-User-Role", "admin"),
    ]


def post_headers(key: str, body: bytes) -> list[tuple[str, str]]:
    """aiohttp's headers in the order it wrote them (Host first, as httpx writes it)."""
    return [
        ("Content-Type", "application/json"),
        *user_headers(),
        ("X-OpenWebUI-Chat-Id", CHAT_ID),
        ("Authorization", f"Bearer {key}"),
        ("Accept", "*/*"),
        ("Accept-Encoding", "gzip, deflate, br"),
        ("User-Agent", AIOHTTP_AGENT),
        ("Content-Length", str(len(body))),
    ]


class OpenWebUiStream(threading.Thread):
    """Its server's read of the stream: `data:` lines, JSON parsed, each delta kept as it arrives."""

    def __init__(self, v1: str, key: str, body: bytes):
        super().__init__(daemon=True)
        self.v1, self.key, self.body = v1, key, body
        self.status: int | None = None
        self.deltas: list[dict[str, Any]] = []
        self.finishes: list[str] = []
        self.errors: list[Any] = []
        self.done = False

    def run(self) -> None:
        with httpx.stream(
            "POST", f"{self.v1}/chat/completions", content=self.body,
            headers=post_headers(self.key, self.body), timeout=30,
        ) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    self.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    self.errors.append(event["error"])
                for choice in event.get("choices") or ():
                    self.deltas.append(choice["delta"])
                    if choice.get("finish_reason"):
                        self.finishes.append(choice["finish_reason"])

    def text(self, key: str) -> str:
        return "".join(delta.get(key) or "" for delta in self.deltas)

    def finish(self) -> None:
        self.join(15)
        assert not self.is_alive() and self.status == 200 and self.done and not self.errors, self.errors


@pytest.fixture
def relaying_front(front):
    """The front set to relay requests with tools (HORDE_OAI_RELAY_WITH_TOOLS)."""
    front.configure(relay_with_tools=True)
    return front


def test_open_webui_lists_the_models_with_its_headers(front, requester, streaming_worker):
    headers = [("Authorization", f"Bearer {requester.key}"), *user_headers(), ("Accept", "*/*"),
               ("Accept-Encoding", "gzip, deflate, br"), ("User-Agent", AIOHTTP_AGENT)]
    listed = httpx.get(f"{front.live.v1}/models", headers=headers, timeout=20)
    assert listed.status_code == 200 and listed.headers["content-type"] == "application/json"
    assert MODEL in [model["id"] for model in listed.json()["data"]]


def test_open_webui_chat_with_its_tools_is_delivered_whole_by_default(front, requester, streaming_worker):
    """The spec's rule (chat_front.md, relays_deltas: no tools): its chat with 28 tools is not relayed;
    the reply reaches the page whole when the worker submits."""
    client = OpenWebUiStream(front.live.v1, requester.key, chat_body(FIRST_MESSAGES))
    client.start()
    job = streaming_worker.pop()
    assert len(job["payload"]["tools"]) == 28 and "stream_progress" not in job["payload"]
    streaming_worker.submit(job, "Once upon a time.")
    client.finish()
    assert [delta["content"] for delta in client.deltas if delta.get("content")] == ["Once upon a time."]
    assert client.finishes == ["stop"]


def test_open_webui_chat_with_its_tools_streams_the_thinking_then_the_call(relaying_front, requester, streaming_worker):
    front = relaying_front
    client = OpenWebUiStream(front.live.v1, requester.key, chat_body(FIRST_MESSAGES))
    client.start()
    job = streaming_worker.pop()
    payload = job["payload"]
    assert len(payload["tools"]) == 28 and "tool_choice" not in payload
    assert payload["stream_progress"] is True  # relayed: the reply's text reaches the page as it comes
    assert streaming_worker.post(job, 1, reasoning="The user wants a story. ") == {"accepted_seq": 1, "cancelled": False}
    # Shown before the worker submits: the page shows the model thinking, not a blank reply.
    _wait(lambda: client.text("reasoning_content") == "The user wants a story. ", 5, "the reasoning delta")
    streaming_worker.post(job, 2, reasoning="First, the time.")
    _wait(lambda: client.text("reasoning_content").endswith("the time."), 5, "the second delta")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_current_timestamp", "arguments": "{}"}}
    body = {
        "id": job["id"], "model_id": MODEL, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": "", "reasoning_content": "The user wants a story. First, the time.",
                    "tool_calls": [call]},
    }
    assert streaming_worker.http.post("/api/v2/generate/text/submit", json=body).status_code == 200
    client.finish()
    assert client.deltas[0] == {"role": "assistant"}
    assert client.text("reasoning_content") == "The user wants a story. First, the time."
    assert client.text("content") == ""
    calls = [delta["tool_calls"] for delta in client.deltas if "tool_calls" in delta]
    assert len(calls) == 1 and calls[0][0]["function"] == call["function"] and calls[0][0]["index"] == 0
    assert client.finishes == ["tool_calls"]


def test_open_webui_tool_answer_streams_the_reply_as_it_comes(relaying_front, requester, streaming_worker):
    front = relaying_front
    client = OpenWebUiStream(front.live.v1, requester.key, chat_body(TOOL_MESSAGES))
    client.start()
    job = streaming_worker.pop()
    assert job["payload"]["messages"][2]["role"] == "tool" and job["payload"]["stream_progress"] is True
    tokens = ["Once", " upon", " a time."]
    for seq, token in enumerate(tokens, start=1):
        streaming_worker.post(job, seq, token)
        _wait(lambda n=seq: client.text("content") == "".join(tokens[:n]), 5, token)
    streaming_worker.submit(job, "Once upon a time. The end.")
    client.finish()
    contents = [delta["content"] for delta in client.deltas if delta.get("content")]
    assert contents == [*tokens, " The end."]
    assert not [delta for delta in client.deltas if "tool_calls" in delta]
    assert client.finishes == ["stop"]


def test_a_refused_call_after_relayed_text_ends_the_stream_diverged(relaying_front, requester, streaming_worker):
    front = relaying_front
    """Under its tools the relayed text may belong to a reply the horde refuses (a call to a function
    the tools do not define): the stream ends in ChatStreamDiverged, as any replaced attempt (ADR 0098)."""
    client = OpenWebUiStream(front.live.v1, requester.key, chat_body(FIRST_MESSAGES))
    client.start()
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, "Let me check.")
    _wait(lambda: client.text("content") == "Let me check.", 5, "the relayed text")
    call = {"id": "call_x", "type": "function", "function": {"name": "no_such_tool", "arguments": "{}"}}
    body = {"id": job["id"], "model_id": MODEL, "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": "Let me check.", "tool_calls": [call]}}
    refused = streaming_worker.http.post("/api/v2/generate/text/submit", json=body)
    assert refused.status_code == 400, refused.text
    # What a worker does with a refused reply (the reference worker too): the attempt's ended marker
    # ends the relayed stream, which has no unexposed attempt to switch to.
    streaming_worker.fault(job)
    client.join(15)
    assert not client.is_alive() and client.done
    assert [error["code"] for error in client.errors] == ["ChatStreamDiverged"]
    assert client.text("content") == "Let me check."


def test_open_webui_chat_controls_reach_the_worker_and_the_thinking_is_relayed(relaying_front, requester, streaming_worker):
    front = relaying_front
    """Its page's chat controls (temperature, reasoning effort, max tokens, seed) are top-level keys
    beside its tools."""
    messages = b'[{"role":"user","content":"think about it"}]'
    body = chat_body(messages).replace(
        b',"tools":', b',"temperature":0.7,"reasoning_effort":"low","max_tokens":200,"seed":42,"tools":', 1
    )
    client = OpenWebUiStream(front.live.v1, requester.key, body)
    client.start()
    job = streaming_worker.pop()
    payload = job["payload"]
    assert (payload["temperature"], payload["reasoning_effort"], payload["max_length"], payload["seed"]) == (
        0.7, "low", 200, 42,
    )
    assert payload["stream_progress"] is True
    streaming_worker.post(job, 1, reasoning="Effort low.")
    _wait(lambda: client.text("reasoning_content") == "Effort low.", 5, "the reasoning delta")
    streaming_worker.submit(job, "Plainly.", reasoning="Effort low. I answer plainly.")
    client.finish()
    assert client.text("reasoning_content") == "Effort low. I answer plainly."
    assert client.text("content") == "Plainly." and client.finishes == ["stop"]


def test_open_webui_title_task_is_answered_whole(front, requester, streaming_worker):
    """After a chat it asks for a title: stream false, max_tokens 1000, its prompt in one user message.
    It reads choices[0].message.content and takes the JSON object in it."""
    body = (Path(__file__).parent / "data" / "open_webui_0_12_4_title.json").read_bytes()
    body = body.replace(b'"model":"scripted"', b'"model":"' + MODEL.encode() + b'"', 1)
    answers: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answers.append(httpx.post(
            f"{front.live.v1}/chat/completions", content=body, headers=post_headers(requester.key, body), timeout=30
        )),
        daemon=True,
    )
    thread.start()
    job = streaming_worker.pop()
    assert job["payload"]["max_length"] == 1000 and "stream_progress" not in job["payload"]
    assert job["payload"]["messages"][0]["content"].startswith("### Task:\nGenerate a concise title")
    streaming_worker.submit(job, '{ "title": "Thinking It Over" }')
    thread.join(15)
    assert answers and answers[0].status_code == 200, answers
    assert answers[0].headers["content-type"] == "application/json"
    content = answers[0].json()["choices"][0]["message"]["content"]
    assert json.loads(content[content.find("{") : content.rfind("}") + 1]) == {"title": "Thinking It Over"}
