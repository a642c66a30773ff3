"""The native API as the web process serves it (hordesite.asgi: Django's WSGI handler on the serving
layer's threads, hordesite/wsgi_pool.py), called in process over HTTP semantics with a program's own
headers and body bytes. Tests using it need `django_db(transaction=True)`: the layer's threads have
their own database connections.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from django.core.wsgi import get_wsgi_application

from hordesite.db_guard import retrying_wsgi
from hordesite.wsgi_pool import PooledWSGI

# What python-requests sends beside a program's own headers (the upstream worker uses requests).
REQUESTS_HEADERS = {
    "User-Agent": "python-requests/2.32.3",
    "Accept-Encoding": "gzip, deflate",
    "Accept": "*/*",
    "Connection": "keep-alive",
}


class LiveStack:
    def __init__(self) -> None:
        self.app = PooledWSGI(retrying_wsgi(get_wsgi_application()), threads=4)

    def close(self) -> None:
        self.app.close()

    def request(
        self, method: str, path: str, *, headers: dict[str, str], body: Any = None, exact_headers: bool = False
    ) -> httpx.Response:
        """`exact_headers`: send only `headers` (and Host, Content-Length), without the ones httpx
        adds itself (Accept, Accept-Encoding, Connection, User-Agent), for a program that sends none
        of them (urllib sends no Accept)."""
        # requests' and urllib's json encoding: json.dumps with its default separators.
        content = json.dumps(body).encode() if body is not None else None
        sent = dict(headers)
        if content is not None:
            sent.setdefault("Content-Type", "application/json")

        async def go() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app, client=("127.0.0.1", 41000))
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                if exact_headers:
                    for name in list(client.headers):
                        if name.lower() not in {key.lower() for key in sent}:
                            del client.headers[name]
                return await client.request(method, path, headers=sent, content=content)

        return asyncio.run(go())
