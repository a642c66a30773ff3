"""A backend stream's end (workers/bridge/connections.py, Streamed.finish): after the last event the
bridge reads the rest (a chunked body's terminator; nothing of a body with a Content-Length) to keep
the connection for the next request, and gives up after STREAM_END_TIMEOUT in all, even against a
server that goes on sending bytes after [DONE]."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer

import pytest

from tests.http_fakes import QuietHandler
from workers.bridge.connections import STREAM_END_TIMEOUT, Connections


class _Stream(QuietHandler):
    """An SSE answer: two events and [DONE], then `after_done` comment chunks 0.2 s apart, then the
    terminator. Records each request's client address."""

    protocol_version = "HTTP/1.1"
    after_done = 0
    chunked = True  # else one body with its Content-Length, as llama.cpp's and vLLM's are not
    peers: list[tuple[str, int]] = []
    ended = threading.Event()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).peers.append(self.client_address)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if not type(self).chunked:
            body = b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            type(self).ended.set()
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"):
                self._chunk(event)
            for _ in range(type(self).after_done):
                time.sleep(0.2)
                self._chunk(b": still here\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True  # the client dropped the connection
        finally:
            type(self).ended.set()


@contextmanager
def _server(after_done: int, *, chunked: bool = True) -> Iterator[str]:
    handler = type(
        "Stream", (_Stream,), {"after_done": after_done, "chunked": chunked, "peers": [], "ended": threading.Event()}
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def _read_events(connections: Connections, url: str) -> tuple[list[str], bool, float]:
    """The events up to [DONE], whether the stream ended complete, and finish()'s seconds."""
    with connections.stream("POST", f"{url}/v1/chat/completions", body=b"{}", timeout=5) as response:
        events = []
        for line in response.lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if line == "data: [DONE]":
                started = time.monotonic()
                response.finish()
                return events, response.complete, time.monotonic() - started
    raise AssertionError("the stream ended without [DONE]")


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
def test_a_stream_that_ends_after_done_keeps_its_connection(chunked):
    with _server(after_done=1 if chunked else 0, chunked=chunked) as (url, handler):
        connections = Connections(url, headers={})
        for _ in range(3):
            events, complete, _seconds = _read_events(connections, url)
            assert events == ['{"n": 1}', '{"n": 2}', "[DONE]"]
            assert complete
        assert len(set(handler.peers)) == 1  # one kept connection served both
        connections.close()


def test_a_server_still_sending_after_done_loses_its_connection_after_the_timeout_in_all():
    # 25 chunks 0.2 s apart: each read gets bytes well within STREAM_END_TIMEOUT, so only a
    # bound on the whole wait stops it.
    with _server(after_done=25) as (url, handler):
        connections = Connections(url, headers={})
        events, complete, seconds = _read_events(connections, url)
        assert events[-1] == "[DONE]"
        assert not complete
        assert STREAM_END_TIMEOUT <= seconds < STREAM_END_TIMEOUT + 1.0  # the old per-read wait took 5 s
        assert handler.ended.wait(5)  # the server found its client gone
        handler.after_done = 0
        events, complete, _seconds = _read_events(connections, url)
        assert complete
        assert len(set(handler.peers)) == 2  # the abandoned connection was not used again
        connections.close()
