"""The request lifecycle of POST /v1/chat/completions and GET /v1/models (spec: chat_front.md), and
of POST /v1/completions, the same lifecycle over a native text request (docs/adr/0014-legacy-completions.md).

One `FrontState` per process (per event loop): settings, metrics, the native client, the completion
signal listener, the in-flight limiter, the failed cancels and the front leases. A chat request is
screened, admitted (an in-flight slot), submitted with an operation key and a front lease (docs/adr/
0020-front-lease.md: a submit given up is found by its key and cancelled), then waited for: non-streamed, the wait ends
in the JSON body; streamed, the first status read decides the HTTP answer and the stream carries
keepalives until the reply is delivered whole, or, for a request whose deltas are relayed
(mapping.relays_deltas, on a front with Redis), sends each delta as it arrives (oai.deltas).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from contract.chat_errors import param_from_native_message
from contract.chat_policy import parse_kudos_cap_message
from oai import sse
from oai.attribution import build_client_agent
from oai.deltas import RelayedStream, build_delta_reader
from oai.errors import ChatFrontError
from oai.front_lease import FrontLeaseRenewer, lease_header
from oai.horde_client import (
    HordeClient,
    NativeAnswer,
    NativeUnreachable,
    SubmitAnswerLost,
    rate_limit_pause,
)
from oai.mapping import Completion, build_completion, build_model_card, relays_deltas
from oai.metrics import FrontMetrics
from oai.schema import ChatCompletionRequest, build_native_chat_body, parse_body, screen_request
from oai.settings import FrontSettings, load_settings
from oai.text_completions import (
    TextCompletion,
    TextCompletionRequest,
    build_text_completion,
    build_text_completion_events,
    screen_text_request,
)
from oai.waiter import (
    NO_ELIGIBLE_WORKER_RETRY_AFTER_SECONDS,
    POSITIONED_READ_WAIT_SECONDS,
    QUEUE_UNAVAILABLE_RETRY_AFTER_CAP_SECONDS,
    ChatRequestWatcher,
    CompletionSignalListener,
    WaitBudget,
    WakeSource,
)

log = logging.getLogger("oai.requests")


ANONYMOUS_API_KEY = "0000000000"
HORDE_CHAT_REQUEST_EXPIRY_SECONDS = 20 * 60
MAX_FAILED_CANCELS = 10_000
FRONT_AT_CAPACITY_RETRY_AFTER_SECONDS = 2
# Native text param keys that differ from the OpenAI parameter they come from (the chat route's and
# the text route's, whose sampler keys sit under params.).
NATIVE_FIELD_PARAMETERS = {
    "max_length": "max_tokens",
    "stop_sequence": "stop",
    "max_context_length": "horde.max_context_length",
    "rep_pen": "presence_penalty",
    "trusted_workers": "horde.trusted_workers",
    "validated_backends": "horde.validated_backends",
    "slow_workers": "horde.slow_workers",
}
# A native field path: its name, then any index suffix ("stop_sequence[0]").
NATIVE_FIELD_PATTERN = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<rest>.*)$")
GAP_GUARANTEES = frozenset(
    {
        "tool_choice_enforced",
        "single_tool_call_enforced",
        "structured_output_enforced",
        "prompt_overflow_refused",
    }
)
LIMIT_WORDS = {
    "max_length": ("a completion limit", "max_tokens", "tokens"),
    "max_context_length": ("a context length", "horde.max_context_length", "tokens"),
}


# --- admission --------------------------------------------------------------------------------------


class InflightSlot:
    __slots__ = ("limiter", "source", "released")

    def __init__(self, limiter: InflightLimiter, source: str):
        self.limiter = limiter
        self.source = source
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limiter._release(self.source)


class InflightLimiter:
    """In-flight caps, overall and per client address; the gauges read `snapshot`."""

    def __init__(self, max_total: int, max_per_source: int):
        self.max_total = max_total
        self.max_per_source = max_per_source
        self.total = 0
        self.by_source: collections.Counter[str] = collections.Counter()

    def acquire(self, source: str) -> InflightSlot | None:
        if self.total >= self.max_total or self.by_source[source] >= self.max_per_source:
            return None
        self.total += 1
        self.by_source[source] += 1
        return InflightSlot(self, source)

    def _release(self, source: str) -> None:
        self.total -= 1
        self.by_source[source] -= 1
        if self.by_source[source] <= 0:
            del self.by_source[source]

    def snapshot(self) -> tuple[int, int, int]:
        return self.total, len(self.by_source), max(self.by_source.values(), default=0)


# --- per-request trace and the finished line --------------------------------------------------------


@dataclass
class RequestTrace:
    streamed: bool
    requested_model: str
    arrived: float = field(default_factory=time.monotonic)
    request_id: str | None = None
    submitted_at: float | None = None
    submitted_mono: float | None = None
    woke_at: float | None = None
    woke_by: str | None = None
    status_code: int = 200
    code: str = "ok"
    wake_count: int = 0
    estimated_usage: bool | None = None
    done_without_generation_reads: int = 0
    served_model: str | None = None
    retry_after: int | None = None
    queue_reason: str | None = None
    wait_time: float | None = None
    eligible_worker_threads: int | None = None
    first_read_wait_time: float | None = None
    first_read_eligible_worker_threads: int | None = None
    finished: bool = False
    # "Chat" for /v1/chat/completions, "Text" for /v1/completions (the finished line's first word).
    kind: str = "Chat"

    def fields(self) -> dict[str, Any]:
        end = time.time()
        if self.submitted_at is None:
            waited = None
        elif self.woke_at is not None:
            waited = round(self.woke_at - self.submitted_at, 3)
        else:
            waited = round(end - self.submitted_at, 3)
        out = {
            "request_id": self.request_id,
            "streamed": self.streamed,
            "submitted_at": round(self.submitted_at, 3) if self.submitted_at is not None else None,
            "woke_at": round(self.woke_at, 3) if self.woke_at is not None else None,
            "woke_by": self.woke_by,
            "waited_seconds": waited,
            "status_code": self.status_code,
            "code": self.code,
            "wake_count": self.wake_count,
            "estimated_usage": self.estimated_usage,
            "done_without_generation_reads": self.done_without_generation_reads,
            "requested_model": self.requested_model,
            "served_model": self.served_model,
            "retry_after": self.retry_after,
            "first_read_wait_time": self.first_read_wait_time,
            "first_read_eligible_worker_threads": self.first_read_eligible_worker_threads,
        }
        if self.code == "queue_unavailable":
            out.update(
                queue_reason=self.queue_reason,
                wait_time=self.wait_time,
                eligible_worker_threads=self.eligible_worker_threads,
            )
        return out

    def message(self, f: dict[str, Any]) -> str:
        def n(value: Any) -> str:
            return "none" if value is None else str(value)

        head = (
            f"{self.kind} request {f['request_id']} finished:"
            if f["request_id"]
            else f"Unsubmitted {self.kind.lower()} request finished:"
        )
        text = (
            f"{head} streamed={f['streamed']} submitted_at={n(f['submitted_at'])} woke_at={n(f['woke_at'])} "
            f"woke_by={f['woke_by']} waited={n(f['waited_seconds'])}s status={f['status_code']} code={f['code']} "
            f"wakes={f['wake_count']} estimated_usage={f['estimated_usage']} "
            f"done_without_generation_reads={f['done_without_generation_reads']} "
            f"requested_model={f['requested_model']} served_model={n(f['served_model'])} "
            f"retry_after={n(f['retry_after'])}"
        )
        if f["code"] == "queue_unavailable":
            text += (
                f" queue_reason={f['queue_reason']} wait_time={n(f['wait_time'])} "
                f"eligible_worker_threads={n(f['eligible_worker_threads'])}"
            )
        text += (
            f" first_read_wait_time={n(f['first_read_wait_time'])} "
            f"first_read_eligible_worker_threads={n(f['first_read_eligible_worker_threads'])}"
        )
        return text

    def finish(self, metrics: FrontMetrics) -> None:
        if self.finished:
            return
        self.finished = True
        metrics.request_duration.record(
            time.monotonic() - self.arrived,
            {"horde.streamed": self.streamed, "horde.status_code": self.status_code, "horde.code": self.code},
        )
        f = self.fields()
        log.info(self.message(f), extra=f)

    def fail(self, error: ChatFrontError, *, after_headers: bool = False) -> None:
        """An error answer; a stream whose headers went out keeps status 200 (an SSE error event)."""
        if not after_headers:
            self.status_code = error.status
        self.code = error.code or "error"
        self.retry_after = error.retry_after


# --- state ------------------------------------------------------------------------------------------


class FrontState:
    def __init__(self, settings: FrontSettings, *, meter: Any = None, propagate: bool = False):
        self.settings = settings
        self.limiter = InflightLimiter(settings.max_inflight, settings.max_inflight_per_source)
        self.metrics = FrontMetrics(meter, inflight=self.limiter.snapshot)
        self.client = HordeClient(settings, self.metrics, propagate=propagate)
        self.listener = (
            CompletionSignalListener(settings.redis_url, ping_seconds=settings.signal_ping_seconds)
            if settings.redis_url
            else None
        )
        # request id -> (submit time (monotonic), text request) of cancels to send again, oldest first;
        # a text request (POST /v1/completions) is cancelled on the native text route.
        self.failed_cancels: collections.OrderedDict[str, tuple[float, bool]] = collections.OrderedDict()
        self.open_requests: dict[str, tuple[float, bool]] = {}
        # operation key -> a submit given up with its outcome unknown, to find and cancel (oldest first).
        self.lost_submits: collections.OrderedDict[str, LostSubmit] = collections.OrderedDict()
        self.leases = (
            FrontLeaseRenewer(
                settings.redis_url,
                lease_seconds=settings.front_lease_seconds,
                renew_seconds=settings.front_lease_renew_seconds,
                open_ids=lambda: list(self.open_requests),
            )
            if settings.redis_url and settings.front_lease_seconds > 0
            else None
        )
        self.delta_reader = build_delta_reader(settings.redis_url, settings.stream_redis_db)
        self._tasks: set[asyncio.Task] = set()
        self._retry_task: asyncio.Task | None = None
        self.started = False

    async def start(self) -> None:
        """The background tasks start when first needed: the listener with the first wait, the cancel
        retries with the first failed cancel (a refused request starts neither)."""
        self.started = True

    async def ensure_listener(self) -> CompletionSignalListener | None:
        if self.listener is not None and self.listener._task is None:
            await self.listener.start()
            # Give the first connection a moment, so the first request is woken by its signal.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.listener._ready.wait(), 0.5)
        return self.listener

    def ensure_cancel_retries(self) -> None:
        if self._retry_task is None:
            self._retry_task = asyncio.create_task(self._retry_failed_cancels_loop(), name="oai-cancel-retry")

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def shutdown(self) -> None:
        """Drain: cancel the requests still open, send the failed cancels once more, close.

        Every step is bounded: a shutdown must end even when Redis or a native root stops answering
        (closing a pub/sub connection can wait on its reader)."""
        bound = self.settings.cancel_timeout_seconds + 0.5
        if self.leases is not None:
            await _bounded(self.leases.close(), bound)
        await _bounded(_cancel_open_requests(self), bound)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=bound)
        await _bounded(_retry_failed_cancels(self), bound)
        if self._retry_task:
            self._retry_task.cancel()
        if self.listener is not None:
            await _bounded(self.listener.close(), bound)
        if self.delta_reader is not None:
            await _bounded(self.delta_reader.close(), bound)
        await _bounded(self.client.aclose(), bound)

    async def _retry_failed_cancels_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cancel_retry_seconds)
            with contextlib.suppress(Exception):
                await _retry_failed_cancels(self)


_states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FrontState] = weakref.WeakKeyDictionary()
_meter_override: Any = None
_settings_override: FrontSettings | None = None
_propagate = False


def configure_front(
    *, meter: Any = None, settings: FrontSettings | None = None, propagate: bool | None = None
) -> None:
    """Set what the next FrontState is built with (tests pass a meter and settings; main sets
    propagate when telemetry is configured) and drop the current states."""
    global _meter_override, _settings_override, _propagate
    _meter_override = meter
    _settings_override = settings
    if propagate is not None:
        _propagate = propagate
    _states.clear()


async def get_front_state() -> FrontState:
    loop = asyncio.get_running_loop()
    state = _states.get(loop)
    if state is None:
        state = FrontState(_settings_override or load_settings(), meter=_meter_override, propagate=_propagate)
        _states[loop] = state
    if not state.started:
        await state.start()
    return state


def current_states() -> list[FrontState]:
    return list(_states.values())


# --- cancels ------------------------------------------------------------------------------------------


async def _bounded(step, seconds: float) -> None:
    """Run one shutdown step for at most `seconds`; a step that fails or overruns is logged."""
    try:
        await asyncio.wait_for(step, timeout=seconds)
    except Exception as error:  # TimeoutError included
        log.warning("front shutdown step did not finish cleanly: %r", error)


async def _cancel_within_budget(state: FrontState, request_id: str, *, text: bool = False) -> str:
    submitted, text = state.open_requests.pop(request_id, (time.monotonic(), text))
    outcome = await state.client.cancel(request_id, text=text)
    state.metrics.cancels.add(1, {"horde.outcome": outcome})
    if outcome in ("failed", "timed_out", "not_started"):
        state.ensure_cancel_retries()
        state.failed_cancels[request_id] = (submitted, text)
        state.failed_cancels.move_to_end(request_id)
        while len(state.failed_cancels) > MAX_FAILED_CANCELS:
            state.failed_cancels.popitem(last=False)
    return outcome


async def _retry_failed_cancels(state: FrontState) -> None:
    now = time.monotonic()
    for request_id, (submitted, text) in list(state.failed_cancels.items()):
        if now - submitted > HORDE_CHAT_REQUEST_EXPIRY_SECONDS:
            state.failed_cancels.pop(request_id, None)
            continue
        outcome = await state.client.cancel(request_id, text=text)
        state.metrics.cancels.add(1, {"horde.outcome": outcome})
        if outcome not in ("failed", "timed_out", "not_started"):
            state.failed_cancels.pop(request_id, None)
    for operation_key, lost in list(state.lost_submits.items()):
        if now - lost.submitted > HORDE_CHAT_REQUEST_EXPIRY_SECONDS:
            state.lost_submits.pop(operation_key, None)
            continue
        await _cancel_lost_submit(state, operation_key)


@dataclass
class LostSubmit:
    """A submit the front gave up on without learning its outcome: sent again with its operation
    key, the horde answers with the request it holds for the key (or queues it now), which is then
    cancelled. Its front lease, never renewed, is the horde's own backstop."""

    body: dict[str, Any]
    headers: dict[str, str]
    text: bool
    submitted: float = field(default_factory=time.monotonic)


def _give_up_submit(state: FrontState, operation_key: str, lost: LostSubmit) -> None:
    state.lost_submits[operation_key] = lost
    state.lost_submits.move_to_end(operation_key)
    while len(state.lost_submits) > MAX_FAILED_CANCELS:
        state.lost_submits.popitem(last=False)
    state.ensure_cancel_retries()


async def _cancel_lost_submit(state: FrontState, operation_key: str) -> bool:
    """Find the claim of a given-up submit by its operation key and cancel it; returns whether the
    horde answered (else the retries send it again)."""
    lost = state.lost_submits.get(operation_key)
    if lost is None:
        return True
    try:
        answer = await asyncio.wait_for(
            state.client.submit(lost.body, lost.headers, call_type="recovery", text=lost.text),
            state.settings.cancel_timeout_seconds,
        )
    except (NativeUnreachable, SubmitAnswerLost, TimeoutError):
        return False
    state.lost_submits.pop(operation_key, None)
    request_id = answer.body.get("id") if answer.ok and isinstance(answer.body, dict) else None
    if request_id:
        await _cancel_within_budget(state, str(request_id), text=lost.text)
    else:  # refused: the horde held no claim for the key when it answered
        log.info("given-up submit %s: the horde holds no request for it (%s)", operation_key, answer.status)
    return True


async def _cancel_open_requests(state: FrontState) -> None:
    ids = list(state.open_requests)
    if ids:
        await asyncio.gather(
            *(_cancel_within_budget(state, request_id) for request_id in ids), return_exceptions=True
        )


# --- native answers as OpenAI errors -------------------------------------------------------------------


def _strip_path(message: str) -> tuple[str | None, str]:
    param = param_from_native_message(message)
    if param is None:
        return None, message
    text = message[len(param) + 2 :].lstrip(":").strip()
    return param, text or message


def _kudos_cap_error(message: str) -> ChatFrontError:
    metadata: dict[str, Any] = {}
    parsed = parse_kudos_cap_message(message)
    if parsed is not None:
        metadata = {"kudos_estimate": parsed[0], "max_kudos": parsed[1]}
    return ChatFrontError(
        400,
        "max_kudos_exceeded",
        message,
        param="horde.max_kudos",
        type="invalid_request_error",
        should_retry=False,
        metadata=metadata,
    )


def native_field_param(field: str, request: ChatCompletionRequest | TextCompletionRequest) -> str | None:
    """The OpenAI param of a native schema failure's field: `params.stop_sequence[0]` is `stop[0]`
    (`stop` when the client sent one string), `workers[1]` the horde list it came from."""
    if field == "payload":
        return None
    field = field.removeprefix("params.")
    match = NATIVE_FIELD_PATTERN.match(field)
    if match is None:
        return field
    name, rest = match["name"], match["rest"]
    if name == "workers":
        return f"horde.{getattr(request, 'worker_list_key', None) or 'only'}{rest}"
    if name == "models" and getattr(request, "model_key", "models") == "model":
        return "model"
    if name == "stop_sequence":
        stop = (
            request.stop_is_string
            if isinstance(request, TextCompletionRequest)
            else isinstance(request.chat.stop, str)
        )
        if stop and rest == "[0]":
            return "stop"
    return NATIVE_FIELD_PARAMETERS.get(name, name) + rest


def _native_submit_error(
    answer: NativeAnswer, request: ChatCompletionRequest | TextCompletionRequest
) -> ChatFrontError:
    body = answer.body if isinstance(answer.body, dict) else {}
    status = answer.status
    rc = body.get("rc")
    message = body.get("message") or f"The AI Horde answered {status}."
    if status == 400 and isinstance(body.get("errors"), dict) and body["errors"]:
        field_name, text = next(iter(body["errors"].items()))
        param = native_field_param(str(field_name), request)
        return ChatFrontError(400, "BadRequest", f"{message}: {text}", param=param, should_retry=False)
    if rc == "ChatKudosCapExceeded":
        return _kudos_cap_error(message)
    if status == 401 or rc in ("InvalidAPIKey", "AnonForbidden"):
        return ChatFrontError(
            401, "invalid_api_key", message, type="authentication_error", should_retry=False
        )
    if status == 429:
        retry_after = _int_header(answer, "Retry-After")
        return ChatFrontError(
            429, rc or "rate_limit_exceeded", message, type="rate_limit_error", retry_after=retry_after
        )
    if rc == "NoEligibleWorker":
        reason = body.get("impossible_reason")
        if isinstance(reason, dict) and reason.get("kind") == "declaration_gap":
            return _gap_error_sync(reason, request, None)
        return _no_eligible_worker(message)
    if rc == "UnknownChatModel":
        param, text = _strip_path(message)
        return ChatFrontError(404, "model_not_found", text, param=param or "model", should_retry=False)
    param, text = _strip_path(message)
    if status >= 500:
        # A horde 503 (its database unavailable) tells the client when to come back.
        return ChatFrontError(
            status, rc or "HordeUnavailable", text, param=param, type="api_error",
            retry_after=_int_header(answer, "Retry-After"),
        )
    return ChatFrontError(status, rc or "BadRequest", text, param=param, should_retry=False)


def _int_header(answer: NativeAnswer, name: str) -> int | None:
    try:
        return int(float(answer.headers.get(name, "")))
    except ValueError:
        return None


def _no_eligible_worker(message: str | None = None) -> ChatFrontError:
    return ChatFrontError(
        503,
        "no_eligible_worker",
        message
        or "No online worker could take this request within the grace period; workers come and go, "
        "try again later.",
        type="api_error",
        retry_after=NO_ELIGIBLE_WORKER_RETRY_AFTER_SECONDS,
    )


def _limit_sentence(limit: str, value: int | None, several: bool) -> str:
    words, _param, unit = LIMIT_WORDS[limit]
    scope = "the listed models" if several else "the model"
    if value is None:
        return (
            f"No worker eligible for this request currently declares {words} that high; the largest "
            f"any online worker for {scope} declares now is not reported ({limit})."
        )
    return (
        f"No worker eligible for this request currently declares {words} that high; the largest any "
        f"online worker for {scope} declares now is {value} {unit}."
    )


def _gap_error_sync(
    reason: dict[str, Any], request: ChatCompletionRequest, offers: dict[str, Any] | None
) -> ChatFrontError:
    missing = list(reason.get("missing_declarations") or [])
    exceeded = list(reason.get("exceeded_limits") or [])
    models = request.requested_models
    if exceeded and not missing and set(exceeded) <= {"max_length", "max_context_length"}:
        sentences = []
        for limit in ("max_length", "max_context_length"):
            if limit not in exceeded:
                continue
            values = [((offers or {}).get(m) or {}).get(limit) for m in models]
            values = [v for v in values if isinstance(v, int)]
            sentences.append(_limit_sentence(limit, max(values) if values else None, len(models) > 1))
        param = "max_tokens" if "max_length" in exceeded else "horde.max_context_length"
        return ChatFrontError(
            400,
            "no_worker_supports_limit",
            " ".join(sentences),
            param=param,
            type="invalid_request_error",
            should_retry=False,
        )
    parts = []
    if missing:
        parts.append("no online worker serving the model declares " + ", ".join(missing))
    if exceeded:
        parts.append(
            "the request exceeds the "
            + ", ".join(exceeded)
            + " limit of every online worker serving the model"
        )
    message = "No worker supports the features this request needs: " + "; ".join(parts) + "."
    if set(missing) & GAP_GUARANTEES:
        message += " Guarantees are not required under horde.conformance best_effort."
    return ChatFrontError(
        404,
        "no_worker_supports_features",
        message,
        type="invalid_request_error",
        should_retry=False,
        metadata={"impossible_reason": reason},
    )


async def _wait_error(
    state: FrontState, reason: dict[str, Any], request: ChatCompletionRequest
) -> ChatFrontError:
    """The answer to a declaration gap; a size-limit gap reads the model list for the declared values."""
    exceeded = set(reason.get("exceeded_limits") or [])
    offers: dict[str, Any] | None = None
    if (
        exceeded
        and not reason.get("missing_declarations")
        and exceeded <= {"max_length", "max_context_length"}
    ):
        with contextlib.suppress(NativeUnreachable):
            answer = await state.client.models()
            if answer.ok and isinstance(answer.body, list):
                offers = {e.get("name"): e.get("chat") or {} for e in answer.body if isinstance(e, dict)}
    return _gap_error_sync(reason, request, offers)


# --- the request lifecycle ------------------------------------------------------------------------


@dataclass
class JsonAnswer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class StreamAnswer:
    events: AsyncIterator[bytes]
    headers: dict[str, str]


class _BudgetEnded(Exception):
    """The request's budget ended while a native call was under way."""


class _Finished(Exception):
    def __init__(self, completion: Completion):
        self.completion = completion


class ChatRun:
    """One admitted request from submit to answer."""

    def __init__(
        self,
        state: FrontState,
        request: ChatCompletionRequest | TextCompletionRequest,
        trace: RequestTrace,
        slot: InflightSlot,
        disconnected: asyncio.Event | None,
    ):
        self.state = state
        self.settings = state.settings
        self.request = request
        self.trace = trace
        self.slot = slot
        self.disconnected = disconnected
        self.request_id: str | None = None
        self.created = int(time.time())
        self.wake = None
        self.watcher: ChatRequestWatcher | None = None
        budget = (
            self.settings.stream_timeout_seconds
            if request.stream
            else self.settings.nonstream_timeout_seconds
        )
        self.budget = WaitBudget(trace.arrived, budget)
        self.impossible_since: float | None = None
        self.done_without_generation_at: float | None = None
        self.first_read_at: float | None = None
        self.first_decided = not request.fail_fast
        self.is_text = isinstance(request, TextCompletionRequest)
        self.cancelled = False
        self.closed = False
        self.operation_key = str(uuid.uuid4())
        # The submit while its answer is awaited (a client gone meanwhile leaves it to find and cancel).
        self.submit_in_flight: LostSubmit | None = None
        # When this request's front lease was last renewed through the database (monotonic).
        self.lease_renewed_at: float | None = None
        # Relayed deltas (chat only): the stream hint is forwarded, and the stream subscribed after the submit.
        self.relays = not self.is_text and state.delta_reader is not None and relays_deltas(request)
        self.relayed: RelayedStream | None = None

    # submit ---------------------------------------------------------------------------------------

    async def submit(self, api_key: str, headers: dict[str, str]) -> None:
        # The text route takes the operation key top-level, as its other options (docs/adr/0020-front-lease.md).
        if self.is_text:
            body = {**self.request.native_body, "operation_key": self.operation_key}
        else:
            body = build_native_chat_body(
                self.request.native_body, operation_key=self.operation_key, stream_progress=self.relays
            )
        native_headers = {
            "Client-Agent": build_client_agent(headers),
            **lease_header(self.settings.front_lease_seconds),
        }
        if api_key != ANONYMOUS_API_KEY:  # no key: the horde's anonymous user
            native_headers["apikey"] = api_key
        native_headers.update(self.state.client.forwarding_headers(self.slot.source))
        self.submit_in_flight = LostSubmit(body, native_headers, self.is_text)
        try:
            answer = await self._native(
                "submit",
                self.state.client.submit(
                    body,
                    native_headers,
                    text=self.is_text,
                    rate_limit_wait_seconds=min(self.settings.rate_limit_wait_seconds, self.budget.left()),
                ),
                bounded=False,
            )
        except NativeUnreachable as error:
            self.submit_in_flight = None  # nothing was sent
            raise ChatFrontError(
                503, "HordeUnavailable", f"The AI Horde could not be reached: {error}", type="api_error"
            ) from None
        except SubmitAnswerLost:
            answer = await self._recover_submit(body, native_headers)
        self.submit_in_flight = None
        if not answer.ok:
            raise _native_submit_error(answer, self.request)
        if not isinstance(answer.body, dict) or not answer.body.get("id"):
            await self._give_up_submit(LostSubmit(body, native_headers, self.is_text))
            raise ChatFrontError(
                502,
                "HordeUnavailable",
                "The AI Horde answered the submit without a request id.",
                type="api_error",
                should_retry=False,
                metadata={"submit_outcome": "unknown"},
            )
        self.request_id = str(answer.body["id"])
        self.trace.request_id = self.request_id
        self.trace.submitted_at = time.time()
        self.trace.submitted_mono = time.monotonic()
        self.state.open_requests[self.request_id] = (time.monotonic(), self.is_text)
        if self.settings.front_lease_seconds > 0:
            self.lease_renewed_at = time.monotonic()  # the submit took the lease
            if self.state.leases is not None:
                self.state.leases.start()

    async def _give_up_submit(self, lost: LostSubmit) -> None:
        """Before answering an error for a submit whose outcome is unknown: find its claim by the
        operation key and cancel it, once now within the cancel timeout, then with the cancel
        retries until the horde answers."""
        self.submit_in_flight = None
        _give_up_submit(self.state, self.operation_key, lost)
        await _cancel_lost_submit(self.state, self.operation_key)

    async def _recover_submit(self, body: dict[str, Any], headers: dict[str, str]) -> NativeAnswer:
        """A submit whose answer was lost is sent again with the same operation key: the horde answers
        200 with the claim when the first one landed, 202 when it did not."""
        try:
            answer = await self._native(
                "recovery",
                self.state.client.submit(
                    body,
                    headers,
                    call_type="recovery",
                    text=self.is_text,
                    rate_limit_wait_seconds=min(self.settings.rate_limit_wait_seconds, self.budget.left()),
                ),
                bounded=False,
            )
            if rate_limit_pause(answer) is not None:
                # The limits are counted before the operation key is looked up: this refusal does not
                # say whether the first submit landed.
                raise SubmitAnswerLost("the recovery was rate limited")
        except (NativeUnreachable, SubmitAnswerLost):
            self.state.metrics.submit_outcome_unknown.add(1)
            await self._give_up_submit(LostSubmit(body, headers, self.is_text))
            raise ChatFrontError(
                502,
                "HordeUnavailable",
                "The AI Horde did not answer the submit, and sending it again did not reach it: the request may "
                "or may not be queued, and is cancelled if it was.",
                type="api_error",
                should_retry=False,
                metadata={"submit_outcome": "unknown"},
            ) from None
        if answer.ok:
            self.state.metrics.submit_recoveries.add(1, {"horde.existing_claim": answer.status == 200})
        return answer

    # reads --------------------------------------------------------------------------------------

    async def _native(self, call_type: str, call: Any, *, bounded: bool = True) -> Any:
        """One native call of this request. A call the request stops waiting for, because its budget
        ended first (`bounded`) or its client left, is recorded with outcome abandoned (the client
        records every other outcome); the budget's end raises _BudgetEnded."""
        started = time.perf_counter()
        try:
            if not bounded:
                return await call
            async with asyncio.timeout(self.budget.left()) as timeout:
                try:
                    return await call
                except asyncio.CancelledError:
                    if timeout.expired():
                        raise _BudgetEnded from None
                    raise
        except _BudgetEnded:
            self.state.metrics.native(call_type, "abandoned", time.perf_counter() - started)
            raise
        except asyncio.CancelledError:
            self.state.metrics.native(call_type, "abandoned", time.perf_counter() - started)
            raise

    async def start_wait(self) -> None:
        if self.relays:
            self.relayed = RelayedStream(
                self.state.delta_reader,
                request_id=self.request_id,
                created=self.created,
                include_reasoning=self.request.include_reasoning,
                fallback_model=self.request.requested_models[0],
                metrics=self.state.metrics,
                submitted_mono=self.trace.submitted_mono,
            )
        # No completion signal is published for text requests: their waits poll.
        listener = None if self.is_text else await self.state.ensure_listener()
        if listener is not None and listener.healthy:
            self.wake = await listener.register(self.request_id)
        self.watcher = ChatRequestWatcher(
            wake=self.wake,
            budget=self.budget,
            recheck_seconds=self.settings.signal_recheck_seconds,
            poll_seconds=self.settings.poll_seconds,
            disconnected=self.disconnected,
        )

    async def read(self, source: WakeSource) -> float | None:
        """One status read; raises _Finished or ChatFrontError, else returns the time the next read
        is due at the latest (None: the watcher's own schedule), no later than the front lease's
        next renewal through the database."""
        not_after = await self._read(source, self._lease_renewal())
        due = self._lease_due()
        if due is not None and (not_after is None or due < not_after):
            return due
        return not_after

    def _renews_in_database(self) -> bool:
        leases = self.state.leases
        return self.lease_renewed_at is not None and (leases is None or not leases.healthy)

    def _lease_renewal(self) -> dict[str, str] | None:
        """The lease header for this read, when the lease is due for a renewal through the database."""
        if not self._renews_in_database():
            return None
        if time.monotonic() - self.lease_renewed_at < self.settings.front_lease_renew_seconds:
            return None
        return lease_header(self.settings.front_lease_seconds)

    def _lease_due(self) -> float | None:
        if not self._renews_in_database():
            return None
        due = self.lease_renewed_at + self.settings.front_lease_renew_seconds
        return max(due, time.monotonic() + self.settings.poll_seconds)  # a failed renewal is not a busy loop

    async def _read(self, source: WakeSource, lease_headers: dict[str, str] | None) -> float | None:
        try:
            answer = await self._native(
                "status",
                self.state.client.status(self.request_id, text=self.is_text, headers=lease_headers),
                bounded=source != WakeSource.DEADLINE,
            )
        except _BudgetEnded:
            self.trace.wake_count += 1
            self.state.metrics.wake(source, False, False)
            raise await self._timeout() from None
        except NativeUnreachable:
            self.trace.wake_count += 1
            self.state.metrics.wake(source, False, False)
            if source == WakeSource.DEADLINE:
                raise await self._timeout() from None
            return None
        self.trace.wake_count += 1
        if lease_headers and answer.ok:
            self.lease_renewed_at = time.monotonic()
        status = answer.body if isinstance(answer.body, dict) else {}
        if answer.status == 404:
            self.state.metrics.wake(source, False, False)
            raise self._faulted(status, gone=True)
        if not answer.ok:
            self.state.metrics.wake(source, False, False)
            if source == WakeSource.DEADLINE:
                raise await self._timeout()
            return None
        generations = status.get("generations") or []
        done_without = bool(status.get("done")) and not status.get("faulted") and not generations
        self.state.metrics.wake(source, bool(generations), done_without)
        now = time.monotonic()
        if generations:
            self.trace.woke_at = time.time()
            self.trace.woke_by = str(source)
            completion_class = TextCompletion if self.is_text else Completion
            raise _Finished(completion_class(self.request, self.request_id, self.created, status))
        if status.get("faulted"):
            raise self._faulted(status)
        if source == WakeSource.DEADLINE:
            raise await self._timeout()
        if done_without:
            self.trace.done_without_generation_reads += 1
            if status.get("waiting") or status.get("processing"):
                return None
            cancelled = self.wake is not None and self.wake.cancelled_signal
            if cancelled or (
                self.done_without_generation_at is not None
                and now - self.done_without_generation_at >= self.settings.signal_recheck_seconds * 0.99
            ):
                await self.cancel()
                raise ChatFrontError(
                    502,
                    "ChatRequestNoGeneration",
                    "The request ended without a generation to deliver.",
                    type="api_error",
                    should_retry=False,
                )
            if self.done_without_generation_at is None:
                self.done_without_generation_at = now
            return now + self.settings.signal_recheck_seconds
        processing = int(status.get("processing") or 0)
        finished = int(status.get("finished") or 0)
        not_after: float | None = None
        if status.get("is_possible") is False and processing == 0:
            reason = status.get("impossible_reason")
            if isinstance(reason, dict) and reason.get("kind") == "declaration_gap":
                await self.cancel()
                raise await _wait_error(self.state, reason, self.request)
            if self.impossible_since is None:
                self.impossible_since = now
            grace_end = self.impossible_since + self.settings.fail_fast_grace_seconds
            if now >= grace_end:
                await self.cancel()
                raise _no_eligible_worker()
            not_after = grace_end
        else:
            self.impossible_since = None
        if not self.first_decided:
            not_after = self._fail_fast(status, processing, finished, now, not_after)
            if isinstance(not_after, ChatFrontError):
                await self.cancel()
                raise not_after
        return not_after

    def _fail_fast(
        self, status: dict[str, Any], processing: int, finished: int, now: float, not_after: float | None
    ) -> Any:
        if self.first_read_at is None:
            self.first_read_at = now
        threads = status.get("eligible_worker_threads")
        wait_time = status.get("wait_time")
        queue_position = status.get("queue_position") or 0
        if threads == 0 and processing == 0 and finished == 0:
            return self._queue_unavailable(
                "no_eligible_threads", NO_ELIGIBLE_WORKER_RETRY_AFTER_SECONDS, status
            )
        positioned = queue_position > 0 or (wait_time or 0) > 0 or processing > 0 or finished > 0
        if not positioned and now - self.first_read_at < POSITIONED_READ_WAIT_SECONDS:
            due = min(
                now + self.settings.signal_recheck_seconds, self.first_read_at + POSITIONED_READ_WAIT_SECONDS
            )
            return due if not_after is None else min(due, not_after)
        self.first_decided = True
        self.trace.first_read_wait_time = wait_time
        self.trace.first_read_eligible_worker_threads = threads
        left = self.budget.left()
        if processing == 0 and finished == 0 and isinstance(wait_time, int | float) and wait_time > left:
            retry = int(min(max(wait_time, 1), QUEUE_UNAVAILABLE_RETRY_AFTER_CAP_SECONDS))
            return self._queue_unavailable("wait_exceeds_budget", retry, status)
        return not_after

    def _queue_unavailable(self, reason: str, retry_after: int, status: dict[str, Any]) -> ChatFrontError:
        threads = status.get("eligible_worker_threads")
        wait_time = status.get("wait_time")
        self.trace.first_read_wait_time = wait_time
        self.trace.first_read_eligible_worker_threads = threads
        self.trace.queue_reason = reason
        self.trace.wait_time = wait_time
        self.trace.eligible_worker_threads = threads
        return ChatFrontError(
            503,
            "queue_unavailable",
            f"No capacity for this request now: {threads if threads is not None else 'unknown'} eligible worker "
            f"threads, an estimated wait of {wait_time if wait_time is not None else 'unknown'} s, and "
            f"{round(self.budget.left())} s left in the request's budget.",
            param="horde.availability_mode",
            type="api_error",
            retry_after=retry_after,
            reason=reason,
        )

    def _faulted(self, status: dict[str, Any], *, gone: bool = False) -> ChatFrontError:
        message = status.get("fault_reason")
        rc = status.get("fault_rc")
        if gone and self.wake is not None and self.wake.last_message:
            message = message or self.wake.last_message.get("fault_reason")
            rc = rc or self.wake.last_message.get("fault_rc")
        if not message:
            message = (
                "The request no longer exists on the AI Horde."
                if gone
                else "The request faulted on the AI Horde."
            )
        metadata = {"fault_rc": rc} if rc else {}
        self.state.open_requests.pop(self.request_id or "", None)
        return ChatFrontError(
            502, "ChatRequestFaulted", message, type="api_error", should_retry=False, metadata=metadata
        )

    async def _timeout(self) -> ChatFrontError:
        await self.cancel()
        return ChatFrontError(
            408,
            "ChatRequestTimeout",
            f"No worker finished the request within {int(self.budget.seconds)} seconds.",
            type="timeout_error",
            should_retry=False,
        )

    async def cancel(self) -> None:
        if self.cancelled or self.request_id is None:
            return
        self.cancelled = True
        await _cancel_within_budget(self.state, self.request_id, text=self.is_text)

    def cancel_in_background(self) -> None:
        if not self.cancelled and self.request_id is not None:
            self.cancelled = True
            self.state.spawn(_cancel_within_budget(self.state, self.request_id, text=self.is_text))
        elif self.request_id is None and self.submit_in_flight is not None:
            # The client left while the submit was out: whatever it queued is found and cancelled.
            lost, self.submit_in_flight = self.submit_in_flight, None
            _give_up_submit(self.state, self.operation_key, lost)
            self.state.spawn(_cancel_lost_submit(self.state, self.operation_key))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.request_id is not None:
            self.state.open_requests.pop(self.request_id, None)
        if self.wake is not None and self.state.listener is not None:
            with contextlib.suppress(Exception):
                await self.state.listener.unregister(self.request_id, self.wake)
        if self.relayed is not None:
            self.relayed.close()
        self.slot.release()

    # the first read decision, then the wait -------------------------------------------------------

    async def first_decision(self) -> Completion | None:
        """Read once after submit (and under fail_fast until the positioned-read rule decides)."""
        source = WakeSource.IMMEDIATE
        while True:
            try:
                not_after = await self.read(source)
            except _Finished as finished:
                return finished.completion
            if self.first_decided:
                self._not_after = not_after
                return None
            source = await self.watcher.next_wake(not_after=not_after)
            if source == WakeSource.DISCONNECT:
                raise asyncio.CancelledError

    async def wait(self, not_after: float | None = None) -> Completion:
        while True:
            source = await self.watcher.next_wake(not_after=not_after)
            if source == WakeSource.DISCONNECT:
                raise asyncio.CancelledError
            try:
                not_after = await self.read(source)
            except _Finished as finished:
                return finished.completion

    def delivered(self, completion: Completion) -> None:
        metrics = self.state.metrics
        self.trace.estimated_usage = completion.estimated_usage
        self.trace.served_model = completion.model
        metrics.completions.add(
            1, {"horde.model": completion.model, "horde.estimated_usage": completion.estimated_usage}
        )
        if completion.empty:
            metrics.completions_empty.add(1, {"horde.model": completion.model})
        if isinstance(completion.queue_wait, int | float):
            metrics.queue_wait.record(completion.queue_wait, {"horde.model": completion.model})
        if self.trace.submitted_mono is not None and not (self.relayed and self.relayed.exposed):
            metrics.first_content.record(
                time.monotonic() - self.trace.submitted_mono,
                {"horde.streamed": self.request.stream, "horde.relayed": False},
            )
        self.state.open_requests.pop(self.request_id or "", None)


def _client_closed(run: ChatRun) -> None:
    run.state.metrics.wake(WakeSource.DISCONNECT, False, False)
    run.trace.woke_by = WakeSource.DISCONNECT.value
    run.trace.code = "client_closed"
    if not run.request.stream or run.trace.status_code != 200 or run.trace.submitted_at is None:
        run.trace.status_code = 499 if not run.request.stream else run.trace.status_code
    run.cancel_in_background()


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


async def _completions(
    screen: Any,
    *,
    raw_body: bytes,
    api_key: str | None,
    headers: dict[str, str],
    source: str,
    disconnected: asyncio.Event | None,
) -> JsonAnswer | StreamAnswer:
    state = await get_front_state()
    metrics = state.metrics
    if api_key is None:
        if not state.settings.allow_anonymous:
            error = ChatFrontError(
                401,
                "invalid_api_key",
                "This AI Horde front needs an API key: send it as a Bearer token.",
                type="authentication_error",
                should_retry=False,
            )
            metrics.refused(401, error.code)
            return _json_error(error)
        api_key = ANONYMOUS_API_KEY
    try:
        request = screen(parse_body(raw_body))
    except ChatFrontError as error:
        metrics.refused(error.status, error.code)
        return _json_error(error)
    retry_count = headers.get("x-stainless-retry-count", "0")
    if retry_count.isdigit() and int(retry_count) > 0:
        metrics.client_retry_hints.add(1)
    slot = state.limiter.acquire(source)
    if slot is None:
        metrics.refused(503, "FrontAtCapacity")
        return _json_error(
            ChatFrontError(
                503,
                "FrontAtCapacity",
                "This AI Horde front is at its in-flight request limit; try again shortly.",
                type="api_error",
                retry_after=FRONT_AT_CAPACITY_RETRY_AFTER_SECONDS,
                should_retry=True,
            )
        )
    metrics.requests_admitted.add(1, {"horde.streamed": request.stream})
    trace = RequestTrace(
        streamed=request.stream,
        requested_model=",".join(request.requested_models),
        kind="Text" if isinstance(request, TextCompletionRequest) else "Chat",
    )
    run = ChatRun(state, request, trace, slot, disconnected)
    streaming_started = False
    try:
        await run.submit(api_key, headers)
        await run.start_wait()
        completion = await run.first_decision()
        if request.stream:
            streaming_started = True
            return StreamAnswer(_stream_completion(run, completion), {})
        if completion is None:
            completion = await run.wait(run._not_after)
        run.delivered(completion)
        body = build_text_completion(completion) if run.is_text else build_completion(completion)
        return JsonAnswer(200, body, {})
    except ChatFrontError as error:
        trace.fail(error)
        metrics.error(error.status, error.code, request.stream, error.reason)
        return _json_error(error, run.request_id)
    except asyncio.CancelledError:
        _client_closed(run)
        raise
    finally:
        if not streaming_started:
            await _finish(run)


async def _finish(run: ChatRun) -> None:
    if run.trace.code == "client_closed":
        run.cancel_in_background()
    await run.close()
    run.trace.finish(run.state.metrics)


async def _stream_completion(run: ChatRun, completion: Completion | None) -> AsyncIterator[bytes]:
    """The SSE body: a first comment (the headers go out with it), keepalives while waiting, then the
    reply whole (events 1-7) or an SSE error event."""
    metrics = run.state.metrics
    keepalive = run.settings.keepalive_seconds
    relayed = run.relayed
    try:
        yield sse.build_keepalive_event()
        not_after = getattr(run, "_not_after", None)
        next_keepalive = time.monotonic() + keepalive  # keepalive seconds after the last bytes sent
        while completion is None:
            while True:
                source = await run.watcher.next_wake(
                    not_after=not_after,
                    keepalive_at=next_keepalive,
                    deltas=relayed.event if relayed is not None else None,
                )
                if source is None:
                    yield sse.build_keepalive_event()
                    next_keepalive = time.monotonic() + keepalive
                    continue
                if source == WakeSource.DELTA:
                    for event in relayed.pending_events():
                        yield event
                        next_keepalive = time.monotonic() + keepalive
                    _check_relay(run)
                    continue
                break
            if source == WakeSource.DISCONNECT:
                _client_closed(run)
                return
            try:
                not_after = await run.read(source)
            except _Finished as finished:
                completion = finished.completion
        run.delivered(completion)
        if relayed is not None:
            for event in relayed.pending_events():  # entries read before the reply was
                yield event
            _check_relay(run)
        if relayed is not None and relayed.exposed:
            events = relayed.final_events(completion, include_usage=run.request.include_usage)
        elif run.is_text:
            events = build_text_completion_events(completion, include_usage=run.request.include_usage)
        else:
            events = sse.build_completion_events(completion, include_usage=run.request.include_usage)
        for event in events:
            yield event
    except ChatFrontError as error:
        run.trace.fail(error, after_headers=True)
        metrics.stream_failures.add(1, {"horde.code": error.code or ""})
        for event in sse.build_error_events(error, run.request_id):
            yield event
    except (asyncio.CancelledError, GeneratorExit):
        _client_closed(run)
        raise
    finally:
        await _finish(run)


def _check_relay(run: ChatRun) -> None:
    """A relayed stream that an entry broke (another attempt, its ended marker, a gap) ends in
    ChatStreamDiverged, and the request is cancelled."""
    error = run.relayed.diverged
    if error is not None:
        run.cancel_in_background()
        raise error


def _json_error(error: ChatFrontError, request_id: str | None = None) -> JsonAnswer:
    return JsonAnswer(error.status, error.body(request_id), error.headers())


# --- /v1/models ------------------------------------------------------------------------------------


async def list_models() -> JsonAnswer:
    state = await get_front_state()
    try:
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
