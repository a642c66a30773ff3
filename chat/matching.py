"""Which waiting requests a worker may take: one set of rules, as SQL for the pop and as Python
for availability (is_possible). Later issues add the chat clauses here."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Count, Exists, OuterRef, Q
from django.utils import timezone

from chat.models import GenerationRequest, RequestModel, RequestWorker
from workers.models import Worker
from workers.selectors import worker_is_slow, worker_is_validated


@dataclass(frozen=True)
class WorkerView:
    """The facts about a worker that eligibility reads, taken once per pop."""

    id: object
    models: tuple[str, ...]
    max_length: int
    max_context_length: int
    owner_trusted: bool
    validated: bool
    slow: bool

    @classmethod
    def of(cls, worker: Worker) -> WorkerView:
        return cls(
            id=worker.id,
            models=tuple(worker.served_models),
            max_length=worker.max_length,
            max_context_length=worker.max_context_length,
            owner_trusted=worker.owner.trusted,
            validated=worker_is_validated(worker),
            slow=worker_is_slow(worker),
        )


def waiting_requests():
    """Requests with a job left to hand out, in no particular order."""
    return GenerationRequest.objects.filter(
        jobs_waiting__gt=0, faulted=False, cancelled=False, expires_at__gt=timezone.now()
    )


def _reason_filters(worker: WorkerView) -> dict[str, Q]:
    """Per skip reason, the requests the worker may NOT take for it (upstream `skipped` keys)."""
    serves_model = Exists(RequestModel.objects.filter(request=OuterRef("pk"), name__in=worker.models))
    listed = Exists(RequestWorker.objects.filter(request=OuterRef("pk"), worker_id=worker.id))
    reasons = {
        "models": Q(any_model=False) & ~Q(serves_model),
        "max_length": Q(max_length__gt=worker.max_length),
        "max_context_length": Q(max_context_length__gt=worker.max_context_length),
        "worker_id": Q(has_worker_list=True) & ((Q(worker_blacklist=False) & ~Q(listed)) | (Q(worker_blacklist=True) & Q(listed))),
    }
    if not worker.owner_trusted:
        reasons["untrusted"] = Q(trusted_workers=True)
    if not worker.validated:
        reasons["bridge_version"] = Q(validated_backends=True)
    if worker.slow:
        reasons["performance"] = Q(slow_workers=False)
    return reasons


def eligibility_filter(worker: WorkerView) -> Q:
    """The requests `worker` may take: none of the skip reasons applies."""
    q = Q(is_chat=False)
    for refused in _reason_filters(worker).values():
        q &= ~refused
    return q


def skipped_counts(worker: WorkerView) -> dict[str, int]:
    """How many waiting requests each reason kept from the worker (only reasons that did)."""
    aggregates = {name: Count("pk", filter=refused) for name, refused in _reason_filters(worker).items()}
    counts = waiting_requests().filter(is_chat=False).aggregate(**aggregates)
    return {name: count for name, count in counts.items() if count}


def worker_may_take(worker: Worker, request: GenerationRequest, listed_worker_ids: set) -> bool:
    """Python twin of eligibility_filter, for availability over the online workers."""
    if not request.any_model and not set(request.requested_models) & set(worker.served_models):
        return False
    if request.max_length > worker.max_length or request.max_context_length > worker.max_context_length:
        return False
    if request.has_worker_list and (worker.id in listed_worker_ids) == request.worker_blacklist:
        return False
    if request.trusted_workers and not worker.owner.trusted:
        return False
    if request.validated_backends and not worker_is_validated(worker):
        return False
    return request.slow_workers or not worker_is_slow(worker)
