"""PostgreSQL lost or unreachable: one retry on a fresh connection, else a quick 503 (issue 13;
docs/adr/0018).

After a restart (or `pg_terminate_backend`) the pool still holds connections whose server side is
gone; each fails on its first statement. A request whose connection was lost before any of its
statements completed, with no statement that commits by itself in flight, has written nothing,
so it is run once more on a fresh connection: the
exception handler recycles the connection (the pool discards it and checks the others), probes
the server with a short connect timeout, and marks the 503 it answers (RETRY_HEADER) for the retry
that `retrying_wsgi` makes with the same body (every native route, from daphne or from the mounted
front's in-process calls). A request that loses its connection after a statement completed, or while a statement that commits by itself was in flight (it may
have committed before the connection went), is not run again; it answers 503 (docs/adr/0038).

A lost connection is told by its error (psycopg's connection errors: SQLSTATE class 08, the
server's shutdown codes 57P01-57P03, or a client-side error without SQLSTATE), not only by the
connection the view ends with: an atomic block that fails takes a fresh connection from the pool
when it restores autocommit, so that one looks healthy.

When the probe fails the database is marked unavailable for HORDE_DATABASE_UNAVAILABLE_SECONDS:
every request meanwhile answers 503 DatabaseUnavailable with Retry-After at once, instead of
waiting out the pool's timeout; the first request after the window probes again (one at a time).
"""

from __future__ import annotations

import contextvars
import io
import json
import logging
import select
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, connections

from contract.errors import is_transaction_conflict as transaction_conflict

log = logging.getLogger(__name__)

DATABASE_UNAVAILABLE_RC = "DatabaseUnavailable"
DATABASE_UNAVAILABLE_MESSAGE = "The database is unavailable; try again shortly."
# On a 503 from the exception handler: the request wrote nothing and may run again once. Never sent
# to a client: the layers that retry remove it.
RETRY_HEADER = "X-Horde-Retry-Fresh-Connection"


@dataclass
class StatementCount:
    """Statements of the current request that completed, and those that failed outside a
    transaction and may have committed anyway (both 0: nothing can have been written)."""

    completed: int = 0
    in_doubt: int = 0

    @property
    def nothing_written(self) -> bool:
        return self.completed == 0 and self.in_doubt == 0


_statements: contextvars.ContextVar[StatementCount | None] = contextvars.ContextVar("horde_statements", default=None)


def start_request() -> StatementCount:
    """Count this request's statements from here (the view's thread shares the context's object)."""
    count = StatementCount()
    _statements.set(count)
    return count


def count_statements(execute, sql, params, many, context):
    count = _statements.get()
    connection = context["connection"]
    doubtful = count is not None and _may_commit_alone(connection, sql) and not _session_ended_before(connection)
    try:
        result = execute(sql, params, many, context)
    except Exception:
        if doubtful:
            count.in_doubt += 1
        raise
    if count is not None:
        count.completed += 1
    return result


def _may_commit_alone(connection: Any, sql: Any) -> bool:
    """A statement sent outside a transaction commits by itself: when its connection is lost it
    may have committed before the answer was read. A plain SELECT writes nothing; a statement in
    an atomic block commits only with the block's COMMIT, which follows a completed statement."""
    if connection.in_atomic_block:
        return False
    return str(sql).lstrip()[:6].upper() != "SELECT"


def _session_ended_before(connection: Any) -> bool:
    """Whether the server ended the session before this statement was sent: an idle session is
    told nothing unasked but its end (a FATAL error, then the socket's EOF), so input already
    waiting means a statement sent now never runs. One poll(2), no round trip."""
    raw = connection.connection
    try:
        fd = raw.fileno()
    except Exception:  # noqa: BLE001  (closed: psycopg refuses the statement before sending it)
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def install_statement_counter(sender: Any, connection: Any, **kwargs: Any) -> None:
    """connection_created: every connection Django opens (each pool checkout) counts statements."""
    if count_statements not in connection.execute_wrappers:
        connection.execute_wrappers.append(count_statements)


# --- unavailable window and probe ---------------------------------------------------------------

_unavailable_until = 0.0
_probe_lock = threading.Lock()


def retry_after_seconds() -> int:
    return max(1, round(settings.HORDE_DATABASE_UNAVAILABLE_SECONDS))


def unavailable_body() -> dict[str, str]:
    return {"message": DATABASE_UNAVAILABLE_MESSAGE, "rc": DATABASE_UNAVAILABLE_RC}


def _mark_unavailable(error: BaseException | str) -> None:
    global _unavailable_until
    first = time.monotonic() >= _unavailable_until
    _unavailable_until = time.monotonic() + settings.HORDE_DATABASE_UNAVAILABLE_SECONDS
    if first:
        log.warning(
            "database unavailable (%s): answering 503 for %.1f s", error, settings.HORDE_DATABASE_UNAVAILABLE_SECONDS
        )


def forget_unavailable() -> None:
    global _unavailable_until
    _unavailable_until = 0.0


def probe(alias: str = DEFAULT_DB_ALIAS) -> bool:
    """Whether the server accepts a new connection within HORDE_DATABASE_CONNECT_TIMEOUT."""
    import psycopg

    wrapper = connections[alias]
    params = dict(wrapper.get_connection_params())
    params["connect_timeout"] = max(1, round(settings.HORDE_DATABASE_CONNECT_TIMEOUT))
    params.pop("cursor_factory", None)
    try:
        psycopg.connect(**params, autocommit=True).close()
        return True
    except psycopg.Error as error:
        _mark_unavailable(error)
        return False


def refuse_while_unavailable() -> bool:
    """True: answer 503 now. Inside the window, or while another request probes; the first request
    after the window probes the server itself."""
    if not _unavailable_until:
        return False
    if time.monotonic() < _unavailable_until:
        return True
    if not _probe_lock.acquire(blocking=False):
        return True
    try:
        if not probe():
            return True
        forget_unavailable()
        _check_pool()
        return False
    finally:
        _probe_lock.release()


def unavailable_now() -> bool:
    """Whether to answer 503 DatabaseUnavailable at once (the window, or another request probing)."""
    return bool(_unavailable_until) and refuse_while_unavailable()


def _check_pool(alias: str = DEFAULT_DB_ALIAS) -> None:
    pool = getattr(connections[alias], "pool", None)
    if pool is not None:
        try:
            pool.check()  # discards every idle connection whose server side is gone
        except Exception:
            log.warning("connection pool check failed", exc_info=True)


# --- the exception handler's part ---------------------------------------------------------------


# SQLSTATEs of a session the server ended or refused: admin_shutdown, crash_shutdown,
# cannot_connect_now; class 08 is connection_exception.
_SESSION_ENDED_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})


def is_connection_failure(exc: BaseException) -> bool:
    """A PostgreSQL connection lost or never obtained (SQLite's errors are the file's, not a server's)."""
    return (
        isinstance(exc, (OperationalError, InterfaceError))
        and connections[DEFAULT_DB_ALIAS].vendor == "postgresql"
        and (_lost_by_its_error(exc) or _connection_gone())
    )


def _lost_by_its_error(exc: BaseException) -> bool:
    """The psycopg error under Django's says the connection was lost, refused or never made."""
    import psycopg
    from psycopg_pool import PoolTimeout

    cause = exc.__cause__
    if isinstance(cause, PoolTimeout):
        return True
    if not isinstance(cause, (psycopg.OperationalError, psycopg.InterfaceError)):
        return False
    sqlstate = cause.sqlstate
    # Without SQLSTATE the error is psycopg's or libpq's own: the socket closed, the connection lost.
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in _SESSION_ENDED_SQLSTATES


# SQLite's primary result codes of a file the process cannot use now: busy or locked past the
# timeout, an I/O error, a full disk, a file it cannot open. Each fails its statement (and rolls
# back its transaction): the request may be sent again.
_SQLITE_UNAVAILABLE_CODES = frozenset({
    sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_FULL, sqlite3.SQLITE_CANTOPEN,
})


def is_database_file_unavailable(exc: BaseException) -> bool:
    """The embedded default's SQLite file out of reach (moved, full, locked past the busy timeout)."""
    cause = exc.__cause__
    return (
        isinstance(exc, OperationalError)
        and isinstance(cause, sqlite3.Error)
        and (getattr(cause, "sqlite_errorcode", 0) & 0xFF) in _SQLITE_UNAVAILABLE_CODES
    )


DATABASE_CONFLICT_RC = "DatabaseConflict"
DATABASE_CONFLICT_MESSAGE = "The request met another at the database and was rolled back; please try again."
DATABASE_CONFLICT_RETRY_AFTER_SECONDS = 1


def is_transaction_conflict(exc: BaseException) -> bool:
    """A statement PostgreSQL refused for a concurrent transaction's sake (the connection lives)."""
    return isinstance(exc, OperationalError) and transaction_conflict(exc)


def _connection_gone(alias: str = DEFAULT_DB_ALIAS) -> bool:
    raw = connections[alias].connection
    return raw is None or bool(getattr(raw, "closed", False)) or bool(getattr(raw, "broken", False))


def on_connection_failure(exc: BaseException) -> bool:
    """After a view failed for a lost or unobtainable connection: whether to run it again. The
    connection is given back (the pool discards a broken one) and the pool's idle ones checked.
    A pool timeout (every connection busy, or none could be made) is not run again."""
    from psycopg_pool import PoolTimeout

    count = _statements.get()
    unwritten = count is not None and count.nothing_written and not isinstance(exc.__cause__, PoolTimeout)
    try:
        connections[DEFAULT_DB_ALIAS].close()
    except Exception:
        log.debug("closing the lost connection failed", exc_info=True)
    if not probe():
        return False
    _check_pool()
    if unwritten:
        log.warning("database connection lost before any statement completed (%s): retrying once", exc)
    return unwritten


def unavailable_headers(*, retry: bool = False) -> dict[str, str]:
    headers = {"Retry-After": str(retry_after_seconds())}
    if retry:
        headers[RETRY_HEADER] = "1"
    return headers


# --- the retrying layers ------------------------------------------------------------------------

NATIVE_PREFIX = "/api/v2/"


def _unavailable_start_and_body() -> tuple[dict[str, Any], dict[str, Any]]:
    body = json.dumps(unavailable_body()).encode()
    start = {
        "type": "http.response.start",
        "status": 503,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(retry_after_seconds()).encode()),
            (b"access-control-allow-origin", b"*"),
        ],
    }
    return start, {"type": "http.response.body", "body": body}


def retrying_wsgi(app: Any) -> Any:
    """The WSGI application `app` (Django's, for every native route however it is reached: daphne
    through hordesite.wsgi_pool, the mounted front's in-process calls): 503 at once while the
    database is marked unavailable, and one more run, with the same body, of a request the
    exception handler marked for a retry."""

    def guarded(environ: dict[str, Any], start_response: Any) -> Any:
        if not environ.get("PATH_INFO", "").startswith(NATIVE_PREFIX):
            return app(environ, start_response)
        if unavailable_now():
            start, body = _unavailable_start_and_body()
            start_response(
                "503 Service Unavailable", [(k.decode(), v.decode()) for k, v in start["headers"]]
            )
            return [body["body"]]
        length = environ.get("CONTENT_LENGTH") or ""
        raw = environ["wsgi.input"].read(int(length)) if length.isascii() and length.isdigit() else b""
        for last in (False, True):
            start_request()
            status, headers, exc_info, chunks = run_wsgi_whole(app, {**environ, "wsgi.input": io.BytesIO(raw)})
            if any(name.lower() == RETRY_HEADER.lower() for name, _ in headers) and not last:
                continue
            start_response(status, [(n, v) for n, v in headers if n.lower() != RETRY_HEADER.lower()], exc_info)
            return [chunks]
        raise AssertionError("unreachable")

    return guarded


def run_wsgi_whole(app: Any, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], Any, bytes]:
    """One WSGI call start to end: its status, headers, exc_info and whole body (the iterable read
    and closed)."""
    captured: list[Any] = []

    def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        captured[:] = [status, headers, exc_info]
        return lambda data: None

    result = app(environ, capture)
    try:
        chunks = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()  # Django's request_finished: the connection goes back to the pool
    return captured[0], captured[1], captured[2], chunks
