"""A local fake OpenAI-compatible backend that answers like llama.cpp's server (a real HTTP server).

GET /v1/models (with meta.n_ctx_train), GET /props (n_ctx, chat template, modalities),
POST /v1/chat/completions and /v1/completions with stream off. By default a chat request with
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
        self._server: ThreadingHTTPServer | None = None
        self._calls = 0

    # -- lifecycle

    def start(self) -> str:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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
