"""The native API as a worker uses it: find_user, pop, submit and progress, on one keep-alive
connection per bridge thread (`connections`), and the messages_url fetch.
"""

from __future__ import annotations

import http.client
import json as json_module
import urllib.request
import zlib
from typing import Any

from contract.chat_limits import MAX_CHAT_BODY_BYTES
from contract.chat_progress import PROGRESS_ROUTE
from workers.bridge import BRIDGE_AGENT
from workers.bridge.connections import Connections, Unreachable, json_body

# The upstream worker's timeouts (spec: existing-clients.md): pop 40 s, submit 60 s.
POP_TIMEOUT = 40.0
SUBMIT_TIMEOUT = 60.0

# A progress post is small and frequent: a slow answer is not worth holding the backend's stream for.
PROGRESS_TIMEOUT = 10.0

# At stop, a pop out this long is taken as held for a job (ADR 0024) and ended; a younger one may be
# one the horde is running, so it is left to answer.
POP_HELD_AFTER = 1.0

# Return codes after which popping again cannot help until the configuration changes.
FATAL_POP_RCS = frozenset(
    {"InvalidAPIKey", "AnonForbiddenWorker", "AnonForbidden", "ChatDeclarationInvalid", "ProfaneWorkerName",
     "WrongCredentials", "TooManySameIPs", "NotTrusted"}
)


class HordeUnavailable(Exception):
    """The horde cannot be reached or answered 5xx/429: retry with backoff."""


class HordeRefused(Exception):
    """A 4xx with the native body {message, rc}."""

    def __init__(self, status: int, rc: str, message: str):
        super().__init__(f"{status} {rc}: {message}")
        self.status = status
        self.rc = rc
        self.message = message


class HordeClient:
    def __init__(self, url: str, api_key: str):
        self.url = url.rstrip("/")
        try:
            self._connections = Connections(
                self.url,
                headers={"apikey": api_key, "Client-Agent": BRIDGE_AGENT, "Accept": "application/json",
                         "Content-Type": "application/json"},
            )
        except ValueError:
            raise ValueError(f"the horde URL must be http:// or https://, not {url!r}") from None
        self._api = f"{self.url}/api/v2/"

    def close(self) -> None:
        """Close every thread's connection; a later call raises RuntimeError."""
        self._connections.close()

    def interrupt_pops(self) -> None:
        """At stop: refuse later pops, and end those the horde holds for a job (it sees the worker
        gone and hands them nothing). A pop out for less than POP_HELD_AFTER seconds is left to
        answer: it may be one the horde is running, whose job would be lost with the connection. A
        job the horde handed out first is still read."""
        self._connections.interrupt(out_for=POP_HELD_AFTER)

    def _exchange(
        self, method: str, path: str, body: Any, timeout: float, *, interruptible: bool = False
    ) -> tuple[int, bytes]:
        """One request on this thread's connection: (status, body). HordeUnavailable without an answer."""
        payload = None if body is None else json_body(body)
        try:
            return self._connections.request(
                method, self._api + path, body=payload, timeout=timeout, interruptible=interruptible
            )
        except Unreachable as error:
            raise HordeUnavailable(str(error)) from None

    def _call(self, method: str, path: str, *, timeout: float, json: Any = None, interruptible: bool = False) -> Any:
        status, data = self._exchange(method, path, json, timeout, interruptible=interruptible)
        if status >= 500 or status == 429:
            raise HordeUnavailable(f"{status}: {data[:200].decode(errors='replace')}")
        body = _json_or_none(data)
        if status >= 400:
            body = body if isinstance(body, dict) else {}
            raise HordeRefused(
                status,
                str(body.get("rc") or "Unknown"),
                str(body.get("message") or data[:200].decode(errors="replace")),
            )
        return body

    def find_user(self) -> dict[str, Any]:
        return _an_object("find_user", self._call("GET", "find_user", timeout=POP_TIMEOUT))

    def pop(self, body: dict[str, Any]) -> dict[str, Any]:
        # Only a pop that asks to be held may be ended at stop (interrupt_pops): any other is running.
        answer = self._call("POST", "generate/text/pop", json=body, timeout=POP_TIMEOUT, interruptible="wait" in body)
        return _an_object("the pop", answer)

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "generate/text/submit", json=body, timeout=SUBMIT_TIMEOUT)

    def progress(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST the progress route: (status, body) for any answer; HordeUnavailable without one."""
        status, data = self._exchange("POST", PROGRESS_ROUTE.removeprefix("/api/v2/"), body, PROGRESS_TIMEOUT)
        answer = _json_or_none(data)
        return status, answer if isinstance(answer, dict) else {}

    def fetch_json(self, url: str, *, timeout: float = 30.0) -> Any:
        """A messages_url: a presigned URL outside the API (any host, redirects followed), fetched
        without the API key. Rare, so through urllib's opener rather than a kept connection. The
        object may be stored gzipped: urllib does not decode Content-Encoding, so this does."""
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - the horde's own URL
                body = response.read(MAX_CHAT_BODY_BYTES + 1)
                if (response.headers.get("Content-Encoding") or "").strip().lower() == "gzip":
                    body = zlib.decompressobj(wbits=31).decompress(body, MAX_CHAT_BODY_BYTES + 1)
                if len(body) > MAX_CHAT_BODY_BYTES:  # the spec's fetch cap for the decoded body
                    raise ValueError(f"the messages are over {MAX_CHAT_BODY_BYTES} bytes")
                return json_module.loads(body)
        except (OSError, EOFError, zlib.error, http.client.HTTPException, ValueError) as error:
            raise HordeUnavailable(f"messages_url: {error}") from None


def _an_object(route: str, answer: Any) -> dict[str, Any]:
    """The horde answers these with a JSON object; a 2xx with anything else is a proxy's or a load
    balancer's page in front of it, retried as an unreachable horde rather than read as one."""
    if not isinstance(answer, dict):
        raise HordeUnavailable(f"{route} was answered with a body that is not a JSON object")
    return answer


def _json_or_none(data: bytes) -> Any:
    try:
        return json_module.loads(data)
    except ValueError:
        return None
