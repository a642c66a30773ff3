"""Server-side prepared statements for the few SQL texts every pop and submit runs (PostgreSQL).

Django binds parameters on the client, so PostgreSQL parses and plans each pop and submit anew:
measured on the bench queue, planning took 2-3 times as long as running them (pop 0.85 ms planned,
0.4 ms run; the submit's generation read 0.3 ms planned, 0.1 ms run). These statements are fixed
texts with their values as parameters, so each connection prepares them once, and keeps one
generic plan for each (hordesite/settings.py sets plan_cache_mode=force_generic_plan, which only
prepared statements read): their plans do not depend on the values (the pop walks the queue index;
the others are primary-key lookups), and re-planning the pop with its values cost more than running
it. The pop's WHERE spells the queue index's condition as literal SQL so the generic plan can use it.

The cursor is Django's own wrapping (errors as django.db errors, queries logged when logging is
on) around a server-binding psycopg cursor that prepares every statement it runs.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from django.db import connection


@lru_cache(maxsize=1)
def _cached_conversion_query_class() -> type | None:
    """psycopg converts a query text to PostgreSQL's placeholders once per text, but only for texts
    under 4 KB; the pop's and the submit's are longer and were converted again on every call (a
    fifth of their CPU outside the HTTP server, measured in process). Their texts are few, so this
    cursor's queries always use the cache. None (psycopg's own class) if psycopg's internals moved."""
    from psycopg import _queries

    if not hasattr(_queries, "_query2pg") or not hasattr(_queries, "PostgresQuery"):
        return None

    class CachedConversionQuery(_queries.PostgresQuery):
        def convert(self, query: Any, vars: Any) -> None:
            if vars is None or not isinstance(query, (str, bytes)):
                return super().convert(query, vars)
            query = self._ensure_bytes(query)
            self.query, self._want_formats, self._order, self._parts = _queries._query2pg(
                query, self._tx.encoding
            )
            self.dump(vars)

    return CachedConversionQuery


@lru_cache(maxsize=1)
def _prepared_cursor_class() -> type:
    from django.db.backends.postgresql.base import ServerBindingCursor

    class PreparedCursor(ServerBindingCursor):
        _query_cls = _cached_conversion_query_class() or ServerBindingCursor._query_cls

        def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None):
            return super().execute(query, params, prepare=True, binary=binary)

    return PreparedCursor


@lru_cache(maxsize=1)
def _debug_wrapper_class() -> type:
    from django.db.backends.postgresql.base import CursorDebugWrapper

    class PreparedDebugWrapper(CursorDebugWrapper):
        """Logs the statement with its values (psycopg keeps no text of a prepared execution)."""

        def execute(self, sql: str, params: Any = None):
            try:
                logged = self.db.ops.compose_sql(sql, params)
            except Exception:  # noqa: BLE001  (only the log's text)
                logged = sql
            with self.debug_sql(logged, params):
                return self._execute_with_wrappers(sql, params, many=False, executor=self._execute)

    return PreparedDebugWrapper


def prepared_cursor():
    """A cursor (use as a context manager) whose statements are prepared on the connection."""
    from django.db.backends.postgresql.base import TIMESTAMPTZ_OID
    from django.db.backends.postgresql.psycopg_any import register_tzloader
    from psycopg.pq import Format

    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        cursor = _prepared_cursor_class()(connection.connection)
        # As Django's create_cursor: the cursor reads timestamps in the connection's time zone.
        if connection.timezone != connection.connection.adapters.get_loader(TIMESTAMPTZ_OID, Format.TEXT).timezone:
            register_tzloader(connection.timezone, cursor)
        # Django's wrapping of a cursor it made (thread check, errors, query logging).
        connection.validate_thread_sharing()
        if connection.queries_logged:
            return _debug_wrapper_class()(cursor, connection)
        return connection.make_cursor(cursor)
