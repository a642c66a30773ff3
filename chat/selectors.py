"""Reads on requests: status, queue position, availability and the horde's model statistics."""

from __future__ import annotations

import math
from uuid import UUID

from django.core.cache import cache
from django.db.models import Count, F, Q, Sum

from chat.matching import waiting_requests, worker_may_take
from chat.models import Generation, GenerationRequest, RequestWorker
from workers.selectors import worker_speed, workers_online

AVAILABILITY_CACHE_SECONDS = 60
ONLINE_WORKERS_CACHE_SECONDS = 5


def request_get(request_id: UUID, *, is_chat: bool = False) -> GenerationRequest | None:
    return GenerationRequest.objects.filter(pk=request_id, is_chat=is_chat).first()


def _online_workers() -> list:
    """The online workers, cached briefly: availability reads them on every status poll."""
    workers = cache.get("horde:online-text-workers")
    if workers is None:
        workers = [w for w in workers_online().filter(maintenance=False, paused=False)]
        cache.set("horde:online-text-workers", workers, ONLINE_WORKERS_CACHE_SECONDS)
    return workers


def request_is_possible(request: GenerationRequest) -> bool:
    """Whether an online worker could take the request (the availability pass, cached 60 s)."""
    key = f"horde:possible:{request.pk}"
    possible = cache.get(key)
    if possible is None:
        listed = set(RequestWorker.objects.filter(request=request).values_list("worker_id", flat=True))
        possible = any(worker_may_take(w, request, listed) for w in _online_workers())
        cache.set(key, possible, AVAILABILITY_CACHE_SECONDS)
    return possible


def _horde_tokens_per_second() -> float:
    return sum(worker_speed(w) * max(w.threads, 1) for w in _online_workers())


def request_queue_stats(request: GenerationRequest) -> tuple[int, int]:
    """(queue_position, wait_time seconds): requests ahead in queue order, and the time the online
    workers need for the tokens ahead plus this request's own."""
    if request.jobs_waiting == 0 or request.faulted or request.cancelled:
        return 0, 0
    ahead = waiting_requests().filter(
        Q(queue_score__gt=request.queue_score) | Q(queue_score=request.queue_score, created__lt=request.created)
    ).aggregate(count=Count("pk"), tokens=Sum(F("max_length") * F("jobs_waiting")))
    tokens = (ahead["tokens"] or 0) + request.max_length * request.jobs_waiting
    speed = _horde_tokens_per_second()
    wait = math.ceil(tokens / speed) if speed else 0
    return ahead["count"], wait


def request_status(request: GenerationRequest, *, include_generations: bool = True) -> dict:
    """The upstream text status body, exactly its keys."""
    counts = dict(
        Generation.objects.filter(request=request).values_list("state").annotate(c=Count("pk")).values_list("state", "c")
    )
    finished = sum(counts.get(s, 0) for s in Generation.FINISHED_STATES)
    processing = counts.get(Generation.State.PROCESSING, 0)
    restarted = counts.get(Generation.State.FAULTED, 0)
    waiting = request.jobs_waiting
    done = not request.faulted and (finished >= request.n or (request.cancelled and processing == 0))
    queue_position, wait_time = request_queue_stats(request)
    generations = []
    if include_generations:
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
        "is_possible": True if done else request_is_possible(request),
    }


def text_models_status() -> list[dict]:
    """GET /status/models?type=text: per model, online threads, queued tokens and jobs, eta, speed."""
    stats: dict[str, dict] = {}
    for worker in _online_workers():
        for model in worker.served_models:
            entry = stats.setdefault(model, {"count": 0, "speeds": []})
            entry["count"] += max(worker.threads, 1)
            entry["speeds"].append(worker_speed(worker))
    queued = {
        row["model_rows__name"]: row
        for row in waiting_requests()
        .filter(is_chat=False, model_rows__name__in=list(stats))
        .values("model_rows__name")
        .annotate(jobs=Sum("jobs_waiting"), tokens=Sum(F("max_length") * F("jobs_waiting")))
    }
    result = []
    for name, entry in sorted(stats.items()):
        q = queued.get(name, {})
        performance = sum(entry["speeds"]) / len(entry["speeds"])
        tokens = q.get("tokens") or 0
        result.append(
            {
                "name": name,
                "count": entry["count"],
                "performance": round(performance, 2),
                "queued": tokens,
                "jobs": q.get("jobs") or 0,
                "eta": math.ceil(tokens / (performance * entry["count"])) if tokens else 0,
                "type": "text",
            }
        )
    return result


def horde_performance() -> dict:
    workers = _online_workers()
    queue = waiting_requests().filter(is_chat=False).aggregate(
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
