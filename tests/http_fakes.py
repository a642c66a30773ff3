"""What the tests' fake HTTP servers share (a horde, a backend, a gateway or an image host stood up
on 127.0.0.1): a request handler that logs nothing and answers a whole body, and a server serving
from a daemon thread."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class QuietHandler(BaseHTTPRequestHandler):
    """A fake server's request handler. The fake servers keep test output clean: no access-log line
    on stderr for each request they answer."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (http.server's name)
        """Logs nothing (the fake servers keep test output clean)."""

    def send_body(self, status: int, body: bytes, content_type: str) -> None:
        """Answers `status` with `body` whole, its Content-Type and Content-Length."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, body: Any, content_type: str = "application/json") -> None:
        self.send_body(status, json.dumps(body).encode(), content_type)


def serve(
    handler: type[BaseHTTPRequestHandler], server_class: type[ThreadingHTTPServer] = ThreadingHTTPServer
) -> ThreadingHTTPServer:
    """A server for `handler` on a free port of 127.0.0.1, serving from a daemon thread (its
    request threads are daemons too); `close_server` stops it."""
    server = server_class(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def close_server(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()
