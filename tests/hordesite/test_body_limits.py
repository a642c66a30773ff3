"""The serving layer answers 413 before Django reads an oversized native body (hordesite/wsgi_pool.py)."""

from __future__ import annotations

import asyncio
import json

from contract.chat_limits import MAX_CHAT_BODY_BYTES
from hordesite.wsgi_pool import PooledWSGI


class Recorder:
    """The inner WSGI application: records that it ran and what body it read."""

    def __init__(self):
        self.body = None

    def __call__(self, environ, start_response):
        self.body = environ["wsgi.input"].read()
        start_response("202 Accepted", [("Content-Type", "application/json")])
        return [b"{}"]


def _run(headers, chunks, path="/api/v2/generate/chat/async", method="POST"):
    inner = Recorder()
    sent, pulled = [], []
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        pulled.append(1)
        return queue.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    app = PooledWSGI(inner, threads=1)
    try:
        asyncio.run(app(scope, receive, send))
    finally:
        app.close()
    return inner, sent, len(pulled)


def test_declared_length_over_the_bound_is_refused_unread():
    inner, sent, pulled = _run([(b"content-length", str(MAX_CHAT_BODY_BYTES + 1).encode())], [b"x"])
    assert sent[0]["status"] == 413 and inner.body is None and pulled == 0
    assert json.loads(sent[1]["body"])["rc"] == "RequestTooLarge"
    assert (b"Access-Control-Allow-Origin", b"*") in sent[0]["headers"]


def test_chunked_body_is_read_only_one_byte_past_the_bound():
    chunk = b"x" * (MAX_CHAT_BODY_BYTES // 4)
    inner, sent, pulled = _run([], [chunk] * 4 + [b"xy", b"never read"])
    assert sent[0]["status"] == 413 and inner.body is None
    assert pulled == 5  # the fifth chunk crossed the bound; the sixth was never pulled


def test_body_within_the_bound_reaches_the_app_whole():
    inner, sent, _ = _run([(b"content-length", b"11")], [b"hello ", b"world"])
    assert sent[0]["status"] == 202 and inner.body == b"hello world"


def test_other_native_routes_are_bounded_at_djangos_bound(settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    inner, sent, pulled = _run([(b"content-length", b"1001")], [b"x"], path="/api/v2/generate/text/async")
    assert sent[0]["status"] == 413 and inner.body is None and pulled == 0
    assert json.loads(sent[1]["body"]) == {"message": "The request body is over 1000 bytes.", "rc": "RequestTooLarge"}
    inner, sent, _ = _run([(b"content-length", b"1000")], [b"x" * 1000], path="/api/v2/generate/text/async")
    assert sent[0]["status"] == 202 and len(inner.body) == 1000


def test_routes_outside_the_native_body_rule_are_spooled_whole(settings):
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 10
    inner, sent, _ = _run([], [b"x" * 600, b"y" * 600], path="/admin/login/")
    assert sent[0]["status"] == 202 and inner.body == b"x" * 600 + b"y" * 600


def test_a_body_outside_the_native_rule_is_bounded_too_before_the_disk_fills(settings):
    """A GET or the admin with a body past Django's bound: 413 at the declared length, or once the
    chunks pass it, and nothing more is read (it was spooled to disk whole)."""
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 10
    inner, sent, pulled = _run([(b"content-length", b"1001")], [b"x"], path="/api/v2/status/heartbeat", method="GET")
    assert sent[0]["status"] == 413 and inner.body is None and pulled == 0
    inner, sent, pulled = _run([], [b"x" * 600, b"y" * 600, b"never read"], path="/admin/login/")
    assert sent[0]["status"] == 413 and inner.body is None and pulled == 2
    assert json.loads(sent[1]["body"]) == {"message": "The request body is over 1000 bytes.", "rc": "RequestTooLarge"}
