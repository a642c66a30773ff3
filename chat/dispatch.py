"""The pop: match a worker to the first eligible waiting request and hand out its jobs."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from chat.matching import WorkerView, eligibility_filter, skipped_counts, waiting_requests
from chat.models import Generation, GenerationRequest
from contract.errors import HordeError
from contract.text import TEXT_JOB_LEASE_SECONDS, TEXT_REQUEST_TTL_SECONDS
from workers.models import Worker


@dataclass(frozen=True)
class PoppedJob:
    request: GenerationRequest | None
    generations: list[Generation]
    model: str | None
    skipped: dict[str, int]


def _priority_user_ids(worker: Worker) -> list[int]:
    """The owner, then each `priority_usernames` entry given as upstream's "alias#id"."""
    ids = [worker.owner_id]
    for alias in worker.priority_usernames or []:
        _, _, tail = str(alias).rpartition("#")
        if tail.isdigit():
            ids.append(int(tail))
    return ids


def _generation_model(request: GenerationRequest, worker: Worker) -> str:
    served = worker.served_models
    for model in request.requested_models:
        if model in served:
            return model
    return served[0] if served else ""


def worker_pop(*, worker: Worker, amount: int) -> PoppedJob:
    """Hand the first eligible request's jobs (up to `amount`) to the worker."""
    if worker.maintenance:
        raise HordeError(
            "WorkerMaintenance",
            f"Worker {worker.name} is in maintenance mode; it receives no jobs until its owner lifts it.",
        )
    view = WorkerView.of(worker)
    eligible = waiting_requests().filter(eligibility_filter(view)).only(
        "id", "prompt", "params", "softprompt", "max_length", "max_context_length", "requested_models",
        "jobs_waiting", "disable_batching", "n",
    )
    if worker.paused:
        return PoppedJob(request=None, generations=[], model=None, skipped={})
    with transaction.atomic():
        locking = eligible.select_for_update(skip_locked=True, of=("self",))
        request = None
        priority_ids = _priority_user_ids(worker)
        if GenerationRequest.objects.filter(user_id__in=priority_ids, jobs_waiting__gt=0).exists():
            request = locking.filter(user_id__in=priority_ids).order_by("-queue_score", "created").first()
        if request is None:
            request = locking.order_by("-queue_score", "created").first()
        if request is None:
            return PoppedJob(request=None, generations=[], model=None, skipped=skipped_counts(view))
        jobs = 1 if request.disable_batching else min(amount, request.jobs_waiting)
        now = timezone.now()
        model = _generation_model(request, worker)
        lease = now + timedelta(seconds=TEXT_JOB_LEASE_SECONDS)
        generations = Generation.objects.bulk_create(
            [Generation(request=request, worker=worker, model=model, lease_expires_at=lease) for _ in range(jobs)]
        )
        GenerationRequest.objects.filter(pk=request.pk).update(
            jobs_waiting=F("jobs_waiting") - jobs,
            expires_at=now + timedelta(seconds=TEXT_REQUEST_TTL_SECONDS),
        )
    return PoppedJob(request=request, generations=generations, model=model, skipped={})


