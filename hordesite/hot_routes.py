"""The worker loop's routes, served without Django's per-request machinery.

Under ASGI a Django request pays for a new thread (ThreadSensitiveContext), thread hops for its
signals, its view and its response, the URL resolver and DRF's dispatch: about as much CPU as
the pop or submit view itself. The routes that every worker and polling client calls every
second (pop, submit, the text and chat status polls) are dispatched here instead, to the same DRF view
methods, on a fixed pool of threads, with the same authentication, exception handler, JSON and
headers as Django would give them.

A request this layer does not fully understand goes on to Django unchanged, body replayed:
another method or path, a query string, a body that is not plain JSON or does not parse or nests
too deeply, an Accept header asking for something else (BodyLimitMiddleware, in front, refused a
body over DATA_UPLOAD_MAX_MEMORY_SIZE). So every error shape for odd input stays Django's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from uuid import UUID

from django.conf import settings
from django.core import signals
from django.http import QueryDict
from rest_framework.renderers import JSONRenderer
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from accounts.api.authentication import ApiKeyAuthentication
from chat.api.chat_views import ChatStatusView
from chat.api.pop_views import TextPopView
from chat.api.progress_views import TextProgressView
from chat.api.submit_views import TextSubmitView
from chat.api.views import TextStatusView
from chat.services.pop_wait import queue_listener
from hordesite.body_limits import read_body
from hordesite.db_guard import start_request
from hordesite.errors import horde_exception_handler
from hordesite.middleware import EXPOSED_HEADERS

log = logging.getLogger(__name__)

_UUID = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"  # Django's <uuid:> converter
_JSON_TYPES = {"application/json", "application/json; charset=utf-8", "application/json;charset=utf-8"}
_ACCEPTED = {"", "*/*", "application/json", "application/*"}


@dataclass(frozen=True)
class HotRoute:
    method: str
    pattern: re.Pattern[str]
    view_class: type[APIView]
    # The path's named groups, converted as the URLconf's converters would.
    converters: dict[str, Callable[[str], Any]]


HOT_ROUTES: tuple[HotRoute, ...] = (
    HotRoute("POST", re.compile(r"/api/v2/generate/text/pop"), TextPopView, {}),
    HotRoute("POST", re.compile(r"/api/v2/generate/text/submit"), TextSubmitView, {}),
    HotRoute("POST", re.compile(r"/api/v2/generate/text/progress"), TextProgressView, {}),
    HotRoute(
        "GET", re.compile(rf"/api/v2/generate/text/status/(?P<request_id>{_UUID})"), TextStatusView, {"request_id": UUID}
    ),
    HotRoute(
        "GET", re.compile(rf"/api/v2/generate/chat/status/(?P<request_id>{_UUID})"), ChatStatusView, {"request_id": UUID}
    ),
)


def _check_served_as_django_would(route: HotRoute) -> None:
    """This layer reproduces DRF's dispatch for views with the project's defaults only."""
    view = route.view_class
    # The project's authentication, or none (the progress route authenticates from its lease).
    assert list(view.authentication_classes) in ([], list(api_settings.DEFAULT_AUTHENTICATION_CLASSES)), view
    assert not view.permission_classes and not view.throttle_classes, view
    assert list(view.renderer_classes) == [JSONRenderer], view


for _route in HOT_ROUTES:
    _check_served_as_django_would(_route)


class _Headers(dict):
    """Request headers by lower-case name, as Django's request.headers answers them."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> Any:
        return super().__getitem__(key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())


class HotRequest:
    """What the hot views read of a DRF request: data, user, auth, headers, META, query params."""

    def __init__(self, scope: dict[str, Any], headers: _Headers, data: Any):
        self.scope = scope
        self.method = scope["method"]
        self.path = scope["path"]
        self.headers = headers
        self.data = data
        self.query_params = QueryDict()
        self.user: Any = None
        self.auth: Any = None

    @cached_property
    def META(self) -> dict[str, Any]:  # noqa: N802  (Django's name)
        meta: dict[str, Any] = {"REQUEST_METHOD": self.method, "PATH_INFO": self.path, "QUERY_STRING": ""}
        client = self.scope.get("client")
        if client:
            meta["REMOTE_ADDR"] = client[0]
        for name, value in self.headers.items():
            key = name.upper().replace("-", "_")
            meta[key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"] = value
        return meta


@dataclass
class HotResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    # An empty pop that asked to wait: how long it may be held for a job (chat/pop_wait.py).
    wait_seconds: float = 0.0


_renderer = JSONRenderer()
_CORS = [
    (b"access-control-allow-origin", b"*"),
    (b"access-control-expose-headers", EXPOSED_HEADERS.encode()),
]


def _allow_header(view_class: type[APIView]) -> bytes:
    view = view_class()
    view.setup(None)  # as for a request: a view with get() also answers HEAD
    return ", ".join(view.allowed_methods).encode()


_ALLOW = {route.view_class: _allow_header(route.view_class) for route in HOT_ROUTES}


def _render(view_class: type[APIView], response: Any) -> HotResponse:
    """A DRF Response as Django would send it through the project's middleware."""
    body = _renderer.render(response.data) if response.data is not None else b""
    headers = [(b"content-type", b"application/json")]
    headers += [
        (k.lower().encode("latin-1"), str(v).encode("latin-1"))
        for k, v in response.items()
        if k.lower() != "content-type"  # HttpResponse's default, replaced by the renderer's
    ]
    headers += [
        (b"allow", _ALLOW[view_class]),
        (b"x-content-type-options", b"nosniff"),
        (b"content-length", str(len(body)).encode()),
        *_CORS,
    ]
    return HotResponse(response.status_code, headers, body, getattr(response, "pop_wait_seconds", 0.0))


def serve_hot_request(route: HotRoute, request: HotRequest, kwargs: dict[str, Any]) -> HotResponse:
    """Run on one of the layer's threads: DRF's dispatch of one view method, without DRF's
    negotiation (JSON only) and with Django's request signals, which close the thread's database
    connection at the end as for any request."""
    signals.request_started.send(sender=HotRoutesASGI, scope=request.scope)
    start_request()  # this thread's context: DatabaseGuardASGI's count does not reach it
    view = route.view_class()
    view.args, view.kwargs, view.request, view.format_kwarg = (), kwargs, request, None
    view.headers = {}
    try:
        try:
            if route.view_class.authentication_classes:
                authenticated = ApiKeyAuthentication().authenticate(request)
                if authenticated is not None:
                    request.user, request.auth = authenticated
            handler = getattr(view, request.method.lower())
            response = handler(request, **kwargs)
        except Exception as exc:  # noqa: BLE001  (the project's exception handler answers every one)
            response = horde_exception_handler(exc, {"view": view, "request": request})
        return _render(route.view_class, response)
    finally:
        signals.request_finished.send(sender=HotRoutesASGI)


_INTERNAL_ERROR = json.dumps({"message": "Internal server error", "rc": "InternalError"}).encode()


class HotRoutesASGI:
    """ASGI: the hot routes here, everything else (and anything odd on them) to `app`."""

    def __init__(self, app: Any, *, threads: int | None = None, enabled: bool | None = None):
        self.app = app
        self.enabled = settings.HORDE_HOT_ROUTES if enabled is None else enabled
        self.threads = threads or settings.HORDE_HOT_ROUTE_THREADS
        self._pool: ThreadPoolExecutor | None = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="hot-route")
        return self._pool

    @staticmethod
    def match(scope: dict[str, Any]) -> tuple[HotRoute, dict[str, Any]] | None:
        if scope["type"] != "http" or scope.get("query_string"):
            return None
        method, path = scope.get("method"), scope.get("path", "")
        for route in HOT_ROUTES:
            if route.method == method:
                found = route.pattern.fullmatch(path)
                if found:
                    return route, {k: route.converters[k](v) for k, v in found.groupdict().items()}
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        matched = self.match(scope) if self.enabled else None
        if matched is None:
            return await self.app(scope, receive, send)
        route, kwargs = matched
        headers = _Headers()
        for raw_name, raw_value in scope.get("headers") or ():
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]},{value}" if name in headers else value
        # Buffered here up to Django's in-memory bound; a bigger body goes on to Django, which
        # spools it to disk (the worker loop's bodies are a few kilobytes).
        body = await read_body(receive, settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
        if body is None:
            return  # the client went away
        data = _NOT_UNDERSTOOD if body.over_limit else self._understood(route, headers, body.content)
        if data is _NOT_UNDERSTOOD:
            return await self.app(scope, body.replay(receive), send)
        request = HotRequest(scope, headers, data)
        if route.view_class is TextPopView and type(data) is dict and data.get("wait"):
            answer = await self._long_poll(route, request, kwargs, receive)
            if answer is None:
                return  # the worker went away while its pop was held
        else:
            answer = await self._serve(route, request, kwargs)
        await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
        await send({"type": "http.response.body", "body": answer.body})

    async def _serve(self, route: HotRoute, request: HotRequest, kwargs: dict[str, Any]) -> HotResponse:
        loop = asyncio.get_running_loop()
        try:
            # In the pool thread's own context, as a WSGI server's thread runs one request after
            # another: per-context objects Django keeps (each cache backend, its Redis client) are
            # made once per thread, not once per request as in a fresh copy of the loop's context.
            return await loop.run_in_executor(self.pool, serve_hot_request, route, request, kwargs)
        except Exception:
            log.exception("hot route %s %s failed", request.method, request.path)
            return HotResponse(
                500,
                [(b"content-type", b"application/json"), (b"content-length", str(len(_INTERNAL_ERROR)).encode()), *_CORS],
                _INTERNAL_ERROR,
            )

    async def _long_poll(
        self, route: HotRoute, request: HotRequest, kwargs: dict[str, Any], receive: Any
    ) -> HotResponse | None:
        """A pop with `wait` (ADR 0024): pop; while the answer is empty and the wait lasts, wait
        on the event loop (no thread held) for the queue's signal or the re-check, and pop again.
        None when the worker disconnected meanwhile."""
        started = time.monotonic()
        listener = queue_listener()
        waiter = listener.register()  # before the first pop: an addition committed after it wakes us
        disconnected = asyncio.ensure_future(receive())
        try:
            await listener.subscribed(timeout=0.5)
            while True:
                waiter.event.clear()
                answer = await self._serve(route, request, kwargs)
                left = started + answer.wait_seconds - time.monotonic()
                if answer.status != 200 or left <= 0:
                    return answer
                woken = asyncio.ensure_future(waiter.wait(min(settings.HORDE_POP_WAIT_RECHECK_SECONDS, left)))
                await asyncio.wait((woken, disconnected), return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                if disconnected.done():
                    return None
        finally:
            listener.unregister(waiter)
            disconnected.cancel()

    @staticmethod
    def _understood(route: HotRoute, headers: _Headers, body: bytes) -> Any:
        """The request's data as DRF's JSON parser would give it, or _NOT_UNDERSTOOD."""
        accept = headers.get("accept", "")
        if accept not in _ACCEPTED and any(part.split(";")[0].strip() not in _ACCEPTED for part in accept.split(",")):
            return _NOT_UNDERSTOOD
        if route.method == "GET":
            return {} if not body and "content-type" not in headers else _NOT_UNDERSTOOD
        if headers.get("content-type", "").lower() not in _JSON_TYPES or not body:
            return _NOT_UNDERSTOOD
        try:
            return json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
        except (ValueError, RecursionError):  # Django answers: a parse error, or nested too deeply
            return _NOT_UNDERSTOOD


_NOT_UNDERSTOOD: Any = object()


def _refuse_constant(name: str) -> Any:
    # DRF's strict JSON parser refuses NaN and the infinities; so does this layer (Django answers).
    raise ValueError(name)
