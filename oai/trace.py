"""The per-request trace: what one /v1 request did (submit, wakes, the answer), recorded as the
request-duration metric and logged once as the finished-request line when it ends."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from oai.errors import ChatFrontError
from oai.metrics import FrontMetrics

# The finished-request line's logger, bridged to OpenTelemetry logs when telemetry is on.
REQUEST_LOG_NAME = "oai.requests"
log = logging.getLogger(REQUEST_LOG_NAME)


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
