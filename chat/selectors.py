"""Reads on requests: status, queue position, availability and the horde's model statistics."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.core.cache import cache
from django.db import connections, router
from django.db.models import Count, F, Q, Sum

from chat.availability import availability_cache_key, chat_request_availability
from chat.matching import waiting_requests
from chat.models import Generation, GenerationRequest
from chat.snapshots import online_worker_facts, online_workers, queue_place
from chat.status_cache import StatusRead, cached_status
from contract.process_cache import ProcessCache
from workers.selectors import chat_workers_online, worker_speed

# GET /status/models answers from a cache keyed by its query string (spec: "Chat model list").
MODELS_STATUS_CACHE_SECONDS = 2


# The status polls never read the prompt, messages or tool settings: leave them in the row.
_REQUEST_DEFERRED = ("prompt", "submitted_prompt", "messages", "params", "chat_extras")
# Stands for the request id while the read is compiled; replaced by the real id at each read.
_ID_PLACEHOLDER = UUID("5e1ec7ed-0000-4000-8000-00000000c0de")


@dataclass(frozen=True)
class _CompiledRequestRead:
    """request_get's statement, compiled once per process and database: the ORM spends more
    building this SQL (the annotated counts) than the database spends answering it."""

    alias: str
    sql: str
    params: tuple
    id_param: int  # which param is the request id
    init_list: tuple[str, ...]  # the model's columns, as ModelIterable passes them to from_db
    model_slice: tuple[int, int]
    annotations: tuple[tuple[str, int], ...]
    # (column, converters, expression): the backend's and fields' conversions of raw values.
    # They read only the connection's settings, the same for every connection to the alias.
    converters: tuple[tuple[int, tuple, Any], ...]

    @classmethod
    def compile(cls, alias: str, *, is_chat: bool) -> _CompiledRequestRead:
        counts = {
            f"gen_{state}": Count("generations", filter=Q(generations__state=state))
            for state in Generation.State.values
        }
        queryset = (
            GenerationRequest.objects.using(alias)
            .filter(pk=_ID_PLACEHOLDER, is_chat=is_chat)
            .defer(*_REQUEST_DEFERRED)
            .annotate(**counts)
        )
        compiler = queryset.query.get_compiler(using=alias)
        sql, params = compiler.as_sql()
        placeholder = GenerationRequest._meta.pk.get_db_prep_value(_ID_PLACEHOLDER, connections[alias])
        positions = [i for i, value in enumerate(params) if value == placeholder]
        if len(positions) != 1:  # pragma: no cover - a Django change; the tests would show it
            raise RuntimeError(f"request_get: the id is not one parameter of {sql!r}")
        select, klass_info = compiler.select, compiler.klass_info
        start, end = klass_info["select_fields"][0], klass_info["select_fields"][-1] + 1
        return cls(
            alias=alias,
            sql=sql,
            params=tuple(params),
            id_param=positions[0],
            init_list=tuple(column[0].target.attname for column in select[start:end]),
            model_slice=(start, end),
            annotations=tuple(compiler.annotation_col_map.items()),
            converters=tuple(
                (position, tuple(convs), expression)
                for position, (convs, expression) in compiler.get_converters([c[0] for c in select]).items()
            ),
        )

    def read(self, request_id: UUID | str) -> GenerationRequest | None:
        connection = connections[self.alias]
        params = list(self.params)
        params[self.id_param] = GenerationRequest._meta.pk.get_db_prep_value(request_id, connection)
        with connection.cursor() as cursor:
            cursor.execute(self.sql, params)
            row = cursor.fetchone()
        if row is None:
            return None
        row = list(row)
        for position, convs, expression in self.converters:
            value = row[position]
            for convert in convs:
                value = convert(value, expression, connection)
            row[position] = value
        start, end = self.model_slice
        request = GenerationRequest.from_db(self.alias, list(self.init_list), row[start:end])
        for name, position in self.annotations:
            setattr(request, name, row[position])
        return request


# A memo (no lifetime) per database alias and kind, forgotten by reset_process_caches.
_compiled_reads: ProcessCache[tuple[str, bool], _CompiledRequestRead] = ProcessCache(
    "compiled request reads", ttl=math.inf, max_entries=16
)


def request_get(request_id: UUID | str, *, is_chat: bool = False) -> GenerationRequest | None:
    """Every read filters on is_chat: a chat id is not found on the text routes, and vice versa.

    The row comes without the prompt, messages or tool settings (deferred), with the generation
    counts by state (see generation_state_counts), in one query compiled once per process."""
    alias = router.db_for_read(GenerationRequest)
    key = (alias, is_chat)
    compiled = _compiled_reads.get(key)
    if compiled is None:
        compiled = _compiled_reads.get_or_build(key, lambda: _CompiledRequestRead.compile(alias, is_chat=is_chat))
    return compiled.read(request_id)


def _online_workers() -> list:
    return online_workers()


def request_is_possible(request: GenerationRequest, *, read: StatusRead | None = None) -> bool:
    """Whether an online worker could take the request: the one availability pass (cached 60 s),
    shared by text and chat requests (`read`: see chat_request_availability)."""
    return chat_request_availability(request, read=read).is_possible


def _horde_tokens_per_second(read: StatusRead | None) -> float:
    if read is None:
        return online_worker_facts().tokens_per_second
    return online_worker_facts(read.serving_version).tokens_per_second


def request_queue_stats(request: GenerationRequest, *, read: StatusRead | None = None) -> tuple[int, int]:
    """(queue_position, wait_time seconds): requests ahead in queue order, and the time the online
    workers need for the tokens ahead plus this request's own (`read`: the status build's, whose
    serving version the workers snapshot is taken under)."""
    if request.jobs_waiting == 0 or request.faulted or request.cancelled:
        return 0, 0
    place = queue_place(request.pk)
    if place is not None:
        ahead = {"count": place.position, "tokens": place.tokens_ahead}
    else:  # newer than the snapshot: one live count
        ahead = waiting_requests().filter(
            Q(queue_score__gt=request.queue_score) | Q(queue_score=request.queue_score, created__lt=request.created)
        ).aggregate(count=Count("pk"), tokens=Sum(F("max_length") * F("jobs_waiting")))
    tokens = (ahead["tokens"] or 0) + request.max_length * request.jobs_waiting
    speed = _horde_tokens_per_second(read)
    wait = math.ceil(tokens / speed) if speed else 0
    return ahead["count"], wait


def generation_state_counts(request: GenerationRequest) -> dict[str, int]:
    """How many of the request's generations are in each state: read with the request by
    request_get, else one grouped query."""
    if hasattr(request, "gen_processing"):
        return {state: getattr(request, f"gen_{state}") for state in Generation.State.values}
    return dict(
        Generation.objects.filter(request=request).values_list("state").annotate(c=Count("pk")).values_list("state", "c")
    )


def text_status_body(request_id: UUID) -> dict | None:
    """GET /generate/text/status/<id>: the status body (cached briefly), None when not found.
    The availability cache is read with the body's, in one round trip."""

    def build(read: StatusRead) -> dict | None:
        request = request_get(request_id)
        return request_status(request, read=read) if request is not None else None

    return cached_status(request_id, is_chat=False, build=build, prefetch=(availability_cache_key(request_id),))


def request_status(request: GenerationRequest, *, include_generations: bool = True, read: StatusRead | None = None) -> dict:
    """The upstream text status body, exactly its keys (`read`: see chat_request_availability)."""
    counts = generation_state_counts(request)
    finished = sum(counts.get(s, 0) for s in Generation.FINISHED_STATES)
    processing = counts.get(Generation.State.PROCESSING, 0)
    restarted = counts.get(Generation.State.FAULTED, 0)
    waiting = request.jobs_waiting
    done = not request.faulted and (finished >= request.n or (request.cancelled and processing == 0))
    queue_position, wait_time = request_queue_stats(request, read=read)
    generations = []
    if include_generations and finished:  # most polls find nothing finished: no second query
        for gen in (
            Generation.objects.filter(request=request, state__in=Generation.FINISHED_STATES)
            .select_related("worker")
            .order_by("finished_at")
        ):
            generations.append(
                {
                    "text": gen.text,
                    "seed": gen.seed,
                    "gen_metadata": gen.gen_metadata or [],
                    "worker_id": str(gen.worker_id),
                    "worker_name": gen.worker.name,
                    "model": gen.model,
                    "state": gen.state,
                }
            )
    return {
        "generations": generations,
        "finished": finished,
        "processing": processing,
        "restarted": restarted,
        "waiting": waiting,
        "done": done,
        "faulted": request.faulted,
        "wait_time": wait_time,
        "queue_position": queue_position,
        "kudos": float(request.consumed_kudos),
        "is_possible": True if done else request_is_possible(request, read=read),
    }


def text_models_status() -> list[dict]:
    """GET /status/models?type=text: per model, online threads, queued tokens and jobs, eta, speed.

    count leaves out the threads of workers that set prompt_jobs: false, since they do not serve
    text requests; a model only they serve is still listed, with count 0. queued and jobs are the
    model's whole queue, which chat requests share with text requests.
    """
    stats: dict[str, dict] = {}
    for worker in _online_workers():
        for model in worker.served_models:
            entry = stats.setdefault(model, {"count": 0, "speeds": []})
            if worker.accepts_prompt_jobs:
                entry["count"] += max(worker.threads, 1)
            entry["speeds"].append(worker_speed(worker))
    queued = {
        row["model_rows__name"]: row
        for row in waiting_requests()
        .filter(model_rows__name__in=list(stats))
        .values("model_rows__name")
        .annotate(jobs=Sum("jobs_waiting"), tokens=Sum(F("max_length") * F("jobs_waiting")))
    }
    result = []
    for name, entry in sorted(stats.items()):
        q = queued.get(name, {})
        performance = sum(entry["speeds"]) / len(entry["speeds"])
        tokens = q.get("tokens") or 0
        throughput = performance * entry["count"]
        result.append(
            {
                "name": name,
                "count": entry["count"],
                "performance": round(performance, 2),
                "queued": tokens,
                "jobs": q.get("jobs") or 0,
                "eta": math.ceil(tokens / throughput) if tokens and throughput else 0,
                "type": "text",
            }
        )
    return result


def chat_model_offers() -> dict[str, dict]:
    """Per model, the chat object of the chat model list, from one query over the online chat workers."""
    offers: dict[str, dict] = {}
    rows = chat_workers_online().values_list(
        "chat_model_id", "chat_max_context_length", "chat_max_length", "chat_features", "created"
    )
    for model_id, max_context_length, max_length, features, created in rows:
        offer = offers.setdefault(
            model_id,
            {"workers": 0, "max_context_length": None, "max_length": None, "features": set(), "created": None},
        )
        offer["workers"] += 1
        offer["max_context_length"] = max(offer["max_context_length"] or 0, max_context_length or 0)
        offer["max_length"] = max(offer["max_length"] or 0, max_length or 0)
        offer["features"].update(features or ())
        if created is not None:
            stamp = int(created.timestamp())
            offer["created"] = stamp if offer["created"] is None else min(offer["created"], stamp)
    for offer in offers.values():
        offer["features"] = sorted(offer["features"])
    return offers


def chat_models_status() -> list[dict]:
    """GET /status/models?type=text&chat=true: the text models at least one online chat worker
    serves, each entry with a chat object."""
    offers = chat_model_offers()
    return [{**entry, "chat": offers[entry["name"]]} for entry in text_models_status() if entry["name"] in offers]


def models_status(*, kind: str, chat: bool) -> list[dict]:
    """The models route's body, through its two-second cache keyed by the (validated) query."""
    key = f"horde:status-models:{kind}:{chat}"
    body = cache.get(key)
    if body is None:
        if kind != "text":
            body = []
        else:
            body = chat_models_status() if chat else text_models_status()
        cache.set(key, body, MODELS_STATUS_CACHE_SECONDS)
    return body


def horde_performance() -> dict:
    workers = _online_workers()
    # Chat requests are text requests to the statistics (spec: chat requests share the text queue).
    queue = waiting_requests().aggregate(
        requests=Count("pk"), tokens=Sum(F("max_length") * F("jobs_waiting"))
    )
    return {
        "queued_requests": 0,
        "queued_text_requests": queue["requests"],
        "worker_count": 0,
        "text_worker_count": len(workers),
        "thread_count": 0,
        "text_thread_count": sum(max(w.threads, 1) for w in workers),
        "queued_megapixelsteps": 0,
        "past_minute_megapixelsteps": 0,
        "queued_forms": 0,
        "interrogator_count": 0,
        "interrogator_thread_count": 0,
        "queued_tokens": queue["tokens"] or 0,
        "past_minute_tokens": 0,
    }
