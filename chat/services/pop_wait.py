"""The queue's signal, and the per-process wake that long-polling pops wait on.

A pop that carries `wait` and finds nothing answers with POP_WAIT_HEADER, and with POP_LISTS_HEADER
naming the queue lists its worker takes from (chat/services/pop_cache.py's tokens); the web process's
serving layer (hordesite/wsgi_pool.py) holds it on the event loop, not on a pool thread, until one
of those lists grows or its wait ends, then pops again. The queue grows where
chat/services/pop_cache.py bumps its lists' counts (a new text or chat request, a requeued job); on
commit the same round trip PUBLISHes the lists' tokens on QUEUE_SIGNAL_CHANNEL.

`QueueSignalListener` holds one Redis pub/sub connection per process (per event loop) subscribed to
that channel, and for each message wakes the waiting pops whose lists it names (all of them for
EVERY_LIST_TOKEN, or a message it cannot read): each pops again, one takes the job and the others
find nothing and wait on. Requests for other models wake no one: with a thousand held pops and
twenty new requests a second, waking every pop for each would be twenty thousand pops a second. A
waiting pop also re-checks every HORDE_POP_WAIT_RECHECK_SECONDS (a lost message, a connection drop,
a request passed over while another transaction held it, which no signal announces), or, when its
empty answer is remembered under its lists' stamps (chat/services/pop_cache.py), when that answer
ages out: only its lists' growth can change it before then, and the signal announces that
(POP_RECHECK_HEADER). Without Redis the wake is in process:
additions made by this process wake all of its pops at once (the embedded server is one process);
the re-check covers the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import threading

from django.conf import settings
from django.core.cache import cache

from contract.aio import cancel_and_wait, within

logger = logging.getLogger(__name__)

QUEUE_SIGNAL_CHANNEL = "horde:queue:grew"
POP_PATH = "/api/v2/generate/text/pop"
# On an empty pop that asked to wait: the seconds it may be held for a job, from its arrival. Never
# sent to a client: the serving layer removes it.
POP_WAIT_HEADER = "X-Horde-Pop-Wait"
# Beside it: the tokens of the queue lists whose growth wakes the held pop, comma separated, and
# the seconds until it is popped again without a signal. Never sent to a client either.
POP_LISTS_HEADER = "X-Horde-Pop-Lists"
POP_RECHECK_HEADER = "X-Horde-Pop-Recheck"
# The WSGI environ key the serving layer sets on each pop after the first of one held request: the
# same worker's pop again, not a new one, for the counters that count a worker's pops.
POP_REPEATED_ENVIRON = "horde.pop_repeated"
# The token of "every list": an addition that may concern any worker (pop_cache.queue_grew()
# without lists).
EVERY_LIST_TOKEN = "*"


def queue_signal_message(tokens: tuple[str, ...]) -> bytes:
    """The signal's payload: the tokens of the lists that grew."""
    return ",".join(tokens).encode()


_TOKEN = re.compile(r"[0-9a-f]{16}(?:,[0-9a-f]{16})*")


def signalled_tokens(data: object) -> frozenset[str] | None:
    """The lists a signal names; None (every list) for EVERY_LIST_TOKEN or any other payload, such
    as an earlier release's "1"."""
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes) or not _TOKEN.fullmatch(data.decode("latin-1")):
        return None
    return frozenset(data.decode().split(","))


def queue_signal_channel() -> str:
    """The channel, under the cache's key prefix and Redis database: pub/sub channels are shared by
    every database of a server, and a horde (or test run) on another database must not wake ours."""
    db = 0
    client = getattr(cache, "client", None)
    if client is not None and hasattr(client, "get_client"):
        with contextlib.suppress(Exception):
            db = client.get_client(write=True).connection_pool.connection_kwargs.get("db", 0)
    return f"{cache.make_key(QUEUE_SIGNAL_CHANNEL)}:{db}"


# The lists QueueGrowth keeps a value for before it starts afresh (a request may name any model).
QUEUE_GROWTH_MAX_LISTS = 100_000


class QueueGrowth:
    """What this process has heard of each queue list's growth, for the empty pops it remembers
    (chat/services/pop_cache.py, docs/adr/0057): per list token, a value that changes whenever
    the queue's signal names the list (or every list), or this process grows it itself; and the
    subscription it was heard on. Written on the event loop (the listener) and on serving threads
    (queue_grew), read on serving threads: every write takes a new value of one process-wide
    sequence (itertools.count is atomic), so a value once read never comes back, and a stale write
    racing a newer one still changes it."""

    def __init__(self) -> None:
        self._sequence = itertools.count(1)
        self._values: dict[str, int] = {}
        self._owner: object | None = None  # the listener whose subscription is live
        self._epoch = 0  # a new subscription, or its loss: every earlier version ends

    def version(self, tokens: tuple[str, ...]) -> tuple | None:
        """The lists' growth as heard now; None while no subscription is live (a message may be
        missed: the caller reads the lists' stamps in Redis instead)."""
        if self._owner is None:
            return None
        values = self._values
        return ("signal", self._epoch, *(values.get(token, 0) for token in tokens))

    def grew(self, tokens: tuple[str, ...]) -> None:
        """The lists grew (EVERY_LIST_TOKEN: every list), heard from the signal or done here."""
        if len(self._values) > QUEUE_GROWTH_MAX_LISTS:
            # Lists of made-up model names would pile up: start afresh, which ends every version.
            self._epoch = next(self._sequence)  # first: a version read meanwhile is already ended
            self._values = {}
        for token in tokens:
            self._values[token] = next(self._sequence)

    def subscribed(self, owner: object) -> None:
        self._epoch = next(self._sequence)
        self._owner = owner

    def lost(self, owner: object) -> None:
        if self._owner is owner:
            self._owner = None
            self._epoch = next(self._sequence)

    def signalled(self, owner: object, tokens: frozenset[str] | None) -> None:
        if self._owner is owner:
            self.grew((EVERY_LIST_TOKEN,) if tokens is None else tuple(tokens))


queue_growth = QueueGrowth()


class PopWaiter:
    """One held pop's wake-up flag, and the lists whose growth sets it (None: any list)."""

    def __init__(self, tokens: frozenset[str] | None = None) -> None:
        self.event = asyncio.Event()
        self.tokens = tokens

    async def wait(self, seconds: float) -> bool:
        """True when woken within `seconds`."""
        if self.event.is_set():
            return True
        with contextlib.suppress(TimeoutError):
            await within(self.event.wait(), max(0.0, seconds))
        return self.event.is_set()


class QueueSignalListener:
    """The process's subscription to the queue's signal (or, without Redis, its in-process wake)."""

    def __init__(self, redis_url: str | None, *, ping_seconds: float = 5.0):
        self.redis_url = redis_url
        self.ping_seconds = ping_seconds
        self.loop = asyncio.get_running_loop()
        self._waiters: set[PopWaiter] = set()
        self._task: asyncio.Task | None = None
        self._subscribed = asyncio.Event()
        if redis_url:
            self._task = self.loop.create_task(self._run(redis_url), name="horde-queue-signal")

    def register(self, tokens: frozenset[str] | None = None) -> PopWaiter:
        waiter = PopWaiter(tokens)
        self._waiters.add(waiter)
        return waiter

    def unregister(self, waiter: PopWaiter) -> None:
        self._waiters.discard(waiter)

    async def subscribed(self, timeout: float) -> None:
        """Wait (briefly) for the first subscription, so a first pop's signal is not missed."""
        if self._task is not None and not self._subscribed.is_set():
            with contextlib.suppress(TimeoutError):
                await within(self._subscribed.wait(), timeout)

    @property
    def listening(self) -> bool:
        """Whether a queue addition would wake a held pop now: subscribed to the signal, or
        without Redis (the in-process wake). False while the subscription is being made again."""
        return self._task is None or self._subscribed.is_set()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def wake_all(self) -> None:
        for waiter in list(self._waiters):
            waiter.event.set()

    def wake(self, tokens: frozenset[str] | None) -> None:
        """Wake the held pops that take from one of the lists `tokens` names (None: every one)."""
        if tokens is None:
            return self.wake_all()
        for waiter in list(self._waiters):
            if waiter.tokens is None or not waiter.tokens.isdisjoint(tokens):
                waiter.event.set()

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self, redis_url: str) -> None:
        import redis.asyncio as aioredis

        channel = queue_signal_channel()
        backoff = 0.5
        while True:
            client = aioredis.Redis.from_url(
                redis_url, socket_connect_timeout=2, socket_timeout=None, health_check_interval=0
            )
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(channel)  # sent, not yet confirmed: nothing is heard yet
                idle = 0.0
                while True:
                    message = await within(pubsub.get_message(timeout=1.0), 3.0)
                    kind = message.get("type") if message is not None else None
                    if kind == "message":
                        tokens = signalled_tokens(message.get("data"))
                        queue_growth.signalled(self, tokens)  # before the wake: a woken pop walks
                        self.wake(tokens)
                        idle = 0.0
                        continue
                    if kind == "subscribe":
                        # Redis has taken the subscription: from here every signal reaches us.
                        queue_growth.subscribed(self)
                        self._subscribed.set()
                        backoff = 0.5
                        idle = 0.0
                        continue
                    idle += 1.0
                    if idle >= self.ping_seconds:
                        await within(pubsub.ping(), self.ping_seconds)
                        idle = 0.0
            except asyncio.CancelledError:
                raise
            except Exception as error:
                # Before the wake: a woken pop must not answer from memory what a lost message changed.
                queue_growth.lost(self)
                logger.warning("queue signal connection lost (%s): reconnecting", error)
                self._subscribed.clear()
                self.wake_all()  # each held pop re-checks: a message may have been lost
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                queue_growth.lost(self)  # whatever ended it (an error, a cancel): messages may be missed
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose()


_listener: QueueSignalListener | None = None
_listener_lock = threading.Lock()


def queue_listener() -> QueueSignalListener:
    """The running event loop's listener, started on first use (an ASGI server runs one loop)."""
    global _listener
    loop = asyncio.get_running_loop()
    listener = _listener
    if listener is None or listener.loop is not loop or loop.is_closed():
        with _listener_lock:
            listener = _listener = QueueSignalListener(settings.REDIS_URL)
    return listener


def wake_in_process() -> None:
    """Without Redis: the queue grew in this process; wake its held pops (from any thread)."""
    listener = _listener
    if listener is None or not listener.waiting or listener.loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        listener.loop.call_soon_threadsafe(listener.wake_all)
