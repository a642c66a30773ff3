"""Which waiting requests a worker may take: one set of rules, as SQL for the pop and as Python
for availability (is_possible, impossible_reason).

Text requests (is_chat=False) go to workers that take prompt jobs, under their text limits. Chat
requests go to workers that declared chat_jobs on their latest pop (spec: chat_requests.md,
"Eligibility" rules 1-4):
  1. the worker's chat_model_id is one of the request's models (RequestModel rows);
  2. every required feature and guarantee is declared (bitmask: required & ~declared == 0), and a
     request with images finds an image-receiving transport (url or base64);
  3. max_context_length, max_length and chat_tools_temperature fit the worker's chat limits;
  4. the usual restrictions (only/ignore, trusted, validated backends, slow workers), shared with text.
The lease capacity rule (chat_requests.md "Job lease", ADR 0041 of the spec): a chat request over
the worker's capacity, floor(speed * (lease - 30)) tokens with the 150-second base lease, goes to
it only while no capable worker (one the request does not exclude) is online (`chat_capacity_clause`, and `chat_capacity_refusal` in Python).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import lru_cache, reduce
from operator import or_
from typing import Any, NamedTuple
from uuid import UUID

from django.conf import settings
from django.db import connection
from django.db.models import (
    BooleanField,
    Count,
    DateTimeField,
    Exists,
    ExpressionWrapper,
    F,
    FloatField,
    OuterRef,
    Q,
    Value,
)
from django.db.models.expressions import Expression, RawSQL
from django.db.models.functions import Coalesce, Now
from django.db.models.lookups import Exact, IsNull
from django.utils import timezone

from chat.models import GenerationRequest, RequestModel, RequestWorker
from chat.sql import run_prepared
from contract.chat_declaration import IMAGE_RECEIVING_TRANSPORTS, ChatDeclaration
from contract.chat_policy import (
    ChatConformance,
    ChatFeature,
    ChatGuarantee,
    ChatRequirements,
    ChatServiceGap,
    chat_service_gap,
)
from contract.chat_progress import TEXT_JOB_PREPARATION_SECONDS
from contract.text import (
    SLOW_TEXT_WORKER_TOKENS_PER_SECOND,
    TEXT_JOB_LEASE_SECONDS,
    UNMEASURED_TEXT_WORKER_TOKENS_PER_SECOND,
    WORKER_ONLINE_SECONDS,
)
from workers.declarations import ALL_CHAT_DECLARATIONS_MASK
from workers.models import Worker
from workers.selectors import worker_chat_declaration, worker_is_slow, worker_is_validated

_FEATURES = {f.value: f for f in ChatFeature}
_GUARANTEES = {g.value: g for g in ChatGuarantee}


@dataclass(frozen=True)
class WorkerView:
    """The facts about a worker that eligibility reads, taken once per pop."""

    id: UUID | None  # None in a declaration shape (declaration_shape)
    models: tuple[str, ...]
    max_length: int
    max_context_length: int
    owner_trusted: bool
    validated: bool
    slow: bool
    accepts_prompt_jobs: bool = True
    chat: ChatDeclaration = ChatDeclaration()
    chat_feature_mask: int = 0
    # The chat output its lease admits (text_worker_lease_capacity); None for a worker without chat.
    chat_capacity: int | None = None
    # The base lease the capacity is measured in (HORDE_TEXT_JOB_LEASE_SECONDS): part of the shape,
    # so a statement compiled for one lease is not reused under another.
    lease_seconds: int = TEXT_JOB_LEASE_SECONDS

    @classmethod
    def of(cls, worker: Worker) -> WorkerView:
        chat = worker_chat_declaration(worker)
        takes_chat = chat.chat_jobs and chat.model_id is not None and chat.chat_limits is not None
        return cls(
            id=worker.id,
            models=tuple(worker.served_models),
            max_length=worker.max_length,
            max_context_length=worker.max_context_length,
            owner_trusted=worker.owner.trusted,
            validated=worker_is_validated(worker),
            slow=worker_is_slow(worker),
            accepts_prompt_jobs=worker.accepts_prompt_jobs,
            chat=chat,
            chat_feature_mask=worker.chat_feature_mask,
            chat_capacity=text_worker_lease_capacity(worker.speed) if takes_chat else None,
            lease_seconds=settings.HORDE_TEXT_JOB_LEASE_SECONDS,
        )

    @property
    def takes_chat(self) -> bool:
        return self.chat.chat_jobs and self.chat.model_id is not None and self.chat.chat_limits is not None


# --- SQL compiled once per declaration shape ----------------------------------------------------
#
# A statement built from a worker's view (the pop's selects, the empty pop's counts) depends on its
# declaration, and on two values of its own: its id (requests that name or exclude workers) and its
# chat capacity, which follows its speed and so moves with nearly every job a chat worker finishes.
# The text is compiled once per declaration shape through the ORM, and each call binds its own two.


def declaration_shape(view: WorkerView) -> WorkerView:
    """What a statement of the worker's depends on: its view without its id and chat capacity."""
    return replace(view, id=None, chat_capacity=None if view.chat_capacity is None else 0)


# The waiting condition as the queue index and the queue lists' triggers (chat/migrations/0009)
# state it, as literal SQL (a parameter would hide the index's predicate from a generic plan), and
# the expiry against the statement's own clock, so that nothing in the text is a per-call value.
WAITING_NOW = Q(
    RawSQL(
        '"horde_requests"."jobs_waiting" > 0 AND NOT "horde_requests"."faulted" AND NOT "horde_requests"."cancelled"',
        (),
        output_field=BooleanField(),
    ),
    expires_at__gt=Now(),
)


def where_sql(*conditions: Q | Expression) -> tuple[str, list[Any]]:
    """`conditions` on horde_requests, all of them, as SQL for a WHERE or a FILTER, and its params."""
    query = GenerationRequest.objects.filter(*conditions).query
    sql, params = query.get_compiler(connection=connection).compile(query.where)
    return sql, list(params)


@dataclass(frozen=True)
class ShapeSQL:
    """SQL texts compiled for a declaration shape, their params, and where a call's own values go."""

    texts: tuple[str, ...]
    params: tuple[Any, ...]
    slots: tuple[tuple[int, str], ...]  # (position in params, "worker_id" | "chat_capacity")

    def bind(self, view: WorkerView) -> list[Any]:
        """The params with the worker's own id and chat capacity in their places."""
        values = {"worker_id": view.id, "chat_capacity": view.chat_capacity}
        params = list(self.params)
        for position, name in self.slots:
            params[position] = values[name]
        return params


# Two workers' ids and capacities: a shape's SQL is compiled for both, and the params that differ
# are the worker's own (no stand-in value of one type can be mistaken for another parameter).
_STAND_INS = (
    (UUID("5e1ec7ed-0000-4000-8000-0000000f00d1"), 1),
    (UUID("5e1ec7ed-0000-4000-8000-0000000f00d2"), 2),
)


def sql_for_shape(
    shape: WorkerView, build: Callable[[WorkerView], tuple[tuple[str, ...], Sequence[Any]]]
) -> ShapeSQL:
    """`build(view)` (texts and params) compiled for two stand-in workers of `shape`: the same
    texts, and the positions of the params that differ, which are the worker's own."""
    compiled = [
        build(replace(shape, id=worker_id, chat_capacity=None if shape.chat_capacity is None else capacity))
        for worker_id, capacity in _STAND_INS
    ]
    (texts, params), (other_texts, other_params) = compiled
    if texts != other_texts or len(params) != len(other_params):  # pragma: no cover
        raise RuntimeError("a statement's text depends on the worker's id or capacity")
    names = {_STAND_INS[0][0]: "worker_id", _STAND_INS[0][1]: "chat_capacity"}
    slots = []
    for position, (value, other) in enumerate(zip(params, other_params, strict=True)):
        if value is not other and value != other:
            if value not in names:  # pragma: no cover - a Django change; the tests would show it
                raise RuntimeError(f"a statement's parameter {position} varies with the worker: {value!r}")
            slots.append((position, names[value]))
    return ShapeSQL(texts=tuple(texts), params=tuple(params), slots=tuple(slots))


class QueueList(NamedTuple):
    """One of the queue's lists (chat.models.QueueEntry): the waiting requests of one kind that
    name one model ("" for a text request naming none)."""

    is_chat: bool
    model: str


def worker_queue_lists(worker: WorkerView) -> tuple[QueueList, ...]:
    """The lists that hold every request the worker may take: each model it serves and "" when it
    takes prompt jobs (text first), its chat model when it takes chat jobs."""
    text = [QueueList(False, name) for name in dict.fromkeys((*worker.models, ""))] if worker.accepts_prompt_jobs else []
    chat = [QueueList(True, worker.chat.model_id or "")] if worker.takes_chat else []
    return (*text, *chat)


def request_queue_lists(*, is_chat: bool, models: Iterable[str]) -> tuple[QueueList, ...]:
    """The lists a waiting request is in: each model it names, or "" when it names none (as the
    database lists it: horde_request_listed_models, chat/migrations/0009_queue_entries.py)."""
    names = dict.fromkeys(models) or {"": None}
    return tuple(QueueList(is_chat, name) for name in names)


def waiting_requests():
    """Requests with a job left to hand out, in no particular order."""
    return GenerationRequest.objects.filter(
        jobs_waiting__gt=0, faulted=False, cancelled=False, expires_at__gt=timezone.now()
    )


# --- SQL ------------------------------------------------------------------------------------


def requests_for_models(names) -> Q:
    """Requests listing any of `names`. On PostgreSQL a jsonb `?|` on the row's own model list,
    tested per candidate as the pop walks the queue index; elsewhere an EXISTS on RequestModel
    rows. (PostgreSQL plans the EXISTS as a hashed subplan over every matching RequestModel row,
    which costs more than the whole walk.)"""
    names = list(names)
    if connection.vendor == "postgresql":
        return Q(requested_models__has_any_keys=names) if names else Q(pk__in=[])
    return Q(Exists(RequestModel.objects.filter(request=OuterRef("pk"), name__in=names)))


def _text_refusals(worker: WorkerView) -> dict[str, Q]:
    """Per skip reason, the text requests the worker may not take for it."""
    return {
        "models": Q(any_model=False) & ~requests_for_models(worker.models),
        "max_length": Q(max_length__gt=worker.max_length),
        "max_context_length": Q(max_context_length__gt=worker.max_context_length),
    }


def _chat_refusals(worker: WorkerView) -> dict[str, Q]:
    """Per skip reason, the chat requests a chat worker may not take for it (rules 1-3)."""
    chat = worker.chat
    limits = chat.chat_limits
    assert limits is not None and chat.model_id is not None  # takes_chat
    # Rule 2 as bits: any required bit the worker does not declare refuses the request.
    undeclared = ALL_CHAT_DECLARATIONS_MASK & ~worker.chat_feature_mask
    features = [~Q(Exact(F("chat_required_mask").bitand(undeclared), 0))] if undeclared else []
    if not chat.receives_images:
        # The column chat_has_images stands for the spec's JSONB containment test on messages.
        features.append(Q(chat_has_images=True))
    reasons = {
        "models": ~requests_for_models([chat.model_id]),
        "max_length": Q(max_length__gt=limits.max_length),
        "max_context_length": Q(max_context_length__gt=limits.max_context_length),
    }
    if features:
        reasons["chat_features"] = reduce(or_, features)
    if limits.tools_max_temperature is not None:
        # NULL (no tools forwarded) never compares greater, so it stays eligible.
        reasons["tools_max_temperature"] = Q(chat_tools_temperature__gt=limits.tools_max_temperature)
    return reasons


def _common_refusals(worker: WorkerView) -> dict[str, Q]:
    """Rule 4: the restrictions text and chat requests share."""
    # A shape's id is None (worker_id IS NULL to Django): its reasons are only named, never run.
    listed = Exists(RequestWorker.objects.filter(request=OuterRef("pk"), worker_id=worker.id))  # type: ignore[misc]
    # The worker's own facts are parameters, not the query's shape: the pop's statement text (one
    # prepared statement per text, chat/sql.py) stays the same for trusted and untrusted, validated
    # or not, slow or not. A reason that does not apply counts nothing, and skipped leaves it out.
    return {
        "worker_id": Q(has_worker_list=True)
        & ((Q(worker_blacklist=False) & ~Q(listed)) | (Q(worker_blacklist=True) & Q(listed))),
        "untrusted": Q(trusted_workers=True) & _fact(not worker.owner_trusted),
        "bridge_version": Q(validated_backends=True) & _fact(not worker.validated),
        "performance": Q(slow_workers=False) & _fact(worker.slow),
    }


def _fact(value: bool) -> Q:
    return Q(Value(bool(value), output_field=BooleanField()))


def lease_generation_seconds(lease_seconds: int | None = None) -> int:
    """The seconds of the base lease (HORDE_TEXT_JOB_LEASE_SECONDS, the spec's 150 by default) a
    worker generates in, after preparing the job."""
    if lease_seconds is None:
        lease_seconds = settings.HORDE_TEXT_JOB_LEASE_SECONDS
    return max(lease_seconds - TEXT_JOB_PREPARATION_SECONDS, 0)


def text_worker_lease_capacity(speed: float | None) -> int:
    """Tokens the worker finishes inside the base lease (get_text_worker_lease_capacity); a worker
    without a measured speed runs at UNMEASURED_TEXT_WORKER_TOKENS_PER_SECOND."""
    tokens_per_second = speed if speed is not None else UNMEASURED_TEXT_WORKER_TOKENS_PER_SECOND
    return math.floor(tokens_per_second * lease_generation_seconds())


def _capable_chat_workers(side, listed: Q) -> Q:
    """Online chat workers capable of a chat request (capable_chat_worker_clauses): not in
    maintenance or paused, serving one of its models, within their chat limits (the tools
    temperature too), declaring every feature it requires (and an image transport for images),
    passing its own restrictions (rule 4: a worker it excludes cannot serve it, so does not block a
    slower one), with the capacity for its max_length (the annotation lease_tokens). `side(name)` is
    the request's column: an OuterRef in the pop's query, a value in Python; `listed` holds for a
    worker in the request's worker list."""
    mask = side("chat_required_mask")
    images = Q(Exact(side("chat_has_images"), False))
    for transport in sorted(IMAGE_RECEIVING_TRANSPORTS):
        images |= Q(image_transports__icontains=f'"{transport}"')
    return (
        Q(accepts_chat_jobs=True, maintenance=False, paused=False)
        & Q(last_check_in__gte=ExpressionWrapper(Now() - Value(timedelta(seconds=WORKER_ONLINE_SECONDS)), output_field=DateTimeField()))
        & Q(chat_max_length__gte=side("max_length"), chat_max_context_length__gte=side("max_context_length"))
        & (
            Q(IsNull(side("chat_tools_temperature"), True))
            | Q(chat_tools_max_temperature__isnull=True)
            | Q(chat_tools_max_temperature__gte=side("chat_tools_temperature"))
        )
        & Q(Exact(mask.bitand(F("chat_feature_mask")), mask))
        & images
        & _passing_restrictions(side, listed)
        & Q(lease_tokens__gte=side("max_length"))
    )


def _passing_restrictions(side, listed: Q) -> Q:
    """Rule 4 over workers, as worker_passes_restrictions states it for one."""
    return (
        (
            Q(Exact(side("has_worker_list"), False))
            | (Q(Exact(side("worker_blacklist"), False)) & listed)
            | (Q(Exact(side("worker_blacklist"), True)) & ~listed)
        )
        & (Q(Exact(side("trusted_workers"), False)) | Q(owner__trusted=True))
        & (Q(Exact(side("validated_backends"), False)) | Q(validated_bridge=True))
        & (Q(Exact(side("slow_workers"), True)) | Q(lease_speed__gte=SLOW_TEXT_WORKER_TOKENS_PER_SECOND))
    )


def chat_capacity_clause(worker: WorkerView) -> Q:
    """The chat requests the worker's lease capacity admits: those within it, and those over it
    that no capable worker online but itself could take (ADR 0041: a model served only by slower
    workers stays served; the pop's copy of the worker can predate a measured speed that makes its
    own row capable)."""
    if worker.chat_capacity is None:
        return Q()
    capable = (
        _with_lease_tokens(worker.lease_seconds)
        .exclude(pk=worker.id)
        .filter(
            _capable_chat_workers(
                OuterRef,
                Q(Exists(RequestWorker.objects.filter(request=OuterRef(OuterRef("pk")), worker_id=OuterRef("pk")))),
            )
        )
        .filter(Exists(RequestModel.objects.filter(request=OuterRef(OuterRef("pk")), name=OuterRef("chat_model_id"))))
    )
    return Q(max_length__lte=worker.chat_capacity) | Q(~Exists(capable))


def _with_lease_tokens(lease_seconds: int):
    """Workers annotated with their speed (the unmeasured assumption without samples) and the
    tokens they finish inside a base lease of `lease_seconds`."""
    speed = Coalesce(F("speed"), Value(float(UNMEASURED_TEXT_WORKER_TOKENS_PER_SECOND)))
    return Worker.objects.annotate(lease_speed=speed).annotate(
        lease_tokens=ExpressionWrapper(
            F("lease_speed") * Value(float(lease_generation_seconds(lease_seconds))), output_field=FloatField()
        )
    )


def _kinds(worker: WorkerView) -> list[tuple[Q, dict[str, Q], Q]]:
    """(request kind, its refusals, its capacity rule) for each kind of request the worker takes.
    The capacity rule is a correlated subquery: eligibility_filter checks it after every refusal,
    so the database runs it only for the requests the cheap rules let through (an AND is checked
    left to right, stopping at the first false). `skipped` is counted without it: the requests it
    withholds from a pop are not counted."""
    kinds = []
    if worker.accepts_prompt_jobs:
        kinds.append((Q(is_chat=False), _text_refusals(worker), Q()))
    if worker.takes_chat:
        kinds.append((Q(is_chat=True), _chat_refusals(worker), chat_capacity_clause(worker)))
    return kinds


def _none_of(refusals) -> Q:
    q = Q()
    for refused in refusals:
        q &= ~refused
    return q


def eligibility_filter(worker: WorkerView) -> Q:
    """The requests `worker` may take: of a kind it takes, and no refusal applies."""
    kinds = [kind & _none_of(refusals.values()) & capacity for kind, refusals, capacity in _kinds(worker)]
    if not kinds:
        return Q(pk__in=[])
    return reduce(or_, kinds) & _none_of(_common_refusals(worker).values())


def _reason_filters(worker: WorkerView) -> dict[str, Q]:
    """Per skip reason (upstream `skipped` keys, plus chat_features and tools_max_temperature), the
    requests of the kinds the worker takes that the reason keeps from it."""
    reasons: dict[str, Q] = {}
    for kind, refusals, _ in _kinds(worker):
        for name, refused in refusals.items():
            reasons[name] = reasons[name] | (kind & refused) if name in reasons else kind & refused
    return {**reasons, **_common_refusals(worker)}


_TAKEABLE = "horde_takeable"


@dataclass(frozen=True)
class EmptyPopCounts:
    """After a pop that found nothing: how many waiting requests each reason kept from the worker
    (only reasons that did), and how many it could take all the same: the pop's SKIP LOCKED passed
    them over while another transaction held them (a pop, a submit settling), or they committed
    after its statement."""

    skipped: dict[str, int]
    takeable: int


def empty_pop_counts(worker: WorkerView) -> EmptyPopCounts:
    """The skipped counts and the takeable count, in one aggregate query: on PostgreSQL compiled
    once per declaration shape and prepared (the ORM's compile of this aggregate cost ten times its
    run: ADR 0051), elsewhere through the ORM."""
    if not _kinds(worker):
        return EmptyPopCounts(skipped={}, takeable=0)
    if connection.vendor == "postgresql":
        reasons, statement = _counts_statement(declaration_shape(worker))
        row = run_prepared(statement.texts[0], statement.bind(worker))
        assert row is not None  # an aggregate without GROUP BY answers one row
        counts = dict(zip((*reasons, _TAKEABLE), row, strict=True))
    else:
        counts = _counts_through_the_orm(worker)
    takeable = counts.pop(_TAKEABLE)
    return EmptyPopCounts(skipped={name: count for name, count in counts.items() if count}, takeable=takeable)


def _counts_through_the_orm(worker: WorkerView) -> dict[str, int]:
    # Aliases apart from the column names (a reason is named after the column it compares, and the
    # takeable count's filter reads those columns).
    aggregates = {
        f"skipped_{name}": Count("pk", filter=refused) for name, refused in _reason_filters(worker).items()
    }
    aggregates[_TAKEABLE] = Count("pk", filter=eligibility_filter(worker))
    kinds = [kind for kind, _, _ in _kinds(worker)]
    counts = waiting_requests().filter(reduce(or_, kinds)).aggregate(**aggregates)
    return {alias.removeprefix("skipped_"): count for alias, count in counts.items()}


def _counts_select(worker: WorkerView) -> tuple[tuple[str], list[Any]]:
    """The counts' SELECT: one FILTERed count per skip reason, then the takeable count, over the
    waiting requests of the kinds the worker takes."""
    columns, params = [], []
    for condition in (*_reason_filters(worker).values(), eligibility_filter(worker)):
        sql, condition_params = where_sql(condition)
        columns.append(f"COUNT(*) FILTER (WHERE {sql})")
        params += condition_params
    where, where_params = where_sql(WAITING_NOW, reduce(or_, (kind for kind, _, _ in _kinds(worker))))
    table = connection.ops.quote_name(GenerationRequest._meta.db_table)
    return (f"SELECT {', '.join(columns)} FROM {table} WHERE {where}",), [*params, *where_params]


@lru_cache(maxsize=4096)
def _counts_statement(shape: WorkerView) -> tuple[tuple[str, ...], ShapeSQL]:
    """The skip reasons in the counts' order, and the counts' SELECT for the declaration shape."""
    return tuple(_reason_filters(shape)), sql_for_shape(shape, _counts_select)


# --- Python twin ----------------------------------------------------------------------------


def request_chat_requirements(request: GenerationRequest) -> ChatRequirements:
    """A stored chat request's requirements, rebuilt from its columns (never its messages)."""
    stored = [str(v) for v in request.chat_required_features or ()]
    return ChatRequirements(
        features=frozenset(_FEATURES[v] for v in stored if v in _FEATURES),
        guarantees=frozenset(_GUARANTEES[v] for v in stored if v in _GUARANTEES),
        conformance=ChatConformance(request.chat_conformance or ChatConformance.STRICT),
        has_images=request.chat_has_images,
        tools_temperature=request.chat_tools_temperature,
    )


def worker_passes_restrictions(worker: Worker, request: GenerationRequest, listed_worker_ids: set) -> bool:
    """Rule 4, shared by text and chat requests."""
    if request.has_worker_list and (worker.id in listed_worker_ids) == request.worker_blacklist:
        return False
    if request.trusted_workers and not worker.owner.trusted:
        return False
    if request.validated_backends and not worker_is_validated(worker):
        return False
    return request.slow_workers or not worker_is_slow(worker)


def worker_serves_chat_model(worker: Worker, request: GenerationRequest) -> bool:
    """Rule 1: chat_jobs declared, and the chat model_id is one of the request's models."""
    declaration = worker_chat_declaration(worker)
    return declaration.chat_limits is not None and declaration.serves_model(request.requested_models)


def chat_declaration_gap(worker: Worker, request: GenerationRequest, *, with_sizes: bool = True) -> ChatServiceGap:
    """Rules 2 and 3 through the contract's chat_service_gap; empty means the worker can serve it.
    Without `with_sizes` only the tool temperature limit of rule 3 is checked."""
    return chat_service_gap(
        request_chat_requirements(request),
        worker_chat_declaration(worker),
        max_context_length=request.max_context_length if with_sizes else None,
        max_length=request.max_length if with_sizes else None,
    )


def capable_chat_workers_online(
    request: GenerationRequest, listed_worker_ids: set | frozenset = frozenset()
) -> frozenset[UUID]:
    """Up to two online workers able to finish the chat request within their lease (one query; the
    same answer for every worker a pass tests): two, so that each worker can tell whether one other
    than itself is online."""
    capable = (
        _with_lease_tokens(settings.HORDE_TEXT_JOB_LEASE_SECONDS)
        .filter(_capable_chat_workers(lambda name: Value(getattr(request, name)), Q(pk__in=listed_worker_ids)))
        .filter(chat_model_id__in=list(request.requested_models or ()))
    )
    return frozenset(capable.values_list("pk", flat=True)[:2])


def chat_capacity_refusal(
    worker: Worker,
    request: GenerationRequest,
    listed_worker_ids: set | frozenset = frozenset(),
    *,
    capable_online: Callable[[], frozenset[UUID]] | None = None,
) -> str | None:
    """"lease_speed" when the worker's lease capacity is below the chat request's max_length and a
    capable worker other than itself is online (the Python twin of chat_capacity_clause; one query,
    only then). Not itself: a process's copy of the worker can predate a measured speed that makes
    its row capable, and it must not lose the request to itself. `capable_online`: a pass's memo of
    capable_chat_workers_online, asked only when needed."""
    if not request.is_chat or text_worker_lease_capacity(worker.speed) >= request.max_length:
        return None
    capable = capable_online() if capable_online else capable_chat_workers_online(request, listed_worker_ids)
    return "lease_speed" if capable - {worker.pk} else None


def text_eligibility_shape(request: GenerationRequest) -> tuple | None:
    """Everything of a text request that worker_may_take reads, as a key: two requests of one
    shape are eligible for the same workers. None for a request with a worker list, which is its own."""
    if request.is_chat or request.has_worker_list:
        return None
    return (
        tuple(request.requested_models or ()),
        request.any_model,
        request.max_length,
        request.max_context_length,
        request.trusted_workers,
        request.validated_backends,
        request.slow_workers,
    )


def worker_may_take(
    worker: Worker,
    request: GenerationRequest,
    listed_worker_ids: set,
    *,
    capable_online: Callable[[], frozenset[UUID]] | None = None,
) -> bool:
    """Python twin of eligibility_filter, for availability over the online workers."""
    if not worker_passes_restrictions(worker, request, listed_worker_ids):
        return False
    if request.is_chat:
        return (
            worker_serves_chat_model(worker, request)
            and chat_declaration_gap(worker, request).empty
            and chat_capacity_refusal(worker, request, listed_worker_ids, capable_online=capable_online) is None
        )
    if not worker.accepts_prompt_jobs:
        return False
    if not request.any_model and not set(request.requested_models) & set(worker.served_models):
        return False
    return request.max_length <= worker.max_length and request.max_context_length <= worker.max_context_length
