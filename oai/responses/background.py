"""Background responses (`background: true`, docs/adr/0102-responses-background.md).

The request is screened, admitted and submitted as any other, without a front lease (no client
waits on it; the front's id alone, so that a record it cannot keep ends it undelivered,
docs/adr/0110), and answered at once with the `response` object in status `queued`. Its record is
kept (oai.response_items) with what reading its progress needs under `background`: the horde
request's id and what the reply is built from. Nothing else lives in the process: any front
process with the same Redis reads the native status (`current`) and builds the response object of
that moment; the first read that finds the request ended keeps the finished record (the whole
response, its output items kept by id), after which the record is an ordinary kept response. The
process that submitted it also watches it (`collect`), so that a reply nobody reads before the
horde deletes its request (its time to live) is kept all the same. The read that keeps the
finished record counts the delivery's metrics, once (docs/adr/0110).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from contract.aio import within
from oai.errors import ChatFrontError
from oai.horde_client import NativeAnswer, NativeUnreachable, request_gone
from oai.mapping import Completion
from oai.response_items import ResponseItemsUnavailable
from oai.responses.kept import kept_response
from oai.responses.reply import build_finished_response, build_response_object, response_id
from oai.responses.request import ResponsesRequest

log = logging.getLogger("oai")

# The statuses of a background response whose request may still run.
ACTIVE_STATUSES = ("queued", "in_progress")
# The process that submitted a request watches it no longer than this (a request no worker pops is
# deleted by the horde after its time to live, HORDE_TEXT_REQUEST_TTL_SECONDS, 20 min by default;
# each pop starts it again).
COLLECT_SECONDS = 3 * 60 * 60
GONE_MESSAGE = "The request no longer exists on the AI Horde (it expired before a worker finished it)."
CANCEL_ONLY_BACKGROUND = "Only responses created with background=true can be cancelled."


@dataclass(frozen=True)
class KeptRequest:
    """What a reply reads of its request (oai.mapping.RepliedRequest), as the record keeps it."""

    requested_models: list[str]
    include_reasoning: bool
    estimated_prompt: int

    def prompt_estimate(self) -> int:
        return self.estimated_prompt


def pending(record: Mapping[str, Any]) -> bool:
    """Whether a kept record is a background response not finished yet."""
    return "background" in record


async def start(
    state: Any, api_key: str, request: ResponsesRequest, request_id: str, created: int, *, submitted_at: float | None
) -> dict[str, Any]:
    """The `queued` response object of a submitted background request, once its record is kept.
    `submitted_at`: when the horde acknowledged its submit (wall clock), from which its delivery's
    first_content.duration is measured. Raises ResponseItemsUnavailable when it could not be kept
    (the caller cancels the request)."""
    queued = build_response_object(
        request.echo, request_id, created=created, model=request.requested_models[0], status="queued"
    )
    background = {
        "request_id": request_id,
        "created": created,
        "echo": request.echo,
        "namespaced": request.namespaced,
        "models": request.requested_models,
        "include_reasoning": request.include_reasoning,
        "prompt_estimate": request.prompt_estimate(),
        "submitted_at": submitted_at,
        "stream": request.stream,
    }
    kept_id = response_id(request_id)
    pending_record = {
        "response": queued,
        "previous_response_id": request.previous_response_id,
        "turn_input": request.turn_input,
        "background": background,
    }
    await state.response_items.keep_pending(api_key, **pending_record)
    state.spawn_collector(collect(state, api_key, kept_id, request_id, pending_record))
    return queued


async def current(state: Any, api_key: str, kept_id: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """The response object of a pending background record now, from its request's native status
    (in process, as ChatRun reads it). The first read that finds the request ended keeps the
    finished record. Raises ChatFrontError 503 when the horde cannot be read."""
    background = record["background"]
    try:
        answer = await state.client.status(background["request_id"])
    except NativeUnreachable as error:
        raise ChatFrontError(
            503, "HordeUnavailable", f"The AI Horde could not be reached: {error}", type="api_error", retry_after=1
        ) from None
    gone = request_gone(answer)
    if not gone and not answer.ok:
        raise ChatFrontError(
            503,
            "HordeUnavailable",
            "The AI Horde did not answer this response's status; read it again.",
            type="api_error",
            retry_after=1,
        )
    finished, completion = _ended(background, answer)
    if finished is None:
        status = answer.body if isinstance(answer.body, dict) else {}
        progress = "in_progress" if int(status.get("processing") or 0) > 0 else "queued"
        return {**record["response"], "status": progress, "output": []}
    return await _keep_finished(state, api_key, kept_id, record, finished, completion)


def _finished(background: Mapping[str, Any], answer: NativeAnswer) -> dict[str, Any] | None:
    """The finished response object of a native status, None while the request may still run."""
    return _ended(background, answer)[0]


def _ended(
    background: Mapping[str, Any], answer: NativeAnswer
) -> tuple[dict[str, Any], Completion | None] | tuple[None, None]:
    """The finished response object of a native status, with the completion it delivers when the
    request ended with a reply; (None, None) while the request may still run."""
    queued = build_response_object(
        background["echo"],
        background["request_id"],
        created=background["created"],
        model=background["models"][0],
        status="queued",
    )
    if request_gone(answer):
        return {**queued, "status": "failed", "error": {"code": "server_error", "message": GONE_MESSAGE}}, None
    status = answer.body if isinstance(answer.body, dict) else {}
    if status.get("generations"):
        request = KeptRequest(
            requested_models=background["models"],
            include_reasoning=background["include_reasoning"],
            estimated_prompt=background["prompt_estimate"],
        )
        completion = Completion(request, background["request_id"], background["created"], status)
        namespaced = {name: (pair[0], pair[1]) for name, pair in background["namespaced"].items()}
        finished = build_finished_response(
            completion, echo=background["echo"], namespaced=namespaced, request_id=background["request_id"]
        )
        return finished, completion
    if status.get("faulted"):
        message = status.get("fault_reason") or "The request faulted on the AI Horde."
        return {**queued, "status": "failed", "error": {"code": "server_error", "message": message}}, None
    if status.get("done") and not status.get("waiting") and not status.get("processing"):
        return {**queued, "status": "cancelled"}, None  # ended without a reply: cancelled on the horde
    return None, None


async def _keep_finished(
    state: Any,
    api_key: str,
    kept_id: str,
    record: Mapping[str, Any],
    finished: dict[str, Any],
    completion: Completion | None = None,
) -> dict[str, Any]:
    """Keep a background response's finished record, unless another read (a cancel, the watcher)
    finished it first: then that one is the response; or it was deleted meanwhile: then nothing is
    kept (the check and the write are one step: ResponseItems.keep_finished). The read that keeps
    it delivers `completion`, counted then as a foreground reply is at its answer: once per
    response, whichever process or read keeps it (docs/adr/0110)."""
    items = state.response_items
    try:
        if await items.keep_finished(
            api_key,
            response=finished,
            previous_response_id=record["previous"],
            turn_input=record["input"],
            queued_model=record["response"]["model"],
        ):
            if completion is not None:
                _count_delivered(state, record["background"], completion)
            return finished
        again = await items.record(api_key, kept_id)
    except ResponseItemsUnavailable as error:
        log.warning("keeping finished background response %s failed: %s", kept_id, error)
        return finished
    return kept_response(again) if again is not None and not pending(again) else finished


def _count_delivered(state: Any, background: Mapping[str, Any], completion: Completion) -> None:
    """The delivery metrics of a background reply (chat_front.md, Metrics): its completion, and its
    first content, readable from the moment its record is kept (a record from before this has no
    submit time, and records none)."""
    state.metrics.delivered(completion)
    submitted_at = background.get("submitted_at")
    if isinstance(submitted_at, int | float):
        state.metrics.first_content.record(
            max(0.0, time.time() - submitted_at),
            {"horde.streamed": bool(background.get("stream")), "horde.relayed": False},
        )


async def cancel(state: Any, api_key: str, kept_id: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """POST /v1/responses/{id}/cancel of a kept record of this key: a background response not
    finished is cancelled on the horde (settled as the native cancel: a job a worker holds is still
    paid for what it does) and is `cancelled`; a finished one is answered as it is. Raises
    ChatFrontError 400 for a response not made with background."""
    if not pending(record) and not (record.get("response") or {}).get("background"):
        raise ChatFrontError(400, None, CANCEL_ONLY_BACKGROUND, should_retry=False)
    if not pending(record):
        return kept_response(record)
    now = await current(state, api_key, kept_id, record)
    if now["status"] not in ACTIVE_STATUSES:  # it ended on its own meanwhile
        return now
    await state.cancels.cancel_within_budget(record["background"]["request_id"])
    # A reply that finished while the cancel was on its way is done and paid (a cancel of a done
    # request changes nothing, ADR 0064): the status read again answers and keeps it as it finished.
    with contextlib.suppress(ChatFrontError):  # unread: answered cancelled, as before the read
        after = await current(state, api_key, kept_id, record)
        if after["status"] not in ACTIVE_STATUSES:
            return after
    # Kept unless the reply finished (and the watcher or a GET kept it) while the cancel was on its
    # way, or the response was deleted meanwhile: as the watcher keeps a finished record.
    return await _keep_finished(state, api_key, kept_id, record, {**now, "status": "cancelled", "output": []})


async def cancel_before_delete(state: Any, record: Mapping[str, Any]) -> None:
    """DELETE /v1/responses/{id} of a background response not finished: its request is cancelled
    first (settled as the native cancel), as nobody could read its reply any more."""
    if pending(record):
        await state.cancels.cancel_within_budget(record["background"]["request_id"])


async def collect(
    state: Any, api_key: str, kept_id: str, request_id: str, pending_record: Mapping[str, Any] | None = None
) -> None:
    """Watch a background request from the process that submitted it until it ends, and keep its
    finished record: woken by its completion signal when the listener is healthy, else polling. A
    record Redis lost (restarted without its data) is kept again from `pending_record`, the one kept
    at the create, so that its reply is read, not run and charged for a client that cannot find it."""
    settings = state.settings
    try:
        async with completion_wake(state, request_id) as wake:
            deadline = time.monotonic() + COLLECT_SECONDS
            while time.monotonic() < deadline:
                listening = wake is not None and wake.listening
                seconds = settings.signal_recheck_seconds if listening else settings.poll_seconds
                if wake is not None:
                    with contextlib.suppress(TimeoutError):
                        await within(wake.event.wait(), seconds)
                    wake.event.clear()
                else:
                    await asyncio.sleep(seconds)
                try:
                    record = await state.response_items.record(api_key, kept_id)
                    if (
                        record is None
                        and pending_record is not None
                        and await state.response_items.lost(api_key, kept_id)
                    ):
                        log.warning("background response %s: Redis lost its record; kept again", kept_id)
                        await state.response_items.keep_pending(api_key, **pending_record)
                        continue
                    if record is None or not pending(record):
                        return
                    if (await current(state, api_key, kept_id, record))["status"] not in ACTIVE_STATUSES:
                        return
                except (ChatFrontError, ResponseItemsUnavailable) as error:
                    log.info("background response %s not read this time: %s", kept_id, error)
    except asyncio.CancelledError:
        # The process stops. Without Redis the record goes with it and nobody could read the reply:
        # the request is ended as a stopping front's, not run and charged (a record in Redis stays).
        if state.response_items.redis_url is None:
            await state.cancels.cancel_within_budget(request_id, undelivered=True)
        raise


@contextlib.asynccontextmanager
async def completion_wake(state: Any, request_id: str) -> AsyncIterator[Any]:
    """The completion signal's wake of `request_id` for the block (None without a listener), always
    unregistered after it. The listener's start and the register are shielded: a cancel (a stop, a
    client that leaves) must not cut a Redis subscribe in half, which can leave the shared
    connection waiting on a reply it never reads; a register a cancel overtook is undone once done."""
    listener = await asyncio.shield(state.ensure_listener())
    if listener is None:
        yield None
        return
    registering = asyncio.ensure_future(listener.register(request_id))
    try:
        yield await asyncio.shield(registering)
    finally:
        with contextlib.suppress(Exception):  # a register that failed has nothing to undo
            await listener.unregister(request_id, await asyncio.shield(registering))
