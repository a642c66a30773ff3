"""The front lease (contract.front_lease, docs/adr/0020-front-lease.md): taking it at submit,
renewing it from a status read's header, and the beat sweep that cancels requests whose front
lease lapsed.

A request submitted with the `Horde-Front-Lease` header stores `front_lease_expires_at`. The front
keeps it alive in Redis (`horde:front:lease:<id>` on the chat signal database) or, without Redis,
with the same header on its status reads, which moves the column. The sweep reads the requests
whose column lapsed, asks Redis once for their keys, carries a live key's expiry over to the row,
and cancels the rest through the cancel service (`chat.services.cancel.request_cancel`: no more jobs handed
out, the hold released, jobs in flight treated as the spec's cancel says). A request the sweep
handled leaves the lease (the column is set to null), so it is read once.

A front names its process beside the lease (`Horde-Front-Id`, stored as `front_id`). A horde
process on the same host knows the moment that process is gone (contract.front_lease
.front_process_gone): the sweep, before it looks at lapsed leases, and a worker's submit for such a
request cancel it as a dead front's (`cancel_for_dead_front`): nobody can receive its reply, so its
jobs in flight end unpaid and their submits are refused `AbortedGen`; nobody is charged for it
(docs/adr/0028-dead-front-requests.md).

A front that stops with a request still generating (docs/adr/0076) cannot deliver its reply either:
its cancel asks for the same settlement (`Horde-Front-Undelivered`), which the horde grants only to a
front it knows by its proxy passkey and only for a request submitted under the front id it sends
(`stopping_front`, `cancel_undelivered`; docs/adr/0086-a-stopping-front-ends-undelivered-requests-unpaid.md):
leased, or a chat request named without a lease, a background response's, whose record its front
could not keep (docs/adr/0110). Any other cancel is the spec's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from functools import lru_cache
from typing import cast
from uuid import UUID

import redis
from django.db import transaction
from django.utils import timezone

from accounts.ratelimit import is_known_proxy_passkey
from chat.models import Generation, GenerationRequest
from chat.selectors.status import request_completed
from chat.services.cancel import lock_jobs_in_flight, request_cancel
from chat.services.progress import flag_cancelled_leases
from chat.signals import signal_url
from contract.front_lease import (
    FRONT_ID_HEADER,
    FRONT_LEASE_HEADER,
    FRONT_LEASE_REDIS_DB,
    FRONT_LEASE_TTL_SECONDS,
    FRONT_UNDELIVERED_HEADER,
    FRONT_UNDELIVERED_VALUE,
    front_lease_key,
    front_process_gone,
    parse_front_id,
    parse_front_lease_header,
)
from contract.rate_limits import PROXY_PASSKEY_HEADER

log = logging.getLogger(__name__)

# Requests one sweep reads at most; the next sweep takes the rest.
FRONT_LEASE_SWEEP_BATCH = 1000
# The sweep's Redis calls: a hung Redis costs at most this, and cancels nothing.
FRONT_LEASE_REDIS_TIMEOUT_SECONDS = 0.5


def front_lease_seconds(headers: Mapping[str, str]) -> int | None:
    """The lease a request's headers ask for (None: no front lease)."""
    return parse_front_lease_header(headers.get(FRONT_LEASE_HEADER))


def front_lease_front_id(headers: Mapping[str, str]) -> str | None:
    """The front process a submit names beside its lease (None: unnamed, the lease alone)."""
    return parse_front_id(headers.get(FRONT_ID_HEADER))


def front_lease_until(seconds: int | None) -> datetime | None:
    """The stored expiry of a lease taken now (None without a lease)."""
    return timezone.now() + timedelta(seconds=seconds) if seconds else None


# The header as a WSGI environ key: a status poll reads it from request.META, without building
# the request's whole header mapping for one header that polls rarely carry.
FRONT_LEASE_META_KEY = "HTTP_" + FRONT_LEASE_HEADER.upper().replace("-", "_")


def front_lease_renew(*, request_id: UUID, header: str | None) -> bool:
    """A status read carrying the header (its value, None without it) renews the lease of a request
    that holds one (a request submitted without a lease is never put under one). Returns whether a
    lease was renewed."""
    seconds = parse_front_lease_header(header)
    if seconds is None:
        return False
    return bool(
        GenerationRequest.objects.filter(pk=request_id, front_lease_expires_at__isnull=False).update(
            front_lease_expires_at=front_lease_until(seconds)
        )
    )


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    pool = redis.ConnectionPool.from_url(
        url,
        socket_timeout=FRONT_LEASE_REDIS_TIMEOUT_SECONDS,
        socket_connect_timeout=FRONT_LEASE_REDIS_TIMEOUT_SECONDS,
    )
    pool.connection_kwargs["db"] = FRONT_LEASE_REDIS_DB  # as the publisher: the URL's database is not it
    return redis.Redis(connection_pool=pool)


def redis_front_leases(request_ids: Iterable[UUID]) -> dict[UUID, float] | None:
    """The requests whose Redis lease key exists, with its seconds left; {} without Redis, None when
    Redis did not answer (then nobody can tell a live front from a dead one)."""
    ids = list(request_ids)
    url = signal_url()
    if not url or not ids:
        return {}
    try:
        pipe = _client(url).pipeline(transaction=False)
        for request_id in ids:
            pipe.pttl(front_lease_key(request_id))
        answers = pipe.execute()
    except Exception as error:  # best effort: a Redis outage cancels nothing
        log.warning("front lease sweep: Redis did not answer (%s); nothing cancelled", error)
        return None
    alive: dict[UUID, float] = {}
    for request_id, pttl in zip(ids, answers, strict=True):
        if pttl == -1:  # a key without expiry: counts as a fresh lease
            alive[request_id] = float(FRONT_LEASE_TTL_SECONDS)
        elif isinstance(pttl, int) and pttl > 0:
            alive[request_id] = pttl / 1000
    return alive


def front_gone(request: GenerationRequest) -> bool:
    """Whether the request's front process is known gone (a request loaded without front_id, as the
    pop's copy of a text job, is not judged: the sweep is)."""
    if "front_id" in request.get_deferred_fields() or not request.front_id:
        return False
    return request.front_lease_expires_at is not None and front_process_gone(request.front_id)


def cancel_for_dead_front(request_id: UUID, *, front_id: str | None = None) -> bool:
    """Cancel a request whose front is gone: no more jobs, the hold released, `cancelled` published,
    and its jobs in flight ended unpaid (their submits answer AbortedGen). A job whose submit holds
    its row meanwhile is left to that submit; a request cancelled or faulted already has its jobs
    in flight ended alike. `front_id`: only a request submitted under that front id, leased or not
    (a front's own, cancel_undelivered: a background response's request holds no lease,
    docs/adr/0110). Returns whether this call cancelled it or ended its jobs."""
    with transaction.atomic():
        lock_jobs_in_flight(request_id)  # before the request: see there
        leased = GenerationRequest.objects.select_for_update().filter(pk=request_id)
        if front_id is None:
            leased = leased.filter(front_lease_expires_at__isnull=False)
        else:
            leased = leased.filter(front_id=front_id)
        request = leased.only("id", "is_chat", "cancelled", "faulted").first()
        if request is None:  # handled already
            return False
        GenerationRequest.objects.filter(pk=request_id).update(front_lease_expires_at=None)
        # A request its front cancelled, or that faulted, before its front died still has jobs in
        # flight nobody can receive (a faulted request is done while its other jobs still run).
        if not request.faulted and request_completed(request_id, is_chat=request.is_chat):
            return False
        in_flight = list(
            Generation.objects.select_for_update(skip_locked=True)
            .filter(request_id=request_id, state=Generation.State.PROCESSING)
            .values_list("id", flat=True)
        )
        ended = 0
        if in_flight:
            ended = Generation.objects.filter(pk__in=in_flight, state=Generation.State.PROCESSING).update(
                state=Generation.State.CANCELLED, finished_at=timezone.now(), kudos=0
            )
        if not request.cancelled and not request.faulted:
            request_cancel(request=request, settle_streams=False)
        elif not ended:
            return False
        if ended and request.is_chat:  # a streaming worker learns of it from its lease
            transaction.on_commit(lambda: flag_cancelled_leases(request_id, in_flight), robust=True)
    log.info(
        "request %s cancelled: %s (%d jobs in flight ended unpaid)",
        request_id,
        "its front stops before it can deliver" if front_id is not None else "its front process is gone",
        ended,
    )
    return True


def _meta_key(header: str) -> str:
    return "HTTP_" + header.upper().replace("-", "_")


_UNDELIVERED_META_KEY = _meta_key(FRONT_UNDELIVERED_HEADER)
_FRONT_ID_META_KEY = _meta_key(FRONT_ID_HEADER)
_PASSKEY_META_KEY = _meta_key(PROXY_PASSKEY_HEADER)


def stopping_front(meta: Mapping[str, object]) -> str | None:
    """The front id of a cancel that a stopping front sends for a request it can no longer deliver
    (`Horde-Front-Undelivered: stopping` with its `Horde-Front-Id` and a proxy passkey this horde
    knows: HORDE_PROXY_PASSKEYS, or the passkey of the front mounted in this process). None for any
    other cancel, which is the spec's: a client, or a front the horde does not know, cannot ask for
    a cancel that leaves the work in flight unpaid."""
    if str(meta.get(_UNDELIVERED_META_KEY, "")).strip() != FRONT_UNDELIVERED_VALUE:
        return None
    front_id = parse_front_id(cast(str | None, meta.get(_FRONT_ID_META_KEY)))
    passkey = str(meta.get(_PASSKEY_META_KEY, "")).strip()
    if front_id is None or not passkey or not is_known_proxy_passkey(passkey):
        log.info("an undelivered cancel without a known front's passkey and id: the spec's cancel")
        return None
    return front_id


def cancel_undelivered(*, request_id: UUID, front_id: str) -> bool:
    """A front's cancel of a request it cannot deliver: ended as a dead front's
    (cancel_for_dead_front: the generations in flight unpaid, nobody charged for them; the horde
    tax taken at the submit stays), when the request was submitted under `front_id`. Returns whether
    it was; else the caller cancels as the spec does."""
    return cancel_for_dead_front(request_id, front_id=front_id)


def cancel_dead_fronts_requests() -> int:
    """Cancel the leased requests of every front process known gone (cancel_for_dead_front)."""
    leased = GenerationRequest.objects.filter(front_lease_expires_at__isnull=False, front_id__isnull=False)
    # Not None (front_id__isnull=False), which the values' type does not know.
    fronts = cast(set[str], set(leased.order_by().values_list("front_id", flat=True).distinct()))
    gone = [front for front in fronts if front_process_gone(front)]
    if not gone:
        return 0
    ids = list(leased.filter(front_id__in=gone).values_list("id", flat=True)[:FRONT_LEASE_SWEEP_BATCH])
    return sum(cancel_for_dead_front(request_id) for request_id in ids)


def cancel_lapsed_front_leases(*, now: datetime | None = None) -> int:
    """Cancel the requests of front processes known gone, then those whose front lease lapsed in the
    database and in Redis (the beat task). Returns how many this sweep cancelled."""
    dead = cancel_dead_fronts_requests()
    return dead + _cancel_lapsed(now=now or timezone.now())


def _cancel_lapsed(*, now: datetime) -> int:
    lapsed = list(
        GenerationRequest.objects.filter(front_lease_expires_at__lt=now).values_list("id", flat=True)[
            :FRONT_LEASE_SWEEP_BATCH
        ]
    )
    if not lapsed:
        return 0
    alive = redis_front_leases(lapsed)
    if alive is None:
        return 0
    cancelled = 0
    for request_id in lapsed:
        seconds = alive.get(request_id)
        if seconds is not None:
            # The front renews in Redis: the row takes the key's expiry, so it is read again then.
            GenerationRequest.objects.filter(pk=request_id, front_lease_expires_at__lt=now).update(
                front_lease_expires_at=now + timedelta(seconds=seconds)
            )
            continue
        with transaction.atomic():
            lock_jobs_in_flight(request_id)  # before the request: see there
            request = (
                GenerationRequest.objects.select_for_update()
                .filter(pk=request_id, front_lease_expires_at__lt=now)
                .only("id", "is_chat", "cancelled", "faulted")
                .first()
            )
            if request is None:  # renewed or expired meanwhile
                continue
            GenerationRequest.objects.filter(pk=request_id).update(front_lease_expires_at=None)
            if request.cancelled or request.faulted or request_completed(request_id, is_chat=request.is_chat):
                continue  # nothing left to stop
            if request_cancel(request=request, jobs_locked=True):
                cancelled += 1
                log.info("request %s cancelled: its front lease lapsed", request_id)
    return cancelled
