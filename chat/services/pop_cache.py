"""Empty pops answered from memory while the worker's queue lists have not grown.

A worker that finds nothing in the queue finds nothing again until a request joins one of its queue
lists (chat.selectors.queue.worker_queue_lists: its models, "" for a text request naming none, its
chat model) or a job goes back to one, yet proving it takes the pop's statement and then an
aggregate over every waiting request, by skip reason: the most expensive pop is the one that hands
out nothing, and idle workers ask about once a second.

So every addition to the queue (a new request, a requeued job) writes a new stamp in Redis to each
list the request is in, at once and again when it commits. A web process remembers a worker's empty
answer with its lists' stamps; the worker's next pop with the same declaration, while those stamps
are unchanged, gets the same answer without a database read. Requests for other models do not end it:
in a busy horde something joins the queue every second, and a single count for the whole queue made
nearly every idle pop walk (docs/adr/0051-empty-pops-remembered-per-queue-list.md). The skipped
counts in a remembered answer are as old as the answer, at most HORDE_EMPTY_POP_CACHE_SECONDS.

The stamps are read only for workers whose last pop was empty, and before their pop's statement, so
an addition committed after the read always changes them. A process serving pops does not read them
while its subscription to the queue's signal is live: the signal each addition publishes on commit
tells it the same, with no round trip per pop (chat.services.pop_wait.QueueGrowth,
docs/adr/0057-empty-pops-remembered-against-the-signal-heard.md). An empty pop that passed over a request it
could take (locked by another transaction at that moment) is not remembered (chat/services/pop.py):
no addition would announce it. Without Redis (the embedded default) every pop walks the queue:
Celery requeues jobs in another process, which a per-process count would not see.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import transaction

from chat.selectors.queue import QueueList, WorkerView, worker_queue_lists
from chat.services.pop_wait import (
    EVERY_LIST_TOKEN,
    queue_growth,
    queue_signal_channel,
    queue_signal_message,
    wake_in_process,
)
from contract.process_cache import ProcessCache
from contract.text import WORKER_ONLINE_SECONDS

logger = logging.getLogger(__name__)

QUEUE_ADDITIONS_KEY = "horde:queue:additions"
# A list's stamp lives this long after its last addition, so lists of made-up model names leave
# Redis; a stamp that expired reads as None, which ends the answers remembered under it (a count
# could expire and climb back to a remembered value; a stamp is never written twice).
QUEUE_LIST_STAMP_SECONDS = 3600


def queue_list_token(listed: QueueList) -> str:
    """A short ASCII name of one queue list, for its stamp's key and the queue's signal (a model's
    name may hold any character; a collision only ends an answer early or wakes a pop for nothing)."""
    kind = "chat" if listed.is_chat else "text"
    return hashlib.blake2b(f"{kind}\0{listed.model}".encode(), digest_size=8).hexdigest()


@lru_cache(maxsize=4096)
def _list_tokens(lists: tuple[QueueList, ...]) -> tuple[str, ...]:
    return (EVERY_LIST_TOKEN, *(queue_list_token(listed) for listed in lists))


def view_list_tokens(view: WorkerView) -> tuple[str, ...]:
    """The tokens an idle worker's empty answer depends on: its queue lists' and EVERY_LIST_TOKEN."""
    return _list_tokens(worker_queue_lists(view))


def _additions_key(token: str) -> str:
    return cache.make_key(f"{QUEUE_ADDITIONS_KEY}:{token}")


@dataclass(frozen=True)
class _EmptyPop:
    view: WorkerView  # the view the answer was found for
    counted: bool  # whether its lists' stamps were read before the pop
    additions: tuple[bytes | None, ...]  # those stamps (None: no addition within the stamps' lifetime)
    skipped: dict[str, int]
    at: float


# A worker's last empty pop, kept while the worker may still pop (its entry tells the next pop to
# read the stamps); whether its answer still holds is HORDE_EMPTY_POP_CACHE_SECONDS, checked at
# each lookup. Workers gone quiet leave with the online window, or past the entries' bound.
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


def queue_grew(lists: Iterable[QueueList] | None = None) -> None:
    """A request joined the queue or a job went back to it, in `lists` (the request's:
    request_queue_lists; None: any list, e.g. after a change to the rules themselves): cached empty
    pops of workers taking from those lists no longer hold. Bumped now and, inside a transaction,
    again when it commits (a pop that read the stamp between the two could not see the uncommitted
    rows). The committed bump also signals the long-polling pops of those lists
    (chat/services/pop_wait.py) in the same round trip; without Redis, this process's."""
    tokens = (EVERY_LIST_TOKEN,) if lists is None else tuple(dict.fromkeys(map(queue_list_token, lists)))
    in_transaction = transaction.get_connection().in_atomic_block
    if _redis() is None:
        if in_transaction:
            transaction.on_commit(wake_in_process, robust=True)
        else:
            wake_in_process()
        return
    if in_transaction:
        _bump(tokens, signal=False)
        transaction.on_commit(partial(_bump, tokens, signal=True), robust=True)
    else:
        _bump(tokens, signal=True)


def _bump(tokens: tuple[str, ...], *, signal: bool) -> None:
    if signal:
        queue_growth.grew(tokens)  # this process's own pops see it at once, before its signal comes back
    stamp = uuid.uuid4().hex
    try:
        pipe = _redis().pipeline(transaction=False)
        for token in tokens:
            pipe.set(_additions_key(token), stamp, ex=QUEUE_LIST_STAMP_SECONDS)
        if signal:
            pipe.publish(queue_signal_channel(), queue_signal_message(tokens))
        pipe.execute()
    except Exception:
        # With Redis down the stamps cannot be read either, so no empty pop is answered from
        # memory; held pops re-check on their own within a second.
        logger.warning("queue additions bump failed", exc_info=True)


def _additions(tokens: tuple[str, ...]) -> tuple[bytes | None, ...]:
    return tuple(_redis().mget([_additions_key(token) for token in tokens]))


@dataclass
class EmptyPopCheck:
    """The outcome of looking a worker up before its pop: `skipped` when the remembered empty
    answer still holds; else the stamps to remember an empty answer under (if read)."""

    skipped: dict[str, int] | None = None
    additions: tuple[bytes | None, ...] = ()
    read: bool = False
    remembered_for: float = 0.0  # with `skipped`: the seconds the answer is still remembered


def empty_pop_lookup(view: WorkerView) -> EmptyPopCheck:
    """Before the worker's pop: whether its last empty answer still holds, by its lists' addition
    stamps."""
    entry = _empty_pops.get(view.id)
    if entry is None or not _enabled():
        return EmptyPopCheck()  # the last pop was not empty: no read (most pops of a busy horde)
    tokens = view_list_tokens(view)
    # What the process's subscription to the queue's signal heard of the lists, without a round
    # trip; while it is not live, their stamps in Redis (docs/adr/0057).
    additions = queue_growth.version(tokens)
    if additions is None:
        try:
            additions = _additions(tokens)
        except Exception:
            logger.warning("queue additions read failed", exc_info=True)
            return EmptyPopCheck()
    left = entry.at + settings.HORDE_EMPTY_POP_CACHE_SECONDS - time.monotonic()
    if entry.view == view and entry.counted and entry.additions == additions and left > 0:
        return EmptyPopCheck(skipped=dict(entry.skipped), additions=additions, read=True, remembered_for=left)
    return EmptyPopCheck(additions=additions, read=True)


def empty_pop_remember(view: WorkerView, check: EmptyPopCheck, skipped: dict[str, int]) -> float:
    """The pop found nothing; remember it under the stamps read before it (if they were read, the
    next empty pop can be answered from memory; if not, the next pop reads the stamps first).
    The seconds the answer is remembered for: 0 when no later pop may take it from memory."""
    if not _enabled():
        return 0.0
    _empty_pops.set(view.id, _EmptyPop(view, check.read, check.additions, dict(skipped), time.monotonic()))
    return settings.HORDE_EMPTY_POP_CACHE_SECONDS if check.read else 0.0


def empty_pop_forget(view: WorkerView) -> None:
    """The worker got a job: its next pop walks the queue without reading the stamps."""
    _empty_pops.forget(view.id)
