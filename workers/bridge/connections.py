"""Keep-alive HTTP/1.1 connections to one origin, one per thread, over the standard library's
http.client: how the reference worker calls the horde and its backend.

A worker makes a pop, a submit, progress posts and a backend call for every job, and its CPU a job
is what bench/bridge.py holds under a quarter of the horde's. httpx spent about 1.4 ms of CPU on a
JSON POST where http.client spends 0.5 ms (docs/benchmarks.md, "Chat queue and the reference
worker"). The environment's proxies apply (HTTP_PROXY / HTTPS_PROXY unless NO_PROXY names the
host), as they do for httpx and for the upstream worker's requests.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import math
import os
import select
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CONNECT_TIMEOUT = 10.0

# After a stream's last event, how long its end (the chunked terminator) may take to arrive
# before the connection is dropped rather than kept for the next call.
STREAM_END_TIMEOUT = 1.0
_FINISH_READ_BYTES = 65536


# How a kept connection that the server had closed fails before any answer.
_CLOSED_UNANSWERED = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class Interrupted(Exception):
    """interrupt() ended the request, or refused it."""


class Unreachable(Exception):
    """No answer: the connection failed, broke or timed out (`timed_out`)."""

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.timed_out = isinstance(error, TimeoutError)
        self.reason = type(error).__name__


class Streamed:
    """An answer read as it arrives: `status`, then `lines()` or `read()`. A stream read to its
    end (or `finish()`ed) leaves the connection for the next call; one left half-read is closed,
    which tells the server to stop (llama-server cancels a generation whose client went away)."""

    def __init__(self, response: http.client.HTTPResponse, sock: socket.socket):
        self.status = response.status
        self._response = response
        self._sock = sock
        self.complete = False

    def read(self) -> bytes:
        try:
            data = self._response.read()
        except (OSError, http.client.HTTPException) as error:
            raise Unreachable(error) from None
        self.complete = True
        return data

    def lines(self) -> Iterator[str]:
        """The body's lines without their ends (\\n, \\r\\n or \\r, as server-sent events allow)."""
        readline = self._response.readline
        while True:
            try:
                raw = readline()
            except (OSError, http.client.HTTPException) as error:
                raise Unreachable(error) from None
            if not raw:
                self.complete = True
                return
            yield from raw.rstrip(b"\n").decode("utf-8", "replace").split("\r")

    def finish(self) -> None:
        """Read what is left of a stream whose last event came (its chunked terminator), so the
        connection can be kept; given up STREAM_END_TIMEOUT after the call, in all (a server that
        goes on trickling bytes loses its connection, not the caller's time)."""
        deadline = time.monotonic() + STREAM_END_TIMEOUT
        try:
            while (left := deadline - time.monotonic()) > 0:
                self._sock.settimeout(left)
                # read1: one read from the socket a call, so that the deadline is checked between.
                if not self._response.read1(_FINISH_READ_BYTES):
                    # At a Content-Length body's end read1 leaves the response open, which would
                    # keep the connection from its next request: close it as read() does.
                    self._response.close()
                    self.complete = True
                    return
        except (OSError, http.client.HTTPException):
            return


class Connections:
    """This origin's connections: one per thread, kept alive between calls, made again when the
    server closed an idle one. After `close()` a call raises RuntimeError (as httpx's client)."""

    def __init__(self, url: str, *, headers: dict[str, str]):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the URL must be http:// or https://, not {url!r}")
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._headers = headers
        self._tls = tls_context() if self._https else None
        self._proxy = proxy_for(parts.scheme, self._host)
        if self._proxy is not None and not self._https and self._proxy[2]:
            self._headers = {**headers, "Proxy-Authorization": self._proxy[2]}
        self._local = threading.local()
        self._opened: list[http.client.HTTPConnection] = []
        # Reentrant: interrupt() runs in a signal handler, which may find the main thread holding it.
        self._lock = threading.RLock()
        self._closed = False
        # Connections whose interruptible request is out (since it was sent; inf before), those
        # interrupt() shut, and whether it was called.
        self._interruptible: dict[http.client.HTTPConnection, float] = {}
        self._shut: set[http.client.HTTPConnection] = set()
        self._interrupted = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            opened, self._opened = self._opened, []
        for connection in opened:
            connection.close()

    def interrupt(self, *, out_for: float = 0.0) -> None:
        """Refuse later interruptible requests, and end those out for at least `out_for` seconds:
        each such connection's sending side is shut, which the server sees as the client gone. An
        answer the server had already sent is still read; without one the request ends Unreachable."""
        now = time.monotonic()
        with self._lock:  # shut under the lock: a connection that left the set may carry a submit next
            self._interrupted = True
            for connection, since in self._interruptible.items():
                if now - since >= out_for and connection not in self._shut:
                    _shut_sending(connection)
                    self._shut.add(connection)

    def request(
        self, method: str, url: str, *, body: bytes | None, timeout: float, interruptible: bool = False
    ) -> tuple[int, bytes]:
        """One exchange: (status, body). Unreachable without an answer. An interruptible one is
        ended by interrupt()."""
        connection = self._connection()
        if interruptible:
            self._enter_interruptible(connection)
        try:
            connection, response = self._open(method, url, body, timeout, connection, interruptible)
            try:
                return response.status, response.read()
            except (OSError, http.client.HTTPException) as error:
                connection.close()  # the next call connects afresh
                raise Unreachable(error) from None
        finally:
            if interruptible:
                with self._lock:
                    self._interruptible.pop(connection, None)
                    shut = connection in self._shut
                    self._shut.discard(connection)
                if shut:
                    connection.close()  # half-shut: the next call connects afresh

    def _enter_interruptible(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if self._interrupted:
                raise Unreachable(Interrupted("the client was interrupted"))
            self._interruptible[connection] = math.inf  # not sent yet: never taken as long out

    def _check_interrupted(self, connection: http.client.HTTPConnection) -> None:
        """After connecting: an interrupt() that found the connection not yet connected ends the
        request here (a later one shuts the socket itself)."""
        with self._lock:
            if self._interrupted:
                connection.close()
                raise Unreachable(Interrupted("the client was interrupted"))

    def _sent(self, connection: http.client.HTTPConnection) -> None:
        """The interruptible request is out: from now on it ages."""
        with self._lock:
            if connection in self._interruptible:
                self._interruptible[connection] = time.monotonic()

    @contextmanager
    def stream(self, method: str, url: str, *, body: bytes | None, timeout: float) -> Iterator[Streamed]:
        """An answer read as it arrives (`timeout` between reads); see Streamed."""
        connection, response = self._open(method, url, body, timeout, self._connection(), False)
        streamed = Streamed(response, connection.sock)
        try:
            yield streamed
        finally:
            if not streamed.complete:
                connection.close()

    def _open(
        self,
        method: str,
        url: str,
        body: bytes | None,
        timeout: float,
        connection: http.client.HTTPConnection,
        interruptible: bool,
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send the request and read the answer's head. A kept connection the server closed
        before answering (an idle timeout that ended it as the request went out: it never read the
        request) is not an answer: the request goes once more on a new connection."""
        if self._closed:
            raise RuntimeError("the client is closed")
        if not url.startswith(self.origin):
            raise ValueError(f"{url!r} is not on {self.origin}")
        # A plain HTTP proxy takes the absolute URL; a direct connection or a tunnel the path.
        target = url if self._proxy is not None and not self._https else (url[len(self.origin):] or "/")
        while True:
            reused = connection.sock is not None
            try:
                if not reused:
                    connection.timeout = CONNECT_TIMEOUT
                    connection.connect()
                    if interruptible:
                        self._check_interrupted(connection)
                connection.sock.settimeout(timeout)
                connection.request(method, target, body=body, headers=self._headers)
                if interruptible:
                    self._sent(connection)
                return connection, connection.getresponse()
            except (OSError, http.client.HTTPException) as error:
                connection.close()
                if reused and isinstance(error, _CLOSED_UNANSWERED) and not (interruptible and self._interrupted):
                    continue  # once: the connection is a new one now
                raise Unreachable(error) from None

    def _connection(self) -> http.client.HTTPConnection:
        """This thread's connection; one the server closed while it was idle is opened again."""
        if self._closed:
            raise RuntimeError("the client is closed")
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
        if self._proxy is None:
            return self._plain_or_tls(self._host, self._port)
        host, port, authorization = self._proxy
        if self._https:  # TLS to the server through the proxy's CONNECT tunnel
            connection = self._plain_or_tls(host, port)
            headers = {"Proxy-Authorization": authorization} if authorization else None
            connection.set_tunnel(self._host, self._port, headers=headers)
            return connection
        return http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT)

    def _plain_or_tls(self, host: str, port: int) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(host, port, timeout=CONNECT_TIMEOUT, context=self._tls)
        return http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT)


def _shut_sending(connection: http.client.HTTPConnection) -> None:
    sock = connection.sock
    if sock is None:
        return
    # The plain socket's shutdown, also under TLS: an SSLSocket's own drops its TLS state, which
    # the answer still on its way needs. Already closed or reset: the request ends on its own.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_WR)


def json_body(value: Any) -> bytes:
    """A request body as JSON: compact and UTF-8, as httpx wrote it (a prompt in CJK costs three
    bytes a character, not six)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def tls_context() -> ssl.SSLContext:
    """What an HTTPS server's certificate is verified against: the files SSL_CERT_FILE /
    SSL_CERT_DIR name when set, else certifi's bundle when it is installed (as httpx and requests
    verify; a python.org macOS build has no system store until its certificates are installed),
    else the system's store."""
    if os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context()
    try:
        import certifi
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


def proxy_for(scheme: str, host: str) -> tuple[str, int, str | None] | None:
    """The environment's proxy for `host` (HTTP_PROXY / HTTPS_PROXY, unless NO_PROXY names it):
    its host, port and Proxy-Authorization value (from the proxy URL's user and password)."""
    proxy = urllib.request.getproxies().get(scheme)
    if not proxy or urllib.request.proxy_bypass(host):
        return None
    parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    authorization = None
    if parts.username is not None:
        credentials = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(credentials.encode()).decode()
    return parts.hostname or "", parts.port or 80, authorization
