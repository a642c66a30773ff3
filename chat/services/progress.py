"""Streaming progress (spec: chat_requests.md, "Streaming progress", "Job lease", "Pricing").

A job whose request carries the stream hint gets a lease in Redis at pop,
horde:chat:lease:<generation id> on the chat signal database: who may post (the owner's key as a
digest), the caps, the job lease (started, job_ttl, lease_cap) and, as posts arrive, the last seq,
the bytes accepted and the last delta. The progress route authenticates from the lease alone and
one Lua script (APPEND_PROGRESS_SCRIPT) checks and appends each post to the request's stream
horde:chat:stream:<request id>, renewing the lease; PostgreSQL is written only when the job lease
was extended, and read only for a post that finds no lease.

Everything here but the route is best effort: writing, flagging and deleting a lease and its
ended marker log a Redis failure and never fail the pop, submit, fault or cancel.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from functools import lru_cache
from string import Template
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

import redis
from django.conf import settings
from django.db import connection
from django.db.models import F
from redis.exceptions import NoScriptError

from accounts.models import HordeUser, hash_api_key
from accounts.services import kudos_settle
from chat.metrics import lease_renewals
from chat.models import Generation, GenerationRequest
from chat.pricing import text_generation_kudos
from chat.signals import signal_redis
from chat.sql import run_prepared
from contract.chat_progress import (
    CHAT_PROGRESS_LEASE_GRACE_SECONDS,
    CHAT_PROGRESS_RENEWAL_SECONDS,
    CHAT_PROGRESS_STREAM_MAX_ENTRIES,
    CHAT_PROGRESS_STREAM_PREFIX,
    CHAT_PROGRESS_STREAM_TTL_SECONDS,
    MAX_CHAT_PROGRESS_ENTRIES,
    PROGRESS_MESSAGES,
    PROGRESS_RC_STATUS,
    ProgressPost,
    chat_progress_max_bytes,
    chat_progress_stream_key,
    chat_stream_lease_key,
    streams_progress,
    text_job_lease_cap,
)
from contract.chat_verify import chat_output_tokens
from contract.errors import HordeError
from workers.services import worker_record_cancelled_settlement

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

log = logging.getLogger(__name__)

# The generation's row holds a streamed job's lease in steps of this many seconds (and at the cap):
# a post renews the lease in Redis every second, the row about once a minute, and the stale sweep
# reads the lease before it aborts a streamed job (ADR 0040). While a worker posts, the row's
# deadline stays at least CHAT_PROGRESS_RENEWAL_SECONDS - this step ahead, so the sweep never even
# looks at a job that is streaming.
JOB_LEASE_WRITE_STEP_SECONDS = 60

# KEYS: lease. ARGV: key digest, seq, content, reasoning ('' when absent), has reasoning (1/0), now
# (Unix seconds), generation id. The constants (renewal seconds, lease grace, max entries, stream
# TTL, stream max entries, stream key prefix) are written into the script once, not sent with every
# post. The stream's key is built from the lease's `request`, so a post costs one round trip (a
# standalone Redis; ADR 0019).
# Returns {'none'} | {'credentials'} | {'sequence', expected} | {'cap'} | {'retry', cancelled}
# | {'ok', cancelled, renewal ('granted', 'at_cap' or ''), job_ttl, started, trusted, persist}:
# persist is 1 when the renewal crossed a JOB_LEASE_WRITE_STEP_SECONDS boundary or reached the cap
# (the generation's row is written then; ADR 0040).
APPEND_PROGRESS_SCRIPT = Template("""
local f = redis.call('HMGET', KEYS[1], 'key', 'seq', 'bytes', 'max_bytes', 'cancelled', 'started',
  'job_ttl', 'lease_cap', 'worker', 'model', 'fake', 'last_content', 'last_reasoning', 'trusted', 'request')
if not f[1] then return {'none'} end
if f[1] ~= ARGV[1] then return {'credentials'} end
local cancelled = 0
if f[5] == '1' then cancelled = 1 end
local last = tonumber(f[2]) or 0
local seq = tonumber(ARGV[2])
if last > 0 and seq == last then
  if (f[12] or '') == ARGV[3] and (f[13] or '') == ARGV[4] then return {'retry', cancelled} end
  return {'sequence', last + 1}
end
if seq ~= last + 1 then return {'sequence', last + 1} end
if seq > $max_entries then return {'cap'} end
local bytes = (tonumber(f[3]) or 0) + string.len(ARGV[3]) + string.len(ARGV[4])
if bytes > (tonumber(f[4]) or 0) then return {'cap'} end
if f[11] ~= '1' then
  local entry = {'gen', ARGV[7], 'seq', ARGV[2], 'content', ARGV[3]}
  if ARGV[5] == '1' then
    entry[#entry + 1] = 'reasoning_content'
    entry[#entry + 1] = ARGV[4]
  end
  if f[9] then
    entry[#entry + 1] = 'worker'
    entry[#entry + 1] = f[9]
  end
  if f[10] and f[10] ~= '' then
    entry[#entry + 1] = 'model'
    entry[#entry + 1] = f[10]
  end
  local stream = '$stream_prefix' .. f[15]
  redis.call('XADD', stream, 'MAXLEN', '~', $stream_max_entries, '*', unpack(entry))
  redis.call('EXPIRE', stream, $stream_ttl)
end
redis.call('HSET', KEYS[1], 'seq', seq, 'bytes', bytes, 'last_content', ARGV[3], 'last_reasoning', ARGV[4])
local ttl = tonumber(f[7])
local renewal = ''
local persist = 0
if cancelled == 0 then
  local started = tonumber(f[6])
  local now = tonumber(ARGV[6])
  local cap = tonumber(f[8])
  if now <= started + ttl then
    local wanted = math.ceil(now + $renewal_seconds - started)
    if wanted > cap then wanted = cap end
    if wanted > ttl then
      if wanted == cap or math.floor(wanted / $write_step) > math.floor(ttl / $write_step) then persist = 1 end
      ttl = wanted
      redis.call('HSET', KEYS[1], 'job_ttl', ttl)
      redis.call('EXPIREAT', KEYS[1], started + ttl + $lease_grace)
      renewal = 'granted'
    elseif ttl >= cap then
      renewal = 'at_cap'
    end
  end
end
return {'ok', cancelled, renewal, ttl, f[6], f[14] or '0', persist}
""").substitute(
    write_step=JOB_LEASE_WRITE_STEP_SECONDS,
    max_entries=MAX_CHAT_PROGRESS_ENTRIES,
    stream_prefix=CHAT_PROGRESS_STREAM_PREFIX,
    stream_max_entries=CHAT_PROGRESS_STREAM_MAX_ENTRIES,
    stream_ttl=CHAT_PROGRESS_STREAM_TTL_SECONDS,
    renewal_seconds=CHAT_PROGRESS_RENEWAL_SECONDS,
    lease_grace=CHAT_PROGRESS_LEASE_GRACE_SECONDS,
)

# KEYS: lease, stream. ARGV: generation id, stream TTL, stream max entries. The ended marker (not
# for a fake generation) and the lease's deletion, only when the lease exists.
END_PROGRESS_SCRIPT = """
local fake = redis.call('HGET', KEYS[1], 'fake')
if not fake then return 0 end
if fake ~= '1' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'gen', ARGV[1], 'ended', '1')
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS: stream, then each lease. ARGV: stream TTL, stream max entries, then each generation id.
# Flags every lease that still exists as cancelled and appends its ended marker (not for a fake one).
# A job without its lease gets a flag alone, which a pop that committed the job but has not yet
# written its lease merges into (the write is a plain HSET); without that write it is no lease to
# the progress route (no key) and expires (docs/adr/0079).
CANCEL_PROGRESS_SCRIPT = Template("""
local flagged = 0
for i = 2, #KEYS do
  local fake = redis.call('HGET', KEYS[i], 'fake')
  if fake then
    redis.call('HSET', KEYS[i], 'cancelled', '1')
    if fake ~= '1' then
      redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'gen', ARGV[i + 1], 'ended', '1')
      redis.call('EXPIRE', KEYS[1], ARGV[1])
    end
    flagged = flagged + 1
  else
    redis.call('HSET', KEYS[i], 'cancelled', '1')
    redis.call('EXPIRE', KEYS[i], $lease_grace)
  end
end
return flagged
""").substitute(lease_grace=CHAT_PROGRESS_LEASE_GRACE_SECONDS)


# The leases and progress streams share the completion signal's client and database.
progress_redis = signal_redis


@lru_cache(maxsize=4)
def _scripts(client: redis.Redis) -> tuple[Any, Any, Any]:
    """Each script registered once per client: later calls are EVALSHA (loaded again on NOSCRIPT)."""
    return (
        client.register_script(APPEND_PROGRESS_SCRIPT),
        client.register_script(END_PROGRESS_SCRIPT),
        client.register_script(CANCEL_PROGRESS_SCRIPT),
    )


def lease_key_digest(api_key_hash: str) -> str:
    """The lease's `key`: a SHA-256 of the owner's stored key hash (never the key itself)."""
    return hashlib.sha256(api_key_hash.encode()).hexdigest()


# --- the lease at pop -----------------------------------------------------------------------


def write_stream_leases(
    *, request: GenerationRequest, generations: list[Generation], worker: Any, owner: HordeUser, model: str | None, now: datetime
) -> None:
    """The pop's leases for a streamed request's new jobs: one pipelined round trip."""
    client = progress_redis()
    if client is None or not generations:
        return
    started = int(now.timestamp())
    job_ttl = settings.HORDE_TEXT_JOB_LEASE_SECONDS  # the row's lease at pop (chat/services/pop.py)
    fields: dict[FieldT, EncodableT] = {
        "request": str(request.pk),
        "worker": str(worker.pk),
        "model": model or "",
        "owner": str(owner.pk),
        "key": lease_key_digest(owner.api_key_hash),
        "max_bytes": chat_progress_max_bytes(request.max_length),
        "fake": 0,
        "started": started,
        "job_ttl": job_ttl,
        "lease_cap": text_job_lease_cap(bool(owner.trusted)),
        "trusted": 1 if owner.trusted else 0,
    }
    try:
        pipe = client.pipeline(transaction=False)
        for generation in generations:
            key = chat_stream_lease_key(generation.pk)
            pipe.hset(key, mapping=fields)
            pipe.expireat(key, started + job_ttl + CHAT_PROGRESS_LEASE_GRACE_SECONDS)
        pipe.execute()
    except Exception as error:  # best effort: the job is handed out whole without its lease
        log.warning("stream leases of request %s not written: %s", request.pk, error)


# --- the progress route -----------------------------------------------------------------------


def _refusal(rc: str, **extra: Any) -> HordeError:
    return HordeError(rc, PROGRESS_MESSAGES[rc], status=PROGRESS_RC_STATUS[rc], extra=extra)


def job_progress(*, api_key: str, post: ProgressPost) -> dict[str, Any]:
    """Check and append one progress post; returns the 200 body or raises the spec's refusal."""
    client = progress_redis()
    if client is None:
        raise _refusal("ChatProgressUnavailable")
    append = _scripts(client)[0]
    digest = lease_key_digest(hash_api_key(api_key or ""))
    reasoning = post.reasoning_content
    generation_id = str(post.id)  # once: a UUID's str is not cheap on a route posted every second
    keys = [chat_stream_lease_key(generation_id)]
    args: list[EncodableT] = [
        digest,
        post.seq,
        post.content.encode("utf-8"),
        (reasoning or "").encode("utf-8"),
        1 if reasoning else 0,
        repr(time.time()),
        generation_id,
    ]
    try:
        try:
            # EVALSHA straight from the client: the Script call checks whether its client is a
            # pipeline on every call (an isinstance against a Protocol, about 20 us here).
            answer = client.evalsha(append.sha, 1, *keys, *args)
        except NoScriptError:
            answer = append(keys=keys, args=args)  # loads the script again, then runs it
    except redis.RedisError as error:
        log.warning("progress of generation %s not recorded: %s", post.id, error)
        raise _refusal("ChatProgressUnavailable") from None
    outcome = answer[0].decode()
    if outcome == "none":
        raise _without_lease(post.id, api_key)
    if outcome == "credentials":
        raise _refusal("WrongCredentials")
    if outcome == "sequence":
        raise _refusal("ChatProgressOutOfSequence", expected_seq=int(answer[1]))
    if outcome == "cap":
        raise _refusal("ChatProgressCapReached")
    cancelled = bool(int(answer[1]))
    if outcome == "ok" and answer[2]:
        renewal, job_ttl, started, trusted = answer[2].decode(), int(answer[3]), int(answer[4]), answer[5] == b"1"
        lease_renewals.add(1, {"horde.outcome": renewal, "horde.worker_trusted": trusted})
        if renewal == "granted" and answer[6]:
            write_job_lease(post.id, datetime.fromtimestamp(started + job_ttl, tz=UTC))
    return {"accepted_seq": post.seq, "cancelled": cancelled}


def _without_lease(generation_id: UUID, api_key: str) -> HordeError:
    """No lease: one read tells a job to stop generating from one to stop posting."""
    row = (
        Generation.objects.filter(pk=generation_id)
        .values_list("state", "worker__owner__api_key_hash")
        .first()
    )
    if row is None:
        return _refusal("ChatJobAborted")  # not stored: its request expired
    state, owner_key_hash = row
    if owner_key_hash != hash_api_key(api_key or ""):
        return _refusal("WrongCredentials")
    if state in (Generation.State.FAULTED, Generation.State.CANCELLED):
        return _refusal("ChatJobAborted")
    return _refusal("ChatProgressNotStreaming")


_RENEW_SQL = (
    "UPDATE horde_generations SET lease_expires_at = %s WHERE id = %s AND state = %s AND lease_expires_at < %s"
)


def write_job_lease(generation_id: UUID, deadline: datetime) -> None:
    """The extended job lease, written to a generation still in progress (never shortened)."""
    if connection.vendor == "postgresql":
        run_prepared(_RENEW_SQL, [deadline, generation_id, Generation.State.PROCESSING, deadline])
        return
    Generation.objects.filter(
        pk=generation_id, state=Generation.State.PROCESSING, lease_expires_at__lt=deadline
    ).update(lease_expires_at=deadline)


def leased_deadlines(generation_ids: list[UUID]) -> dict[UUID, datetime] | None:
    """The job lease's deadline (started + job_ttl) of each streamed generation that still has a
    stream lease, for the stale sweep; None when Redis cannot be read."""
    client = progress_redis()
    if client is None or not generation_ids:
        return {}
    try:
        pipe = client.pipeline(transaction=False)
        for generation_id in generation_ids:
            pipe.hmget(chat_stream_lease_key(generation_id), "started", "job_ttl")
        answers = pipe.execute()
    except Exception as error:
        log.warning("stream leases of %d stale generations not read: %s", len(generation_ids), error)
        return None
    return {
        generation_id: datetime.fromtimestamp(int(started) + int(job_ttl), tz=UTC)
        for generation_id, (started, job_ttl) in zip(generation_ids, answers, strict=True)
        if started is not None and job_ttl is not None
    }


# --- ends: submit, fault, cancel ------------------------------------------------------------------


def end_progress_after_submit(generation_id: UUID) -> None:
    """A stored submit deletes the lease; the stream is left to expire, so a reader reconciles."""
    delete_stream_leases([generation_id])


def delete_stream_leases(generation_ids: list[UUID]) -> None:
    """The jobs' stream leases deleted (a submit stored, or a pop taken back before its worker had
    it): no progress post authenticates from them any more."""
    client = progress_redis()
    if client is None or not generation_ids:
        return
    try:
        client.delete(*(chat_stream_lease_key(generation_id) for generation_id in generation_ids))
    except Exception as error:
        log.warning("stream leases of generations %s not deleted: %s", generation_ids, error)


def end_progress_after_fault(generation_id: UUID, request_id: UUID) -> None:
    """A faulted job with a lease: the ended marker on its stream, and the lease deleted."""
    client = progress_redis()
    if client is None:
        return
    try:
        _scripts(client)[1](
            keys=[chat_stream_lease_key(generation_id), chat_progress_stream_key(request_id)],
            args=[str(generation_id), CHAT_PROGRESS_STREAM_TTL_SECONDS, CHAT_PROGRESS_STREAM_MAX_ENTRIES],
        )
    except Exception as error:
        log.warning("stream of generation %s not ended: %s", generation_id, error)


def flag_cancelled_leases(request_id: UUID, generation_ids: list[UUID]) -> int:
    """The cancel: every lease still there flagged cancelled, with its ended marker, in one script."""
    client = progress_redis()
    if client is None or not generation_ids:
        return 0
    try:
        return int(
            _scripts(client)[2](
                keys=[chat_progress_stream_key(request_id), *(chat_stream_lease_key(g) for g in generation_ids)],
                args=[CHAT_PROGRESS_STREAM_TTL_SECONDS, CHAT_PROGRESS_STREAM_MAX_ENTRIES, *map(str, generation_ids)],
            )
        )
    except Exception as error:
        log.warning("stream leases of request %s not flagged cancelled: %s", request_id, error)
        return 0


# --- settlement at cancel -----------------------------------------------------------------------


@dataclass(frozen=True)
class PostedProgress:
    """What a cancel prices a generation on: characters, and where they came from
    (stream: its content entries; lease_bytes: the fallback; none: the floor)."""

    characters: int
    source: str


def read_posted_progress(request_id: UUID, generation_id: UUID) -> PostedProgress:
    """The generation's content entries from the request's stream, joined in seq order (reasoning
    aside); the lease's accepted bytes when the stream holds none; nothing on a Redis failure."""
    client = progress_redis()
    if client is None:
        return PostedProgress(0, "none")
    gen = str(generation_id).encode()
    try:
        # The client does not decode (bytes), and XRANGE answers a list (empty without the
        # stream) of entries, each with its fields: the stubs allow None for both.
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(chat_progress_stream_key(request_id)))
        parts: dict[int, bytes] = {}
        for _, fields in entries:
            if fields.get(b"gen") != gen:
                continue
            if b"ended" in fields:  # posts after the cancel's marker were answered cancelled: true
                break
            if b"seq" in fields:
                parts[int(fields[b"seq"])] = fields.get(b"content", b"")
        if parts:
            text = b"".join(parts[seq] for seq in sorted(parts)).decode("utf-8", "replace")
            return PostedProgress(len(text), "stream")
        accepted = client.hget(chat_stream_lease_key(generation_id), "bytes")
    except Exception as error:
        log.warning("posted progress of generation %s not read: %s", generation_id, error)
        return PostedProgress(0, "none")
    if accepted is not None and int(accepted) > 0:
        return PostedProgress(int(accepted), "lease_bytes")
    return PostedProgress(0, "none")


def settle_cancelled_streams(*, request_id: UUID, now: datetime) -> list[UUID]:
    """Inside the cancel's transaction (the request row locked): settle each in-flight generation
    of a streamed request on its posted content (TextProcessingGeneration.settle_cancelled), its
    lease flagged first; returns their ids."""
    request = GenerationRequest.objects.only(
        "user_id", "prompt", "max_length", "kudos_context", "chat_extras", "shared_key_id"
    ).get(pk=request_id)
    if not streams_progress(request.chat_extras):
        return []
    # The cancel holds the request row; a submit holds its generation's row before it locks the
    # request. A generation a submit has locked is skipped (that submit settles it), so the two never
    # wait on each other.
    in_flight = list(
        Generation.objects.filter(request_id=request_id, state=Generation.State.PROCESSING)
        .select_related("worker__owner")
        .only("id", "model", "assigned_model", "worker__owner__id", "worker__owner__trusted")
        .select_for_update(skip_locked=True, of=("self",))
    )
    # Flagged before the stream is read: the flag and each job's ended marker are one script, so
    # the entries before the marker are exactly the posts answered cancelled: false, the content
    # the worker was told to go on with. Read first, a post accepted while the settlement waited
    # on a balance was answered cancelled: false and left unpaid (docs/adr/0079).
    flag_cancelled_leases(request_id, [generation.pk for generation in in_flight])
    claimed: list[tuple[Generation, PostedProgress, Decimal]] = []
    for generation in in_flight:
        posted = read_posted_progress(request_id, generation.pk)
        tokens = chat_output_tokens(posted.characters, request.max_length)
        reward = text_generation_kudos(
            model=generation.assigned_model or generation.model,
            prompt=request.prompt,
            context=request.kudos_context,
            generation=None,
            max_length=request.max_length,
            owner_trusted=bool(generation.worker.owner.trusted),
            tokens=tokens,
        )
        won = Generation.objects.filter(pk=generation.pk, state=Generation.State.PROCESSING).update(
            state=Generation.State.CANCELLED,
            finished_at=now,
            kudos=reward,
            settled_character_count=posted.characters,
        )
        if won:  # else submitted meanwhile: paid as usual
            claimed.append((generation, posted, reward))
    # The horde's one lock order (docs/adr/0068-one-lock-order.md): after the request and its jobs,
    # every worker, then every balance, each set by id.
    for generation, _, reward in sorted(claimed, key=lambda settled: settled[0].worker_id):
        worker_record_cancelled_settlement(worker_id=generation.worker_id, kudos=reward)
    balances = {request.user_id, *(generation.worker.owner.pk for generation, _, _ in claimed)}
    locking = HordeUser.objects.select_for_update(no_key=True).filter(pk__in=balances).order_by("pk")
    list(locking.values_list("pk", flat=True))
    for generation, posted, reward in claimed:
        kudos_settle(
            payee_id=generation.worker.owner.pk,
            payer_id=request.user_id,
            reward=reward,
            charge=reward,
            release_held=Decimal("0"),  # the cancel released the whole hold
            request_id=request_id,
            generation_id=generation.pk,
            shared_key_id=request.shared_key_id,
        )
        log.info(
            "horde.cancel.settled generation=%s request=%s characters=%d source=%s kudos=%s",
            generation.pk, request_id, posted.characters, posted.source, reward,
        )
    if claimed:
        consumed = sum((reward for _, _, reward in claimed), Decimal("0"))
        GenerationRequest.objects.filter(pk=request_id).update(consumed_kudos=F("consumed_kudos") + consumed)
    return [generation.pk for generation, _, _ in claimed]


__all__ = [
    "APPEND_PROGRESS_SCRIPT",
    "PostedProgress",
    "end_progress_after_fault",
    "end_progress_after_submit",
    "flag_cancelled_leases",
    "job_progress",
    "leased_deadlines",
    "read_posted_progress",
    "settle_cancelled_streams",
    "write_job_lease",
    "write_stream_leases",
]
