"""The front's ASGI layer, in front of Django for the /v1/ paths (mounted in the horde's web process
by hordesite/asgi.py, and the whole application of the standalone front).

It does what has to happen before Django reads a request, and what Django's handler cannot tell a
waiting view:
- admission of the body: a declared length over the limit is 413 before anything is read, a body
  that grows past it is 413 as soon as it does, and a body not received within
  body_read_timeout_seconds is 408 RequestBodyTimeout (Django would spool any body, however slow);
- the size of each POST body received whole (horde.oai.request.body_bytes);
- CORS: browser preflights are answered here, and every answer carries
  Access-Control-Allow-Origin: * and exposes Retry-After, x-should-retry and x-request-id;
- the request's id (oai.request_ids): every answer, refusals and streams included, carries
  x-request-id, and the request's log records carry it (docs/adr/0128);
- disconnect: an `asyncio.Event` in scope["oai.disconnected"] is set the moment the server reports
  http.disconnect, so the view's wait (streamed or not) notices it and cancels the horde request,
  whichever thread or task Django runs the view on;
- /healthz for the standalone process, and the server span of each request when telemetry is on;
- the stop (`drain_fronts`, docs/adr/0076): the requests it serves end, answered, by the stop's deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from contract.errors import (
    request_too_large_message,
    unsupported_content_encoding,
    unsupported_content_encoding_message,
)
from oai import request_ids
from oai.errors import ChatFrontError

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase

log = logging.getLogger("oai")

ALLOWED_HEADERS = (
    "authorization, content-type, apikey, client-agent, x-stainless-retry-count, x-stainless-lang, "
    "x-stainless-package-version, x-stainless-os, x-stainless-arch, x-stainless-runtime, "
    "x-stainless-runtime-version, x-stainless-timeout, openai-organization, openai-project, http-referer, x-title"
)
EXPOSED_HEADERS = "Retry-After, x-should-retry, x-request-id"
# DELETE: a kept response (DELETE /v1/responses/{id}, ADR 0103), not a CORS-safelisted method.
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"


# --- CORS, for the front and the native API (hordesite.middleware) -----------------------------


@dataclass(frozen=True)
class CorsPolicy:
    """What a browser may send, as a preflight answers it. Every answer of either API allows any
    origin (KoboldAI Lite runs from file://, origin null) and exposes EXPOSED_HEADERS."""

    allowed_headers: str
    allowed_methods: str
    preflight_status: int


FRONT_CORS = CorsPolicy(ALLOWED_HEADERS, ALLOWED_METHODS, 204)


def is_preflight(method: str, request_method_header: str | None) -> bool:
    """A browser's preflight: OPTIONS with Access-Control-Request-Method."""
    return method == "OPTIONS" and request_method_header is not None


def cors_headers() -> list[tuple[str, str]]:
    """The headers every answer carries."""
    return [("Access-Control-Allow-Origin", "*"), ("Access-Control-Expose-Headers", EXPOSED_HEADERS)]


def preflight_headers(policy: CorsPolicy, requested: str | None) -> list[tuple[str, str]]:
    """A preflight's answer headers (besides cors_headers()); `requested`: its
    Access-Control-Request-Headers, allowed too."""
    names = [policy.allowed_headers]
    if requested:  # the ones the policy does not list already, each named once
        seen = {name.strip().lower() for name in policy.allowed_headers.split(",")}
        for name in (part.strip() for part in requested.split(",")):
            if name and name.lower() not in seen:
                seen.add(name.lower())
                names.append(name)
    allowed = ", ".join(names)
    return [
        ("Access-Control-Allow-Methods", policy.allowed_methods),
        ("Access-Control-Allow-Headers", allowed),
        ("Access-Control-Max-Age", "86400"),
    ]


def _cors_headers() -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in cors_headers()]


_tracer: Any = None
# OpenTelemetry's HTTP conventions: a response header as a string array, named by its lowercase name.
SPAN_REQUEST_ID_ATTRIBUTE = f"http.response.header.{request_ids.REQUEST_ID_HEADER}"


def set_tracer(tracer: Any) -> None:
    """Server spans (POST /v1/chat/completions, GET /v1/models) when telemetry is configured."""
    global _tracer
    _tracer = tracer


async def _send_json(
    send: Any, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    raw += _cors_headers()
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


async def _refuse(send: Any, error: ChatFrontError, path: str, headers: dict[str, str] | None = None) -> None:
    from oai.state import get_front_state

    (await get_front_state()).metrics.refused(error.status, error.code)
    # Logged as Django logs the answers of the views (django.request), which it never reaches.
    log.warning("%s %s: %s", error.status, error.code, path.encode("unicode_escape").decode("ascii"))
    await _send_json(send, error.status, error.body(), {**error.headers(), **(headers or {})})


def front_django_handler() -> Any:
    """A Django ASGI handler for the front's own routes, with the front's middleware: none, as in
    the standalone front (oai.django_settings). Mounted in the horde's process, /v1/ goes through it
    instead of the horde's middleware (sessions, messages, auth, security, common): those serve the
    admin and the native routes, and each sync middleware step of an async view is a thread hop
    (MiddlewareMixin runs process_request and process_response through sync_to_async), about ten
    per request. This layer already does the front's CORS, body admission and disconnect; DRF
    does its authentication; the URLconf, signals and error handlers are the project's."""
    from django.core.handlers.asgi import ASGIHandler
    from django.core.handlers.exception import convert_exception_to_response

    class FrontDjangoHandler(ASGIHandler):
        # Django's private handler methods and lists, which django-stubs leaves out.
        _get_response: Callable[[HttpRequest], HttpResponseBase]
        _get_response_async: Callable[[HttpRequest], Awaitable[HttpResponseBase]]
        _view_middleware: list[Any]
        _template_response_middleware: list[Any]
        _exception_middleware: list[Any]

        def load_middleware(self, is_async: bool = False) -> None:
            self._view_middleware = []
            self._template_response_middleware = []
            self._exception_middleware = []
            get_response = self._get_response_async if is_async else self._get_response
            self._middleware_chain = convert_exception_to_response(get_response)

        async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
            # Django's own __call__ enters a ThreadSensitiveContext per request, so its
            # thread-sensitive sync work (the request_started and request_finished receivers, the
            # response's close) gets a thread of its own, created at the start and idle for the
            # whole of a stream's wait: tens of KB resident per open stream (issue 14). Without it
            # that work runs on asgiref's one shared thread-sensitive thread; the front's views are
            # async and make their native calls on their own executor.
            if scope["type"] != "http":
                raise ValueError(f"The front serves HTTP connections only, not {scope['type']}.")
            await self.handle(scope, receive, send)

    return FrontDjangoHandler()


FRONT_PATH_PREFIX = "/v1/"


class FrontASGI:
    """`app` serves every path outside `prefix`; `front_app`, when given, serves the front's routes
    (else `app` serves them too)."""

    def __init__(self, app: Any, *, prefix: str = FRONT_PATH_PREFIX, serve_healthz: bool = False, front_app: Any = None):
        self.app = app
        self.front_app = front_app or app
        self.prefix = prefix
        self.serve_healthz = serve_healthz
        # The front's requests being served (their ASGI tasks), for the drain at a stop.
        self.requests: set[asyncio.Task] = set()
        _FRONTS.add(self)
        request_ids.install_log_records()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.serve_healthz and path == "/healthz":
            return await _send_json(send, 200, {"status": "ok"})
        if not path.startswith(self.prefix):
            return await self.app(scope, receive, send)
        task = asyncio.current_task()
        if task is None:
            return await self._serve_front(scope, receive, send)
        self.requests.add(task)
        try:
            return await self._serve_front(scope, receive, send)
        finally:
            self.requests.discard(task)

    async def _serve_front(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if _tracer is None:
            return await self._handle(scope, receive, send)
        with _tracer.start_as_current_span(server_span_name(scope.get("method", "GET"), path), kind=_server_kind()) as span:
            try:
                return await self._handle(scope, receive, send)
            finally:
                # The id the answer carried, so that an id a user quotes finds its trace (ADR 0128).
                ids = request_ids.current()
                if ids is not None:
                    span.set_attribute(SPAN_REQUEST_ID_ATTRIBUTE, [ids.request_id])

    async def _handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = {k.decode("latin1").lower(): v.decode("latin1") for k, v in scope.get("headers", [])}
        method = scope.get("method", "GET")
        path = scope.get("path", "")
        send = _answering(send, request_ids.begin(headers).request_id)
        if is_preflight(method, headers.get("access-control-request-method")):
            return await self._preflight(send, headers)
        from oai.state import get_front_state

        state = await get_front_state()
        settings = state.settings
        limit = settings.max_body_bytes
        declared = headers.get("content-length")
        if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
            return await _refuse(send, _too_large(limit), path)
        encoding = unsupported_content_encoding(headers.get("content-encoding")) if method == "POST" else None
        if encoding is not None:
            return await _refuse(send, _compressed(encoding), path, {"Accept-Encoding": "identity"})
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(settings.body_read_timeout_seconds):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        return await _refuse(send, _too_large(limit), path)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await _refuse(
                send,
                ChatFrontError(
                    408,
                    "RequestBodyTimeout",
                    f"The request body did not arrive within {settings.body_read_timeout_seconds:g} seconds.",
                    type="invalid_request_error",
                ),
                path,
            )
        body = b"".join(chunks)
        if method == "POST":  # every body received whole, whatever the answer (a refusal included)
            state.metrics.body_bytes.record(len(body))
        disconnected = asyncio.Event()
        scope = {**scope, "oai.body": body, "oai.disconnected": disconnected}
        replayed = False

        async def replay_receive() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                # Django is handed no body: the front's views read scope["oai.body"], and Django
                # would spool a large one to a temporary file on the event loop (docs/adr/0127).
                replayed = True
                return {"type": "http.request", "body": b"", "more_body": False}
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected.set()
            return message

        await self.front_app(scope, replay_receive, send)

    async def _preflight(self, send: Any, headers: dict[str, str]) -> None:
        requested = headers.get("access-control-request-headers", "").strip()
        raw = [
            (k.lower().encode(), v.encode("latin1"))
            for k, v in [*cors_headers(), *preflight_headers(FRONT_CORS, requested)]
        ]
        raw.append((b"content-length", b"0"))
        await send({"type": "http.response.start", "status": FRONT_CORS.preflight_status, "headers": raw})
        await send({"type": "http.response.body", "body": b""})


def _answering(send: Any, request_id: str) -> Any:
    """`send`, whose answer carries the CORS headers and the request's x-request-id: the one place
    every answer of the front passes, Django's (whole, streamed, refused) and this layer's."""
    stamped = [*_cors_headers(), (request_ids.REQUEST_ID_HEADER.encode(), request_id.encode())]

    async def send_answer(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", [])}
            extra = [(k, v) for k, v in stamped if k not in names]
            if extra:
                message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return send_answer


# Every front layer of the process, for the drain at a stop.
_FRONTS: weakref.WeakSet[FrontASGI] = weakref.WeakSet()


async def drain_fronts(deadline: float) -> None:
    """The process stops at `deadline` (monotonic): each waiting request reads its status once and
    is delivered, or waits on while a worker generates it, or is cancelled and answered FrontStopping
    (oai.run), all before the deadline; a request arriving now is refused. Returns when the front's
    requests have ended, or at the deadline (what is left is the server's to cancel)."""
    from oai.state import stop_fronts

    stop_fronts(deadline)
    while (left := deadline - time.monotonic()) > 0:
        serving = {task for front in list(_FRONTS) for task in front.requests if not task.done()}
        if not serving:
            return
        await asyncio.wait(serving, timeout=left)


def _too_large(limit: int) -> ChatFrontError:
    return _body_refused(413, "RequestTooLarge", request_too_large_message(limit))


def _compressed(encoding: str) -> ChatFrontError:
    return _body_refused(415, "UnsupportedContentEncoding", unsupported_content_encoding_message(encoding))


def _body_refused(status: int, code: str, message: str) -> ChatFrontError:
    """A body the layer refuses before reading it whole: the same again would be refused again."""
    return ChatFrontError(status, code, message, type="invalid_request_error", should_retry=False)


# The front's routes; a span of any other path is named by its method alone, as OpenTelemetry's
# HTTP conventions name a request without a route, so unknown paths make no new span names.
FRONT_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})


def server_span_name(method: str, path: str) -> str:
    return f"{method} {path}" if path in FRONT_ROUTES else method


def _server_kind() -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind.SERVER
