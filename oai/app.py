"""The routes of the OpenAI front (spec: chat_front.md): POST /v1/chat/completions, POST
/v1/completions (the same lifecycle over a native text request, docs/adr/0014-legacy-completions.md),
POST /v1/responses (the chat lifecycle in the Responses API's shapes, docs/adr/0101-responses-api.md)
and GET /v1/models.

A completions request is authenticated, screened (oai.schema, oai.text_completions), admitted (an
in-flight slot, oai.admission), then run (oai.run): non-streamed, the wait ends in the JSON body;
streamed, the first status read decides the HTTP answer and the stream carries the rest
(oai.streaming). The module map of the front is in docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from oai.admission import front_at_capacity
from oai.errors import ChatFrontError, front_stopping, invalid_api_key, request_crashed
from oai.horde_client import NativeUnreachable
from oai.mapping import build_completion, build_model_card
from oai.response_items import ResponseItems, ResponseItemsUnavailable
from oai.responses import background
from oai.responses.background_stream import (
    NOT_BACKGROUND,
    STREAM_STOPPING,
    stream_created,
    stream_kept,
    streamable,
)
from oai.responses.events import stream_response
from oai.responses.kept import (
    deleted_response,
    input_items_page,
    kept_response,
    response_not_found,
    stream_query,
)
from oai.responses.references import KEPT_FOR, PreparedBody, items_unavailable, resolve_references
from oai.responses.reply import build_response
from oai.responses.request import ResponsesRequest, screen_responses_request
from oai.run import ANONYMOUS_API_KEY, ChatRun
from oai.schema import model_not_found, parse_body, screen_request
from oai.state import get_front_state
from oai.streaming import start_stream, stream_completion
from oai.text_completions import TextCompletionRequest, screen_text_request
from oai.text_reply import TextCompletion, build_text_completion
from oai.trace import RequestTrace

log = logging.getLogger("oai")

# A completions body of this many bytes or more is parsed and screened on a thread of its own pool,
# off the event loop (docs/adr/0127): a 33 MiB body of images costs the loop about 0.4-0.9 s of
# parse and screening, while every other stream and request of the process waits. Below it the
# work stays on the loop: a few KB, most bodies, cost ~0.1-0.3 ms, and the thread hop ~0.05-0.1 ms;
# at this size the costliest shape (hundreds of tiny messages) is a few ms.
OFF_LOOP_BODY_BYTES = 16 * 1024
# The pool's threads: the work holds the interpreter lock, so more threads would run it no sooner,
# and a pool of its own leaves the loop's default executor (name lookups) to others.
BODY_THREADS = 2
_body_pool: concurrent.futures.ThreadPoolExecutor | None = None


@dataclass
class JsonAnswer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class StreamAnswer:
    events: AsyncIterator[bytes]
    headers: dict[str, str]



async def chat_completions(
    *,
    raw_body: bytes,
    api_key: str | None,
    headers: dict[str, str],
    source: str,
    disconnected: asyncio.Event | None = None,
) -> JsonAnswer | StreamAnswer:
    """POST /v1/chat/completions: the JSON answer, or the stream once the first read passed."""
    return await _completions(
        screen_request,
        raw_body=raw_body,
        api_key=api_key,
        headers=headers,
        source=source,
        disconnected=disconnected,
    )


async def text_completions(
    *,
    raw_body: bytes,
    api_key: str | None,
    headers: dict[str, str],
    source: str,
    disconnected: asyncio.Event | None = None,
) -> JsonAnswer | StreamAnswer:
    """POST /v1/completions (OpenAI's legacy completions) over a native text request: the same
    authentication, admission, wait, errors and cancels as chat completions."""
    return await _completions(
        screen_text_request,
        raw_body=raw_body,
        api_key=api_key,
        headers=headers,
        source=source,
        disconnected=disconnected,
    )


async def responses(
    *,
    raw_body: bytes,
    api_key: str | None,
    headers: dict[str, str],
    source: str,
    disconnected: asyncio.Event | None = None,
) -> JsonAnswer | StreamAnswer:
    """POST /v1/responses (OpenAI's Responses API) over a chat request: the chat route's
    authentication, admission, wait, relay, errors and cancels, in the Responses API's shapes."""
    items = (await get_front_state()).response_items

    async def resolve(body: Any, key: str) -> PreparedBody:
        return await resolve_references(body, key, items)

    return await _completions(
        partial(screen_responses_request, keeps_items=items.enabled),
        raw_body=raw_body,
        api_key=api_key,
        headers=headers,
        source=source,
        disconnected=disconnected,
        prepare=resolve,
    )


async def _completions(
    screen: Any,
    *,
    raw_body: bytes,
    api_key: str | None,
    headers: dict[str, str],
    source: str,
    disconnected: asyncio.Event | None,
    prepare: Callable[[Any, str], Awaitable[Any]] | None = None,
) -> JsonAnswer | StreamAnswer:
    state = await get_front_state()
    metrics = state.metrics
    # Counted for every request that carries it, refused ones included.
    retry_count = headers.get("x-stainless-retry-count", "0")
    if retry_count.isascii() and retry_count.isdigit() and int(retry_count) > 0:  # isdigit alone takes "²"
        metrics.client_retry_hints.add(1)
    try:
        api_key = _caller_key(state, api_key)
    except ChatFrontError as error:
        metrics.refused(error.status, error.code)
        return _json_error(error)
    try:
        request = await _screened(screen, raw_body, api_key, prepare)
    except ChatFrontError as error:
        metrics.refused(error.status, error.code)
        return _json_error(error)
    if state.stopping.is_set():  # a kept-alive connection's request during a stop: nothing submitted
        metrics.refused(503, "FrontStopping")
        return _json_error(front_stopping())
    slot = state.limiter.acquire(source)
    if slot is None:
        metrics.refused(503, "FrontAtCapacity")
        return _json_error(front_at_capacity(state.limiter, source))
    metrics.requests_admitted.add(1, {"horde.streamed": request.stream})
    trace = RequestTrace(
        streamed=request.stream,
        requested_model=",".join(request.requested_models),
        kind="Text" if isinstance(request, TextCompletionRequest) else "Chat",
    )
    in_background = isinstance(request, ResponsesRequest) and request.background
    run = ChatRun(state, request, trace, slot, disconnected, leased=not in_background)
    streaming_started = False
    try:
        if in_background:
            await _record_keepable(state)
        await run.submit(api_key, headers)
        if in_background:
            assert isinstance(request, ResponsesRequest)
            queued = await _start_background(state, api_key, request, run)
            if request.stream:  # its events from its state: a client that leaves cancels nothing (ADR 0106)
                stream = stream_created(state, api_key, run.submitted_id(), queued, disconnected=disconnected)
                return StreamAnswer(stream, {})
            return JsonAnswer(200, queued, {})
        await run.start_wait()
        completion = await run.first_decision()
        if request.stream:
            streaming_started = True
            # Started here: an answer dropped before its first read still finishes its run.
            chat_events = await start_stream(stream_completion(run, completion))
            if not isinstance(request, ResponsesRequest):
                return StreamAnswer(chat_events, {})
            keep = partial(keep_response, state, api_key, request) if request.echo["store"] else None
            events = stream_response(request, run.submitted_id(), run.created, chat_events, keep=keep)
            return StreamAnswer(events, {})
        if completion is None:
            completion = await run.wait(run.not_after)
        run.delivered(completion)
        if isinstance(completion, TextCompletion):
            body = build_text_completion(completion)
        elif isinstance(request, ResponsesRequest):
            body = build_response(completion, request, run.submitted_id())
            if request.echo["store"]:
                await keep_response(state, api_key, request, body)
        else:
            body = build_completion(completion)
        return JsonAnswer(200, body, {})
    except ChatFrontError as error:
        if isinstance(request, ResponsesRequest):
            error = request.responses_error(error)
        trace.fail(error)
        metrics.error(error.status, error.code, request.stream, error.reason)
        return _json_error(error, run.request_id)
    except asyncio.CancelledError:
        run.client_closed()
        raise
    except Exception:  # a defect: the client gets a 500 and its request is cancelled, not left queued
        log.exception("request %s failed before its answer", run.request_id)
        crashed = request_crashed()
        trace.fail(crashed)
        metrics.error(crashed.status, crashed.code, request.stream, crashed.reason)
        run.cancel_in_background()  # a done request is unchanged
        return _json_error(crashed, run.request_id)
    finally:
        if not streaming_started:
            await run.finish()


async def _screened(
    screen: Any, raw_body: bytes, api_key: str, prepare: Callable[[Any, str], Awaitable[Any]] | None
) -> Any:
    """The body parsed (oai.schema.parse_body), its references resolved (`prepare`, on the loop: it
    reads Redis) and screened: on the body threads for a body of OFF_LOOP_BODY_BYTES or more, inline
    below. Raises ChatFrontError, the same either way."""
    off_loop = len(raw_body) >= OFF_LOOP_BODY_BYTES
    if prepare is None:
        return await _body_work(off_loop, lambda: screen(parse_body(raw_body)))
    body = await _body_work(off_loop, parse_body, raw_body)
    body = await prepare(body, api_key)
    return await _body_work(off_loop, screen, body)


async def _body_work(off_loop: bool, work: Callable[..., Any], *args: Any) -> Any:
    """`work(*args)`, inline, or off the loop on the body threads (with the caller's context: its
    telemetry span)."""
    if not off_loop:
        return work(*args)
    global _body_pool
    if _body_pool is None:
        _body_pool = concurrent.futures.ThreadPoolExecutor(max_workers=BODY_THREADS, thread_name_prefix="oai-body")
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_body_pool, context.run, work, *args)


async def _record_keepable(state: Any) -> None:
    """Before a background request is submitted: a Redis that cannot keep its record is 503 with
    nothing queued (docs/adr/0107); only a Redis failing between this and the keep is left to the
    cancel below."""
    try:
        await state.response_items.reachable()
    except ResponseItemsUnavailable:
        raise items_unavailable() from None


async def _start_background(state: Any, api_key: str, request: ResponsesRequest, run: ChatRun) -> dict[str, Any]:
    """A submitted background request answered at once, queued (docs/adr/0102-responses-background.md);
    one whose record cannot be kept is cancelled as undelivered: its id would name nothing, so nobody
    could read its reply, and a job a worker popped meanwhile ends unpaid (docs/adr/0110)."""
    try:
        return await background.start(
            state, api_key, request, run.submitted_id(), run.created, submitted_at=run.trace.submitted_at
        )
    except ResponseItemsUnavailable:
        await run.cancel(undelivered=True)
        raise items_unavailable() from None


async def keep_response(state: Any, api_key: str, request: ResponsesRequest, response: dict[str, Any]) -> None:
    """A delivered response kept for later references to it (its items, previous_response_id) and
    reads of it."""
    await state.response_items.keep(
        api_key,
        response=response,
        previous_response_id=request.previous_response_id,
        turn_input=request.turn_input,
    )


# --- a kept response: GET /v1/responses/{id}, its input items, DELETE ------------------------------


async def retrieve_response(
    response_id: str,
    api_key: str | None,
    query: dict[str, str] | None = None,
    *,
    disconnected: asyncio.Event | None = None,
) -> JsonAnswer | StreamAnswer:
    """GET /v1/responses/{id}: the kept response as it was delivered; with `stream=true` (and
    `starting_after`), a background response's events (docs/adr/0106-resumable-background-streams.md)."""
    try:
        state = await get_front_state()
        record = await _kept_record(response_id, api_key)  # the key first, then the query, as every kept-response route
        stream, starting_after = stream_query(query or {})
        if stream:
            if not streamable(record):  # its events were not the background sequence (OpenAI refuses it too)
                raise ChatFrontError(400, "BadRequest", NOT_BACKGROUND, param="stream", should_retry=False)
            if state.stopping.is_set():
                raise front_stopping(STREAM_STOPPING)
            events = stream_kept(
                state, _caller_key(state, api_key), record, starting_after=starting_after, disconnected=disconnected
            )
            return StreamAnswer(events, {})
        if background.pending(record):  # as it is now, read from the horde (ADR 0102)
            return JsonAnswer(200, await background.current(state, _caller_key(state, api_key), response_id, record), {})
        if "response" not in record:  # kept before its object was (ADR 0103): continued, not read
            raise _not_kept(state.response_items, response_id)
        return JsonAnswer(200, kept_response(record), {})
    except ChatFrontError as error:
        return _json_error(error)


async def cancel_response(response_id: str, api_key: str | None) -> JsonAnswer:
    """POST /v1/responses/{id}/cancel: a background response of this key, cancelled unless it
    finished (docs/adr/0102-responses-background.md)."""
    try:
        state = await get_front_state()
        record = await _kept_record(response_id, api_key)
        return JsonAnswer(200, await background.cancel(state, _caller_key(state, api_key), response_id, record), {})
    except ChatFrontError as error:
        return _json_error(error)


async def list_input_items(response_id: str, api_key: str | None, query: dict[str, str]) -> JsonAnswer:
    """GET /v1/responses/{id}/input_items: a page of the kept response's own input items."""
    try:
        record = await _kept_record(response_id, api_key)
        return JsonAnswer(200, input_items_page(record, response_id, query), {})
    except ChatFrontError as error:
        return _json_error(error)


async def delete_response(response_id: str, api_key: str | None) -> JsonAnswer:
    """DELETE /v1/responses/{id}: the kept response and its output items forgotten; a background
    response not finished is cancelled first (docs/adr/0102-responses-background.md)."""
    state = await get_front_state()
    try:
        key = _caller_key(state, api_key)
        record = await state.response_items.record(key, response_id)
        if record is not None and background.pending(record):
            await background.cancel_before_delete(state, record)
        if not await state.response_items.forget(key, response_id):
            raise _not_kept(state.response_items, response_id)
    except ResponseItemsUnavailable:
        return _json_error(items_unavailable())
    except ChatFrontError as error:
        return _json_error(error)
    return JsonAnswer(200, deleted_response(response_id), {})


async def _kept_record(response_id: str, api_key: str | None) -> dict[str, Any]:
    """The record of the response `response_id` kept for the caller's key; raises ChatFrontError:
    401 as a completion would get, 404 when none is kept, 503 when Redis cannot tell."""
    state = await get_front_state()
    try:
        record = await state.response_items.record(_caller_key(state, api_key), response_id)
    except ResponseItemsUnavailable:
        raise items_unavailable() from None
    if record is None:
        raise _not_kept(state.response_items, response_id)
    return record


def _not_kept(items: ResponseItems, response_id: str) -> ChatFrontError:
    return response_not_found(response_id, KEPT_FOR.format(seconds=items.keep_seconds) + ".")


def _caller_key(state: Any, api_key: str | None) -> str:
    """The key a request is made with: its own, or the anonymous key where anonymous requests are
    served; else 401."""
    if api_key is not None:
        return api_key
    if not state.settings.allow_anonymous:
        raise invalid_api_key("This AI Horde front needs an API key: send it as a Bearer token.")
    return ANONYMOUS_API_KEY


def _json_error(error: ChatFrontError, request_id: str | None = None) -> JsonAnswer:
    return JsonAnswer(error.status, error.body(request_id), error.headers())


# --- /v1/models ------------------------------------------------------------------------------------


async def list_models(api_key: str | None = None) -> JsonAnswer:
    """GET /v1/models. A key the caller sent is checked first: an app that tests its connection by
    listing the models learns of a wrong key there, as from OpenAI, not at its first completion."""
    state = await get_front_state()
    try:
        if api_key is not None:
            checked = await state.client.key_check(api_key)
            if checked.status == 401:
                body = checked.body if isinstance(checked.body, dict) else {}
                return _json_error(invalid_api_key(body.get("message") or "The API key is not valid."))
        answer = await state.client.models()
    except NativeUnreachable as error:
        return _json_error(
            ChatFrontError(
                503, "HordeUnavailable", f"The AI Horde could not be reached: {error}", type="api_error"
            )
        )
    if not answer.ok or not isinstance(answer.body, list):
        return _json_error(
            ChatFrontError(
                502, "HordeUnavailable", "The AI Horde's model list could not be read.", type="api_error"
            )
        )
    cards = [
        build_model_card(entry) for entry in answer.body if isinstance(entry, dict) and entry.get("chat")
    ]
    return JsonAnswer(200, {"object": "list", "data": cards}, {})


async def retrieve_model(model_id: str, api_key: str | None = None) -> JsonAnswer:
    """GET /v1/models/{model} (the SDKs' models.retrieve): the list's card with that id, else OpenAI's
    404 model_not_found."""
    listed = await list_models(api_key)
    if listed.status != 200:
        return listed
    for card in listed.body["data"]:
        if card["id"] == model_id:
            return JsonAnswer(200, card, {})
    return _json_error(model_not_found(model_id, "model"))
