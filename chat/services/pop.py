"""The pop: match a worker to the first eligible waiting request and hand out its jobs."""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, IntegrityError, connection, connections, transaction
from django.db.models import Case, F, Field, Value, When
from django.utils import timezone

from accounts.models import HordeUser
from accounts.selectors import anonymous_user_get
from chat.gate_shadow import record_over_capacity_assignment
from chat.metrics import lease_capacity_limited, queue_wait_seconds, size_bucket
from chat.models import Generation, GenerationRequest
from chat.object_store import ChatObjectMissing, ChatObjectStoreUnavailable
from chat.pricing import model_kudos_factors
from chat.selectors.queue import (
    WAITING_NOW,
    ShapeSQL,
    WorkerView,
    declaration_shape,
    eligibility_filter,
    empty_pop_counts,
    sql_for_shape,
    waiting_requests,
    where_sql,
    worker_queue_lists,
)
from chat.services.chat_images import job_image_messages, job_messages_url, select_chat_transport
from chat.services.faults import requeue_faulted, requeue_jobs
from chat.services.pop_cache import empty_pop_forget, empty_pop_lookup, empty_pop_remember, view_list_tokens
from chat.services.progress import delete_stream_leases, write_stream_leases
from chat.sql import RowLoader, column_name, compose_sql, run_prepared
from contract.chat_declaration import parse_chat_declaration
from contract.chat_errors import ChatDeclarationInvalid
from contract.chat_limits import CHAT_SAMPLING_DEFAULTS
from contract.chat_progress import CHAT_STREAM_PROGRESS_KEY, streams_progress
from contract.errors import HordeError
from contract.text import PRIORITY_USERNAME, text_pop_refusal
from workers.models import Worker
from workers.services import TextWorkerDeclaration, worker_check_in, worker_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoppedJob:
    request: GenerationRequest | None
    generations: list[Generation]
    model: str | None
    skipped: dict[str, int]
    # Of an empty answer: the tokens of the queue lists whose growth may change it (a held pop
    # waits on them: chat/services/pop_wait.py), and the seconds it is remembered under their
    # stamps (0: not remembered), during which only their growth, which the queue's signal
    # announces, can change it.
    wake_on: tuple[str, ...] = ()
    remembered_for: float = 0.0
    # A job whose messages the worker fetches (the messages_url transport), sent in their place.
    messages_url: str | None = None


def _priority_user_ids(worker: Worker) -> list[int]:
    """The owner, then the id of each `priority_usernames` entry, upstream's "alias#id": the
    declaration the pop checked in, which text_pop_refusal checked by the same rule."""
    ids = [worker.owner_id]
    for alias in worker.priority_usernames or []:
        match = PRIORITY_USERNAME.fullmatch(str(alias))
        if match is not None and int(match[1]) not in ids:
            ids.append(int(match[1]))
    return ids


# The payload's sampling keys: always present, the client's value or CHAT_SAMPLING_DEFAULTS.
CHAT_PAYLOAD_SAMPLING_KEYS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "rep_pen", "top_k", "min_p")
# Payload keys present only when the client sent them.
CHAT_PAYLOAD_OPTIONAL_KEYS = ("stop_sequence", "seed", "reasoning_effort")
CHAT_EXTRAS_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")

# The fields a pop reads from the request it takes (the locked row), and what the job's submit
# reads of it (requester and quote).
POP_REQUEST_FIELDS = (
    "id", "is_chat", "prompt", "params", "softprompt", "max_length", "max_context_length",
    "requested_models", "jobs_waiting", "disable_batching", "n", "messages", "chat_extras",
    "user", "kudos_quote", "kudos_context", "created", "chat_has_images",
    "chat_messages_offloaded",
    # What a submit checks of the front that waits (chat.front_lease.front_gone).
    "front_id", "front_lease_expires_at",
)
# The declaration a chat generation is assigned under (Generation columns).
_ASSIGNED_COLUMNS = ("assigned_model", "assigned_max_context_length", "assigned_max_length")


def _generation_model(request: GenerationRequest, worker: Worker) -> str:
    if request.is_chat:
        # Rule 1 matched the chat model_id against the request's models.
        return worker.chat_model_id or ""
    served = worker.served_models
    for model in request.requested_models:
        if model in served:
            return model
    return served[0] if served else ""


def worker_check_in_and_pop(
    *,
    owner: HordeUser,
    name: str,
    models: list[str],
    max_length: int,
    max_context_length: int,
    threads: int,
    amount: int,
    bridge_agent: str,
    nsfw: bool,
    softprompts: list[str],
    priority_usernames: list[str],
    chat_jobs: Any = None,
    prompt_jobs: Any = None,
    chat_features: Any = None,
    chat_limits: Any = None,
    model_id: Any = None,
    image_transports: Any = None,
    repeated: bool = False,
    image_url_base: Callable[[], str] | None = None,
) -> PoppedJob:
    """A worker's pop: check it in under the declaration it states (its first pop registers it),
    then hand it a job when one is eligible. The chat fields are as sent (None: not sent); the
    contract reads them, and its refusal is the spec's. `repeated`: the serving layer runs a held
    pop again (ADR 0024), which is not another pop of the worker's for the pop counters.
    `image_url_base`: the horde's address as the worker reached it, for the image URLs of the
    local store (HORDE_PUBLIC_URL when set)."""
    models = list(dict.fromkeys(models))
    sent = {"chat_jobs": chat_jobs, "prompt_jobs": prompt_jobs, "chat_features": chat_features,
            "chat_limits": chat_limits, "model_id": model_id, "image_transports": image_transports}
    try:
        chat = parse_chat_declaration({k: v for k, v in sent.items() if v is not None}, models=models)
    except ChatDeclarationInvalid as refusal:
        raise HordeError(refusal.rc, refusal.message, status=refusal.status) from refusal
    declared_refusal = text_pop_refusal(
        models=models, priority_usernames=priority_usernames, owner_alias=owner.unique_alias
    )
    if declared_refusal is not None:
        raise HordeError(*declared_refusal)
    declaration = TextWorkerDeclaration(
        name=name.strip(),
        models=models,
        max_length=max_length,
        max_context_length=max_context_length,
        threads=threads,
        bridge_agent=bridge_agent,
        nsfw=nsfw,
        softprompts=softprompts,
        priority_usernames=priority_usernames,
        chat=chat,
    )
    worker = worker_check_in(owner=owner, declaration=declaration)
    worker.owner = owner
    try:
        return worker_pop(worker=worker, amount=amount, repeated=repeated, image_url_base=image_url_base)
    except IntegrityError:
        # The process's copy of the worker row outlived the row (an operator deleted it): the
        # pop wrote nothing; check in afresh, which registers the worker again, and pop once more.
        worker_rows.forget(declaration.name)
        worker = worker_check_in(owner=owner, declaration=declaration)
        worker.owner = owner
        return worker_pop(worker=worker, amount=amount, repeated=repeated, image_url_base=image_url_base)


def worker_pop(
    *, worker: Worker, amount: int, repeated: bool = False, image_url_base: Callable[[], str] | None = None
) -> PoppedJob:
    """Hand the first eligible request's jobs (up to `amount`) to the worker: the owner's and its
    priority users' requests first, then by queue score, oldest first. A `repeated` run of a held
    pop is not counted again."""
    if worker.maintenance:
        return _maintenance_pop(worker=worker, amount=amount, image_url_base=image_url_base)
    if worker.paused:
        return PoppedJob(request=None, generations=[], model=None, skipped={})
    view = WorkerView.of(worker)
    # chat_capacity is set only for a worker that declares chat limits (WorkerView.of).
    limits = view.chat.chat_limits
    if not repeated and view.chat_capacity is not None and limits is not None and view.chat_capacity < limits.max_length:
        # From values the pop holds: the worker's speed caps the chat output it is offered.
        lease_capacity_limited.add(1, {"horde.gentype": "text"})
    check = empty_pop_lookup(view)
    if check.skipped is not None:  # found nothing last time, and nothing joined its lists since
        return PoppedJob(
            request=None, generations=[], model=None, skipped=check.skipped,
            wake_on=view_list_tokens(view), remembered_for=check.remembered_for,
        )
    now = timezone.now()
    if connection.vendor == "postgresql":
        popped = _pop_in_one_statement(worker=worker, view=view, amount=amount, now=now)
    else:
        popped = _pop_in_transaction(worker=worker, view=view, amount=amount, now=now)
    if popped is None:
        counts = empty_pop_counts(view)
        remembered_for = 0.0
        if counts.takeable:
            # Passed over while locked, or committed after the statement: no queue addition will
            # announce it, so the next pop looks again instead of answering from memory.
            empty_pop_forget(view)
        else:
            remembered_for = empty_pop_remember(view, check, counts.skipped)
        return PoppedJob(
            request=None, generations=[], model=None, skipped=counts.skipped,
            wake_on=view_list_tokens(view), remembered_for=remembered_for,
        )
    empty_pop_forget(view)
    return _handed_out(popped, worker=worker, now=now, image_url_base=image_url_base)


def worker_maintenance_refusal(worker: Worker) -> HordeError:
    return HordeError(
        "WorkerMaintenance",
        worker.maintenance_msg
        or f"Worker {worker.name} is in maintenance mode: it takes only its owner's requests until the owner lifts it.",
    )


def _maintenance_pop(*, worker: Worker, amount: int, image_url_base: Callable[[], str] | None) -> PoppedJob:
    """A worker in maintenance takes only its owner's requests, so the owner can test it privately
    (upstream's rule); with none of them waiting it is refused with WorkerMaintenance, as upstream
    refuses it only when it found nothing. Its pops walk only the owner's requests, through their
    own statement, and are never answered from the empty pops' memory: the refusal is no answer
    to remember, and the walk of one user's lists is short (docs/adr/0083)."""
    if worker.paused:
        raise worker_maintenance_refusal(worker)
    view = WorkerView.of(worker)
    now = timezone.now()
    if connection.vendor == "postgresql":
        popped = _pop_in_one_statement(worker=worker, view=view, amount=amount, now=now, owner_only=True)
    else:
        popped = _pop_in_transaction(worker=worker, view=view, amount=amount, now=now, owner_only=True)
    if popped is None:
        raise worker_maintenance_refusal(worker)
    return _handed_out(popped, worker=worker, now=now, image_url_base=image_url_base)


def _handed_out(
    popped: PoppedJob, *, worker: Worker, now: datetime, image_url_base: Callable[[], str] | None
) -> PoppedJob:
    """What follows a pop that took jobs: the chat job's stored objects, the metrics, the leases."""
    request = popped.request
    assert request is not None  # a pop that took jobs carries their request
    if request.is_chat and (request.chat_has_images or request.chat_messages_offloaded):
        popped = _send_job_objects(popped, request, worker, image_url_base)
    _record_queue_wait(request, popped.generations, now)
    record_over_capacity_assignment(request=request, generations=popped.generations, worker=worker)
    if request.is_chat and streams_progress(request.chat_extras):
        write_stream_leases(
            request=request,
            generations=popped.generations,
            worker=worker,
            owner=worker.owner,
            model=popped.model,
            now=now,
        )
    return popped


def _send_job_objects(
    popped: PoppedJob, request: GenerationRequest, worker: Worker, image_url_base: Callable[[], str] | None
) -> PoppedJob:
    """Send the job's stored objects (of `request`, the popped one) as the worker declared (after
    the commit that assigned the job, so the store is not read under the queue's lock): the
    messages object's URL in place of the messages, or each image reference replaced; the
    transport is recorded on its generations. A store that fails gives the jobs back and refuses
    with 503."""
    transport = select_chat_transport(
        worker.image_transports, offloaded=request.chat_messages_offloaded, has_images=request.chat_has_images
    )
    if transport is None:  # offloaded, to a worker that takes it inline
        return popped
    base_url = settings.HORDE_PUBLIC_URL or (image_url_base() if image_url_base else "")
    messages_url = None
    try:
        if transport == "messages_url":
            messages_url = job_messages_url(request.id, base_url=base_url)
        else:
            request.messages = job_image_messages(
                request.messages or [], transport=transport, seconds=settings.HORDE_TEXT_JOB_LEASE_SECONDS,
                base_url=base_url,
            )
    except ChatObjectMissing:
        # Gone for good: the jobs fault, so the fault limit ends the request instead of every
        # later pop being handed it again until it expires.
        log.warning("stored objects of %s missing at pop; its jobs fault", request.id, exc_info=True)
        generation_ids = [g.id for g in popped.generations]
        with transaction.atomic():
            Generation.objects.filter(pk__in=generation_ids, state=Generation.State.PROCESSING).update(
                state=Generation.State.FAULTED, finished_at=timezone.now()
            )
            requeue_faulted(generation_ids, request.id)
        raise HordeError(
            "ChatImageStorageUnavailable", "The job's images are no longer stored; the job was faulted.", status=503
        ) from None
    except ChatObjectStoreUnavailable:
        log.warning("stored objects of %s unavailable at pop; its jobs go back", request.id, exc_info=True)
        popped_jobs_give_back(generation_ids=[g.id for g in popped.generations])
        raise HordeError(
            "ChatImageStorageUnavailable", "The job's images could not be read; please try again.", status=503
        ) from None
    Generation.objects.filter(pk__in=[g.id for g in popped.generations]).update(image_transport=transport)
    for generation in popped.generations:
        generation.image_transport = transport
    return replace(popped, messages_url=messages_url)


def _record_queue_wait(request: GenerationRequest, generations: list[Generation], now: datetime) -> None:
    """horde.text.queue_wait_seconds: each job's time from its request's creation to this pop."""
    try:
        anonymous = request.user_id == anonymous_user_get().pk
    except HordeUser.DoesNotExist:  # a database without the anonymous user's row
        anonymous = False
    attributes = {
        "horde.requester": "anonymous" if anonymous else "registered",
        "horde.chat": request.is_chat,
        "horde.requested_bucket": size_bucket(request.max_length),
    }
    wait = max((now - request.created).total_seconds(), 0.0)
    for _ in generations:
        queue_wait_seconds.record(wait, attributes)


def popped_jobs_give_back(*, generation_ids: list[uuid.UUID]) -> int:
    """Undo the pop of jobs whose answer never reached their worker, which left before it was sent
    (hordesite/wsgi_pool.py): each job still processing is deleted, as if never handed out, and
    goes back to the queue now rather than when its lease lapses. The worker's counters are left as
    they are: it never had the job. Returns how many jobs went back."""
    with transaction.atomic():
        taken = list(
            Generation.objects.select_for_update()
            .filter(pk__in=generation_ids, state=Generation.State.PROCESSING)
            .order_by("pk")  # jobs by id, as every write that locks several (docs/adr/0068)
            .values_list("id", "request_id")
        )
        if not taken:
            return 0
        Generation.objects.filter(pk__in=[generation_id for generation_id, _ in taken]).delete()
        for request_id, count in Counter(request_id for _, request_id in taken).items():
            requeue_jobs(request_id, count)
    delete_stream_leases([generation_id for generation_id, _ in taken])
    return len(taken)


def _assigned_declaration(worker: Worker) -> dict[str, Any]:
    """A chat generation records the declaration it was assigned under, so a later change to the
    worker's declaration does not redefine work already handed out."""
    return {
        "assigned_model": worker.chat_model_id,
        "assigned_max_context_length": worker.chat_max_context_length,
        "assigned_max_length": worker.chat_max_length,
    }


def _job_price(request: GenerationRequest, model: str, worker: Worker) -> dict[str, Any]:
    """The price columns of a job (as the one statement computes them)."""
    if request.kudos_context is None:
        return {}
    per_token, flat = model_kudos_factors(model, bool(worker.owner.trusted))
    return {
        "price_rate": request.kudos_context * per_token,
        "price_flat": request.kudos_context * flat,
        "price_max_length": request.max_length,
        "price_owner_trusted": bool(worker.owner.trusted),
    }


def _pop_in_transaction(
    *, worker: Worker, view: WorkerView, amount: int, now, owner_only: bool = False
) -> PoppedJob | None:
    """The pop as ORM statements in one transaction (SQLite, the embedded default); `owner_only`:
    among the owner's requests alone (a worker in maintenance)."""
    eligible = waiting_requests().filter(eligibility_filter(view)).only(*POP_REQUEST_FIELDS)
    with transaction.atomic():
        locking = eligible.select_for_update(skip_locked=True, of=("self",)).order_by("-queue_score", "created")
        if owner_only:
            request = locking.filter(user_id=worker.owner_id).first()
        else:
            request = locking.filter(user_id__in=_priority_user_ids(worker)).first() or locking.first()
        if request is None:
            return None
        jobs = 1 if request.disable_batching else min(amount, request.jobs_waiting)
        model = _generation_model(request, worker)
        lease = now + timedelta(seconds=settings.HORDE_TEXT_JOB_LEASE_SECONDS)
        assigned = _assigned_declaration(worker) if request.is_chat else {}
        price = _job_price(request, model, worker)
        generations = Generation.objects.bulk_create(
            [
                Generation(request=request, worker=worker, model=model, lease_expires_at=lease, **assigned, **price)
                for _ in range(jobs)
            ]
        )
        GenerationRequest.objects.filter(pk=request.pk).update(
            jobs_waiting=F("jobs_waiting") - jobs,
            expires_at=now + timedelta(seconds=settings.HORDE_TEXT_REQUEST_TTL_SECONDS),
        )
    return PoppedJob(request=request, generations=generations, model=model, skipped={})


# --- PostgreSQL: the pop as one statement ------------------------------------------------------
#
# Lock the first eligible request (the owner's and priority users' first), insert its generations
# and take its jobs in one round trip: a pop is what a busy horde does most, and each statement of
# the transactional form costs a round trip plus the ORM's compile. The statement is atomic on its
# own, and the rows are the ones _pop_in_transaction writes.

# POP_REQUEST_FIELDS in the model's field order, the order Model.from_db reads values in.
_POP_REQUEST_COLUMNS = tuple(
    f.attname for f in GenerationRequest._meta.concrete_fields if f.name in POP_REQUEST_FIELDS
)
# What a job's submit prices and settles with, fixed at pop (docs/adr/0026-price-at-pop.md).
_PRICE_COLUMNS = ("price_rate", "price_flat", "price_max_length", "price_owner_trusted")
# Generation columns whose value the statement computes from the request it locks.
_POP_COMPUTED_COLUMNS = ("id", "request_id", "model", *_ASSIGNED_COLUMNS, *_PRICE_COLUMNS)
# Stands for the priority users' ids while the select is compiled; the pop's own go in its place.
_PRIORITY_IDS = object()
# The id of the unsaved generation the per-call column values are read from (never stored).
_TEMPLATE_ID = uuid.UUID(int=0)


def _queue_lists(view: WorkerView) -> tuple[list[str], int]:
    """The worker's queue lists (worker_queue_lists, text lists first) as the lists' models and how
    many of the first are text lists: one array to bind (psycopg dumps an array in Python), not one
    per column. They follow from the declaration's shape, so they are among the params built once
    with its statement; parameters, not spelled out in the text, which stays one per declaration
    shape whatever the models (prepared_max, tests/chat/test_prepared.py)."""
    lists = worker_queue_lists(view)
    return [listed.model for listed in lists], sum(not listed.is_chat for listed in lists)


def _eligible_select(view: WorkerView, priority: bool) -> tuple[str, tuple]:
    """SELECT of the first request the worker may take in one queue list (the lateral join's
    `queue_list`: its kind and model), with `priority` only among one priority user's requests
    (`priority_user`), as SQL and params. Compiled once per declaration (_pop_statement); `now()`
    keeps it free of per-pop values. The pop walks the lists of its worker's models in queue order
    and stops at the first request it may take in each, rather than walk the whole queue past
    every other model's (or every one of its owner's) requests (docs/adr/0050-a-queue-list-per-model.md).

    The worker's rules go in as one CASE, which the planner cannot see into and counts as true for
    half the rows. Spelled out, each rule compared with a parameter gets a default selectivity,
    and their product told the generic plan that a handful of requests match: it then read and
    sorted every one rather than walk in order and stop at the first match
    (docs/adr/0042-pop-plan-walks-the-queue.md)."""
    eligible = Case(When(eligibility_filter(view), then=Value(True)), default=Value(False))
    where, params = where_sql(WAITING_NOW, eligible)
    table = connection.ops.quote_name(GenerationRequest._meta.db_table)
    columns = ", ".join(f"{table}.{connection.ops.quote_name(name)}" for name in _POP_REQUEST_COLUMNS)
    requester = "e.user_id = priority_user.id AND " if priority else ""
    return (
        f"SELECT {columns}, e.queue_score AS list_score, e.created AS list_created"
        f" FROM horde_queue_entries AS e JOIN {table} ON {table}.\"id\" = e.request_id"
        f" WHERE {requester}e.is_chat = queue_list.is_chat AND e.model = queue_list.model AND {where}"
        " ORDER BY e.queue_score DESC, e.created ASC LIMIT 1",
        tuple(params),
    )


# Generation columns a pop sets per call, beside the computed ones.
_POP_VARYING_COLUMNS = ("worker_id", "created", "lease_expires_at")


def _takes_fresh_default(f) -> bool:
    """A default computed per row (a callable other than an empty container's constructor)."""
    return f.has_default() and callable(f.default) and f.default not in (list, dict)


@lru_cache(maxsize=1)
def _generation_insert_columns() -> tuple[list[str], list[str], list[Field]]:
    """(columns, SQL values, per-call fields) of a new generation's columns outside
    _POP_COMPUTED_COLUMNS: the model's constant defaults rendered once as literals, a typed
    placeholder for the rest, so a column added to Generation is filled as the ORM fills it."""
    template = Generation()
    columns, values, per_call = [], [], []
    for f in Generation._meta.concrete_fields:
        if f.column in _POP_COMPUTED_COLUMNS:
            continue
        columns.append(connection.ops.quote_name(column_name(f)))
        typed = f"%s::{f.db_type(connection)}"
        if f.column in _POP_VARYING_COLUMNS or _takes_fresh_default(f):
            values.append(typed)
            per_call.append(f)
        else:
            literal = compose_sql(typed, [f.get_db_prep_save(getattr(template, f.attname), connection)])
            values.append(literal.replace("%", "%%"))
    return columns, values, per_call


def _generation_per_call_values(template: Generation) -> list[Any]:
    """The per-call columns' values, as the ORM's insert would set them on `template` (its
    `created` included)."""
    db = connections[DEFAULT_DB_ALIAS]  # once: each read through django.db.connection looks it up again
    return [f.get_db_prep_save(f.pre_save(template, add=True), db) for f in _generation_insert_columns()[2]]


def _job_prices(worker: Worker) -> tuple[list[str], list[float], list[float]]:
    """Per model the job may be given (its served models, its chat model), the per-token and flat
    factors of its price for this worker's owner (chat.pricing.model_kudos_factors)."""
    served = list(worker.served_models or [])
    names = list(dict.fromkeys([*served, worker.chat_model_id or "", served[0] if served else ""]))
    factors = [model_kudos_factors(name, bool(worker.owner.trusted)) for name in names]
    return names, [f[0] for f in factors], [f[1] for f in factors]


@lru_cache(maxsize=1)
def _popped_request_loader() -> RowLoader:
    return RowLoader.of_fields(connection.alias, [(GenerationRequest, _POP_REQUEST_COLUMNS)], extra=(None, None))


def _pop_selects(view: WorkerView) -> tuple[tuple[str, ...], tuple]:
    """The pop's two selects (the priority users' walk, the lists' walk) and their params in the
    statement's order: the lists, the priority users and their walk, the lists' walk."""
    models, text_count = _queue_lists(view)
    (priority_sql, priority_params), (rest_sql, rest_params) = _eligible_select(view, True), _eligible_select(view, False)
    return (priority_sql, rest_sql), (text_count, models, _PRIORITY_IDS, *priority_params, *rest_params)


def _owner_only_selects(view: WorkerView) -> tuple[tuple[str, ...], tuple]:
    """A worker in maintenance's select: the priority users' walk alone, which its pop runs for its
    owner alone."""
    models, text_count = _queue_lists(view)
    priority_sql, priority_params = _eligible_select(view, True)
    return (priority_sql,), (text_count, models, _PRIORITY_IDS, *priority_params)


@dataclass(frozen=True)
class _PopStatement:
    """The pop's SQL for one declaration shape, and its selects' params (chat.selectors.queue.ShapeSQL)."""

    sql: str
    selects: ShapeSQL

    def bind(self, *, priority_ids: list[int], view: WorkerView) -> list[Any]:
        """The selects' params with this pop's own values in their places."""
        params = self.selects.bind(view)
        params[params.index(_PRIORITY_IDS)] = priority_ids
        return params


@lru_cache(maxsize=4096)
def _pop_statement(shape: WorkerView, owner_only: bool = False) -> _PopStatement:
    """The pop's SQL for a declaration shape (declaration_shape): the text and the selects' params
    are the same for every pop under it, so they are built once. `owner_only`: a worker in
    maintenance's variant, which walks its priority users' lists (the owner's alone) and not the
    rest of the queue; every other pop keeps the statement that has no word of maintenance."""
    selects = sql_for_shape(shape, _owner_only_selects if owner_only else _pop_selects)
    priority_sql, rest_sql = selects.texts if not owner_only else (selects.texts[0], None)
    columns, placeholders, _ = _generation_insert_columns()
    fields = ", ".join(f"p.{connection.ops.quote_name(name)}" for name in _POP_REQUEST_COLUMNS)
    listed = ", ".join(f"c.{connection.ops.quote_name(name)}" for name in _POP_REQUEST_COLUMNS)
    table = connection.ops.quote_name(GenerationRequest._meta.db_table)
    rest, candidates = "", "SELECT * FROM priority"
    if rest_sql is not None:
        rest = f"""\
        rest AS (
            SELECT {listed} FROM queue_list
            CROSS JOIN LATERAL ({rest_sql} FOR UPDATE OF {table} SKIP LOCKED) AS c
            WHERE NOT EXISTS (SELECT 1 FROM priority)
            ORDER BY c.list_score DESC, c.list_created ASC LIMIT 1
        ),"""
        candidates = "SELECT * FROM priority UNION ALL SELECT * FROM rest LIMIT 1"
    sql = f"""
        WITH queue_list AS (
            SELECT l.position > %s AS is_chat, l.model FROM unnest(%s::text[]) WITH ORDINALITY AS l(model, position)
        ),
        priority AS (
            SELECT {listed} FROM unnest(%s::bigint[]) AS priority_user(id) CROSS JOIN queue_list
            CROSS JOIN LATERAL ({priority_sql} FOR UPDATE OF {table} SKIP LOCKED) AS c
            ORDER BY c.list_score DESC, c.list_created ASC LIMIT 1
        ),
{rest}
        picked AS (
            SELECT p.*,
                CASE WHEN p.disable_batching THEN 1 ELSE LEAST(%s, p.jobs_waiting) END AS take,
                CASE WHEN p.is_chat THEN %s::varchar ELSE COALESCE(
                    (SELECT m FROM jsonb_array_elements_text(p.requested_models) WITH ORDINALITY AS t(m, i)
                     WHERE m = ANY(%s::text[]) ORDER BY i LIMIT 1),
                    %s::varchar)
                END AS job_model
            FROM ({candidates}) AS p
        ),
        generations AS (
            INSERT INTO horde_generations (id, request_id, model, {", ".join(_ASSIGNED_COLUMNS)},
                {", ".join(_PRICE_COLUMNS)}, {", ".join(columns)})
            SELECT g.id, p.id, p.job_model,
                CASE WHEN p.is_chat THEN %s::varchar END,
                CASE WHEN p.is_chat THEN %s::integer END,
                CASE WHEN p.is_chat THEN %s::integer END,
                p.kudos_context * price.per_token, p.kudos_context * price.flat, p.max_length, %s::boolean,
                {", ".join(placeholders)}
            FROM picked AS p
            LEFT JOIN LATERAL (
                SELECT t.per_token, t.flat FROM unnest(%s::text[], %s::float8[], %s::float8[]) AS t(m, per_token, flat)
                WHERE t.m = p.job_model LIMIT 1
            ) AS price ON true,
            LATERAL (SELECT gen_random_uuid() AS id FROM generate_series(1, p.take)) AS g
            RETURNING id
        ),
        taken AS (
            UPDATE horde_requests AS r SET jobs_waiting = r.jobs_waiting - p.take, expires_at = %s
            FROM picked AS p WHERE r.id = p.id
        )
        SELECT {fields}, p.job_model, (SELECT array_agg(g.id) FROM generations AS g) FROM picked AS p
    """
    return _PopStatement(sql=sql, selects=selects)


def _pop_in_one_statement(
    *, worker: Worker, view: WorkerView, amount: int, now, owner_only: bool = False
) -> PoppedJob | None:
    if owner_only:
        statement = _pop_statement(declaration_shape(view), True)
        select_params = statement.bind(priority_ids=[worker.owner_id], view=view)
    else:
        statement = _pop_statement(declaration_shape(view))
        select_params = statement.bind(priority_ids=_priority_user_ids(worker), view=view)
    lease = now + timedelta(seconds=settings.HORDE_TEXT_JOB_LEASE_SECONDS)
    served = list(worker.served_models or [])
    assigned = _assigned_declaration(worker)
    price_models, price_per_token, price_flat = _job_prices(worker)
    # The ids come from PostgreSQL (gen_random_uuid): uuid.uuid4() reads os.urandom, a system call
    # that gives up the interpreter lock, which a loaded web process takes a while to get back.
    template = Generation(id=_TEMPLATE_ID, worker=worker, lease_expires_at=lease)
    params = [
        *select_params,
        amount,
        worker.chat_model_id or "",
        served,
        served[0] if served else "",
        assigned["assigned_model"],
        assigned["assigned_max_context_length"],
        assigned["assigned_max_length"],
        bool(worker.owner.trusted),
        *_generation_per_call_values(template),
        price_models,
        price_per_token,
        price_flat,
        now + timedelta(seconds=settings.HORDE_TEXT_REQUEST_TTL_SECONDS),
    ]
    row = run_prepared(statement.sql, params)
    if row is None:
        return None
    (request,), (model, generation_ids) = _popped_request_loader().load(row)
    generations = [
        Generation(id=gid, request=request, worker=worker, model=model, lease_expires_at=lease, created=template.created)
        for gid in generation_ids
    ]
    return PoppedJob(request=request, generations=generations, model=model, skipped={})


# --- Job payloads ---------------------------------------------------------------------------


def build_worker_chat_extras(chat_extras: Mapping[str, Any] | None) -> dict[str, Any]:
    """The worker's copy of the stored tool keys (dispatch narrowing); the stored values stay the
    client's, which reply verification reads.

    tool_choice none: tools are not forwarded, so tools, tool_choice and parallel_tool_calls go.
    A function choice: only that function is sent, under tool_choice required (the worker's
    grammar forces "some call", and one tool leaves only that call). auto and required as stored.
    """
    extras = {key: chat_extras[key] for key in CHAT_EXTRAS_KEYS if chat_extras and key in chat_extras}
    choice = extras.get("tool_choice")
    if choice == "none":
        for key in ("tools", "tool_choice", "parallel_tool_calls"):
            extras.pop(key, None)
    elif isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        extras["tools"] = [
            tool
            for tool in extras.get("tools") or []
            if isinstance(tool, Mapping)
            and isinstance(tool.get("function"), Mapping)
            and tool["function"].get("name") == name
        ]
        extras["tool_choice"] = "required"
    return extras


def build_chat_job_payload(request: GenerationRequest, messages_url: str | None = None) -> dict[str, Any]:
    """A chat job's payload (spec: "Chat job pop response"). No prompt: the worker renders the
    messages with its own template. Every sampling key is present, so a worker's defaults never apply.
    `messages_url`: the messages object the worker fetches, in place of the messages."""
    params = request.params or {}
    payload: dict[str, Any] = {"messages_url": messages_url} if messages_url else {"messages": request.messages or []}
    payload.update(build_worker_chat_extras(request.chat_extras))
    for key in CHAT_PAYLOAD_SAMPLING_KEYS:
        value = params.get(key)
        payload[key] = value if value is not None else CHAT_SAMPLING_DEFAULTS[key]
    for key in CHAT_PAYLOAD_OPTIONAL_KEYS:
        if params.get(key) is not None:
            payload[key] = params[key]
    payload["max_length"] = request.max_length
    payload["max_context_length"] = request.max_context_length
    payload["n"] = 1
    if request.chat_extras and request.chat_extras.get(CHAT_STREAM_PROGRESS_KEY):
        payload[CHAT_STREAM_PROGRESS_KEY] = True
    return payload


def build_text_job_payload(request: GenerationRequest) -> dict[str, Any]:
    """A text job's payload: the stored params, the prompt and the budgets."""
    return {
        **request.params,
        "prompt": request.prompt,
        "n": 1,
        "max_length": request.max_length,
        "max_context_length": request.max_context_length,
    }


def build_job_payload(request: GenerationRequest, messages_url: str | None = None) -> dict[str, Any]:
    return build_chat_job_payload(request, messages_url) if request.is_chat else build_text_job_payload(request)
