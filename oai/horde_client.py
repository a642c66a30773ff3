"""The native API over HTTP: submit, status, cancel and the model list, with native root rotation.

A call that cannot connect to a root (nothing was sent) moves to the next root and is tried there;
the root that answered stays current for later calls. A submit whose answer was lost after it was
sent (timeout, reset) raises `SubmitAnswerLost`: the caller re-sends it with the same operation key
(lost-submit recovery) and the horde answers 200 with the claim when the first one landed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from oai.metrics import FrontMetrics
from oai.settings import FrontSettings

SUBMIT_PATH = "/generate/chat/async"
STATUS_PATH = "/generate/chat/status/{id}"
MODELS_PATH = "/status/models?type=text&chat=true"


class NativeUnreachable(Exception):
    """No native root could be reached; nothing was sent."""


class SubmitAnswerLost(Exception):
    """The call was sent but its answer did not arrive: its outcome is unknown."""


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

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.cancel_http.aclose()

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
        client = client or self.http
        count = len(self.roots)
        first = self._current if start_root is None else start_root % count
        started = time.perf_counter()
        kwargs: dict[str, Any] = {"headers": self._headers(headers)}
        if json is not None:
            kwargs["json"] = json
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
                raise SubmitAnswerLost(str(error) or type(error).__name__) from None
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

    async def submit(
        self, body: dict[str, Any], headers: dict[str, str], *, call_type: str = "submit"
    ) -> NativeAnswer:
        # A lost answer already moved the current root on: the recovery goes to the next root.
        return await self._send("POST", SUBMIT_PATH, call_type=call_type, json=body, headers=headers)

    async def status(self, request_id: str) -> NativeAnswer:
        try:
            return await self._send("GET", STATUS_PATH.format(id=request_id), call_type="status")
        except SubmitAnswerLost as error:
            raise NativeUnreachable(str(error)) from None

    async def models(self) -> NativeAnswer:
        try:
            return await self._send("GET", MODELS_PATH, call_type="models")
        except SubmitAnswerLost as error:
            raise NativeUnreachable(str(error)) from None

    async def cancel(self, request_id: str) -> str:
        """DELETE the request within the cancel timeout; returns the outcome (acknowledged, failed,
        timed_out, not_started, already_gone)."""
        budget = self.settings.cancel_timeout_seconds
        try:
            await asyncio.wait_for(self._cancel_slots.acquire(), timeout=budget)
        except TimeoutError:
            return "not_started"
        try:
            answer = await self._send(
                "DELETE",
                STATUS_PATH.format(id=request_id),
                call_type="cancel",
                timeout=budget,
                client=self.cancel_http,
            )
        except SubmitAnswerLost as error:
            return "timed_out" if "timeout" in str(error).lower() or "Timeout" in str(error) else "failed"
        except NativeUnreachable:
            return "failed"
        finally:
            self._cancel_slots.release()
        if answer.status == 404:
            return "already_gone"
        return "acknowledged" if answer.ok else "failed"
