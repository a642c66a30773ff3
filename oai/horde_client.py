"""The native API over HTTP: submit, status, cancel and the model list, with native root rotation.

A call that cannot connect to a root (nothing was sent) moves to the next root and is tried there;
the root that answered stays current for later calls. A submit whose answer was lost after it was
sent (timeout, reset) raises `SubmitAnswerLost`: the caller re-sends it with the same operation key
(lost-submit recovery) and the horde answers 200 with the claim when the first one landed.

In process: when the front is mounted in the horde's own web process, `hordesite/asgi.py` hands it
that process's native application (`mount_native_app`, a WSGI callable), and with
`native_in_process` (the default when HORDE_OAI_NATIVE_ROOTS is unset) each call is the same HTTP
request given to that application directly, start to end on one of the front's threads, instead of
a TCP round trip back into the process (docs/adr/0008-oai-native-calls-in-process.md). The request,
its headers, the native views and their answers are the same; the call slots, the native timeout
(an answer that does not come in time is a lost answer) and the metrics apply alike. Root rotation
does not apply: there is one application.

Rate limits: a front's users all reach the horde from the front's address. With a passkey the horde
knows (HORDE_OAI_PROXY_PASSKEY over HTTP; in process, the passkey this process made, which
hordesite/asgi.py gives the horde), each submit carries `Proxy-Authorization` and, in `Proxied-For`,
its client's address, and the horde counts that address instead. A submit the horde's short-window
limit refuses (429 RateLimited, Retry-After) is sent again once the window has passed, within
HORDE_OAI_RATE_LIMIT_WAIT_SECONDS (docs/adr/0015-rate-limits-behind-a-front.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json as jsonlib
import logging
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from contract.aio import within
from contract.chat_limits import CHAT_IMAGE_FETCH_TOTAL_SECONDS
from contract.front_lease import FRONT_ID_HEADER, FRONT_UNDELIVERED_HEADER, FRONT_UNDELIVERED_VALUE
from contract.rate_limits import PROXIED_FOR_HEADER, PROXY_PASSKEY_HEADER
from oai import request_ids
from oai.errors import IN_PROCESS_ENVIRON_KEY
from oai.metrics import FrontMetrics
from oai.settings import FrontSettings

SUBMIT_PATH = "/generate/chat/async"
STATUS_PATH = "/generate/chat/status/{id}"
MODELS_PATH = "/status/models?type=text&chat=true"
# The caller's account: the models routes check a key they are given (OpenAI answers a wrong key 401).
FIND_USER_PATH = "/find_user"
# POST /v1/completions is served over native text requests (docs/adr/0014-legacy-completions.md).
TEXT_SUBMIT_PATH = "/generate/text/async"
TEXT_STATUS_PATH = "/generate/text/status/{id}"


# The native ASGI application of the process the front is mounted in, and the path it serves the
# native API under; set by the horde (hordesite/asgi.py), never by the standalone front.
_native_app: Any = None
_native_app_root = "/api/v2"
# Threads of the in-process calls: each runs one native request start to end (its views are sync
# and use the database; more threads than the horde's database pool would only wait on it).
IN_PROCESS_THREADS = 16
# What the front allows the horde to decode, check and re-encode one image of a submit.
IMAGE_ENCODE_SECONDS = 1.0
# The passkey of this process's in-process calls: they never leave the process, and the horde in it
# is told this value (hordesite/asgi.py), so the mounted front forwards its clients' addresses
# without one being configured.
IN_PROCESS_PROXY_PASSKEY = secrets.token_urlsafe(32)
# A rate-limited submit is sent again no sooner than this, whatever Retry-After says (0 would spin).
RATE_LIMIT_MIN_PAUSE_SECONDS = 0.5


def mount_native_app(app: Any, *, root_path: str = "/api/v2") -> None:
    """The horde's web process hands the mounted front its native application, a WSGI callable
    (None: unmount)."""
    global _native_app, _native_app_root
    _native_app = app
    _native_app_root = root_path.rstrip("/")


def mounted_native_app() -> Any:
    return _native_app


class NativeUnreachable(Exception):
    """No native root could be reached; nothing was sent."""


class SubmitAnswerLost(Exception):
    """The call was sent but its answer did not arrive: its outcome is unknown. `timed_out`: the
    answer did not come within the call's timeout (rather than the connection failing)."""

    def __init__(self, message: str, *, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def _is_timeout(error: BaseException) -> bool:
    """Whether a failed call ran out of time, by the exception's type (never its text)."""
    return isinstance(error, httpx.TimeoutException | asyncio.TimeoutError | TimeoutError)


@dataclass(frozen=True)
class NativeAnswer:
    status: int
    body: Any
    headers: httpx.Headers

    @property
    def ok(self) -> bool:
        return self.status < 400


def create_http_client(settings: FrontSettings, *, max_connections: int | None = None) -> httpx.AsyncClient:
    limit = max_connections or settings.native_max_connections
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            settings.native_timeout_seconds, connect=min(2.0, settings.native_timeout_seconds)
        ),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        headers={"Accept": "application/json"},
    )


def cancel_max_connections(settings: FrontSettings) -> int:
    return settings.cancel_max_connections


class HordeClient:
    def __init__(self, settings: FrontSettings, metrics: FrontMetrics, *, propagate: bool = False):
        self.settings = settings
        self.metrics = metrics
        self.roots = list(settings.native_roots)
        self._current = 0
        self.http = create_http_client(settings)
        self.cancel_http = create_http_client(settings, max_connections=cancel_max_connections(settings))
        self._cancel_slots = asyncio.Semaphore(cancel_max_connections(settings))
        self._propagate = propagate
        # In process: the mounted horde's native application, with as many call slots as the HTTP
        # pool, run on a small pool of threads of the front's own.
        self.app = _native_app if settings.native_in_process else None
        self._app_root = _native_app_root
        self._app_slots = asyncio.Semaphore(settings.native_max_connections)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        root = httpx.URL(self.roots[0]) if self.roots else httpx.URL("http://127.0.0.1:8000")
        self._app_host = root.netloc.decode("ascii") or "127.0.0.1"
        self._app_server_name = root.host or "127.0.0.1"
        self._app_server_port = str(root.port or 80)

    @property
    def in_process(self) -> bool:
        return self.app is not None

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.cancel_http.aclose()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _headers(self, extra: dict[str, str] | None) -> dict[str, str]:
        headers = dict(extra or {})
        if self._propagate:
            from opentelemetry.propagate import inject

            inject(headers)  # the horde's instrumentation continues this client span's trace
        return headers

    async def _traced(self, method: str, call_type: str, call: Any) -> Any:
        """With telemetry on, each native call is a client span (its traceparent goes to the horde)."""
        if not self._propagate:
            return await call()
        from opentelemetry import trace

        tracer = trace.get_tracer("horde.oai")
        with tracer.start_as_current_span(f"{method} native {call_type}", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("horde.call_type", call_type)
            return await call()

    async def _send(self, method: str, path: str, *, call_type: str, **kwargs: Any) -> NativeAnswer:
        return await self._traced(
            method, call_type, lambda: self._send_untraced(method, path, call_type=call_type, **kwargs)
        )

    async def _send_untraced(
        self,
        method: str,
        path: str,
        *,
        call_type: str,
        json: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        client: httpx.AsyncClient | None = None,
        start_root: int | None = None,
    ) -> NativeAnswer:
        """One call, moving through the roots on connection failure. Raises NativeUnreachable when no
        root could be connected to, SubmitAnswerLost when the request went out and no answer came."""
        if self.app is not None:
            return await self._send_in_process(
                method,
                path,
                call_type=call_type,
                json=json,
                headers=headers,
                timeout=timeout,
                slots=self._cancel_slots if client is self.cancel_http else self._app_slots,
            )
        client = client or self.http
        count = len(self.roots)
        first = self._current if start_root is None else start_root % count
        started = time.perf_counter()
        kwargs: dict[str, Any] = {"headers": self._headers(headers)}
        if json is not None:
            # Encoded off the loop, as in process: a body of images is tens of ms of json.dumps, which
            # on the loop would stall every other stream (docs/adr/0127). Once for every root tried.
            kwargs["content"] = await asyncio.to_thread(_json_bytes, json)
            kwargs["headers"]["content-type"] = "application/json"
        if timeout is not None:
            kwargs["timeout"] = timeout
        for step in range(count):
            index = (first + step) % count
            url = self.roots[index] + path
            try:
                response = await client.request(method, url, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout):
                continue  # nothing was sent: the next root
            except (
                httpx.TimeoutException,
                httpx.RemoteProtocolError,
                httpx.ReadError,
                httpx.WriteError,
            ) as error:
                self._current = (index + 1) % count  # try elsewhere next time
                self.metrics.native(call_type, "unreachable", time.perf_counter() - started)
                raise SubmitAnswerLost(str(error) or type(error).__name__, timed_out=_is_timeout(error)) from None
            self._current = index
            try:
                body = response.json()
            except ValueError:
                body = None
            self.metrics.native(
                call_type, "ok" if response.status_code < 400 else "refused", time.perf_counter() - started
            )
            return NativeAnswer(response.status_code, body, response.headers)
        self.metrics.native(call_type, "unreachable", time.perf_counter() - started)
        raise NativeUnreachable(f"no native root answered ({', '.join(self.roots)})")

    async def _send_in_process(
        self,
        method: str,
        path: str,
        *,
        call_type: str,
        json: Any,
        headers: dict[str, str] | None,
        timeout: float | None,
        slots: asyncio.Semaphore,
    ) -> NativeAnswer:
        """One call given to the mounted native application on a thread of the front's pool. Raises
        NativeUnreachable when no call slot freed up within the timeout (nothing was sent),
        SubmitAnswerLost when the answer did not come within it (the view may still complete, as
        over HTTP)."""
        started = time.perf_counter()
        budget = self.settings.native_timeout_seconds if timeout is None else timeout
        holds_slot = slots is self._app_slots  # a cancel already holds its cancel slot
        if holds_slot:
            try:
                await within(slots.acquire(), budget)
            except TimeoutError:
                self.metrics.native(call_type, "unreachable", time.perf_counter() - started)
                raise NativeUnreachable("no native call slot became free in time") from None
        try:
            sent_headers = self._headers(headers)
            ids = request_ids.current()

            def call() -> tuple[int, list[tuple[str, str]], bytes]:
                # The body is encoded on the pool's thread too: tens of MiB of images are ~50 ms of
                # json.dumps, which on the loop would stall every other stream (docs/adr/0127).
                body = b"" if json is None else _json_bytes(json)
                with request_ids.serving(ids):  # the native API's lines name the front's request
                    return _call_wsgi(self.app, self._environ(method, path, body, sent_headers))

            loop = asyncio.get_running_loop()
            try:
                status, response_headers, content = await within(loop.run_in_executor(self._executor(), call), budget)
            except TimeoutError as error:
                self.metrics.native(call_type, "unreachable", time.perf_counter() - started)
                raise SubmitAnswerLost("in-process native call: timeout", timed_out=_is_timeout(error)) from None
        finally:
            if holds_slot:
                slots.release()
        try:
            parsed = jsonlib.loads(content) if content else None
        except ValueError:
            parsed = None
        self.metrics.native(call_type, "ok" if status < 400 else "refused", time.perf_counter() - started)
        return NativeAnswer(status, parsed, httpx.Headers(response_headers))

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=IN_PROCESS_THREADS, thread_name_prefix="oai-native"
            )
        return self._pool

    def _environ(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
        """The WSGI environ of one native request, as a WSGI server builds it (PEP 3333)."""
        full, _, query = (self._app_root + path).partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method,
            "SCRIPT_NAME": "",
            "PATH_INFO": full,
            "QUERY_STRING": query,
            "SERVER_NAME": self._app_server_name,
            "SERVER_PORT": self._app_server_port,
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": "127.0.0.1",
            "REMOTE_PORT": "0",
            "HTTP_HOST": self._app_host,
            "HTTP_ACCEPT": "application/json",
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
            # Not from the network: no client can set a key without HTTP_ (the Host check skips it).
            IN_PROCESS_ENVIRON_KEY: True,
        }
        if body:
            environ["CONTENT_TYPE"] = "application/json"
            environ["CONTENT_LENGTH"] = str(len(body))
        for name, value in headers.items():
            key = name.upper().replace("-", "_")
            if key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                environ[key] = value
            else:
                environ["HTTP_" + key] = value
        return environ

    @property
    def proxy_passkey(self) -> str:
        """The passkey the horde knows this front by ("" without one)."""
        return IN_PROCESS_PROXY_PASSKEY if self.in_process else self.settings.proxy_passkey

    def undelivered_headers(self, front_id: str) -> dict[str, str] | None:
        """The headers of a stopping front's cancel of a request it cannot deliver (docs/adr/0086):
        the horde ends it unpaid when it knows the passkey and the request was submitted under
        `front_id` (with a front lease, or a background response's without one: docs/adr/0110).
        None without a passkey: then only the spec's cancel. (With the front lease off, a request
        waited on names no front, and the horde answers the spec's cancel.)"""
        if not self.proxy_passkey:
            return None
        return {
            PROXY_PASSKEY_HEADER: self.proxy_passkey,
            FRONT_ID_HEADER: front_id,
            FRONT_UNDELIVERED_HEADER: FRONT_UNDELIVERED_VALUE,
        }

    def forwarding_headers(self, client_address: str | None) -> dict[str, str]:
        """The headers that make the horde count `client_address` instead of this front's address:
        none without a passkey or without a known address."""
        passkey = self.proxy_passkey
        if not passkey or not client_address or client_address == "unknown":
            return {}
        return {PROXY_PASSKEY_HEADER: passkey, PROXIED_FOR_HEADER: client_address}

    async def submit(
        self,
        body: dict[str, Any],
        headers: dict[str, str],
        *,
        call_type: str = "submit",
        text: bool = False,
        rate_limit_wait_seconds: float = 0.0,
    ) -> NativeAnswer:
        """POST the chat submit (the text submit with `text`). Refused by a rate limit whose window
        ends within `rate_limit_wait_seconds`, it is sent again when the window has passed (nothing
        was created: the limits are the route's first check)."""
        path = TEXT_SUBMIT_PATH if text else SUBMIT_PATH
        deadline = time.monotonic() + rate_limit_wait_seconds
        timeout = None if text else self.submit_timeout(body)
        while True:
            # A lost answer already moved the current root on: the recovery goes to the next root.
            answer = await self._send("POST", path, call_type=call_type, json=body, headers=headers, timeout=timeout)
            if not_the_hordes_answer(answer):
                # A gateway's error page (a 504 while the horde still creates the request): in doubt,
                # as a lost answer; the recovery goes to the next root (docs/adr/0105).
                if self.roots and not self.in_process:
                    self._current = (self._current + 1) % len(self.roots)
                raise SubmitAnswerLost(f"the native root answered {answer.status} without the AI Horde's body")
            pause = rate_limit_pause(answer)
            if pause is None or time.monotonic() + pause > deadline:
                return answer
            await asyncio.sleep(pause)

    def submit_timeout(self, body: dict[str, Any]) -> float | None:
        """A chat submit with images waits longer: the horde fetches the URL images (up to
        CHAT_IMAGE_FETCH_TOTAL_SECONDS for them all) and re-encodes every image before it answers. None: the
        usual native timeout."""
        urls = images = 0
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else ():
                if isinstance(part, dict) and part.get("type") == "image_url":
                    images += 1
                    url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
                    urls += isinstance(url, str) and not url.startswith("data:")
        if not images:
            return None
        fetching = CHAT_IMAGE_FETCH_TOTAL_SECONDS if urls else 0.0  # one bound for all of them
        return self.settings.native_timeout_seconds + fetching + images * IMAGE_ENCODE_SECONDS

    async def status(
        self, request_id: str, *, text: bool = False, headers: dict[str, str] | None = None
    ) -> NativeAnswer:
        path = (TEXT_STATUS_PATH if text else STATUS_PATH).format(id=request_id)
        try:
            return await self._send("GET", path, call_type="status", headers=headers)
        except SubmitAnswerLost as error:
            raise NativeUnreachable(str(error)) from None

    async def models(self) -> NativeAnswer:
        try:
            return await self._send("GET", MODELS_PATH, call_type="models")
        except SubmitAnswerLost as error:
            raise NativeUnreachable(str(error)) from None

    async def key_check(self, api_key: str) -> NativeAnswer:
        """The account of `api_key` (401 InvalidAPIKey for a key the horde does not know); a call of
        the models routes, so counted as one."""
        try:
            return await self._send("GET", FIND_USER_PATH, call_type="models", headers={"apikey": api_key})
        except SubmitAnswerLost as error:
            raise NativeUnreachable(str(error)) from None

    async def cancel(
        self, request_id: str, *, text: bool = False, headers: dict[str, str] | None = None
    ) -> str:
        """DELETE the request within the cancel timeout; returns the outcome (acknowledged, failed,
        timed_out, not_started, already_gone). timed_out is a call whose answer did not come within
        the timeout (told by the exception's type); failed, any other call without an answer or
        with an error status. `headers`: a stopping front's (undelivered_headers)."""
        budget = self.settings.cancel_timeout_seconds
        try:
            await within(self._cancel_slots.acquire(), budget)
        except TimeoutError:
            return "not_started"
        try:
            answer = await self._send(
                "DELETE",
                (TEXT_STATUS_PATH if text else STATUS_PATH).format(id=request_id),
                call_type="cancel",
                timeout=budget,
                client=self.cancel_http,
                headers=headers,
            )
        except SubmitAnswerLost as error:
            return "timed_out" if error.timed_out else "failed"
        except NativeUnreachable:
            return "failed"
        finally:
            self._cancel_slots.release()
        if request_gone(answer):
            return "already_gone"
        return "acknowledged" if answer.ok else "failed"


def request_gone(answer: NativeAnswer) -> bool:
    """The horde's own 404 for a request it no longer holds (`RequestNotFound`). A gateway's 404 in
    its place, a page or a JSON body of its own (Kong's "no Route matched"), is a failed call that
    says nothing of the request (docs/adr/0105)."""
    return answer.status == 404 and isinstance(answer.body, dict) and answer.body.get("rc") == "RequestNotFound"


def not_the_hordes_answer(answer: NativeAnswer) -> bool:
    """A 5xx whose body is not the horde's JSON error: an intermediary's (a gateway's timeout or
    error page), which does not tell whether the call reached the horde. Every error the horde
    itself answers is a JSON object with its message."""
    return answer.status >= 500 and not isinstance(answer.body, dict)


def rate_limit_pause(answer: NativeAnswer) -> float | None:
    """Seconds until the horde's rate limit admits the call again: its 429 RateLimited's
    Retry-After; None for any other answer."""
    if answer.status != 429 or not isinstance(answer.body, dict) or answer.body.get("rc") != "RateLimited":
        return None
    try:
        seconds = float(answer.headers.get("Retry-After", ""))
    except ValueError:
        return None
    return max(seconds, RATE_LIMIT_MIN_PAUSE_SECONDS)


def _json_bytes(value: Any) -> bytes:
    # As httpx encodes a json= body.
    return jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _call_wsgi(app: Any, environ: dict[str, Any]) -> tuple[int, list[tuple[str, str]], bytes]:
    """One request through a WSGI application, on the calling thread: status, headers, whole body."""
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        answer["status"] = int(status.split(" ", 1)[0])
        answer["headers"] = headers
        return lambda data: None

    try:
        result = app(environ, start_response)
        try:
            content = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()  # Django's request_finished, as a WSGI server does after the body
    except Exception:  # as a server would: an application error is a 500
        logging.getLogger("oai").exception("the in-process native call failed")
        return 500, [], b""
    return answer.get("status", 500), answer.get("headers", []), content
