"""Empty pops answered from memory while the queue has not grown.

A worker that finds nothing in the queue finds nothing again until a request joins the queue or a
job goes back to it, yet proving it walks every waiting request (nothing matches, so nothing stops
the walk) and then counts them by skip reason: the most expensive pop is the one that hands out
nothing, and idle workers ask about once a second.

So every addition to the queue (a new request, a requeued job) bumps a shared count in Redis, at
once and again when it commits. A web process remembers a worker's empty answer with the count
it was found at; the worker's next pop with the same declaration, while the count is unchanged,
gets the same answer without a database read. The count is read only for workers whose last pop
was empty, and before their pop's statement, so an addition committed after the read always
changes it. An empty pop that passed over a request it could take (locked by another transaction
at that moment) is not remembered (chat/services/pop.py): no addition would announce it. Without
Redis (the embedded default) every pop walks the queue: Celery requeues jobs in another process,
which a per-process count would not see.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import transaction

from chat.services.pop_wait import queue_signal_channel, wake_in_process
from contract.process_cache import ProcessCache
from contract.text import WORKER_ONLINE_SECONDS

logger = logging.getLogger(__name__)

QUEUE_ADDITIONS_KEY = "horde:queue:additions"


@dataclass(frozen=True)
class _EmptyPop:
    view: Any  # the WorkerView the answer was found for
    counted: bool  # whether the queue's addition count was read before the pop
    additions: bytes | None  # that count (None: no addition yet)
    skipped: dict[str, int]
    at: float


# A worker's last empty pop, kept while the worker may still pop (its entry tells the next pop to
# read the count); whether its answer still holds is HORDE_EMPTY_POP_CACHE_SECONDS, checked at
# each lookup. Workers gone quiet leave with the online window, or past the count.
_empty_pops: ProcessCache[Any, _EmptyPop] = ProcessCache(
    "empty pops", ttl=WORKER_ONLINE_SECONDS, max_entries=100_000
)


def _redis():
    client = getattr(cache, "client", None)
    if not settings.REDIS_URL or not hasattr(client, "get_client"):
        return None
    return client.get_client(write=True)


def _enabled() -> bool:
    return settings.HORDE_EMPTY_POP_CACHE_SECONDS > 0 and _redis() is not None


def queue_grew() -> None:
    """A request joined the queue or a job went back to it: cached empty pops no longer hold.
    Bumped now and, inside a transaction, again when it commits (a pop that read the count
    between the two could not see the uncommitted rows). The committed bump also signals the
    long-polling pops (chat/services/pop_wait.py) in the same round trip; without Redis, this process's."""
    in_transaction = transaction.get_connection().in_atomic_block
    if _redis() is None:
        if in_transaction:
            transaction.on_commit(wake_in_process, robust=True)
        else:
            wake_in_process()
        return
    if in_transaction:
        _bump()
        transaction.on_commit(_bump_and_signal, robust=True)
    else:
        _bump_and_signal()


def _bump() -> None:
    try:
        _redis().incr(cache.make_key(QUEUE_ADDITIONS_KEY))
    except Exception:
        # With Redis down the count cannot be read either, so no empty pop is answered from memory.
        logger.warning("queue additions bump failed", exc_info=True)


def _bump_and_signal() -> None:
    try:
        pipe = _redis().pipeline(transaction=False)
        pipe.incr(cache.make_key(QUEUE_ADDITIONS_KEY))
        pipe.publish(queue_signal_channel(), b"1")
        pipe.execute()
    except Exception:
        # Held pops re-check on their own within a second.
        logger.warning("queue additions bump failed", exc_info=True)


def _additions() -> bytes | None:
    return _redis().get(cache.make_key(QUEUE_ADDITIONS_KEY))


@dataclass
class EmptyPopCheck:
    """The outcome of looking a worker up before its pop: `skipped` when the remembered empty
    answer still holds; else the count to remember an empty answer under (if read)."""

    skipped: dict[str, int] | None = None
    additions: bytes | None = None
    read: bool = False


def empty_pop_lookup(view: Any) -> EmptyPopCheck:
    entry = _empty_pops.get(view.id)
    if entry is None or not _enabled():
        return EmptyPopCheck()  # the last pop was not empty: no read (most pops of a busy horde)
    try:
        additions = _additions()
    except Exception:
        logger.warning("queue additions read failed", exc_info=True)
        return EmptyPopCheck()
    fresh = time.monotonic() - entry.at < settings.HORDE_EMPTY_POP_CACHE_SECONDS
    if entry.view == view and entry.counted and entry.additions == additions and fresh:
        return EmptyPopCheck(skipped=dict(entry.skipped), additions=additions, read=True)
    return EmptyPopCheck(additions=additions, read=True)


def empty_pop_remember(view: Any, check: EmptyPopCheck, skipped: dict[str, int]) -> None:
    """The pop found nothing; remember it under the count read before it (if it was read, the next
    empty pop can be answered from memory; if not, the next pop reads the count first)."""
    if not _enabled():
        return
    _empty_pops.set(view.id, _EmptyPop(view, check.read, check.additions, dict(skipped), time.monotonic()))


def empty_pop_forget(view: Any) -> None:
    """The worker got a job: its next pop walks the queue without reading the count."""
    _empty_pops.forget(view.id)
