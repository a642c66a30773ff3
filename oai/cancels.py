"""The cancels of one front (one per FrontState): the requests it waits for, the cancels to send
again, and the submits given up with their outcome unknown (docs/adr/0020-front-lease.md: found by
their operation key and cancelled). The retries start with the first failed cancel.

At a stop, a request whose reply its client will not receive is cancelled as undelivered
(docs/adr/0086): the horde ends it as a dead front's, its generation in flight unpaid, when it knows
this front's passkey; else the spec's cancel."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from contract.aio import within
from oai.front_lease import front_id
from oai.horde_client import HordeClient, NativeUnreachable, SubmitAnswerLost
from oai.metrics import FrontMetrics
from oai.settings import FrontSettings

log = logging.getLogger("oai.requests")

HORDE_CHAT_REQUEST_EXPIRY_SECONDS = 20 * 60
MAX_FAILED_CANCELS = 10_000


@dataclass
class LostSubmit:
    """A submit the front gave up on without learning its outcome: sent again with its operation
    key, the horde answers with the request it holds for the key (or queues it now), which is then
    cancelled. Its front lease, never renewed, is the horde's own backstop."""

    body: dict[str, Any]
    headers: dict[str, str]
    text: bool
    submitted: float = field(default_factory=time.monotonic)


class Cancels:
    def __init__(self, settings: FrontSettings, client: HordeClient, metrics: FrontMetrics):
        self.settings = settings
        self.client = client
        self.metrics = metrics
        # request id -> (submit time (monotonic), text request) of the requests waited for; a text
        # request (POST /v1/completions) is cancelled on the native text route.
        self.open_requests: dict[str, tuple[float, bool]] = {}
        # The cancels to send again, oldest first: (submit time, text request, undelivered).
        self.failed: collections.OrderedDict[str, tuple[float, bool, bool]] = collections.OrderedDict()
        # operation key -> a submit given up with its outcome unknown, to find and cancel (oldest first).
        self.lost_submits: collections.OrderedDict[str, LostSubmit] = collections.OrderedDict()
        self._retry_task: asyncio.Task | None = None

    def ensure_retries(self) -> None:
        if self._retry_task is None:
            # A context of its own: it retries every request's cancels, not the one that started it (docs/adr/0128).
            self._retry_task = asyncio.create_task(
                self._retry_loop(), name="oai-cancel-retry", context=contextvars.Context()
            )

    def stop_retries(self) -> None:
        if self._retry_task:
            self._retry_task.cancel()

    async def _retry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cancel_retry_seconds)
            with contextlib.suppress(Exception):
                await self.retry_failed()

    def _headers(self, undelivered: bool) -> dict[str, str] | None:
        return self.client.undelivered_headers(front_id()) if undelivered else None

    async def cancel_within_budget(self, request_id: str, *, text: bool = False, undelivered: bool = False) -> str:
        """Cancel a request, within the cancel timeout; `undelivered`: its client will not receive
        its reply because this process stops (docs/adr/0086)."""
        submitted, text = self.open_requests.pop(request_id, (time.monotonic(), text))
        outcome = await self.client.cancel(request_id, text=text, headers=self._headers(undelivered))
        self.metrics.cancels.add(1, {"horde.outcome": outcome})
        if outcome in ("failed", "timed_out", "not_started"):
            self.ensure_retries()
            self.failed[request_id] = (submitted, text, undelivered)
            self.failed.move_to_end(request_id)
            while len(self.failed) > MAX_FAILED_CANCELS:
                self.failed.popitem(last=False)
        return outcome

    async def retry_failed(self) -> None:
        now = time.monotonic()
        for request_id, (submitted, text, undelivered) in list(self.failed.items()):
            if now - submitted > HORDE_CHAT_REQUEST_EXPIRY_SECONDS:
                self.failed.pop(request_id, None)
                continue
            outcome = await self.client.cancel(request_id, text=text, headers=self._headers(undelivered))
            self.metrics.cancels.add(1, {"horde.outcome": outcome})
            if outcome not in ("failed", "timed_out", "not_started"):
                self.failed.pop(request_id, None)
        for operation_key, lost in list(self.lost_submits.items()):
            if now - lost.submitted > HORDE_CHAT_REQUEST_EXPIRY_SECONDS:
                self.lost_submits.pop(operation_key, None)
                continue
            await self.cancel_lost_submit(operation_key)

    def give_up_submit(self, operation_key: str, lost: LostSubmit) -> None:
        self.lost_submits[operation_key] = lost
        self.lost_submits.move_to_end(operation_key)
        while len(self.lost_submits) > MAX_FAILED_CANCELS:
            self.lost_submits.popitem(last=False)
        self.ensure_retries()

    async def cancel_lost_submit(self, operation_key: str) -> bool:
        """Find the claim of a given-up submit by its operation key and cancel it; returns whether the
        horde answered (else the retries send it again)."""
        lost = self.lost_submits.get(operation_key)
        if lost is None:
            return True
        try:
            answer = await within(
                self.client.submit(lost.body, lost.headers, call_type="recovery", text=lost.text),
                self.settings.cancel_timeout_seconds,
            )
        except (NativeUnreachable, SubmitAnswerLost, TimeoutError):
            return False
        self.lost_submits.pop(operation_key, None)
        request_id = answer.body.get("id") if answer.ok and isinstance(answer.body, dict) else None
        if request_id:
            await self.cancel_within_budget(str(request_id), text=lost.text)
        else:  # refused: the horde held no claim for the key when it answered
            log.info("given-up submit %s: the horde holds no request for it (%s)", operation_key, answer.status)
        return True

    async def cancel_open_requests(self) -> None:
        """At the stop's shutdown: the requests still open were never answered, so none is delivered."""
        ids = list(self.open_requests)
        if ids:
            await asyncio.gather(
                *(self.cancel_within_budget(request_id, undelivered=True) for request_id in ids),
                return_exceptions=True,
            )
