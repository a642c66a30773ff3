"""Reads on the worker registry."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from django.core.cache import cache
from django.db.models import QuerySet
from django.utils import timezone

from contract.chat_declaration import ChatDeclaration, ChatLimits
from contract.text import (
    SLOW_TEXT_WORKER_TOKENS_PER_SECOND,
    UNMEASURED_TEXT_WORKER_TOKENS_PER_SECOND,
    WORKER_ONLINE_SECONDS,
    is_validated_bridge,
)
from workers.models import Worker

# Single worker details are cached this long (spec: "Worker details").
WORKER_DETAILS_CACHE_SECONDS = 30


def online_cutoff(now: datetime | None = None) -> datetime:
    return (now or timezone.now()) - timedelta(seconds=WORKER_ONLINE_SECONDS)


def workers_online() -> QuerySet[Worker]:
    return Worker.objects.filter(last_check_in__gte=online_cutoff()).select_related("owner")


def worker_speed(worker: Worker) -> float:
    """Tokens per second; a worker without samples runs at the unmeasured assumption."""
    return worker.speed if worker.speed is not None else UNMEASURED_TEXT_WORKER_TOKENS_PER_SECOND


def worker_is_slow(worker: Worker) -> bool:
    return worker_speed(worker) < SLOW_TEXT_WORKER_TOKENS_PER_SECOND


def worker_is_validated(worker: Worker) -> bool:
    return is_validated_bridge(worker.bridge_agent)


def worker_chat_declaration(worker: Worker) -> ChatDeclaration:
    """The chat declaration of the worker's latest pop, rebuilt from its columns."""
    if not worker.accepts_chat_jobs:
        return ChatDeclaration(chat_jobs=False, prompt_jobs=worker.accepts_prompt_jobs)
    limits = None
    if worker.chat_max_context_length is not None and worker.chat_max_length is not None:
        limits = ChatLimits(
            max_context_length=worker.chat_max_context_length,
            max_length=worker.chat_max_length,
            tools_max_temperature=worker.chat_tools_max_temperature,
        )
    return ChatDeclaration(
        chat_jobs=True,
        prompt_jobs=worker.accepts_prompt_jobs,
        chat_features=frozenset(worker.chat_features or ()),
        chat_limits=limits,
        model_id=worker.chat_model_id,
        image_transports=frozenset(worker.image_transports or ()),
    )


def chat_workers_online() -> QuerySet[Worker]:
    """Online workers, not in maintenance, that serve chat jobs (the chat model list's one query).
    A paused worker is left out as well: it receives no job, as the plain list's entries say."""
    return Worker.objects.filter(
        last_check_in__gte=online_cutoff(), maintenance=False, paused=False, accepts_chat_jobs=True
    ).exclude(chat_model_id=None)


def worker_details_cache_key(worker_id) -> str:
    return f"horde:worker-details:{worker_id}"


def worker_details_name_cache_key(name: str) -> str:
    # Names are free text: hashed, so no character of one reaches the cache key.
    return f"horde:worker-details:name:{hashlib.sha256(name.encode()).hexdigest()}"


def worker_get(worker_id) -> Worker | None:
    """One worker with its owner, read now (None when there is none)."""
    return Worker.objects.select_related("owner").filter(pk=worker_id).first()


def worker_get_cached_by_name(name: str) -> Worker | None:
    """One worker by its name for its details, cached as by id (WORKER_DETAILS_CACHE_SECONDS)."""
    if "\x00" in name:
        # No worker has one (a pop's and a rename's name refuse NUL), and PostgreSQL text cannot
        # hold it: the query would fail (a 500) rather than find none.
        return None
    key = worker_details_name_cache_key(name)
    worker = cache.get(key)
    if worker is None:
        worker = Worker.objects.select_related("owner").filter(name=name).first()
        if worker is not None:
            cache.set(key, worker, WORKER_DETAILS_CACHE_SECONDS)
    return worker


def worker_get_cached(worker_id) -> Worker | None:
    """One worker for its details, cached WORKER_DETAILS_CACHE_SECONDS (a changed declaration can
    take that long to appear, as the spec allows); owner changes clear it (worker_update)."""
    key = worker_details_cache_key(worker_id)
    worker = cache.get(key)
    if worker is None:
        worker = worker_get(worker_id)
        if worker is not None:
            cache.set(key, worker, WORKER_DETAILS_CACHE_SECONDS)
    return worker


def worker_details(worker: Worker) -> dict:
    """The worker's public details (spec: "Worker details"); reads only the worker and its owner."""
    details = {
        "type": "text",
        "name": worker.name,
        "id": str(worker.id),
        "online": worker.last_check_in >= online_cutoff(),
        "models": worker.served_models,
        "max_length": worker.max_length,
        "max_context_length": worker.max_context_length,
        "threads": worker.threads,
        "bridge_agent": worker.bridge_agent,
        "nsfw": worker.nsfw,
        "maintenance_mode": worker.maintenance,
        "paused": worker.paused,
        "trusted": worker.owner.trusted,
        "flagged": False,  # upstream's owner flag; this horde flags no users
        "owner": worker.owner.unique_alias,
        "performance": f"{worker_speed(worker):.1f} tokens per second",
        "kudos_rewards": float(worker.kudos_earned),
        # Upstream's breakdown by action: this horde rewards generations only (no uptime kudos).
        "kudos_details": {"generated": float(worker.kudos_earned)},
        "requests_fulfilled": worker.fulfilments,
        "uncompleted_jobs": worker.aborted_jobs,
        "uptime": int((worker.last_check_in - worker.created).total_seconds()),
        "nonconformant_replies": worker.nonconformant_replies,
        # The declaration of the latest pop; `chat` is absent for a worker that takes no chat jobs.
        "accepts_chat_jobs": worker.accepts_chat_jobs,
        "accepts_prompt_jobs": worker.accepts_prompt_jobs,
    }
    if worker.info is not None:  # the owner's note, when one was set (upstream skips a null)
        details["info"] = worker.info
    chat = worker_chat_declaration(worker).details()
    if chat is not None:
        details["chat"] = chat
    return details


def workers_online_details(*, name: str | None = None) -> list[dict]:
    """The details of every online worker, or of the one called `name` in any case, by name."""
    workers = workers_online()
    if name is not None:
        # Upstream compares Python's str.lower() of both names. SQL folds case otherwise: SQLite's
        # LIKE only ASCII letters (Ä), PostgreSQL's UPPER more of them (ı and i are both I).
        wanted = name.lower()
        workers = workers.filter(
            pk__in=[pk for pk, listed in workers.values_list("pk", "name") if listed.lower() == wanted]
        )
    return [worker_details(worker) for worker in workers.order_by("name")]
