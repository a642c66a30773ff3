"""A local fake OpenAI-compatible backend that answers like llama.cpp's server (a real HTTP server).

GET /v1/models (with meta.n_ctx_train), GET /props (n_ctx, chat template, modalities),
POST /v1/chat/completions and /v1/completions. A chat request with stream: true is answered as
llama-server streams it: SSE `data: {chat.completion.chunk}` events (role first, then
reasoning_content, content and tool call deltas of `chunk_chars` characters, `chunk_delay` apart,
a final chunk with finish_reason, the usage chunk under stream_options.include_usage, then
`data: [DONE]`), chunked over HTTP/1.1; a client that closes the stream stops the generation
(`streams` records what each stream sent). By default a chat request with
tools forwarded gets one tool call (an id the server mints), a json_schema request gets the
schema's first enum or "{}", anything else a text reply; `chat_handler` / `completion_handler`
replace that, `delay` holds each generation, `fail_with` answers an error. Every request body is
kept in `requests`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LLAMA_CONTEXT_OVERFLOW = (
    400,
    {
        "error": {
            "code": 400,
            "message": "the request exceeds the available context size, try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 9000,
            "n_ctx": 8192,
        }
    },
)
LLAMA_GRAMMAR_ERROR = (
    400,
    {"error": {"code": 400, "message": "Failed to parse grammar: JSON schema conversion failed", "type": "invalid_request_error"}},
)
LLAMA_SERVER_ERROR = (500, {"error": {"code": 500, "message": "llama_decode failed: KV cache full", "type": "server_error"}})
TOOL_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<tool_call>{% endfor %}"


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # A client that gave up a slow generation (the lease and stop tests) closes its end.
        pass


class FakeLlamaCpp:
    def __init__(self, *, n_ctx: int = 8192, n_ctx_train: int = 32768, model: str = "qwen3-8b-q4_k_m.gguf"):
        self.n_ctx = n_ctx
        self.n_ctx_train = n_ctx_train
        self.model = model
        self.chat_template = TOOL_TEMPLATE
        self.vision = False
        self.delay = 0.0
        self.fail_with: tuple[int, dict[str, Any]] | None = None
        self.chat_handler: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self.completion_handler: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.generating = threading.Event()  # set when a generation request arrived
        self.chunk_chars = 4
        self.chunk_delay = 0.0
        self.streams: list[StreamRecord] = []
        self.stream_ended = threading.Event()  # set when a stream finished or its client went away
        self._server: ThreadingHTTPServer | None = None
        self._calls = 0

    # -- lifecycle

    def start(self) -> str:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # llama-server streams with chunked transfer encoding

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, body: dict[str, Any]) -> None:
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                events = stream_chunks(fake.chat(body), fake.chunk_chars, include_usage=include_usage)
                record = StreamRecord(total=len(events))
                fake.streams.append(record)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for event in events:
                        data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.flush()
                        record.sent += 1
                        if fake.chunk_delay:
                            time.sleep(fake.chunk_delay)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    record.finished = True
                except (BrokenPipeError, ConnectionResetError):
                    record.closed_early = True  # llama-server cancels the task when its client goes away
                    self.close_connection = True
                finally:
                    fake.stream_ended.set()

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, fake.models())
                elif self.path == "/props":
                    self._send(200, fake.props())
                elif self.path == "/health":
                    self._send(200, {"status": "ok"})
                else:
                    self._send(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                fake.requests.append((self.path, body))
                if self.path in ("/v1/chat/completions", "/v1/completions"):
                    fake.generating.set()
                    if fake.delay:
                        time.sleep(fake.delay)
                    if fake.fail_with:
                        self._send(*fake.fail_with)
                    elif self.path == "/v1/chat/completions" and body.get("stream"):
                        self._stream(body)
                    elif self.path == "/v1/chat/completions":
                        self._send(200, fake.chat(body))
                    else:
                        self._send(200, fake.completion(body))
                else:
                    self._send(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

        self._server = QuietServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- answers

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": 1700000000,
                    "owned_by": "llamacpp",
                    "meta": {"vocab_type": 2, "n_vocab": 151936, "n_ctx_train": self.n_ctx_train, "n_embd": 4096},
                }
            ],
        }

    def props(self) -> dict[str, Any]:
        return {
            "default_generation_settings": {"n_ctx": self.n_ctx, "params": {"temperature": 0.8}},
            "total_slots": 1,
            "model_path": f"/models/{self.model}",
            "chat_template": self.chat_template,
            "modalities": {"vision": self.vision},
            "build_info": "b6000-fake",
        }

    def chat_requests(self) -> list[dict[str, Any]]:
        return [body for path, body in self.requests if path == "/v1/chat/completions"]

    def completion_requests(self) -> list[dict[str, Any]]:
        return [body for path, body in self.requests if path == "/v1/completions"]

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.chat_handler is not None:
            return self.chat_handler(body)
        self._calls += 1
        message: dict[str, Any] = {"role": "assistant", "content": "Hello from the fake llama.cpp."}
        finish = "stop"
        tools = body.get("tools") or []
        last = (body.get("messages") or [{}])[-1]
        response_format = body.get("response_format") or {}
        if tools and body.get("tool_choice") != "none" and last.get("role") != "tool":
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": tools[0]["function"]["name"], "arguments": '{"city":"Paris"}'},
                        "id": f"llama_call_{self._calls:04d}",
                    }
                ],
            }
            finish = "tool_calls"
        elif response_format.get("type") == "json_schema":
            message["content"] = json.dumps({"shade": "teal"})
        return chat_completion(message, finish, model=self.model)

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.completion_handler is not None:
            return self.completion_handler(body)
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 1700000000,
            "model": self.model,
            "choices": [{"text": " the dragon slept.", "index": 0, "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
        }


@dataclass
class StreamRecord:
    total: int  # events the whole reply takes, [DONE] included
    sent: int = 0
    finished: bool = False
    closed_early: bool = False


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def stream_chunks(completion: dict[str, Any], size: int, *, include_usage: bool) -> list[Any]:
    """A chat.completion as the events llama-server streams for it."""
    choice = completion["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
            "created": 1700000000,
            "id": "chatcmpl-fake",
            "model": completion.get("model", "fake"),
            "system_fingerprint": "b6000-fake",
            "object": "chat.completion.chunk",
            **extra,
        }

    events: list[Any] = [chunk({"role": "assistant", "content": None})]
    events += [chunk({"reasoning_content": piece}) for piece in _pieces(message.get("reasoning_content") or "", size)]
    events += [chunk({"content": piece}) for piece in _pieces(message.get("content") or "", size)]
    for index, call in enumerate(message.get("tool_calls") or []):
        head = {"index": index, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": ""}}
        events.append(chunk({"tool_calls": [head]}))
        events += [
            chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            for piece in _pieces(call["function"]["arguments"], size)
        ]
    usage = completion.get("usage")
    events.append(chunk({}, choice["finish_reason"], timings={"predicted_n": len(events)}))
    if include_usage and usage:
        usage_chunk = chunk({}, usage=usage)
        usage_chunk["choices"] = []
        events.append(usage_chunk)
    events.append("[DONE]")
    return events


def chat_completion(
    message: dict[str, Any], finish: str = "stop", *, model: str = "fake", usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "system_fingerprint": "b6000-fake",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage or {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30},
    }
