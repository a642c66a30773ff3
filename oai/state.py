"""One `FrontState` per process (per event loop): settings, metrics, the native client, the
completion signal listener, the in-flight limiter, the cancels and the front leases; the process's
stop (`stop_fronts`: the requests waiting end by its deadline, docs/adr/0076) and the shutdown
drain."""

from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass
from typing import Any

from contract.aio import within
from oai.admission import InflightLimiter
from oai.cancels import Cancels
from oai.deltas import build_delta_reader
from oai.front_lease import FrontLeaseRenewer
from oai.horde_client import HordeClient
from oai.metrics import FrontMetrics
from oai.response_items import ResponseItems
from oai.settings import FrontSettings, load_settings
from oai.waiter import CompletionSignalListener, InProcessSignalListener, in_process_signals

log = logging.getLogger("oai.requests")

# At a stop, a request's wait ends this long before the stop's deadline, plus the cancel's own
# bound (cancel_timeout_seconds): time to send its answer before the server cancels what is left.
STOP_ANSWER_SECONDS = 0.5


class FrontState:
    def __init__(self, settings: FrontSettings, *, meter: Any = None, propagate: bool = False):
        self.settings = settings
        self.limiter = InflightLimiter(settings.max_inflight, settings.max_inflight_per_source)
        self.metrics = FrontMetrics(meter, inflight=self.limiter.snapshot)
        self.client = HordeClient(settings, self.metrics, propagate=propagate)
        self.listener: CompletionSignalListener | InProcessSignalListener | None = None
        if settings.redis_url:
            self.listener = CompletionSignalListener(settings.redis_url, ping_seconds=settings.signal_ping_seconds)
        elif in_process_signals.enabled:
            self.listener = in_process_signals.listener()
        self.cancels = Cancels(settings, self.client, self.metrics)
        self.leases = (
            FrontLeaseRenewer(
                settings.redis_url,
                lease_seconds=settings.front_lease_seconds,
                renew_seconds=settings.front_lease_renew_seconds,
                open_ids=lambda: list(self.cancels.open_requests),
            )
            if settings.redis_url and settings.front_lease_seconds > 0
            else None
        )
        self.delta_reader = build_delta_reader(settings.redis_url, settings.stream_redis_db)
        self.response_items = ResponseItems(settings.redis_url, keep_seconds=settings.response_items_seconds)
        self._tasks: set[asyncio.Task] = set()
        # The watchers of the background responses this process submitted (oai.responses.background):
        # ended at shutdown, as any front process reads those responses from the horde.
        self._collectors: set[asyncio.Task] = set()
        # The streams of background responses being read now (oai.responses.background_stream).
        self.background_streams = 0
        self.started = False
        # Set when the process stops (stop_fronts): each waiting request wakes, and those not
        # delivered by stop_deadline (monotonic) are cancelled and answered FrontStopping.
        self.stopping = asyncio.Event()
        self.stop_deadline: float | None = None

    async def start(self) -> None:
        """The background tasks start when first needed: the listener with the first wait, the cancel
        retries with the first failed cancel (a refused request starts neither)."""
        self.started = True

    async def ensure_listener(self) -> CompletionSignalListener | InProcessSignalListener | None:
        if self.listener is not None:
            await self.listener.ensure_started()
        return self.listener

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def spawn_collector(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._collectors.add(task)
        task.add_done_callback(self._collectors.discard)
        return task

    def stop(self, deadline: float) -> None:
        """The process stops at `deadline` (monotonic): new requests are refused, and a waiting one
        ends its wait in time to cancel its horde request and send its answer before it."""
        self.stop_deadline = deadline - self.settings.cancel_timeout_seconds - STOP_ANSWER_SECONDS
        self.stopping.set()

    async def shutdown(self) -> None:
        """Drain: cancel the requests still open, send the failed cancels once more, close.

        Every step is bounded: a shutdown must end even when Redis or a native root stops answering
        (closing a pub/sub connection can wait on its reader)."""
        bound = self.settings.cancel_timeout_seconds + 0.5
        for task in list(self._collectors):
            task.cancel()
        if self._collectors:
            await asyncio.wait(list(self._collectors), timeout=bound)
        if self.leases is not None:
            await _bounded(self.leases.close(), bound)
        await _bounded(self.cancels.cancel_open_requests(), bound)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=bound)
        await _bounded(self.cancels.retry_failed(), bound)
        self.cancels.stop_retries()
        if self.listener is not None:
            await _bounded(self.listener.close(), bound)
        if self.delta_reader is not None:
            await _bounded(self.delta_reader.close(), bound)
        await _bounded(self.response_items.close(), bound)
        await _bounded(self.client.aclose(), bound)


async def _bounded(step, seconds: float) -> None:
    """Run one shutdown step for at most `seconds`; a step that fails or overruns is logged."""
    try:
        await within(step, seconds)
    except Exception as error:  # TimeoutError included
        log.warning("front shutdown step did not finish cleanly: %r", error)


@dataclass
class FrontConfig:
    """What the next FrontState is built with: tests pass a meter and settings; main sets propagate
    when telemetry is configured. None: the settings are read from the environment."""

    meter: Any = None
    settings: FrontSettings | None = None
    propagate: bool = False
    # The process's stop (monotonic), once stop_fronts ran: a state made after it starts stopped.
    stop_deadline: float | None = None


_config = FrontConfig()
_states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FrontState] = weakref.WeakKeyDictionary()


def configure_front(
    *, meter: Any = None, settings: FrontSettings | None = None, propagate: bool | None = None
) -> None:
    """Set what the next FrontState is built with and drop the current states."""
    _config.meter = meter
    _config.settings = settings
    if propagate is not None:
        _config.propagate = propagate
    _config.stop_deadline = None
    _states.clear()


async def get_front_state() -> FrontState:
    loop = asyncio.get_running_loop()
    state = _states.get(loop)
    if state is None:
        state = FrontState(_config.settings or load_settings(), meter=_config.meter, propagate=_config.propagate)
        if _config.stop_deadline is not None:
            state.stop(_config.stop_deadline)
        _states[loop] = state
    if not state.started:
        await state.start()
    return state


def current_states() -> list[FrontState]:
    return list(_states.values())


def stop_fronts(deadline: float) -> None:
    """The process stops at `deadline` (monotonic): every front state, and any made from now on."""
    _config.stop_deadline = deadline
    for state in current_states():
        state.stop(deadline)


async def close_fronts(seconds: float) -> None:
    """After a stop: each state's shutdown (open cancels sent, failed ones once more), all within
    `seconds`, so the stop stays bounded when the horde does not answer."""
    states = current_states()
    if states:
        await _bounded(asyncio.gather(*(state.shutdown() for state in states)), seconds)
