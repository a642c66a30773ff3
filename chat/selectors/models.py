"""Reads on the horde's models and performance: GET /status/models (text, and the chat model
list) and GET /status/performance."""

from __future__ import annotations

import math
from datetime import timedelta
from uuid import UUID

from django.core.cache import cache
from django.db.models import Count, F, IntegerField, Sum, Value
from django.db.models.functions import Cast, Ceil, Coalesce, Length
from django.utils import timezone

from chat.model_reference import is_known_text_model
from chat.models import Generation, GenerationRequest
from chat.selectors.queue import waiting_requests, worker_passes_restrictions
from chat.selectors.snapshots import online_worker_facts, online_workers
from workers.selectors import chat_workers_online, worker_speed

# GET /status/models answers from a cache keyed by its query string (spec: "Chat model list").
MODELS_STATUS_CACHE_SECONDS = 2
PAST_MINUTE_TOKENS_CACHE_KEY = "horde:past-minute-tokens"
PAST_MINUTE_TOKENS_CACHE_SECONDS = 5


def text_models_status() -> list[dict]:
    """GET /status/models?type=text: per model, online threads, queued tokens and jobs, eta, speed.

    count leaves out the threads of workers that set prompt_jobs: false, since they do not serve
    text requests; a model only they serve is still listed, with count 0. queued and jobs are the
    model's whole queue, which chat requests share with text requests.
    """
    stats: dict[str, dict] = {}
    for worker in online_workers():
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


def text_workers_limits(
    models: list[str], *, restrictions: GenerationRequest | None = None, listed_worker_ids: set[UUID] | None = None
) -> list[tuple[UUID, int, int]]:
    """(id, max_length, max_context_length) of each online text worker serving any of `models` (any
    text model when empty), from the process's snapshot; with `restrictions`, an unsaved request
    holding a request's worker rules, only of the workers those rules let take it."""
    candidates = online_worker_facts().text_candidates(models, any_model=not models)
    if restrictions is not None:
        listed = listed_worker_ids or set()
        candidates = [w for w in candidates if worker_passes_restrictions(w, restrictions, listed)]
    return [(w.id, w.max_length, w.max_context_length) for w in candidates]


def chat_model_offers() -> dict[str, dict]:
    """Per model, the chat object of the chat model list, from one query over the online chat workers."""
    offers: dict[str, dict] = {}
    rows = chat_workers_online().values_list(
        "chat_model_id", "chat_max_context_length", "chat_max_length", "chat_features", "created"
    )
    for model_id, max_context_length, max_length, features, created in rows:
        assert model_id is not None  # chat_workers_online excludes workers without a chat model
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


def models_status(
    *,
    kind: str,
    chat: bool,
    model_state: str = "all",
    min_count: int | None = None,
    max_count: int | None = None,
) -> list[dict]:
    """The models route's body, through its two-second cache keyed by the (validated) query; then
    upstream's filters: a serving thread count within [min_count, max_count], and a model in the text
    model reference (known), out of it (custom) or either (all)."""
    key = f"horde:status-models:{kind}:{chat}"
    body = cache.get(key)
    if body is None:
        if kind != "text":
            body = []
        else:
            body = chat_models_status() if chat else text_models_status()
        cache.set(key, body, MODELS_STATUS_CACHE_SECONDS)
    if model_state == "all" and min_count is None and max_count is None:
        return body
    return [
        entry
        for entry in body
        if (min_count is None or entry["count"] >= min_count)
        and (max_count is None or entry["count"] <= max_count)
        and (model_state == "all" or is_known_text_model(entry["name"]) == (model_state == "known"))
    ]


def horde_performance() -> dict:
    workers = online_workers()
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
        "past_minute_tokens": past_minute_tokens(),
    }


def past_minute_tokens() -> int:
    """The tokens of the generations finished in the last minute, by the horde's own estimate (a
    quarter of the characters; a worker's reported count is not taken on trust), read at most once
    every PAST_MINUTE_TOKENS_CACHE_SECONDS: the route is public and the table has no index on it."""
    tokens = cache.get(PAST_MINUTE_TOKENS_CACHE_KEY)
    if tokens is None:
        since = timezone.now() - timedelta(seconds=60)
        estimate = Coalesce(Cast(Ceil(Length("text") / Value(4.0)), IntegerField()), Value(0))
        done = Generation.objects.filter(state__in=Generation.FINISHED_STATES, finished_at__gte=since)
        tokens = done.aggregate(tokens=Sum(estimate))["tokens"] or 0
        cache.set(PAST_MINUTE_TOKENS_CACHE_KEY, tokens, PAST_MINUTE_TOKENS_CACHE_SECONDS)
    return tokens
