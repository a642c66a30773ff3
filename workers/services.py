"""Writes on the worker registry: check-in on every pop, job outcomes, owner settings."""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import IntegrityError, transaction
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from accounts.models import HordeUser
from contract.chat_declaration import ChatDeclaration
from contract.errors import HordeError
from contract.process_cache import ProcessCache
from contract.text import MAX_WORKER_NAME_LENGTH, WORKER_SPEED_SAMPLES, is_validated_bridge
from workers.declarations import declaration_mask
from workers.models import WORKER_INFO_MAX_LENGTH, Worker
from workers.selectors import online_cutoff, worker_details_cache_key, worker_details_name_cache_key
from workers.serving_version import serving_changed

log = logging.getLogger(__name__)

# A worker pops about once a second; an unchanged declaration rewrites its row (the check-in
# time) at most this often. Online means checked in within WORKER_ONLINE_SECONDS (300).
WORKER_CHECK_IN_REFRESH_SECONDS = 30


@dataclass(frozen=True)
class TextWorkerDeclaration:
    """What a text worker states on each pop."""

    name: str
    models: list[str]
    max_length: int
    max_context_length: int
    threads: int
    bridge_agent: str
    nsfw: bool
    softprompts: list[str]
    priority_usernames: list[str]
    # The six chat fields, parsed by the contract; the default is a pop without chat_jobs.
    chat: ChatDeclaration = field(default_factory=ChatDeclaration)


def chat_declaration_columns(chat: ChatDeclaration) -> dict:
    """The worker columns of a chat declaration. Written at every pop, so a pop without chat_jobs
    withdraws the whole declaration (every chat column back to its default)."""
    limits = chat.chat_limits if chat.chat_jobs else None
    features = sorted(chat.chat_features) if chat.chat_jobs else []
    return {
        "accepts_chat_jobs": chat.chat_jobs,
        "accepts_prompt_jobs": chat.prompt_jobs,
        "chat_features": features,
        "chat_feature_mask": declaration_mask(features),
        "chat_max_context_length": limits.max_context_length if limits else None,
        "chat_max_length": limits.max_length if limits else None,
        "chat_tools_max_temperature": limits.tools_max_temperature if limits else None,
        "chat_model_id": chat.model_id if chat.chat_jobs else None,
        "image_transports": sorted(chat.image_transports) if chat.chat_jobs else [],
    }


# Upstream's bounds on the workers one owner registers (its pop refuses a new name past them):
# worker rows stay until their owner deletes them, so without a bound any key could add rows
# without end. Counted before the new one, as upstream counts: an untrusted owner's fifth name
# and a trusted owner's twenty-second are refused.
UNTRUSTED_OWNER_MAX_WORKERS = 3
TRUSTED_OWNER_MAX_WORKERS = 20


def ensure_may_register_a_worker(owner: HordeUser) -> None:
    """TooManyWorkers / TooManyWorkersTrusted when `owner` has more workers than upstream lets it
    register another beside (read on a new worker name only, not on a pop's check-in)."""
    count = Worker.objects.filter(owner=owner).count()
    if not owner.trusted and count > UNTRUSTED_OWNER_MAX_WORKERS:
        raise HordeError(
            "TooManyWorkers",
            f"To avoid abuse, untrusted users can only have up to {UNTRUSTED_OWNER_MAX_WORKERS} distinct workers.",
        )
    if count > TRUSTED_OWNER_MAX_WORKERS:
        raise HordeError(
            "TooManyWorkersTrusted",
            f"To avoid abuse, you cannot onboard more than {TRUSTED_OWNER_MAX_WORKERS} workers as a trusted user.",
        )


def worker_check_in(*, owner: HordeUser, declaration: TextWorkerDeclaration) -> Worker:
    """Register the worker on its first pop, refresh its declaration and check-in on each later one."""
    now = timezone.now()
    fields = {
        "served_models": declaration.models,
        "max_length": declaration.max_length,
        "max_context_length": declaration.max_context_length,
        "threads": declaration.threads,
        "bridge_agent": declaration.bridge_agent,
        "validated_bridge": is_validated_bridge(declaration.bridge_agent),
        "nsfw": declaration.nsfw,
        "softprompts": declaration.softprompts,
        "priority_usernames": declaration.priority_usernames,
        "last_check_in": now,
        **chat_declaration_columns(declaration.chat),
    }
    cached = worker_rows.get(declaration.name)
    worker = copy.copy(cached) if cached is not None else None
    if worker is None:
        worker = next(iter(Worker.objects.filter(name=declaration.name)), None)  # unique name: no ORDER BY
        if worker is None:
            try:
                with transaction.atomic():
                    # The owner's row, locked: first pops of new names count the owner's workers one
                    # at a time, so racing ones stay within the bound (a balance row, last in the
                    # horde's one lock order: no worker row is locked after it). A name registered
                    # meanwhile is not counted again: its create fails, and the pop checks in on it.
                    list(HordeUser.objects.select_for_update(no_key=True).filter(pk=owner.pk).values_list("pk"))
                    if not Worker.objects.filter(name=declaration.name).exists():
                        ensure_may_register_a_worker(owner)
                    worker = Worker.objects.create(
                        name=declaration.name, owner=owner, serving_changed_at=now, **fields
                    )
            except IntegrityError:
                # Two first pops raced on the name; the loser checks in on the row the winner made.
                worker = Worker.objects.get(name=declaration.name)
            else:
                worker_rows.set(worker.name, copy.copy(worker))
                serving_changed()  # a new worker: every process's availability sees it at once
                return worker
        worker_rows.set(worker.name, copy.copy(worker))
    if worker.owner_id != owner.pk:
        raise HordeError("WrongCredentials", "Wrong credentials to submit as this worker.")
    changed = any(getattr(worker, name) != value for name, value in fields.items() if name != "last_check_in")
    # A changed declaration, or a worker coming back online, changes what the horde can serve.
    serving = changed or worker.last_check_in < online_cutoff(now)
    if serving or now - worker.last_check_in >= timedelta(seconds=WORKER_CHECK_IN_REFRESH_SECONDS):
        if serving:
            fields["serving_changed_at"] = now
        Worker.objects.filter(pk=worker.pk).update(**fields)
        # The row as just written, without reading it back: the pop reads these fields next.
        for name, value in fields.items():
            setattr(worker, name, value)
        # Our own write: the row's other fields are as old as the read, which keeps its expiry.
        worker_rows.replace(worker.name, copy.copy(worker))
        if serving:
            serving_changed()
    return worker


# The worker rows this process read by name, reused for HORDE_WORKER_CACHE_SECONDS: a worker pops
# about once a second, and its row changes only through its own check-in (written here) or its
# owner's and moderators' switches, which take at most that long to reach the pop in another
# process (worker_update forgets the row in its own process at once). Each caller gets a copy.
worker_rows: ProcessCache[str, Worker] = ProcessCache(
    "worker rows by name", ttl=lambda: settings.HORDE_WORKER_CACHE_SECONDS, max_entries=100_000
)


def worker_record_job(*, worker: Worker, tokens: int, seconds: float, kudos: Decimal) -> None:
    """A completed job: speed sample (last WORKER_SPEED_SAMPLES), counters and kudos earned.

    Called inside the transaction that stores the result. The samples are read there, with the
    worker's row locked, so two submits of one worker in the same instant both keep theirs.
    """
    stored = Worker.objects.select_for_update(no_key=True).filter(pk=worker.pk).values_list("speed_samples", flat=True)
    stored_samples = next(iter(stored), None)
    samples = _speed_samples_after(stored_samples or [], tokens=tokens, seconds=seconds)
    speed = sum(samples) / len(samples) if samples else None
    Worker.objects.filter(pk=worker.pk).update(
        speed_samples=samples,
        speed=speed,
        fulfilments=F("fulfilments") + 1,
        tokens_generated=F("tokens_generated") + tokens,
        kudos_earned=F("kudos_earned") + kudos,
    )


def worker_record_job_cte(*, source: str, now) -> tuple[str, str, list]:
    """worker_record_job as a PostgreSQL CTE (name, SQL, params) for a caller's single statement.
    `source` is a FROM item of at most one row with the columns worker_id, tokens, kudos and
    created (the job's start, timed to `now`); nothing is written without its row. The samples are
    the updated row's own, so two submits of one worker in the same instant both keep theirs."""
    seconds = "EXTRACT(EPOCH FROM (%s::timestamptz - s.created))"
    sample = (
        f"CASE WHEN {seconds} > 0 AND s.tokens > 0"
        f" THEN jsonb_build_array(round(s.tokens / {seconds}, 3)) ELSE '[]'::jsonb END"
    )
    last = (
        f"SELECT v, i FROM jsonb_array_elements(COALESCE(w.speed_samples, '[]'::jsonb) || {sample})"
        f" WITH ORDINALITY AS t(v, i) ORDER BY i DESC LIMIT {WORKER_SPEED_SAMPLES}"
    )
    sql = (
        "UPDATE horde_workers AS w SET"
        f" speed_samples = (SELECT COALESCE(jsonb_agg(v ORDER BY i), '[]'::jsonb) FROM ({last}) AS l),"
        f" speed = (SELECT avg(v::float8 ORDER BY i) FROM ({last}) AS l),"
        " fulfilments = w.fulfilments + 1, tokens_generated = w.tokens_generated + s.tokens,"
        " kudos_earned = w.kudos_earned + s.kudos"
        f" FROM {source} WHERE w.id = s.worker_id"
    )
    return ("worker_recorded", sql, [now] * 4)  # `seconds`, twice in `sample`, twice in `last`


def _speed_samples_after(stored: list[float], *, tokens: int, seconds: float) -> list[float]:
    samples = list(stored)
    if seconds > 0 and tokens > 0:
        samples = (samples + [round(tokens / seconds, 3)])[-WORKER_SPEED_SAMPLES:]
    return samples


def worker_record_cancelled_settlement(*, worker_id: Any, kudos: Decimal) -> None:
    """A streamed job settled at its request's cancel on the content it posted: the worker is paid
    (its kudos earned grow) for partial work, which is neither a fulfilment nor a speed sample."""
    Worker.objects.filter(pk=worker_id).update(kudos_earned=F("kudos_earned") + kudos)


# Upstream's log_aborted_job: more aborted jobs than HORDE_WORKER_DROPPED_JOBS_PER_HOUR (its
# contract.text.ABORTED_JOBS_PER_HOUR_LIMIT outside raid mode, which this horde does not have)
# within an hour put a worker into maintenance.
ABORTED_JOBS_WINDOW = timedelta(hours=1)


def aborted_jobs_maintenance_message(limit: int) -> str:
    return (
        f"Maintenance mode activated because this worker dropped more than {limit} jobs"
        " within an hour. Please investigate whether its performance has been impacted, and consider"
        " lowering its max_length or its threads."
    )


def worker_record_aborted(*, worker_ids: list) -> None:
    """Count a dropped job, lifetime and in the hour's window (which starts afresh at the first
    drop after it ends, as upstream's); the drop that crosses the limit puts the worker into
    maintenance with its message, where it still serves its owner (docs/adr/0083)."""
    now = timezone.now()
    limit = settings.HORDE_WORKER_DROPPED_JOBS_PER_HOUR
    window_open = Q(aborted_window_started_at__gt=now - ABORTED_JOBS_WINDOW)
    for worker_id in worker_ids:
        Worker.objects.filter(pk=worker_id).update(
            aborted_jobs=F("aborted_jobs") + 1,
            aborted_in_window=Case(When(window_open, then=F("aborted_in_window") + 1), default=Value(1)),
            aborted_window_started_at=Case(When(window_open, then=F("aborted_window_started_at")), default=Value(now)),
        )
        if limit <= 0:  # the operator turned the automatic maintenance off
            continue
        switched = Worker.objects.filter(pk=worker_id, aborted_in_window__gt=limit).update(
            maintenance=True, maintenance_msg=aborted_jobs_maintenance_message(limit), aborted_in_window=0,
            serving_changed_at=now,
        )
        if switched:
            name = Worker.objects.filter(pk=worker_id).values_list("name", flat=True).get()
            log.warning("worker %s put into maintenance: more than %d aborted jobs in an hour", name, limit)
            transaction.on_commit(functools.partial(_worker_changed, worker_id, name, name, serving=True))


def worker_record_nonconformant(*, worker_id) -> None:
    """A dropped job whose reply the horde refused as nonconformant: not an aborted job."""
    Worker.objects.filter(pk=worker_id).update(nonconformant_replies=F("nonconformant_replies") + 1)


WORKER_DELETE_LOCKED_MESSAGE = (
    "Could not delete the worker at this point as it's referenced by a job it completed. "
    "Please try again once the requests it served have expired."
)


def worker_update(
    *,
    worker_id: Any,
    actor: HordeUser,
    maintenance: bool | None = None,
    maintenance_msg: str | None = None,
    paused: bool | None = None,
    info: str | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """The owner's (or a moderator's) changes to a worker, with upstream's rules per field, checked
    before anything is written; returns the fields sent with their values now, as PUT
    /api/v2/workers/{id} answers. The row is locked, so two changes at once both land."""
    if maintenance is None and info is None and paused is None and name is None:
        raise HordeError("NoWorkerModSelected", "No worker modification selected!")
    with transaction.atomic():
        # NO KEY, as its UPDATE's own lock: a pop's new jobs for this worker (a foreign key check)
        # are not held up behind an owner's note.
        worker = Worker.objects.select_for_update(no_key=True).filter(pk=worker_id).first()
        if worker is None:
            raise HordeError("WorkerNotFound", f"Worker with ID '{worker_id}' not found.")
        owner_or_moderator = actor.pk == worker.owner_id or actor.moderator
        if (maintenance is not None or info is not None) and not owner_or_moderator:
            raise HordeError("NotOwner", "Only the worker's owner or a moderator can change it.")
        if name is not None and not owner_or_moderator:
            raise HordeError("NotModerator", "Only the worker's owner or a moderator can rename it.")
        if paused is not None and not actor.moderator:
            raise HordeError("NotModerator", "Only a moderator can pause a worker.")
        if info is not None and len(info) > WORKER_INFO_MAX_LENGTH:
            raise HordeError(
                "TooLongWorkerName",  # upstream's rc for a long info too
                f"The specified worker info is too long. Please stay below {WORKER_INFO_MAX_LENGTH}",
            )
        if name is not None and not name:
            raise HordeError("BadRequest", "A worker's name cannot be empty.")
        if name is not None and len(name) > MAX_WORKER_NAME_LENGTH:
            raise HordeError(
                "TooLongWorkerName",
                f"The specified worker name is too long. Please stay below {MAX_WORKER_NAME_LENGTH}",
            )
        old_name, serving_before = worker.name, (worker.maintenance, worker.paused)
        updates: dict[str, Any] = {}
        if maintenance is not None:
            updates["maintenance"] = maintenance
            # A message stands only with the maintenance it explains.
            updates["maintenance_msg"] = (maintenance_msg or None) if maintenance else None
        for field_name, value in (("paused", paused), ("info", info), ("name", name)):
            if value is not None:
                updates[field_name] = value
        fields = [field_name for field_name, value in updates.items() if getattr(worker, field_name) != value]
        for field_name in fields:
            setattr(worker, field_name, updates[field_name])
        serving = (worker.maintenance, worker.paused) != serving_before
        if serving:
            worker.serving_changed_at = timezone.now()
            fields.append("serving_changed_at")
        if fields:
            try:
                with transaction.atomic():
                    worker.save(update_fields=fields)
            except IntegrityError:  # the unique name: another worker has it
                raise HordeError(
                    "WorkerNameAlreadyExists", f"The specified worker name '{name}' is already taken!"
                ) from None
    if fields:
        _worker_changed(worker.pk, old_name, worker.name, serving=serving)
    return {
        key: getattr(worker, key)
        for key, value in (("maintenance", maintenance), ("info", info), ("paused", paused), ("name", name))
        if value is not None
    }


def worker_delete(*, worker_id, actor: HordeUser) -> dict[str, str]:
    """Delete a worker that served no job still stored (its generations would go with it)."""
    with transaction.atomic():
        # Locked against a pop's insert of a generation (which takes a key-share lock on the row).
        worker = Worker.objects.select_for_update().filter(pk=worker_id).first()
        if worker is None:
            raise HordeError("WorkerNotFound", f"Worker with ID '{worker_id}' not found.")
        if actor.pk != worker.owner_id and not actor.moderator:
            raise HordeError("NotModerator", "Only the worker's owner or a moderator can delete it.")
        if worker.generations.exists():
            raise HordeError("Locked", WORKER_DELETE_LOCKED_MESSAGE)
        deleted = {"deleted_id": str(worker.pk), "deleted_name": worker.name}
        worker.delete()
    log.warning("%s deleted worker: %s", actor.unique_alias, deleted["deleted_name"])
    _worker_changed(worker_id, deleted["deleted_name"], deleted["deleted_name"], serving=True)
    return deleted


def _worker_changed(worker_id: Any, old_name: str, name: str, *, serving: bool) -> None:
    """What readers hold of the worker is dropped: the pop's row and its details, by id and by
    name(s); with `serving` (maintenance or paused switched, or the worker gone: what it serves
    changed) every process's snapshots too."""
    for each in {old_name, name}:
        worker_rows.forget(each)
    if serving:
        serving_changed()
    cache.delete_many(
        [worker_details_cache_key(worker_id), worker_details_name_cache_key(old_name), worker_details_name_cache_key(name)]
    )

