"""The native API's body rule: every native route that takes a body has a bound, past which it
answers 413 RequestTooLarge (docs/adr/0018): the chat submission MAX_CHAT_BODY_BYTES, every other
one Django's DATA_UPLOAD_MAX_MEMORY_SIZE, past which `request.body` would raise.

It is enforced where the body enters the process, once: on daphne by the serving layer
(hordesite.wsgi_pool: the declared Content-Length at once, a chunked body read only up to one byte
past the bound; spec: chat_requests.md, Routes, step 1), on a WSGI entry (the suite's client, the
mounted front's in-process calls) by hordesite.middleware.JsonBodyMiddleware from the declared
length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from contract.chat_limits import MAX_CHAT_BODY_BYTES
from contract.errors import request_too_large_body

NATIVE_PREFIX = "/api/v2/"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# (method, path) -> bound in bytes, for the routes whose bound is not Django's.
BODY_LIMITS: dict[tuple[str, str], int] = {("POST", "/api/v2/generate/chat/async"): MAX_CHAT_BODY_BYTES}


def body_limit(method: str, path: str) -> int | None:
    """The body bound of a native route in bytes; None: not a native route that takes a body."""
    if method not in BODY_METHODS or not path.startswith(NATIVE_PREFIX):
        return None
    return BODY_LIMITS.get((method, path), settings.DATA_UPLOAD_MAX_MEMORY_SIZE)


def too_large_body(limit: int) -> bytes:
    return json.dumps(request_too_large_body(limit)).encode()


@dataclass
class BufferedBody:
    """The request body messages read so far; over_limit: reading stopped past the bound."""

    messages: list[dict[str, Any]]
    over_limit: bool

    @property
    def content(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages)


async def read_body(receive: Any, limit: int | None) -> BufferedBody | None:
    """Read a request's body messages, stopping at the first that takes it past `limit` (None: no
    bound). None when the client went away."""
    messages: list[dict[str, Any]] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        messages.append(message)
        size += len(message.get("body", b""))
        if limit is not None and size > limit:
            return BufferedBody(messages, over_limit=True)
        if not message.get("more_body", False):
            return BufferedBody(messages, over_limit=False)
