"""The SSE body of a streamed /v1 request: the first status read passed, so the headers go out with
a first comment; keepalives while waiting, then the reply whole (events 1-7), or, for a request
whose deltas are relayed (oai.schema.relays_deltas, on a front with Redis), each delta as it
arrives (oai.deltas); an error after the headers is an SSE error event."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

from oai import sse
from oai.deltas import RelayedStream
from oai.errors import ChatFrontError
from oai.mapping import Completion
from oai.run import ChatRun, Delivered
from oai.text_reply import TextCompletion, build_text_completion_events
from oai.waiter import WakeSource

log = logging.getLogger("oai")


async def stream_completion(
    run: ChatRun, completion: Completion | TextCompletion | None
) -> AsyncGenerator[bytes, None]:
    """The SSE body: a first comment (the headers go out with it), keepalives while waiting, then the
    reply whole (events 1-7) or an SSE error event."""
    metrics = run.state.metrics
    keepalive = run.settings.keepalive_seconds
    relayed = run.relayed
    try:
        watcher = run.watcher
        assert watcher is not None, "start_wait first"
        yield sse.build_keepalive_event()
        not_after = run.not_after
        next_keepalive = time.monotonic() + keepalive  # keepalive seconds after the last bytes sent
        while completion is None:
            while True:
                source = await watcher.next_wake(
                    not_after=not_after,
                    keepalive_at=next_keepalive,
                    deltas=relayed.event if relayed is not None else None,
                )
                if source is None:
                    yield sse.build_keepalive_event()
                    next_keepalive = time.monotonic() + keepalive
                    continue
                if source == WakeSource.DELTA:
                    assert relayed is not None  # a DELTA wake needs its deltas to wait on
                    for event in pending_events(run, relayed):
                        yield event
                        next_keepalive = time.monotonic() + keepalive
                    check_relay(run, relayed)
                    continue
                break
            if source == WakeSource.DISCONNECT:
                run.client_closed()
                return
            outcome = await run.read(source)
            if isinstance(outcome, Delivered):
                completion = outcome.completion
            else:
                not_after = outcome.not_after
        run.delivered(completion)
        if relayed is not None:
            # Entries read before the reply (in the same wake, or before the first read found it
            # done) are sent before it: they may expose the stream, and are then its first content.
            for event in pending_events(run, relayed):
                yield event
            check_relay(run, relayed)
        # A text request's stream is never relayed (ChatRun.relays).
        if isinstance(completion, TextCompletion):
            events = build_text_completion_events(completion, include_usage=run.request.include_usage)
        elif relayed is not None and relayed.exposed:
            events = relayed.final_events(completion, include_usage=run.request.include_usage)
        else:
            events = sse.build_completion_events(completion, include_usage=run.request.include_usage)
        run.first_content_sent()  # the reply's chunks, unless a relayed delta came first
        for event in events:
            yield event
    except ChatFrontError as error:
        run.trace.fail(error, after_headers=True)
        metrics.stream_failures.add(1, {"horde.code": error.code or ""})
        for event in sse.build_error_events(error, run.request_id):
            yield event
    except (asyncio.CancelledError, GeneratorExit):
        run.client_closed()
        raise
    except Exception:  # a defect: the client gets an error event, not a stream left open
        log.exception("the stream of request %s failed after its headers", run.request_id)
        crashed = stream_crashed()
        run.trace.fail(crashed, after_headers=True)
        metrics.stream_failures.add(1, {"horde.code": crashed.code or ""})
        run.cancel_in_background()  # the reply cannot reach its client; a done request is unchanged
        for event in sse.build_error_events(crashed, run.request_id):
            yield event
    finally:
        await run.finish()


class StartedStream:
    """A stream whose first event was already taken, so that the generator has started: its `finally`
    (the run's finish: the cancel of an undelivered request, the in-flight slot) then runs however
    the answer ends, whether it is read to the end, closed, or dropped unread (the event loop closes
    a started generator that is dropped; an unstarted one would end without running anything)."""

    def __init__(self, first: bytes, events: AsyncGenerator[bytes, None]) -> None:
        self._first: bytes | None = first
        self._events = events

    def __aiter__(self) -> StartedStream:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._events.__anext__()

    async def athrow(self, error: BaseException) -> bytes:
        """`error` raised in the stream where it waits (its own guard records it, cancels the
        request and answers with its error event, which is returned)."""
        self._first = None
        return await self._events.athrow(error)

    async def aclose(self) -> None:
        self._first = None
        await self._events.aclose()


async def start_stream(events: AsyncGenerator[bytes, None]) -> StartedStream:
    """`events` started (stream_completion yields its first comment at once)."""
    return StartedStream(await events.__anext__(), events)


def stream_crashed() -> ChatFrontError:
    return ChatFrontError(
        500,
        "InternalError",
        "The AI Horde front failed while streaming this request, which it cancelled; send it again.",
        type="api_error",
    )


def pending_events(run: ChatRun, relayed: RelayedStream) -> list[bytes]:
    """The relayed chunks of the entries read so far; the ones that expose the stream are the
    request's first content (relayed true)."""
    events = relayed.pending_events()
    if relayed.exposed:
        run.first_content_sent(relayed=True)
    return events


def check_relay(run: ChatRun, relayed: RelayedStream) -> None:
    """A relayed stream that an entry broke (another attempt, its ended marker, a gap) ends in
    ChatStreamDiverged, and the request is cancelled."""
    error = relayed.diverged
    if error is not None:
        run.cancel_in_background()
        raise error
