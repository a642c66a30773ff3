"""The wait: one completion signal subscription per process, and each request's wake sources.

`CompletionSignalListener` holds one Redis pub/sub connection for the whole process. A request
registers its id (SUBSCRIBE horde:chat:<id>) and gets a `Wake` that the listener sets for each
message on its channel. A liveness ping runs every signal_ping_seconds (every
SIGNAL_BUSY_PING_SECONDS while requests wait); a ping or read that fails, or a PONG that does not
come back in time, drops the connection, every registered request is woken (a recheck reads its status, so nothing a
lost message announced is missed) and polls every poll_seconds until the listener has reconnected
and subscribed again (a PONG first: a hung server still accepts connections). A PONG or subscribe
slower than SIGNAL_COMMAND_TIMEOUT_SECONDS counts as failed, so a hung Redis is noticed within a
ping interval plus that. Without Redis there is no
listener and waits poll the status route every poll_seconds.

`ChatRequestWatcher` decides when a waiting request reads its status next: at once after the
submit (immediate), on a signal, at each recheck (signal_recheck_seconds with Redis, poll_seconds
without), at the grace or positioned-read end, at the budget's deadline, or never again once the
client disconnected.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import json
import logging
import time
import weakref
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, overload

from contract.aio import cancel_and_wait, within
from contract.chat_signal import CHAT_SIGNAL_CHANNEL_PREFIX

log = logging.getLogger("oai.waiter")

# Under fail_fast, reads after the first wait at most this long for a status carrying queue information.
POSITIONED_READ_WAIT_SECONDS = 2.0
QUEUE_UNAVAILABLE_RETRY_AFTER_CAP_SECONDS = 600
NO_ELIGIBLE_WORKER_RETRY_AFTER_SECONDS = 30
# The longest Retry-After the OpenAI SDKs honour; past it they retry at once (docs/adr/0125).
SDK_RETRY_AFTER_MAX_SECONDS = 60
# A PONG or a subscribe that takes longer means a hung Redis: the connection is dropped and waiting
# requests poll as without Redis until it is back (docs/adr/0018). The horde's short Redis timeout
# (HORDE_REDIS_SOCKET_TIMEOUT's default).
SIGNAL_COMMAND_TIMEOUT_SECONDS = 0.5
# While requests wait on the listener it pings at least this often, so a hung Redis costs a request
# already waiting at most this plus SIGNAL_COMMAND_TIMEOUT_SECONDS before it polls. A request that
# registers polls until a PONG sent after its subscribe came back, so a Redis hung before it costs
# it nothing but polling.
SIGNAL_BUSY_PING_SECONDS = 0.5


class WakeSource(StrEnum):
    IMMEDIATE = "immediate"
    SIGNAL = "signal"
    RECHECK = "recheck"
    POLL = "poll"
    DEADLINE = "deadline"
    DISCONNECT = "disconnect"
    # The process is stopping (oai.server): one read decides whether the request may still finish.
    STOPPING = "stopping"
    # A relayed stream's deltas arrived: no status read, so never a horde.oai.wakes attribute.
    DELTA = "delta"


@dataclass(eq=False)
class Wake:
    """One request's wake-up flag, set by the listener for each message on its channel."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled_signal: bool = False
    signal_lost: bool = False
    # False while the listener has no live subscription for it: the request polls meanwhile.
    listening: bool = True
    last_message: dict[str, Any] | None = None

    def set(self, message: dict[str, Any] | None) -> None:
        if message is not None:
            self.last_message = message
            if message.get("event") == "cancelled":
                self.cancelled_signal = True
        else:
            self.signal_lost = True
        self.event.set()


class CompletionSignalListener:
    """One pub/sub connection per process, with a liveness ping and reconnection."""

    def __init__(self, redis_url: str, *, ping_seconds: float = 5.0):
        self.redis_url = redis_url
        self.ping_seconds = ping_seconds
        self._wakes: dict[str, set[Wake]] = {}
        self._client: Any = None
        self._pubsub: Any = None
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        # The PINGs in flight, oldest first: when each was sent, and the request it confirms (None:
        # the liveness ping).
        self._pings: collections.deque[tuple[float, Wake | None]] = collections.deque()
        self._closing = False
        self.healthy = False

    async def start(self) -> None:
        if self._task is None:
            # A context of its own, as the delta reader's: it serves every request after the first
            # that started it, so its lines and spans are none of that request's (docs/adr/0128).
            self._task = asyncio.create_task(self._run(), name="oai-completion-signal", context=contextvars.Context())

    async def ensure_started(self) -> None:
        """Started with the first wait; the first connection gets a moment, so that the first
        request is woken by its signal."""
        if self._task is None:
            await self.start()
            with contextlib.suppress(TimeoutError):
                await within(self._ready.wait(), 0.5)

    async def close(self) -> None:
        self._closing = True
        await cancel_and_wait(self._task)
        await self._drop()

    async def register(self, request_id: str) -> Wake:
        wake = Wake()
        channel = CHAT_SIGNAL_CHANNEL_PREFIX + request_id
        wakes = self._wakes.setdefault(channel, set())
        wakes.add(wake)
        if self._pubsub is None or not self.healthy:
            wake.listening = False
            return wake
        try:
            if len(wakes) == 1:
                await within(self._pubsub.subscribe(channel), SIGNAL_COMMAND_TIMEOUT_SECONDS)
            # Listening once Redis answered after the subscribe: a PONG, which the reader awaits.
            # (Queued before it is sent, so the queue keeps the order of the PINGs on the wire; on a
            # hung Redis no PONG comes at all, so an order off by one never confirms a request.)
            wake.listening = False
            self._pings.append((time.monotonic(), wake))
            await within(self._pubsub.ping(), SIGNAL_COMMAND_TIMEOUT_SECONDS)
        except Exception as error:  # the reader reconnects; the request polls meanwhile
            log.warning("completion signal subscribe failed: %s", error)
            self._fail()
        return wake

    async def unregister(self, request_id: str, wake: Wake) -> None:
        channel = CHAT_SIGNAL_CHANNEL_PREFIX + request_id
        wakes = self._wakes.get(channel)
        if not wakes:
            return
        wakes.discard(wake)
        if not wakes:
            del self._wakes[channel]
            if self._pubsub is not None and self.healthy:
                with contextlib.suppress(Exception):
                    await within(self._pubsub.unsubscribe(channel), SIGNAL_COMMAND_TIMEOUT_SECONDS)

    def _fail(self) -> None:
        self.healthy = False
        self._pings.clear()
        for wakes in self._wakes.values():
            for wake in wakes:
                wake.listening = False
                wake.set(None)

    async def _drop(self) -> None:
        pubsub, client = self._pubsub, self._client
        self._pubsub = self._client = None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _connect(self) -> None:
        import redis.asyncio as aioredis

        self._client = aioredis.Redis.from_url(
            self.redis_url, socket_connect_timeout=2, socket_timeout=None, health_check_interval=0
        )
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        # Subscribe to a fixed channel first so the connection exists even with no request waiting.
        await self._pubsub.subscribe(CHAT_SIGNAL_CHANNEL_PREFIX + "front-liveness")
        if self._wakes:
            await self._pubsub.subscribe(*self._wakes)
        # A hung server still accepts the connection and the commands: only a PONG shows it answers.
        await within(self._pubsub.ping(), SIGNAL_COMMAND_TIMEOUT_SECONDS)
        await self._await_pong(time.monotonic() + SIGNAL_COMMAND_TIMEOUT_SECONDS)
        self.healthy = True
        for wakes in self._wakes.values():
            for wake in wakes:
                wake.listening = True
        self._ready.set()

    async def _run(self) -> None:
        backoff = 0.5
        while not self._closing:
            try:
                await self._connect()
                backoff = 0.5
                last_ping = time.monotonic()
                while True:
                    interval = min(self.ping_seconds, SIGNAL_BUSY_PING_SECONDS) if self._wakes else self.ping_seconds
                    # Woken often enough that a request that registers meets the shorter interval, and
                    # by the oldest PONG's deadline.
                    timeout = min(SIGNAL_BUSY_PING_SECONDS, interval - (time.monotonic() - last_ping))
                    if self._pings:
                        timeout = min(timeout, self._pings[0][0] + SIGNAL_COMMAND_TIMEOUT_SECONDS - time.monotonic())
                    timeout = max(0.01, timeout)
                    message = await within(
                        self._pubsub.get_message(ignore_subscribe_messages=False, timeout=timeout),
                        timeout + 2.0,
                    )
                    if message is not None:
                        if message.get("type") == "pong":
                            if self._pings:  # PONGs come back in the order of their PINGs
                                _sent, wake = self._pings.popleft()
                                if wake is not None:
                                    wake.listening = self.healthy
                        else:
                            self._dispatch(message)
                    now = time.monotonic()
                    if self._pings and now > self._pings[0][0] + SIGNAL_COMMAND_TIMEOUT_SECONDS:
                        raise TimeoutError(f"no PONG within {SIGNAL_COMMAND_TIMEOUT_SECONDS} s")
                    if not self._pings and now - last_ping >= interval:
                        last_ping = now
                        self._pings.append((now, None))
                        await within(self._pubsub.ping(), SIGNAL_COMMAND_TIMEOUT_SECONDS)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if not self._closing:
                    log.warning("completion signal connection lost (%s): reconnecting", error)
                self._fail()
                await self._drop()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _await_pong(self, deadline: float) -> None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no PONG within {SIGNAL_COMMAND_TIMEOUT_SECONDS} s")
            message = await within(
                self._pubsub.get_message(ignore_subscribe_messages=False, timeout=left), left + 1.0
            )
            if message is not None and message.get("type") == "pong":
                return
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        if message.get("type") != "message":
            return
        channel = message.get("channel")
        if isinstance(channel, bytes):
            channel = channel.decode()
        wakes = self._wakes.get(channel) if isinstance(channel, str) else None
        if not wakes:
            return
        try:
            data = json.loads(message.get("data") or b"{}")
        except ValueError:
            data = {}
        for wake in list(wakes):
            wake.set(data if isinstance(data, dict) else {})


class InProcessSignalListener:
    """Without Redis, in a process that also runs the horde's native API (the embedded default):
    the completion signal's messages that this process's horde would have published, handed over
    in process (hordesite/asgi.py; docs/adr/0054). Its wakes are not `listening`, so a waiting
    request still reads every poll_seconds, as without a listener: a message published by another
    process (a sweep in the Celery worker) reaches no one here. A message only brings the read
    forward."""

    healthy = True

    def __init__(self) -> None:
        self._wakes: dict[str, set[Wake]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def ensure_started(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        self._wakes.clear()

    async def register(self, request_id: str) -> Wake:
        wake = Wake(listening=False)
        self._wakes.setdefault(request_id, set()).add(wake)
        return wake

    async def unregister(self, request_id: str, wake: Wake) -> None:
        wakes = self._wakes.get(request_id)
        if wakes is not None:
            wakes.discard(wake)
            if not wakes:
                del self._wakes[request_id]

    def deliver(self, message: dict[str, Any]) -> None:
        """From any thread (the horde's submit commits on a serving thread)."""
        loop = self._loop
        if loop is None or loop.is_closed() or message.get("id") not in self._wakes:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        if not isinstance(request_id, str):  # deliver let through only ids it has wakes for
            return
        for wake in list(self._wakes.get(request_id, ())):
            wake.set(dict(message))


class InProcessSignals:
    """The process's in-process listeners (one per front state, so per event loop). Off until the
    process that mounts the native API turns it on (hordesite/asgi.py, without Redis)."""

    def __init__(self) -> None:
        self.enabled = False
        self._listeners: weakref.WeakSet[InProcessSignalListener] = weakref.WeakSet()

    def listener(self) -> InProcessSignalListener:
        listener = InProcessSignalListener()
        self._listeners.add(listener)
        return listener

    def publish(self, message: dict[str, Any]) -> None:
        for listener in list(self._listeners):
            listener.deliver(message)


in_process_signals = InProcessSignals()


@dataclass
class WaitBudget:
    """The request's deadline, from its arrival: nonstream_timeout_seconds or stream_timeout_seconds."""

    started: float
    seconds: float

    @property
    def deadline(self) -> float:
        return self.started + self.seconds

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def end_by(self, when: float) -> None:
        """The budget ends at `when` at the latest (a stopping process's deadline)."""
        self.seconds = min(self.seconds, when - self.started)


class ChatRequestWatcher:
    """Waits for the next reason to read one request's status. `polls`: the signal announces only
    some of the request's changes (a text request's submit, docs/adr/0055), so the periodic read is
    a poll every poll_seconds, which a signal brings forward."""

    def __init__(
        self,
        *,
        wake: Wake | None,
        budget: WaitBudget,
        recheck_seconds: float,
        poll_seconds: float,
        disconnected: asyncio.Event | None,
        polls: bool = False,
        stopping: asyncio.Event | None = None,
    ):
        self.wake = wake
        self.budget = budget
        polls = polls or wake is None
        self.recheck_seconds = poll_seconds if polls else recheck_seconds
        self.poll_seconds = poll_seconds
        self.periodic_source = WakeSource.POLL if polls else WakeSource.RECHECK
        self.disconnected = disconnected
        # The signal's and the disconnect's waits outlive one next_wake: a relayed stream calls it
        # for every delta, and making and cancelling a task per source per call was most of its cost.
        self._signal_waiter: asyncio.Future | None = None
        self._disconnect_waiter: asyncio.Future | None = None
        # The process's stop (FrontState.stopping) wakes the request once.
        self.stopping = stopping
        self._stopping_waiter: asyncio.Future | None = None

    # Without `keepalive_at` a wake always has a source.
    @overload
    async def next_wake(
        self,
        *,
        not_after: float | None = None,
        keepalive_at: None = None,
        deltas: asyncio.Event | None = None,
    ) -> WakeSource: ...

    @overload
    async def next_wake(
        self,
        *,
        not_after: float | None = None,
        keepalive_at: float | None,
        deltas: asyncio.Event | None = None,
    ) -> WakeSource | None: ...

    async def next_wake(
        self,
        *,
        not_after: float | None = None,
        keepalive_at: float | None = None,
        deltas: asyncio.Event | None = None,
    ) -> WakeSource | None:
        """Block until the next read is due. Returns its source, or None when `keepalive_at` came
        first (the caller sends a keepalive comment and calls again), or DELTA when `deltas` (a
        relayed stream's subscription) was set first."""
        now = time.monotonic()
        # While the listener has lost Redis, no signal can come: poll as without Redis.
        listening = self.wake is None or self.wake.listening
        interval, periodic = (self.recheck_seconds, self.periodic_source) if listening else (self.poll_seconds, WakeSource.POLL)
        due = min(now + interval, self.budget.deadline)
        source = periodic if due < self.budget.deadline else WakeSource.DEADLINE
        if not_after is not None and not_after < due:
            due, source = not_after, WakeSource.RECHECK
        timer_source: WakeSource | None = source
        if keepalive_at is not None and keepalive_at < due:
            due, timer_source = keepalive_at, None
        waiters: list[asyncio.Future] = []
        # Deltas first: an ended marker is appended before the cancelled signal is published.
        if deltas is not None and deltas.is_set():
            return WakeSource.DELTA
        if self.wake is not None:
            if self.wake.event.is_set():
                return self._take_signal(self.wake)
            if self._signal_waiter is None or self._signal_waiter.done():
                self._signal_waiter = asyncio.ensure_future(self.wake.event.wait())
            waiters.append(self._signal_waiter)
        if self.disconnected is not None:
            if self.disconnected.is_set():
                return WakeSource.DISCONNECT
            if self._disconnect_waiter is None or self._disconnect_waiter.done():
                self._disconnect_waiter = asyncio.ensure_future(self.disconnected.wait())
            waiters.append(self._disconnect_waiter)
        if self.stopping is not None:
            if self.stopping.is_set():
                return self._take_stop()
            if self._stopping_waiter is None or self._stopping_waiter.done():
                self._stopping_waiter = asyncio.ensure_future(self.stopping.wait())
            waiters.append(self._stopping_waiter)
        deltas_waiter = asyncio.ensure_future(deltas.wait()) if deltas is not None else None
        if deltas_waiter is not None:
            waiters.append(deltas_waiter)
        try:
            if waiters:
                await asyncio.wait(
                    waiters, timeout=max(0.0, due - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
                )
            else:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
        finally:
            if deltas_waiter is not None and not deltas_waiter.done():
                deltas_waiter.cancel()
        if self.disconnected is not None and self.disconnected.is_set():
            return WakeSource.DISCONNECT
        if self.stopping is not None and self.stopping.is_set():
            return self._take_stop()
        if deltas is not None and deltas.is_set():
            return WakeSource.DELTA
        if self.wake is not None and self.wake.event.is_set():
            return self._take_signal(self.wake)
        return timer_source

    def close(self) -> None:
        """The request is over: its waits end with it."""
        for waiter in (self._signal_waiter, self._disconnect_waiter, self._stopping_waiter):
            if waiter is not None and not waiter.done():
                waiter.cancel()
        self._signal_waiter = self._disconnect_waiter = self._stopping_waiter = None

    def _take_stop(self) -> WakeSource:
        """The stop wakes once; the request's budget, cut to the stop's deadline, ends its wait."""
        self.stopping = None
        if self._stopping_waiter is not None and not self._stopping_waiter.done():
            self._stopping_waiter.cancel()
        self._stopping_waiter = None
        return WakeSource.STOPPING

    def _take_signal(self, wake: Wake) -> WakeSource:
        """A message woke the request (signal), or the listener lost its connection (recheck)."""
        wake.event.clear()
        if wake.signal_lost:
            wake.signal_lost = False
            return WakeSource.RECHECK
        return WakeSource.SIGNAL
