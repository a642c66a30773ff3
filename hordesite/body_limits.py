"""ASGI guard for bodies with a size bound, before Django spools them.

Django's ASGI handler reads a whole body into a temporary file before any view runs, so a view
can only refuse an oversized body after receiving all of it. This middleware answers 413 from
the declared Content-Length at once, and reads a chunked body only up to one byte past the bound
(spec: chat_requests.md, Routes, step 1).
"""

from __future__ import annotations

import json

from contract.chat_limits import MAX_CHAT_BODY_BYTES

# (method, path) -> bound in bytes
BODY_LIMITS: dict[tuple[str, str], int] = {("POST", "/api/v2/generate/chat/async"): MAX_CHAT_BODY_BYTES}


def too_large_body(limit: int) -> bytes:
    return json.dumps({"message": f"The request body is over {limit} bytes.", "rc": "RequestTooLarge"}).encode()


class BodyLimitMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        limit = BODY_LIMITS.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        if limit is None:
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, limit)
        # Read the body here (as Django would), stopping one byte past the bound.
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            messages.append(message)
            size += len(message.get("body", b""))
            if size > limit:
                return await self._refuse(send, limit)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, limit: int) -> None:
        body = too_large_body(limit)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"access-control-allow-origin", b"*"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
