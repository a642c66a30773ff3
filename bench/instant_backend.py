"""An instant OpenAI-compatible backend, for the benches that run the reference worker: every chat
completion answered at once with one fixed reply; with `stream: true` as server-sent events (a
role chunk, one content chunk, a finish chunk and [DONE]). `GET /v1/models` lists its one model.

    python bench/instant_backend.py PORT      # serve until stopped
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from common import PYTHON, free_port

REPLY = "An instant reply."


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-instant",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "instant",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def serve(port: int) -> None:
    whole = json.dumps(
        {
            "id": "chatcmpl-instant",
            "object": "chat.completion",
            "model": "instant",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
        }
    ).encode()
    models = json.dumps({"object": "list", "data": [{"id": "instant", "object": "model", "owned_by": "bench"}]}).encode()
    streamed = (
        _chunk({"role": "assistant", "content": ""})
        + _chunk({"content": REPLY})
        + _chunk({}, "stop")
        + b"data: [DONE]\n\n"
    )

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _send(self, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(models)
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                stream = bool(json.loads(raw).get("stream"))
            except ValueError:
                stream = False
            if stream:
                self._send(streamed, "text/event-stream")
            else:
                self._send(whole)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.serve_forever()


class InstantBackend:
    """The backend in a child process on a free port, for a `with` block; `url` is its /v1 root."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> InstantBackend:
        self.proc = subprocess.Popen([PYTHON, __file__, str(self.port)], start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
