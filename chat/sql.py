"""The hot path's SQL: the statements every pop, submit and status poll runs (and their
companions: the empty pop's counts, a finished request's generations, a streamed job's lease row),
prepared on each connection (PostgreSQL), and the one loader that turns their rows into models.

Django binds parameters on the client, so PostgreSQL parses and plans each pop and submit anew:
measured on the bench queue, planning took 2-3 times as long as running them (pop 0.85 ms planned,
0.4 ms run). These statements are fixed texts with their values as parameters, so each connection
prepares them once (psycopg's `execute(..., prepare=True)`), and keeps one generic plan for each
(hordesite/settings.py sets plan_cache_mode=force_generic_plan, which only prepared statements
read): their plans do not depend on the values (the pop walks the queue index; the others are
primary-key lookups). The pop's WHERE spells the queue index's condition as literal SQL so the
generic plan can use it. psycopg keeps at most `prepared_max` (100) statements per connection;
the pop's texts are one per declaration shape, a handful (tests/chat/test_prepared.py counts them).

They run on psycopg's raw-query cursor, in PostgreSQL's own `$1` placeholders, rewritten from
Django's `%s` once per text (`native_placeholders`): psycopg's `%s` cursor parses a text on every
execute unless the text is short (it caches only texts under 4 KB and 50 parameters), and the pop's
text is over 6 KB, so every pop paid that parse again (about 140 us of CPU).
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any, cast

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import Field, Model

from contract.process_cache import ProcessCache

if TYPE_CHECKING:
    from django.db.backends.postgresql.operations import DatabaseOperations as PostgresOperations

log = logging.getLogger("django.db.backends")


_PLACEHOLDER = re.compile(r"%(.)", re.DOTALL)


@lru_cache(maxsize=256)
def native_placeholders(sql: str) -> str:
    """The statement in PostgreSQL's placeholders: each `%s` in order becomes `$1`, `$2`, ... and
    `%%` a literal `%`, as psycopg's `%s` cursor reads the same text."""
    numbers = itertools.count(1)

    def rewrite(match: re.Match[str]) -> str:
        if match.group(1) == "%":
            return "%"
        if match.group(1) == "s":
            return f"${next(numbers)}"
        raise ValueError(f"only %s and %% placeholders are supported, not %{match.group(1)}")

    return _PLACEHOLDER.sub(rewrite, sql)


def compose_sql(sql: str, params: Sequence[Any]) -> str:
    """The statement with its values inlined as literals, by PostgreSQL's backend (the only one
    that composes; the default connection's type does not say which backend it is)."""
    return cast("PostgresOperations", connection.ops).compose_sql(sql, params)


def stored_field(model: type[Model], name: str) -> Field:
    """The model's field by name or attname: these statements read only fields, never the reverse
    relations get_field also answers."""
    field = model._meta.get_field(name)
    assert isinstance(field, Field), f"{model.__name__}.{name} is a reverse relation"
    return field


def column_name(field: Field) -> str:
    """A concrete field's column (only a field without one, such as a ForeignObject, has None)."""
    assert field.column is not None, f"{field} has no column"
    return field.column


def _execute(sql: str, params: Sequence[Any], many: bool, context: dict[str, Any]) -> Any:
    context["connection"].validate_no_broken_transaction()
    return context["cursor"].execute(native_placeholders(sql), params, prepare=True)


def _logged(executor, sql: str, params: Sequence[Any], context: dict[str, Any]) -> Any:
    """As Django's debug cursor logs a statement: its text with the values, into connection.queries."""
    start = time.monotonic()
    try:
        return executor(sql, params, False, context)
    finally:
        duration = time.monotonic() - start
        try:
            text = compose_sql(sql, params)
        except Exception:  # noqa: BLE001  (only the log's text)
            text = sql
        connection.queries_log.append({"sql": text, "time": f"{duration:.3f}"})
        log.debug("(%.3f) %s; args=%s; alias=%s", duration, text, params, connection.alias)


def _ints_as_bigint(raw_connection: Any) -> None:
    """Every Python int bound as bigint on this connection: psycopg types an int by its value
    (int2, int4, int8) and keys a prepared statement by its parameter types too, so a larger user
    id or limit would prepare the same text again. Django's client-side binding writes an int as
    the same literal either way."""
    from psycopg.adapt import PyFormat
    from psycopg.types.numeric import Int8BinaryDumper, Int8Dumper

    # By name: with psycopg's C extension the registered class is its own Int8Dumper.
    if raw_connection.adapters.get_dumper(int, PyFormat.TEXT).__name__ != Int8Dumper.__name__:
        raw_connection.adapters.register_dumper(int, Int8Dumper)
        raw_connection.adapters.register_dumper(int, Int8BinaryDumper)


# One raw cursor per psycopg connection, made on its first prepared statement and reused by the
# next ones (a cursor runs one statement after another; its connection serves one thread at a
# time). Making a cursor and its adapters, and checking the int dumpers and the time zone loader,
# cost each statement about 20 us of CPU (docs/benchmarks.md, "Text queue"). Kept as an attribute
# of the connection, so it goes with it: the cursor refers to its connection, and a map keyed
# weakly by the connection kept every connection it ever saw (docs/adr/0088).
_RAW_CURSOR_ATTRIBUTE = "_horde_raw_cursor"


def _raw_cursor(db: Any, raw: Any) -> Any:
    """The connection's raw cursor, reading timestamps in Django's connection time zone (as
    Django's create_cursor does): made again if that zone changed (override_settings)."""
    import psycopg
    from django.db.backends.postgresql.psycopg_any import register_tzloader

    made = getattr(raw, _RAW_CURSOR_ATTRIBUTE, None)
    if made is not None and made[0] == db.timezone:
        return made[1]
    _ints_as_bigint(raw)
    cursor = psycopg.RawCursor(raw)
    register_tzloader(db.timezone, cursor)
    # A cycle (connection, cursor): Python's collector frees both once nothing else holds them.
    setattr(raw, _RAW_CURSOR_ATTRIBUTE, (db.timezone, cursor))
    return cursor


def run_prepared(sql: str, params: Sequence[Any]) -> tuple | None:
    """Run one statement prepared on the default connection (PostgreSQL); its first row, if any."""
    return _run_prepared(sql, params, all_rows=False)


def run_prepared_all(sql: str, params: Sequence[Any]) -> list[tuple]:
    """Run one statement prepared on the default connection (PostgreSQL); all its rows."""
    return _run_prepared(sql, params, all_rows=True)


def _run_prepared(sql: str, params: Sequence[Any], *, all_rows: bool) -> Any:
    """The statement prepared on the default connection, its first row or all its rows.

    A psycopg server-binding raw cursor (Django's default binds on the client, which never prepares)
    on Django's connection, wrapped as Django wraps its own: thread check, database errors as
    django.db errors, the connection's execute_wrappers, and query logging when it is on.
    """
    # The connection itself, looked up once: each attribute read through django.db.connection
    # goes through its thread-local lookup again.
    db = connections[DEFAULT_DB_ALIAS]
    db.close_if_health_check_failed()
    db.ensure_connection()
    db.validate_thread_sharing()
    with db.wrap_database_errors:
        cursor = _raw_cursor(db, db.connection)
        context = {"connection": db, "cursor": cursor}
        executor = _execute
        for wrapper in reversed(db.execute_wrappers):
            executor = partial(wrapper, executor)
        if db.queries_logged:
            _logged(executor, sql, params, context)
        else:
            executor(sql, params, False, context)
        # rownumber, not description: it does not build a Column for each of the row's columns.
        if cursor.rownumber is None:
            return [] if all_rows else None
        return cursor.fetchall() if all_rows else cursor.fetchone()


# --- the row loader ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _ModelSlice:
    model: type[Model]
    start: int
    stop: int
    attnames: tuple[str, ...]
    # What from_db tests each of the model's fields against when some are deferred: a set, not
    # the list the ORM passes, as a status poll's row leaves most of a request's fields deferred.
    loaded: frozenset[str]


@dataclass(frozen=True)
class RowLoader:
    """How one statement's row becomes model instances: each model's slice of the row, the
    trailing plain values, and each column's conversions as the ORM's iterator applies them (the
    backend's and the field's, e.g. JSON text to Python, SQLite's UUID and Decimal text). Built
    once per statement text; the conversions read only the connection's settings."""

    alias: str
    slices: tuple[_ModelSlice, ...]
    converters: tuple[tuple[int, tuple, Any], ...]
    width: int

    @classmethod
    def of(cls, alias: str, columns: Sequence[Any], models: Sequence[tuple[type[Model], Sequence[str]]]) -> RowLoader:
        """`columns`: every selected expression in row order (a model's columns first, in the order
        of `models`, each model's attnames in its own order; then any plain values)."""
        db = connections[alias]
        converters = []
        for position, expression in enumerate(columns):
            if expression is None:  # a plain value, taken as it arrives
                continue
            convs = tuple(db.ops.get_db_converters(expression) + expression.get_db_converters(db))
            if convs:
                converters.append((position, convs, expression))
        slices, position = [], 0
        for model, attnames in models:
            slices.append(_ModelSlice(model, position, position + len(attnames), tuple(attnames), frozenset(attnames)))
            position += len(attnames)
        return cls(alias=alias, slices=tuple(slices), converters=tuple(converters), width=len(columns))

    @classmethod
    def of_fields(
        cls, alias: str, models: Sequence[tuple[type[Model], Sequence[str]]], extra: Sequence[Any] = ()
    ) -> RowLoader:
        """A row of the given models' columns (by attname) and then `extra` expressions."""
        columns = [stored_field(model, name).get_col(model._meta.db_table) for model, names in models for name in names]
        return cls.of(alias, [*columns, *extra], models)

    def load(self, row: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """The models of the row (in the order given) and the values after them, converted. Each
        instance is of its own model, which one list's type cannot say: Any, not Model."""
        db = connections[self.alias]
        values = list(row)
        for position, convs, expression in self.converters:
            value = values[position]
            for convert in convs:
                value = convert(value, expression, db)
            values[position] = value
        instances = [
            part.model.from_db(self.alias, part.loaded, values[part.start : part.stop]) for part in self.slices
        ]
        return instances, values[self.slices[-1].stop if self.slices else 0 :]


def fetch_one(sql: str, params: Sequence[Any]) -> tuple | None:
    """One row of a statement: prepared on PostgreSQL, through Django's cursor elsewhere."""
    if connection.vendor == "postgresql":
        return run_prepared(sql, params)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()


def fetch_all(sql: str, params: Sequence[Any]) -> list[tuple]:
    """Every row of a statement: prepared on PostgreSQL, through Django's cursor elsewhere."""
    if connection.vendor == "postgresql":
        return run_prepared_all(sql, params)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


# --- a job with its request, worker and owner (every submit that is not a priced text one) -------


@lru_cache(maxsize=1)
def _generation_joins() -> tuple[str, RowLoader]:
    from accounts.models import HordeUser
    from chat.models import Generation, GenerationRequest
    from workers.models import Worker

    joins = (
        (Generation, "g", ""),
        (GenerationRequest, "r", "JOIN horde_requests AS r ON r.id = g.request_id"),
        (Worker, "w", "JOIN horde_workers AS w ON w.id = g.worker_id"),
        (HordeUser, "u", "JOIN horde_users AS u ON u.id = w.owner_id"),
    )
    quote = connection.ops.quote_name
    columns = [f"{alias}.{quote(column_name(f))}" for model, alias, _ in joins for f in model._meta.concrete_fields]
    sql = (
        f"SELECT {', '.join(columns)} FROM horde_generations AS g "
        + " ".join(join for _, _, join in joins if join)
        + " WHERE g.id = %s"
    )
    loader = RowLoader.of_fields(
        connection.alias, [(model, [f.attname for f in model._meta.concrete_fields]) for model, _, _ in joins]
    )
    return sql, loader


def generation_with_relations(generation_id: Any) -> Any:
    """select_related("worker", "worker__owner", "request") as one fixed SQL text (prepared on
    PostgreSQL): the ORM would compile its hundred columns on every submit. None when not found."""
    from chat.models import Generation

    sql, loader = _generation_joins()
    row = fetch_one(sql, [Generation._meta.pk.get_db_prep_value(generation_id, connection)])
    if row is None:
        return None
    (generation, request, worker, owner), _ = loader.load(row)
    worker.owner = owner
    generation.worker = worker
    generation.request = request
    return generation


# --- a request's finished generations (the status body's list) -----------------------------------

# What the status body shows of a finished generation (chat.selectors.status._generation_entry).
FINISHED_GENERATION_FIELDS = (
    "id", "worker_id", "model", "state", "text", "seed", "gen_metadata", "created", "message",
    "finish_reason", "native_finish_reason", "prompt_tokens", "completion_tokens", "reasoning_tokens",
    "charge_basis",
)


@lru_cache(maxsize=1)
def _finished_generations_read() -> tuple[str, RowLoader]:
    from chat.models import Generation
    from workers.models import Worker

    quote = connection.ops.quote_name

    def columns(model: type[Model], alias: str, names: Sequence[str]) -> list[str]:
        return [f"{alias}.{quote(column_name(stored_field(model, name)))}" for name in names]

    worker_fields = ("id", "name")
    states = ", ".join(f"'{state}'" for state in Generation.FINISHED_STATES)
    sql = (
        f"SELECT {', '.join(columns(Generation, 'g', FINISHED_GENERATION_FIELDS) + columns(Worker, 'w', worker_fields))}"
        " FROM horde_generations AS g JOIN horde_workers AS w ON w.id = g.worker_id"
        f" WHERE g.request_id = %s AND g.state IN ({states}) ORDER BY g.finished_at, g.id"
    )
    loader = RowLoader.of_fields(connection.alias, [(Generation, FINISHED_GENERATION_FIELDS), (Worker, worker_fields)])
    return sql, loader


def finished_generations(request_id: Any) -> list[Any]:
    """The request's finished generations, each with its worker (id and name), in the order they
    finished: one fixed SQL text (prepared on PostgreSQL), as the ORM would compile its select on
    every poll that finds a result. Only FINISHED_GENERATION_FIELDS are loaded."""
    from chat.models import GenerationRequest

    sql, loader = _finished_generations_read()
    generations = []
    for row in fetch_all(sql, [GenerationRequest._meta.pk.get_db_prep_value(request_id, connection)]):
        (generation, worker), _ = loader.load(row)
        generation.worker = worker
        generations.append(generation)
    return generations


# --- the priced text submit (docs/adr/0026-price-at-pop.md) ---------------------------------------


def _ceiling_cents(value: str) -> str:
    """`value` (numeric) up to the cent, as chat.services.submit.hold_share rounds the hold's share."""
    return f"(ceil(({value}) * 100) / 100)"


def _settled_submit(won: tuple[str, list], *, owner_id: int, now: Any) -> tuple[str, list]:
    """A submit as one statement (SQL, params): the `won` CTE claims the job (an UPDATE returning
    id, request_id, worker_id, created, kudos, tokens, price_max_length, price_owner_trusted,
    over_capacity_at_assignment and model, no row when it did not win), then every write of the
    settlement gated on it: the hold's share, the request's kudos, both balances and their ledger
    rows, the shared key's draw, the worker's record. Its row: request_id, reward, created, max_length, owner trusted, over
    capacity, model; none when not won."""
    from accounts.services import kudos_settle_ctes
    from workers.services import worker_record_job_cte

    ctes: list[tuple[str, str, list]] = [
        ("won", *won),
        (
            # The request row locked before its hold is read (as chat.services.submit._settle), so
            # two jobs of one request release their shares one after the other.
            "held",
            # A chat request's one job releases the whole hold, which a multi-model request
            # takes at its dearest model while kudos_quote is its first's (spec: Pricing).
            "SELECT r.id, r.user_id, r.shared_key_id, CASE WHEN r.is_chat THEN r.kudos_held"
            f" ELSE LEAST(r.kudos_held, {_ceiling_cents('r.kudos_quote / r.n')}) END AS release"
            " FROM horde_requests AS r JOIN won ON r.id = won.request_id FOR NO KEY UPDATE OF r",
            [],
        ),
        (
            "settled",
            "SELECT won.id AS generation_id, won.request_id, won.worker_id, won.created, won.tokens,"
            # The charge is the reward: a withheld result's is 0 (docs/adr/0070).
            " won.kudos AS reward, won.kudos AS kudos, won.kudos AS charge,"
            " %s::bigint AS payee_id, held.user_id AS payer_id, held.release, held.shared_key_id,"
            " won.price_max_length, won.price_owner_trusted, won.over_capacity_at_assignment, won.model"
            " FROM won JOIN held ON held.id = won.request_id",
            [owner_id],
        ),
        (
            "request_settled",
            "UPDATE horde_requests AS r SET consumed_kudos = r.consumed_kudos + s.charge,"
            " kudos_held = r.kudos_held - s.release FROM settled AS s WHERE r.id = s.request_id",
            [],
        ),
        # The settlement's rows locked in the horde's one order (docs/adr/0068-one-lock-order.md):
        # after the job and its request, the worker, then both balances by id. Each lock waits on
        # the one before it, and the main query reads the last, so they are taken here and not in
        # whatever order PostgreSQL runs the data-modifying CTEs at the statement's end. NO KEY, as
        # the UPDATEs' own locks: the foreign key checks of other inserts (a request, a ledger row)
        # go on.
        (
            "worker_locked",
            "SELECT w.id FROM horde_workers AS w JOIN settled AS s ON w.id = s.worker_id FOR NO KEY UPDATE OF w",
            [],
        ),
        (
            "balances_locked",
            "SELECT u.id FROM horde_users AS u JOIN settled AS s ON u.id IN (s.payee_id, s.payer_id)"
            " WHERE (SELECT count(*) FROM worker_locked) >= 0 ORDER BY u.id FOR NO KEY UPDATE OF u",
            [],
        ),
        *kudos_settle_ctes(source="settled AS s", now=now),
        worker_record_job_cte(source="settled AS s", now=now),
    ]
    sql = (
        "WITH "
        + ", ".join(f"{name} AS ({body})" for name, body, _ in ctes)
        + " SELECT s.request_id, s.reward, s.created, s.price_max_length, s.price_owner_trusted,"
        " s.over_capacity_at_assignment, s.model FROM settled AS s"
        " WHERE (SELECT count(*) FROM balances_locked) >= 0"
    )
    return sql, [param for _, _, params in ctes for param in params]


def priced_text_submit(
    *,
    generation_id: Any,
    owner_id: int,
    state: str,
    text: str,
    seed: int,
    gen_metadata: str,
    tokens: int,
    charged: bool,
    processing: str,
    now: Any,
) -> tuple[str, list]:
    """The priced text submit as one statement (_settled_submit): the pending text job of the
    caller's worker (`owner_id`), its reward (none when not `charged`) from the rate its pop stored (`tokens` uncapped; capped
    here at the stored max_length), rounded as chat.pricing.kudos_amount."""
    won = (
        "UPDATE horde_generations AS g SET state = %s, text = %s, seed = %s, gen_metadata = %s::jsonb,"
        " finished_at = %s,"
        # A withheld result (not charged) is not paid either: nothing is made.
        " kudos = CASE WHEN %s THEN round((LEAST(%s, g.price_max_length) * g.price_rate + g.price_flat)::numeric, 2)"
        " ELSE 0 END"
        " FROM horde_workers AS w, horde_requests AS r"
        " WHERE g.id = %s AND g.state = %s AND g.price_rate IS NOT NULL"
        " AND w.id = g.worker_id AND w.owner_id = %s AND r.id = g.request_id AND NOT r.is_chat"
        # A request whose front named its process goes the read path, which checks that process
        # is alive (docs/adr/0028-dead-front-requests.md).
        " AND r.front_id IS NULL"
        " RETURNING g.id, g.request_id, g.worker_id, g.created, g.kudos,"
        " LEAST(%s, g.price_max_length) AS tokens,"
        " g.price_max_length, g.price_owner_trusted, g.over_capacity_at_assignment, g.model",
        [state, text, seed, gen_metadata, now, charged, tokens, generation_id, processing, owner_id, tokens],
    )
    return _settled_submit(won, owner_id=owner_id, now=now)


def chat_reply_submit(
    *,
    generation_id: Any,
    payee_id: int,
    columns: dict[str, Any],
    tokens: int,
    reward: Any,
    processing: str,
    now: Any,
) -> tuple[str, list]:
    """A verified chat reply stored and settled in one statement (_settled_submit): the job still
    pending claims `columns` (the reply's; `message` as JSON text), its reward (priced by the
    caller, 0 for a withheld result) and `finished_at`; its worker's owner `payee_id` earns it and the
    requester pays it."""
    names = [*columns, "finished_at", "kudos"]
    assignments = ", ".join(f"{name} = %s::jsonb" if name == "message" else f"{name} = %s" for name in names)
    won = (
        f"UPDATE horde_generations AS g SET {assignments} WHERE g.id = %s AND g.state = %s"
        " RETURNING g.id, g.request_id, g.worker_id, g.created, g.kudos, %s::bigint AS tokens,"
        " g.price_max_length, g.price_owner_trusted, g.over_capacity_at_assignment, g.model",
        [*columns.values(), now, reward, generation_id, processing, tokens],
    )
    return _settled_submit(won, owner_id=payee_id, now=now)


# --- a request with its generation counts by state (the status polls) ----------------------------

# The status polls never read the prompt, messages or tool settings: leave them in the row.
_REQUEST_DEFERRED = ("prompt", "submitted_prompt", "messages", "params", "chat_extras")
# Stands for the request id while the read is compiled; replaced by the real id at each read.
_ID_PLACEHOLDER = "5e1ec7ed-0000-4000-8000-00000000c0de"


@dataclass(frozen=True)
class _RequestRead:
    """The read compiled once per process, database, kind and columns: the ORM spends more building this
    SQL (the annotated counts) than the database spends answering it."""

    alias: str
    sql: str
    params: tuple
    id_param: int  # which param is the request id
    loader: RowLoader
    # The counts and the workers' serving version, in row order after the model's columns.
    annotations: tuple[str, ...]

    @classmethod
    def compile(cls, alias: str, *, is_chat: bool, only: tuple[str, ...] | None = None) -> _RequestRead:
        """`only`: the only columns read (the rest deferred); all but _REQUEST_DEFERRED without."""
        from uuid import UUID

        from django.db.models import Count, Q

        from chat.models import Generation, GenerationRequest
        from workers.serving_version import serving_version_subquery

        counts = {
            f"gen_{state}": Count("generations", filter=Q(generations__state=state)) for state in Generation.State.values
        }
        placeholder = UUID(_ID_PLACEHOLDER)
        queryset = GenerationRequest.objects.using(alias).filter(pk=placeholder, is_chat=is_chat)
        queryset = queryset.only(*only) if only is not None else queryset.defer(*_REQUEST_DEFERRED)
        queryset = queryset.annotate(**counts, serving_version=serving_version_subquery())
        compiler = queryset.query.get_compiler(using=alias)
        sql, params = compiler.as_sql()
        prepared_id = GenerationRequest._meta.pk.get_db_prep_value(placeholder, connections[alias])
        positions = [i for i, value in enumerate(params) if value == prepared_id]
        select, fields = compiler.select, compiler.klass_info["select_fields"]
        annotations = sorted(compiler.annotation_col_map.items(), key=lambda item: item[1])
        if (  # pragma: no cover - a Django change; the tests would show it
            len(positions) != 1
            or fields != list(range(len(fields)))
            or [position for _, position in annotations] != list(range(len(fields), len(select)))
        ):
            raise RuntimeError(f"request_get: unexpected layout of {sql!r}")
        attnames = [column[0].target.attname for column in select[: len(fields)]]
        return cls(
            alias=alias,
            sql=sql,
            params=tuple(params),
            id_param=positions[0],
            loader=RowLoader.of(alias, [column[0] for column in select], [(GenerationRequest, attnames)]),
            annotations=tuple(name for name, _ in annotations),
        )

    def read(self, request_id: Any) -> Any:
        from chat.models import GenerationRequest

        db = connections[self.alias]
        params = list(self.params)
        params[self.id_param] = GenerationRequest._meta.pk.get_db_prep_value(request_id, db)
        if self.alias == connection.alias:
            # Prepared on PostgreSQL: a poll is planned once per connection, not on every read.
            row = fetch_one(self.sql, params)
        else:
            with db.cursor() as cursor:
                cursor.execute(self.sql, params)
                row = cursor.fetchone()
        if row is None:
            return None
        (request,), counts = self.loader.load(row)
        for name, value in zip(self.annotations, counts, strict=True):
            setattr(request, name, value)
        return request


# A memo (no lifetime) per database alias, kind and columns, forgotten by reset_process_caches.
_request_reads: ProcessCache[tuple[str, bool, tuple[str, ...] | None], _RequestRead] = ProcessCache(
    "compiled request reads", ttl=math.inf, max_entries=16
)


def request_with_counts(request_id: Any, *, is_chat: bool, only: tuple[str, ...] | None = None) -> Any:
    """The request (of that kind) without its prompt, messages or tool settings, with its
    generations counted by state (gen_<state>) and the workers' serving version (serving_version,
    read here so a status poll needs no other round trip for it), in one query compiled once per
    process. `only`: only those columns (a caller that reads no others; any other would be one
    more query each), for the status polls' hot path."""
    from django.db import router

    from chat.models import GenerationRequest

    alias = router.db_for_read(GenerationRequest)
    key = (alias, is_chat, only)
    read = _request_reads.get(key)
    if read is None:
        read = _request_reads.get_or_build(key, lambda: _RequestRead.compile(alias, is_chat=is_chat, only=only))
    return read.read(request_id)
