"""The native API as a worker uses it: find_user, pop, submit and progress, over the standard
library's http.client, one keep-alive connection per bridge thread.

A worker makes two or three horde calls a job, and the worker's CPU a job is what bench/bridge.py
holds under a quarter of the horde's. httpx spent about 1.4 ms of CPU a call here against
http.client's 0.5 ms (docs/benchmarks.md, "Chat queue and the reference worker"), so these calls
take the plain client; the backend's calls and the rare messages_url fetch stay on httpx. The
environment's proxies apply, as httpx and the upstream worker's requests apply them.
"""

from __future__ import annotations

import base64
import http.client
import json as json_module
import select
import threading
import urllib.parse
import urllib.request
from typing import Any

import httpx

from contract.chat_progress import PROGRESS_ROUTE
from workers.bridge import BRIDGE_AGENT

CONNECT_TIMEOUT = 10.0

# The upstream worker's timeouts (spec: existing-clients.md): pop 40 s, submit 60 s.
POP_TIMEOUT = 40.0
SUBMIT_TIMEOUT = 60.0

# A progress post is small and frequent: a slow answer is not worth holding the backend's stream for.
PROGRESS_TIMEOUT = 10.0

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
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the horde URL must be http:// or https://, not {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._origin = f"{parts.scheme}://{parts.netloc}"
        self._base = f"{parts.path.rstrip('/')}/api/v2/"
        self._headers = {
            "apikey": api_key, "Client-Agent": BRIDGE_AGENT, "Accept": "application/json",
            "Content-Type": "application/json",
        }
        self._proxy = _proxy_for(parts.scheme, self._host)
        self._local = threading.local()
        self._opened: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Close every thread's connection; a later call raises RuntimeError, as a closed httpx client does."""
        with self._lock:
            self._closed = True
            opened, self._opened = self._opened, []
        for connection in opened:
            connection.close()

    def _connection(self) -> http.client.HTTPConnection:
        """This thread's connection; one the server closed while it was idle is opened again."""
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._new_connection()
            self._local.connection = connection
            with self._lock:
                self._opened.append(connection)
        elif connection.sock is not None and select.select([connection.sock], [], [], 0)[0]:
            connection.close()  # an idle keep-alive connection that reads as ready was closed by the peer
        return connection

    def _new_connection(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        if self._proxy is None:
            return kind(self._host, self._port, timeout=CONNECT_TIMEOUT)
        host, port, authorization = self._proxy
        if self._https:  # through the proxy's CONNECT tunnel
            connection = kind(host, port, timeout=CONNECT_TIMEOUT)
            headers = {"Proxy-Authorization": authorization} if authorization else None
            connection.set_tunnel(self._host, self._port, headers=headers)
            return connection
        return http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT)

    def _exchange(self, method: str, path: str, body: Any, timeout: float) -> tuple[int, bytes]:
        """One request on this thread's connection: (status, body). HordeUnavailable without an answer."""
        if self._closed:
            raise RuntimeError("the horde's client is closed")
        connection = self._connection()
        target = self._base + path
        headers = self._headers
        if self._proxy is not None and not self._https:  # a plain HTTP proxy takes the absolute URL
            target = self._origin + target
            if self._proxy[2]:
                headers = {**headers, "Proxy-Authorization": self._proxy[2]}
        payload = None if body is None else json_module.dumps(body).encode()
        try:
            if connection.sock is None:
                connection.timeout = CONNECT_TIMEOUT
                connection.connect()
            connection.sock.settimeout(timeout)
            connection.request(method, target, body=payload, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as error:
            connection.close()  # the next call connects afresh
            raise HordeUnavailable(f"{type(error).__name__}: {error}") from None

    def _call(self, method: str, path: str, *, timeout: float, json: Any = None) -> Any:
        status, data = self._exchange(method, path, json, timeout)
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
        return self._call("GET", "find_user", timeout=POP_TIMEOUT)

    def pop(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "generate/text/pop", json=body, timeout=POP_TIMEOUT)

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "generate/text/submit", json=body, timeout=SUBMIT_TIMEOUT)

    def progress(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST the progress route: (status, body) for any answer; HordeUnavailable without one."""
        status, data = self._exchange("POST", PROGRESS_ROUTE.removeprefix("/api/v2/"), body, PROGRESS_TIMEOUT)
        answer = _json_or_none(data)
        return status, answer if isinstance(answer, dict) else {}

    def fetch_json(self, url: str, *, timeout: float = 30.0) -> Any:
        """A messages_url: a presigned URL outside the API, fetched without the API key."""
        try:
            response = httpx.get(url, timeout=timeout, follow_redirects=True)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as error:
            raise HordeUnavailable(f"messages_url: {error}") from None


def _json_or_none(data: bytes) -> Any:
    try:
        return json_module.loads(data)
    except ValueError:
        return None


def _proxy_for(scheme: str, host: str) -> tuple[str, int, str | None] | None:
    """The environment's proxy for the horde (HTTP_PROXY / HTTPS_PROXY, unless NO_PROXY names the
    host): its host, port and Proxy-Authorization value (from the proxy URL's user and password)."""
    proxy = urllib.request.getproxies().get(scheme)
    if not proxy or urllib.request.proxy_bypass(host):
        return None
    parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    authorization = None
    if parts.username is not None:
        credentials = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(credentials.encode()).decode()
    return parts.hostname or "", parts.port or 80, authorization
