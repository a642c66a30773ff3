"""The hot path's prepared statements (PostgreSQL, chat/sql.py): how many statement texts the pop
and its empty answer's counts make across declaration shapes, against psycopg's `prepared_max` (100 per connection), and that a
second round of the same pops prepares nothing new (no churn: nothing evicted and prepared again)."""

from __future__ import annotations

import gc
import itertools
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import DataError, connection

from chat.sql import native_placeholders, run_prepared
from contract.process_cache import reset_process_caches
from tests.chat.pop_helpers import ALL_GUARANTEES, MODEL, OTHER, chat_pop
from workers.models import Worker

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]

PSYCOPG_PREPARED_MAX = 100
VALIDATED = "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"
UNVALIDATED = "SomeOtherWorker:1:https://example.invalid"


def _prepared_on_this_connection() -> set[tuple[str, str]]:
    """(text, parameter types) of every statement prepared on this connection: psycopg keys a
    prepared statement by both."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, parameter_types::text FROM pg_prepared_statements")
        return set(cursor.fetchall())


def _fresh(owners) -> None:
    """Before each pop: no empty-pop memory, and the workers of the pops before gone (an owner
    registers at most four workers, twenty-one trusted, as upstream's pop allows)."""
    Worker.objects.filter(owner__in=[o.user for o in owners]).delete()
    reset_process_caches()


def _pops(horde, owners) -> None:
    """One pop per shape: text and chat declarations, trusted or not, validated or not, each with
    0-3 priority users and a varying amount (every pop reaches the database: no empty-pop memory)."""
    chat_shapes = [
        {"features": ALL_GUARANTEES},
        {"features": [*ALL_GUARANTEES, "tools"], "limits": {"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 1.0}},
        {"features": [*ALL_GUARANTEES, "vision"], "transports": ["base64"]},
    ]
    for index, (owner, agent, priority, models) in enumerate(
        itertools.product(owners, (VALIDATED, UNVALIDATED), range(4), ([MODEL], [MODEL, OTHER]))
    ):
        # Small and large ids and limits: psycopg would type them int2, int4 or int8.
        aliases = [f"friend#{user_id}" for user_id in (900, 40_000, 3_000_000_000)[:priority]]
        _fresh(owners)
        assert horde.pop(
            owner.key, name=f"text-{index}", models=models, bridge_agent=agent, priority_usernames=aliases,
            amount=(1, 2, 20, 5)[priority], max_length=(512, 40_000)[index % 2],
        ).status_code == 200
        for shape_index, shape in enumerate(chat_shapes):
            _fresh(owners)
            response = chat_pop(
                horde, owner.key, name=f"chat-{index}-{shape_index}", bridge_agent=agent,
                priority_usernames=aliases, **shape,
            )
            assert response.status_code == 200, response.json()
            reset_process_caches()
            # A worker taking both text and chat jobs.
            response = chat_pop(
                horde, owner.key, name=f"both-{index}-{shape_index}", bridge_agent=agent,
                priority_usernames=aliases, prompt_jobs=True, models=models if MODEL in models else [MODEL], **shape,
            )
            assert response.status_code == 200, response.json()


def test_the_pop_prepares_one_text_per_declaration_shape_well_under_prepared_max(horde, make_user):
    owners = [make_user("trusted-owner", trusted=True), make_user("plain-owner")]
    before = _prepared_on_this_connection()
    _pops(horde, owners)
    first = _prepared_on_this_connection() - before
    pops = [text for text, _ in first if "horde_queue_entries" in text and "SKIP LOCKED" in text]
    # 2 owners x 2 agents x 4 priority counts x 2 model lists, and 3 chat shapes twice each: only
    # what the worker takes (text, chat, both) and the chat declaration's shape make a text.
    assert 1 <= len(pops) <= 7, len(pops)
    # Every pop here finds nothing, so each shape's empty pop counts run too: one text a shape.
    counts = [text for text, _ in first if text.startswith("SELECT COUNT(*) FILTER")]
    assert 1 <= len(counts) <= 7, len(counts)
    assert len(first) < PSYCOPG_PREPARED_MAX // 4
    _pops(horde, owners)
    assert _prepared_on_this_connection() - before == first, "a second round of the same pops prepared new texts"


def test_a_prepared_statement_runs_with_each_calls_values_and_is_prepared_once():
    before = _prepared_on_this_connection()
    for value in ("first", "second", "third"):
        assert run_prepared("SELECT %s::text, %s::int", [value, 7]) == (value, 7)
    assert len(_prepared_on_this_connection() - before) == 1


def test_a_statement_runs_in_postgresqls_own_placeholders_with_its_literal_percent_signs():
    assert native_placeholders("SELECT %s::text, '100%%', %s::int") == "SELECT $1::text, '100%', $2::int"
    assert run_prepared("SELECT %s::text || '%%', %s::int", ["50", 2]) == ("50%", 2)
    statements = {text for text, _ in _prepared_on_this_connection()}
    assert "SELECT $1::text || '%', $2::int" in statements


def test_a_placeholder_other_than_s_is_refused_before_it_reaches_the_database():
    with pytest.raises(ValueError, match="%b"):
        native_placeholders("SELECT %b")


def test_the_hordes_connections_run_without_jit():
    """A chat worker's eligibility query is estimated costly enough for PostgreSQL's JIT, whose
    compile took 0.4-0.7 s for a query that runs in under a millisecond (ADR 0047)."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW jit")
        assert cursor.fetchone()[0] == "off"


@pytest.mark.django_db(transaction=True)
def test_prepared_statements_read_timestamps_in_the_connections_zone_across_reconnects():
    """The raw cursor is kept per connection (chat/sql.py): a new connection gets its own, with the
    connection's time zone loader and bigint ints, and an error leaves it usable."""
    moment = datetime(2026, 12, 4, 9, 30, tzinfo=ZoneInfo("Europe/Paris"))
    for _ in range(2):
        (value,) = run_prepared("SELECT %s::timestamptz", [moment])
        assert value == moment and value.utcoffset() == timedelta(0)
        with pytest.raises(DataError):
            run_prepared("SELECT %s::int / 0", [3_000_000_000])
        assert run_prepared("SELECT pg_typeof(%s)::text", [1]) == ("bigint",)
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_connection_is_freed_with_its_raw_cursor_once_it_is_closed():
    """The raw cursor kept for a connection (chat/sql.py) goes with it. Before, it was kept in a
    WeakKeyDictionary whose value, the cursor, refers to its key, the connection: every connection
    that ever ran a prepared statement stayed in memory for the life of the process. The Celery
    worker closes its connection (and its pool) at each task, so its pool child kept one more
    connection, its adapters, types and cursor, at every sweep: about 1.4 MB a minute under
    load (docs/adr/0088)."""
    import psycopg

    def connections_alive() -> int:
        gc.collect()
        # By type: isinstance() asks a dead weak proxy among the objects for its class, and raises.
        return sum(1 for thing in gc.get_objects() if issubclass(type(thing), psycopg.Connection))

    connection.ensure_connection()
    before = connections_alive()
    for _ in range(50):
        assert run_prepared("SELECT %s::int", [1]) == (1,)
        connection.close()
        if connection.pool is not None:
            connection.close_pool()  # as Celery's Django fixup does at each task under prefork
    assert connections_alive() <= before + 1  # at most the connection in use
