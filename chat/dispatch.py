"""The pop: match a worker to the first eligible waiting request and hand out its jobs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from chat.matching import WorkerView, eligibility_filter, skipped_counts, waiting_requests
from chat.models import Generation, GenerationRequest
from chat.status_cache import status_changed
from contract.chat_limits import CHAT_SAMPLING_DEFAULTS
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


# The stream hint's key in chat_extras and in the job payload (spec: "Streaming progress").
CHAT_STREAM_PROGRESS_KEY = "stream_progress"
# The payload's sampling keys: always present, the client's value or CHAT_SAMPLING_DEFAULTS.
CHAT_PAYLOAD_SAMPLING_KEYS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "rep_pen", "top_k", "min_p")
# Payload keys present only when the client sent them.
CHAT_PAYLOAD_OPTIONAL_KEYS = ("stop_sequence", "seed", "reasoning_effort")
CHAT_EXTRAS_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")

# The fields a pop reads from the request it takes (the locked row).
POP_REQUEST_FIELDS = (
    "id", "is_chat", "prompt", "params", "softprompt", "max_length", "max_context_length",
    "requested_models", "jobs_waiting", "disable_batching", "n", "messages", "chat_extras",
)


def _generation_model(request: GenerationRequest, worker: Worker) -> str:
    if request.is_chat:
        # Rule 1 matched the chat model_id against the request's models.
        return worker.chat_model_id or ""
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
    eligible = waiting_requests().filter(eligibility_filter(view)).only(*POP_REQUEST_FIELDS)
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
        # A chat generation records the declaration it was assigned under, so a later change to the
        # worker's declaration does not redefine work already handed out.
        assigned = (
            {
                "assigned_model": worker.chat_model_id,
                "assigned_max_context_length": worker.chat_max_context_length,
                "assigned_max_length": worker.chat_max_length,
            }
            if request.is_chat
            else {}
        )
        generations = Generation.objects.bulk_create(
            [
                Generation(request=request, worker=worker, model=model, lease_expires_at=lease, **assigned)
                for _ in range(jobs)
            ]
        )
        GenerationRequest.objects.filter(pk=request.pk).update(
            jobs_waiting=F("jobs_waiting") - jobs,
            expires_at=now + timedelta(seconds=TEXT_REQUEST_TTL_SECONDS),
        )
        status_changed(request.pk)
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


def build_chat_job_payload(request: GenerationRequest) -> dict[str, Any]:
    """A chat job's payload (spec: "Chat job pop response"). No prompt: the worker renders the
    messages with its own template. Every sampling key is present, so a worker's defaults never apply."""
    params = request.params or {}
    payload: dict[str, Any] = {"messages": request.messages or []}
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


def build_job_payload(request: GenerationRequest) -> dict[str, Any]:
    return build_chat_job_payload(request) if request.is_chat else build_text_job_payload(request)
