"""Redis calls that cost at most one short timeout per request when Redis hangs (issue 13;
docs/adr/0018).

Every Redis call on a request path (the cache, the rate limiter, the empty-pop cache,
the completion signal publisher) already falls back when Redis fails: the cache ignores the error,
the limiter lets the request through, the publisher logs. A hung Redis (stopped, black-holed)
still made each of those calls wait out its socket timeout, and a request makes several, so a pop
cost seconds. Here a call that times out or loses its connection marks that Redis server
unavailable for HORDE_REDIS_UNAVAILABLE_SECONDS in this process: until then every connection to
it refuses at once with `RedisUnavailable` (a redis ConnectionError, so every existing fallback
takes it), exactly as when Redis is down. The first call after the window tries again; one that
succeeds ends the window early for everyone.

`GuardedConnectionPool` is a redis-py ConnectionPool whose connections are the URL's own class
(TCP, TLS, unix socket) with the guard mixed in; django-redis takes it as CONNECTION_POOL_CLASS
and the project's own clients build their pools with it (settings.HORDE_REDIS_POOL_CLASS).
"""

from __future__ import annotations

import logging
import threading
import time
from functools import cache
from typing import Any

import redis

log = logging.getLogger(__name__)

_unavailable_until: dict[tuple[Any, ...], float] = {}
_lock = threading.Lock()


class RedisUnavailable(redis.ConnectionError):
    """Refused without a network call: this Redis timed out or dropped a connection moments ago."""


def _server(connection: Any) -> tuple[Any, ...]:
    return (getattr(connection, "host", None), getattr(connection, "port", None), getattr(connection, "path", None))


def _unavailable_seconds() -> float:
    from django.conf import settings

    return float(getattr(settings, "HORDE_REDIS_UNAVAILABLE_SECONDS", 5.0))


def mark_unavailable(server: tuple[Any, ...], error: BaseException) -> None:
    seconds = _unavailable_seconds()
    if seconds <= 0:
        return
    with _lock:
        first = server not in _unavailable_until
        _unavailable_until[server] = time.monotonic() + seconds
    if first:
        log.warning("Redis %s unavailable (%s): calls refused for %.1f s", server, error, seconds)


def _refuse_if_unavailable(server: tuple[Any, ...]) -> None:
    until = _unavailable_until.get(server)
    if until is not None and time.monotonic() < until:
        raise RedisUnavailable(f"Redis {server[0] or server[2]}:{server[1]} is unavailable; retrying after a pause")


def _available_again(server: tuple[Any, ...]) -> None:
    if server in _unavailable_until:
        with _lock:
            _unavailable_until.pop(server, None)


def forget_unavailable() -> None:
    """Forget every mark (tests start from a clean slate)."""
    with _lock:
        _unavailable_until.clear()


_FAILURES = (redis.ConnectionError, redis.TimeoutError, OSError)


class _Guard:
    """Mixed into a redis-py connection class: refuse while the server is marked, mark it on a
    timeout or a lost connection."""

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        server = _server(self)
        _refuse_if_unavailable(server)
        try:
            return super().connect(*args, **kwargs)  # type: ignore[misc]
        except RedisUnavailable:
            raise
        except _FAILURES as error:
            mark_unavailable(server, error)
            raise

    def send_packed_command(self, *args: Any, **kwargs: Any) -> Any:
        server = _server(self)
        _refuse_if_unavailable(server)
        try:
            return super().send_packed_command(*args, **kwargs)  # type: ignore[misc]
        except RedisUnavailable:
            raise
        except _FAILURES as error:
            mark_unavailable(server, error)
            raise

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        server = _server(self)
        try:
            response = super().read_response(*args, **kwargs)  # type: ignore[misc]
        except RedisUnavailable:
            raise
        except _FAILURES as error:
            mark_unavailable(server, error)
            raise
        _available_again(server)
        return response


@cache
def guarded(connection_class: type) -> type:
    """`connection_class` with the guard (one class per original, made once)."""
    if issubclass(connection_class, _Guard):
        return connection_class
    return type(f"Guarded{connection_class.__name__}", (_Guard, connection_class), {})


class GuardedConnectionPool(redis.ConnectionPool):
    """A ConnectionPool whose connections carry the guard, whatever class the URL chose."""

    def __init__(self, connection_class: type = redis.Connection, **kwargs: Any):
        super().__init__(connection_class=guarded(connection_class), **kwargs)
