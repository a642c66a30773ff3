"""The stream of a background response (docs/adr/0106-resumable-background-streams.md): what
`POST /v1/responses` with `background: true, stream: true` answers, and what
`GET /v1/responses/{id}?stream=true&starting_after=N` answers for a background response.

The sequence is built from the response's state alone, so every reader, live or resuming, sees the
same events under the same sequence numbers: `response.created` and `response.queued` (its queued
object), `response.in_progress` once a worker took its request (or with the rest), then, once its
request ended, its output's events and its end
(oai.responses.events, ResponseEvents.replay). A reader waits for the end as the watcher does
(oai.responses.background: the completion signal, else polling; keepalive comments meanwhile), and
stops at once when its client leaves: the request is a background one, so nothing is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

from oai import sse
from oai.errors import ChatFrontError
from oai.response_items import ResponseItemsUnavailable
from oai.responses.background import ACTIVE_STATUSES, COLLECT_SECONDS, completion_wake, current, pending
from oai.responses.events import ResponseEvents
from oai.responses.kept import kept_response
from oai.responses.reply import queued_response
from oai.waiter import ChatRequestWatcher, WaitBudget, WakeSource

log = logging.getLogger("oai")

# The sequence number of the first event after the start (response.created, response.queued).
AFTER_START = 2
NOT_BACKGROUND = "This response cannot be streamed because it was not created with background=true."
# A stream asked of a stopping process would end at once, without its end: read it from one that stays.
STREAM_STOPPING = "This AI Horde front is restarting; read this response's stream again (its request runs on)."


@dataclass
class ReplayedRequest:
    """The events' view of a background response's request: what they read of it comes from its
    response objects (ResponseEvents.replay names the namespaced calls from the output)."""

    echo: dict[str, Any] = field(default_factory=dict)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)


def streamable(record: Mapping[str, Any]) -> bool:
    """Whether a kept record is a background response's (pending, or finished)."""
    return pending(record) or bool((record.get("response") or {}).get("background"))


def stream_created(
    state: Any, api_key: str, request_id: str, queued: dict[str, Any], *, disconnected: asyncio.Event | None
) -> AsyncGenerator[bytes, None]:
    """The stream of a background response just created (its `queued` object)."""
    return _stream(state, api_key, queued, request_id=request_id, finished=None, starting_after=None, disconnected=disconnected)


def stream_kept(
    state: Any, api_key: str, record: Mapping[str, Any], *, starting_after: int | None, disconnected: asyncio.Event | None
) -> AsyncGenerator[bytes, None]:
    """The stream of a kept background response (streamable), its events after `starting_after`."""
    if pending(record):
        queued = queued_response(record["response"], model=record["response"]["model"])
        return _stream(
            state,
            api_key,
            queued,
            request_id=record["background"]["request_id"],
            finished=None,
            starting_after=starting_after,
            disconnected=disconnected,
        )
    finished = kept_response(record)
    # A record finished before ADR 0106 kept no queued model: its own model stands in.
    queued = queued_response(finished, model=record.get("queued_model") or finished["model"])
    return _stream(
        state, api_key, queued, request_id=None, finished=finished, starting_after=starting_after, disconnected=disconnected
    )


def _after(events: list[bytes], first: int, starting_after: int | None) -> bytes:
    """The events numbered after `starting_after`, of `events` numbered from `first` (each is one)."""
    return b"".join(event for number, event in enumerate(events, first) if starting_after is None or number > starting_after)


@dataclass
class _Ended:
    """The finished response a reader waited for (None: it stopped waiting first)."""

    response: dict[str, Any] | None = None


async def _stream(
    state: Any,
    api_key: str,
    queued: dict[str, Any],
    *,
    request_id: str | None,
    finished: dict[str, Any] | None,
    starting_after: int | None,
    disconnected: asyncio.Event | None,
) -> AsyncGenerator[bytes, None]:
    kept_id = queued["id"]
    writer = ResponseEvents(ReplayedRequest(), kept_id.removeprefix("resp_"), created=queued["created_at"], model=queued["model"])
    in_progress_sent = False
    state.background_streams += 1
    try:
        # The headers go out at once, with the start or, when the reader has it, a comment.
        yield _after(writer.start_queued(queued), 0, starting_after) or sse.build_keepalive_event()
        if finished is None:
            assert request_id is not None
            ended = _Ended()
            async with contextlib.aclosing(_wait(state, api_key, kept_id, request_id, disconnected, ended)) as waiting:
                async for keepalive in waiting:
                    if keepalive is not None:
                        yield keepalive
                    elif not in_progress_sent:  # a worker took it: the third event now, not at the end
                        in_progress_sent = True
                        event = _after([writer.in_progress(queued)], AFTER_START, starting_after)
                        if event:
                            yield event
            if ended.response is None:  # the reader left, the process stops, or the response was deleted
                return
            finished = ended.response
        first = AFTER_START + 1 if in_progress_sent else AFTER_START
        events = _after(writer.replay(queued, finished, in_progress_sent=in_progress_sent), first, starting_after)
        if events:
            yield events
    finally:
        state.background_streams -= 1


async def _wait(
    state: Any, api_key: str, kept_id: str, request_id: str, disconnected: asyncio.Event | None, ended: _Ended
) -> AsyncGenerator[bytes | None, None]:
    """Keepalive comments (and None each time it reads the request taken by a worker) until the
    background response ended, then `ended` holds its finished
    response. Ends without it when the client left, the process stops (the reader resumes
    elsewhere), the response was deleted, or COLLECT_SECONDS passed."""
    settings = state.settings
    async with completion_wake(state, request_id) as wake:
        watcher = ChatRequestWatcher(
            wake=wake,
            budget=WaitBudget(time.monotonic(), COLLECT_SECONDS),
            recheck_seconds=settings.signal_recheck_seconds,
            poll_seconds=settings.poll_seconds,
            disconnected=disconnected,
            stopping=state.stopping,
        )
        next_keepalive = time.monotonic() + settings.keepalive_seconds
        try:
            while True:
                try:
                    record = await state.response_items.record(api_key, kept_id)
                    if record is None:  # deleted meanwhile
                        return
                    now = await current(state, api_key, kept_id, record) if pending(record) else kept_response(record)
                    if now["status"] not in ACTIVE_STATUSES:
                        ended.response = now
                        return
                    if now["status"] == "in_progress":
                        yield None  # a worker took it
                except (ChatFrontError, ResponseItemsUnavailable) as error:  # read again at the next wake
                    log.info("background response %s not read this time: %s", kept_id, error)
                # The next read is due at a time of its own: a keepalive due first must not put it off
                # again (with keepalives as often as the rechecks, nothing but a signal would read).
                listening = wake is not None and wake.listening
                read_at = time.monotonic() + (settings.signal_recheck_seconds if listening else settings.poll_seconds)
                while (source := await watcher.next_wake(not_after=read_at, keepalive_at=next_keepalive)) is None:
                    yield sse.build_keepalive_event()
                    next_keepalive = time.monotonic() + settings.keepalive_seconds
                if source in (WakeSource.DISCONNECT, WakeSource.STOPPING, WakeSource.DEADLINE):
                    return
        finally:
            watcher.close()
