"""One admitted /v1 request from submit to answer (`ChatRun`): the submit with an operation key and
a front lease (docs/adr/0020-front-lease.md: a submit given up is found by its key and cancelled),
then the reads of its status and their decisions (grace, declaration gap, fail_fast, done without
generation, deadline). A text request (POST /v1/completions) runs the same way on the native text
routes, without the completion signal (its waits poll)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from oai.admission import InflightSlot
from oai.attribution import build_client_agent
from oai.cancels import LostSubmit
from oai.deltas import RelayedStream
from oai.errors import ChatFrontError, front_stopping
from oai.front_lease import front_id_header, lease_header
from oai.horde_client import NativeAnswer, NativeUnreachable, SubmitAnswerLost, rate_limit_pause, request_gone
from oai.mapping import Completion
from oai.native_errors import (
    declaration_gap_error,
    native_submit_error,
    no_eligible_worker,
    submit_declaration_gap,
)
from oai.schema import ChatCompletionRequest, build_native_chat_body, relays_deltas
from oai.state import FrontState
from oai.text_completions import TextCompletionRequest
from oai.text_reply import TextCompletion
from oai.trace import RequestTrace
from oai.waiter import (
    NO_ELIGIBLE_WORKER_RETRY_AFTER_SECONDS,
    POSITIONED_READ_WAIT_SECONDS,
    QUEUE_UNAVAILABLE_RETRY_AFTER_CAP_SECONDS,
    SDK_RETRY_AFTER_MAX_SECONDS,
    ChatRequestWatcher,
    WaitBudget,
    Wake,
    WakeSource,
)

ANONYMOUS_API_KEY = "0000000000"


class _BudgetEnded(Exception):
    """The request's budget ended while a native call was under way."""


@dataclass(frozen=True, slots=True)
class Delivered:
    """A read found the reply: the wait ends with it."""

    completion: Completion | TextCompletion


@dataclass(frozen=True, slots=True)
class Pending:
    """A read found no reply yet: the next read is due by `not_after` at the latest (None: the
    watcher's own schedule)."""

    not_after: float | None


ReadOutcome = Delivered | Pending


class ChatRun:
    """One admitted request from submit to answer."""

    def __init__(
        self,
        state: FrontState,
        request: ChatCompletionRequest | TextCompletionRequest,
        trace: RequestTrace,
        slot: InflightSlot,
        disconnected: asyncio.Event | None,
        *,
        leased: bool = True,
    ):
        self.state = state
        # False for a background response (docs/adr/0102): no client waits on it, so no front lease,
        # and it is not among the process's open requests (which a stopping front cancels).
        self.leased = leased
        self.settings = state.settings
        self.request = request
        self.trace = trace
        self.slot = slot
        self.disconnected = disconnected
        self.request_id: str | None = None
        self.created = int(time.time())
        self.wake: Wake | None = None
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
        # A background request relays none: its stream is built from its state (ADR 0106).
        self.relays = (
            leased
            and isinstance(request, ChatCompletionRequest)
            and state.delta_reader is not None
            and relays_deltas(request, with_tools=self.settings.relay_with_tools)
        )
        self.relayed: RelayedStream | None = None
        # horde.oai.first_content.duration is recorded once (first_content_sent).
        self.first_content_recorded = False
        # The next read's latest time after a first decision that delivered nothing.
        self.not_after: float | None = None
        # Whether the last status read showed a worker generating the request.
        self.generating = False
        # The process is stopping: the wait ends by the stop's deadline (read_at_stop).
        self.stopping = False

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
            **(lease_header(self.settings.front_lease_seconds) if self.leased else front_id_header()),
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
            gap = submit_declaration_gap(answer)
            if gap is not None and not self.is_text:
                # Read the model list for the declared values, as a gap found on the status is.
                raise await declaration_gap_error(self.state.client, gap, self.request)
            raise native_submit_error(answer, self.request)
        if not isinstance(answer.body, dict) or not answer.body.get("id"):
            self.state.metrics.submit_outcome_unknown.add(1)
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
        if isinstance(self.request, TextCompletionRequest):
            adjustments = answer.body.get("context_adjustments")
            if isinstance(adjustments, list) and adjustments:
                self.request.context_adjustments = adjustments
        self.trace.request_id = self.request_id
        self.trace.submitted_at = time.time()
        self.trace.submitted_mono = time.monotonic()
        if not self.leased:
            return
        self.state.cancels.open_requests[self.request_id] = (time.monotonic(), self.is_text)
        if self.settings.front_lease_seconds > 0:
            self.lease_renewed_at = time.monotonic()  # the submit took the lease
            if self.state.leases is not None:
                self.state.leases.start()

    async def _give_up_submit(self, lost: LostSubmit) -> None:
        """Before answering an error for a submit whose outcome is unknown: find its claim by the
        operation key and cancel it, once now within the cancel timeout, then with the cancel
        retries until the horde answers."""
        self.submit_in_flight = None
        self.state.cancels.give_up_submit(self.operation_key, lost)
        await self.state.cancels.cancel_lost_submit(self.operation_key)

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

    def submitted_id(self) -> str:
        """The request's id, for what follows its submit."""
        assert self.request_id is not None, "used before the submit"
        return self.request_id

    async def start_wait(self) -> None:
        request_id = self.submitted_id()
        if self.relays:
            # What __init__ decided relays on: a chat request, and the front's delta reader.
            assert isinstance(self.request, ChatCompletionRequest) and self.state.delta_reader is not None
            self.relayed = RelayedStream(
                self.state.delta_reader,
                request_id=request_id,
                created=self.created,
                include_reasoning=self.request.include_reasoning,
                fallback_model=self.request.requested_models[0],
                metrics=self.state.metrics,
            )
        listener = await self.state.ensure_listener()
        if listener is not None and listener.healthy:
            self.wake = await listener.register(request_id)
        self.watcher = ChatRequestWatcher(
            wake=self.wake,
            budget=self.budget,
            recheck_seconds=self.settings.signal_recheck_seconds,
            poll_seconds=self.settings.poll_seconds,
            disconnected=self.disconnected,
            # A text request's submit is signalled, not its fault, cancel or expiry (docs/adr/0055).
            polls=self.is_text,
            stopping=self.state.stopping,
        )

    async def read(self, source: WakeSource) -> ReadOutcome:
        """One status read: the reply, or when the next read is due at the latest, no later than the
        front lease's next renewal through the database; an error answer raises ChatFrontError."""
        if source == WakeSource.STOPPING:
            return await self._read_at_stop()
        outcome = await self._read(source, self._lease_renewal())
        if isinstance(outcome, Delivered):
            return outcome
        due = self._lease_due()
        if due is not None and (outcome is None or due < outcome):
            return Pending(due)
        return Pending(outcome)

    async def _read_at_stop(self) -> ReadOutcome:
        """The process is stopping (docs/adr/0076): one read. A request a worker is generating may
        still be delivered before the stop's deadline, where its wait ends (its budget is cut);
        any other is cancelled now, before a worker takes it, and answered FrontStopping, so its
        client's retry, on another process, is the request that runs."""
        self.stopping = True
        outcome = await self._read(WakeSource.STOPPING, None)
        if isinstance(outcome, Delivered):
            return outcome
        stop_deadline = self.state.stop_deadline
        if self.generating and stop_deadline is not None and stop_deadline > time.monotonic():
            self.budget.end_by(stop_deadline)
            return Pending(outcome)
        await self.cancel(undelivered=self.undelivered)
        raise front_stopping()

    def _database_renewed_at(self) -> float | None:
        """When the lease was last renewed, while it is renewed through the database (else None)."""
        leases = self.state.leases
        if leases is not None and leases.healthy:
            return None
        return self.lease_renewed_at

    def _lease_renewal(self) -> dict[str, str] | None:
        """The lease header for this read, when the lease is due for a renewal through the database."""
        renewed_at = self._database_renewed_at()
        if renewed_at is None:
            return None
        if time.monotonic() - renewed_at < self.settings.front_lease_renew_seconds:
            return None
        return lease_header(self.settings.front_lease_seconds)

    def _lease_due(self) -> float | None:
        renewed_at = self._database_renewed_at()
        if renewed_at is None:
            return None
        due = renewed_at + self.settings.front_lease_renew_seconds
        return max(due, time.monotonic() + self.settings.poll_seconds)  # a failed renewal is not a busy loop

    async def _read(
        self, source: WakeSource, lease_headers: dict[str, str] | None
    ) -> Delivered | float | None:
        request_id = self.submitted_id()
        try:
            answer = await self._native(
                "status",
                self.state.client.status(request_id, text=self.is_text, headers=lease_headers),
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
        self.generating = answer.ok and int(status.get("processing") or 0) > 0
        if request_gone(answer):
            # The horde's own 404 (a gateway's in its place is a failed read: docs/adr/0105).
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
            if isinstance(self.request, TextCompletionRequest):
                return Delivered(TextCompletion(self.request, request_id, self.created, status))
            return Delivered(Completion(self.request, request_id, self.created, status))
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
                raise await declaration_gap_error(self.state.client, reason, self.request)
            if self.impossible_since is None:
                self.impossible_since = now
            grace_end = self.impossible_since + self.settings.fail_fast_grace_seconds
            if now >= grace_end:
                await self.cancel()
                raise no_eligible_worker()
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
            # The SDKs ignore a Retry-After over 60 s and retry within a second (docs/adr/0125).
            should_retry=False if retry_after > SDK_RETRY_AFTER_MAX_SECONDS else None,
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
        self.state.cancels.open_requests.pop(self.request_id or "", None)
        return ChatFrontError(
            502, "ChatRequestFaulted", message, type="api_error", should_retry=False, metadata=metadata
        )

    async def _timeout(self) -> ChatFrontError:
        if self.stopping:  # the budget the stop cut ended, not the request's own
            await self.cancel(undelivered=self.undelivered)
            return front_stopping()
        await self.cancel()
        return ChatFrontError(
            408,
            "ChatRequestTimeout",
            f"No worker finished the request within {int(self.budget.seconds)} seconds.",
            type="timeout_error",
            should_retry=False,
        )

    @property
    def undelivered(self) -> bool:
        """At a stop: whether the client has received none of the reply, so that the request is
        ended unpaid (docs/adr/0086); a relayed stream that sent deltas is settled as the spec's
        cancel, on what its worker posted."""
        return not (self.relayed is not None and self.relayed.exposed)

    async def cancel(self, *, undelivered: bool = False) -> None:
        """Cancel the horde request (once); `undelivered`: its client will receive none of its reply
        because this process stops, and the horde ends it as a dead front's (docs/adr/0086)."""
        if self.cancelled or self.request_id is None:
            return
        self.cancelled = True
        await self.state.cancels.cancel_within_budget(self.request_id, text=self.is_text, undelivered=undelivered)

    def cancel_in_background(self) -> None:
        if not self.cancelled and self.request_id is not None:
            self.cancelled = True
            self.state.spawn(self.state.cancels.cancel_within_budget(self.request_id, text=self.is_text))
        elif self.request_id is None and self.submit_in_flight is not None:
            # The client left while the submit was out: whatever it queued is found and cancelled.
            lost, self.submit_in_flight = self.submit_in_flight, None
            self.state.cancels.give_up_submit(self.operation_key, lost)
            self.state.spawn(self.state.cancels.cancel_lost_submit(self.operation_key))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.request_id is not None:
            self.state.cancels.open_requests.pop(self.request_id, None)
        if self.wake is not None and self.request_id is not None and self.state.listener is not None:
            with contextlib.suppress(Exception):
                await self.state.listener.unregister(self.request_id, self.wake)
        if self.relayed is not None:
            self.relayed.close()
        if self.watcher is not None:
            self.watcher.close()
        self.slot.release()

    # the first read decision, then the wait -------------------------------------------------------

    async def first_decision(self) -> Completion | TextCompletion | None:
        """Read once after submit (and under fail_fast until the positioned-read rule decides)."""
        assert self.watcher is not None, "start_wait first"
        source = WakeSource.IMMEDIATE
        while True:
            outcome = await self.read(source)
            if isinstance(outcome, Delivered):
                return outcome.completion
            if self.first_decided:
                self.not_after = outcome.not_after
                return None
            source = await self.watcher.next_wake(not_after=outcome.not_after)
            if source == WakeSource.DISCONNECT:
                raise asyncio.CancelledError

    async def wait(self, not_after: float | None = None) -> Completion | TextCompletion:
        assert self.watcher is not None, "start_wait first"
        while True:
            source = await self.watcher.next_wake(not_after=not_after)
            if source == WakeSource.DISCONNECT:
                raise asyncio.CancelledError
            outcome = await self.read(source)
            if isinstance(outcome, Delivered):
                return outcome.completion
            not_after = outcome.not_after

    def delivered(self, completion: Completion | TextCompletion) -> None:
        self.trace.estimated_usage = completion.estimated_usage
        self.trace.served_model = completion.model
        self.state.metrics.delivered(completion)
        if not self.request.stream:
            self.first_content_sent()  # the body; a stream records it as it sends (oai.streaming)
        self.state.cancels.open_requests.pop(self.request_id or "", None)

    def first_content_sent(self, *, relayed: bool = False) -> None:
        """horde.oai.first_content.duration, once per request, by whatever sends the first content:
        the first relayed delta (relayed true), the first completion chunk or the non-streamed body."""
        if self.first_content_recorded or self.trace.submitted_mono is None:
            return
        self.first_content_recorded = True
        self.state.metrics.first_content.record(
            time.monotonic() - self.trace.submitted_mono,
            {"horde.streamed": self.request.stream, "horde.relayed": relayed},
        )

    def client_closed(self) -> None:
        """The client left: recorded, and the request cancelled in the background."""
        self.state.metrics.wake(WakeSource.DISCONNECT, False, False)
        self.trace.woke_by = WakeSource.DISCONNECT.value
        self.trace.code = "client_closed"
        if not self.request.stream or self.trace.status_code != 200 or self.trace.submitted_at is None:
            self.trace.status_code = 499 if not self.request.stream else self.trace.status_code
        self.cancel_in_background()

    async def finish(self) -> None:
        if self.trace.code == "client_closed":
            self.cancel_in_background()
        await self.close()
        self.trace.finish(self.state.metrics)
