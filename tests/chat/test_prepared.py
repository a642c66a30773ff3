"""The prepared statements' cursor (PostgreSQL): statements over psycopg's 4 KB conversion-cache
bound are converted once per text, and still run with each call's values."""

from __future__ import annotations

import pytest
from psycopg import _queries

from chat.sql import _cached_conversion_query_class, prepared_cursor

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]


def test_a_long_statement_is_converted_once_and_runs_with_each_calls_values(monkeypatch):
    assert _cached_conversion_query_class() is not None, "psycopg's internals moved: long statements are converted on every call"
    conversions = []
    real = _queries._query2pg_nocache
    monkeypatch.setattr(_queries, "_query2pg", _queries.lru_cache(lambda q, e: conversions.append(q) or real(q, e)))
    padding = " ".join(f"%s::int AS c{i}," for i in range(400))  # well over 4 KB of SQL
    sql = f"SELECT {padding} %s::text AS last"
    assert len(sql) > _queries.MAX_CACHED_STATEMENT_LENGTH
    for value in ("first", "second"):
        with prepared_cursor() as cursor:
            cursor.execute(sql, [*range(400), value])
            row = cursor.fetchone()
        assert row[-1] == value and row[:3] == (0, 1, 2)
    assert len(conversions) == 1
