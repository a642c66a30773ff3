"""The front's instruments (spec: chat_front.md, Metrics) and their bucket boundaries.

`FrontMetrics` takes a meter: the global provider's unless one is passed (tests pass a meter of a
separate MeterProvider with an InMemoryMetricReader). Unconfigured, the global provider records
nothing. Every attribute is bounded; client addresses, keys, prompts and request ids never are.
The relay's span (horde.oai.delta_read) is recorded by oai.deltas.DeltaStreamReader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

METER_NAME = "horde.oai"
# The horde's native call latency buckets and request lifecycle buckets.
BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
BUCKETS_REQUEST_LIFECYCLE_SECONDS = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
BUCKETS_BODY_BYTES = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 37748736)


def histogram_views() -> list[Any]:
    """The SDK views giving each histogram its boundaries (needs opentelemetry-sdk)."""
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

    def view(name: str, bounds: tuple[float, ...]) -> View:
        return View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(list(bounds)))

    return [
        view("horde.oai.native.duration", BUCKETS_SECONDS),
        view("horde.oai.queue_wait", BUCKETS_REQUEST_LIFECYCLE_SECONDS),
        view("horde.oai.first_content.duration", BUCKETS_REQUEST_LIFECYCLE_SECONDS),
        view("horde.oai.request.duration", BUCKETS_REQUEST_LIFECYCLE_SECONDS),
        view("horde.oai.request.body_bytes", BUCKETS_BODY_BYTES),
    ]


class FrontMetrics:
    def __init__(
        self, meter: Any | None = None, *, inflight: Callable[[], tuple[int, int, int]] | None = None
    ):
        meter = meter or metrics.get_meter(METER_NAME)
        self._inflight = inflight or (lambda: (0, 0, 0))
        self.requests_admitted = meter.create_counter(
            "horde.oai.requests.admitted", description="Chat requests that took an in-flight slot"
        )
        self.requests_refused = meter.create_counter(
            "horde.oai.requests.refused", description="Chat requests refused before an in-flight slot"
        )
        self.requests_errors = meter.create_counter(
            "horde.oai.requests.errors",
            description="Admitted requests answered with an error status before any header",
        )
        self.stream_failures = meter.create_counter(
            "horde.oai.stream.failures", description="Streams that ended in an SSE error event"
        )
        meter.create_observable_gauge(
            "horde.oai.inflight",
            callbacks=[self._observe(0)],
            description="Requests holding an in-flight slot",
        )
        meter.create_observable_gauge(
            "horde.oai.inflight.sources",
            callbacks=[self._observe(1)],
            description="Client addresses holding a slot",
        )
        meter.create_observable_gauge(
            "horde.oai.inflight.source_max",
            callbacks=[self._observe(2)],
            description="Most slots one client address holds",
        )
        self.body_bytes = meter.create_histogram(
            "horde.oai.request.body_bytes", unit="By", description="Size of each request body"
        )
        self.native_duration = meter.create_histogram(
            "horde.oai.native.duration", unit="s", description="Latency of each native call"
        )
        self.queue_wait = meter.create_histogram(
            "horde.oai.queue_wait",
            unit="s",
            description="The horde's queue wait of each delivered generation",
        )
        self.first_content = meter.create_histogram(
            "horde.oai.first_content.duration",
            unit="s",
            description="Submit acknowledgement to the first content sent",
        )
        self.request_duration = meter.create_histogram(
            "horde.oai.request.duration", unit="s", description="Admitted request arrival to its end"
        )
        self.wakes = meter.create_counter(
            "horde.oai.wakes", description="Status reads of waiting requests, by cause"
        )
        self.submit_outcome_unknown = meter.create_counter(
            "horde.oai.submit.outcome_unknown", description="Requests answered with submit_outcome unknown"
        )
        self.submit_recoveries = meter.create_counter(
            "horde.oai.submit.recoveries", description="Lost submits recovered by re-sending"
        )
        self.client_retry_hints = meter.create_counter(
            "horde.oai.client_retry_hints", description="Requests carrying x-stainless-retry-count above zero"
        )
        self.completions = meter.create_counter("horde.oai.completions", description="Delivered completions")
        self.completions_empty = meter.create_counter(
            "horde.oai.completions.empty", description="Delivered completions without visible text"
        )
        self.stream_relayed = meter.create_counter(
            "horde.oai.stream.relayed", description="Streamed requests that sent at least one relayed delta"
        )
        self.stream_relay_outcomes = meter.create_counter(
            "horde.oai.stream.relay_outcomes", description="How relayed streams ended"
        )
        self.cancels = meter.create_counter(
            "horde.oai.cancels", description="Cancels sent to the horde, by outcome"
        )

    def _observe(self, index: int) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(_options: CallbackOptions) -> list[Observation]:
            return [Observation(self._inflight()[index])]

        return callback

    # Small helpers so call sites stay one line.
    def refused(self, status_code: int, code: str | None) -> None:
        self.requests_refused.add(1, {"horde.status_code": status_code, "horde.code": code or ""})

    def error(self, status_code: int, code: str | None, streamed: bool, reason: str = "") -> None:
        self.requests_errors.add(
            1,
            {
                "horde.status_code": status_code,
                "horde.code": code or "",
                "horde.streamed": streamed,
                "horde.reason": reason,
            },
        )

    def delivered(self, completion: Any) -> None:
        """A delivered completion (oai.mapping.Completion or oai.text_reply.TextCompletion): counted
        once per request, by the answer that delivers it, or a background response's finished
        record (docs/adr/0110)."""
        self.completions.add(
            1,
            {
                "horde.model": completion.model,
                "horde.estimated_usage": completion.estimated_usage,
                "horde.finish_reason": completion.finish_reason,
                "horde.max_length_lowered": completion.max_length_lowered,
            },
        )
        if completion.empty:
            self.completions_empty.add(1, {"horde.model": completion.model})
        if isinstance(completion.queue_wait, int | float):
            self.queue_wait.record(completion.queue_wait, {"horde.model": completion.model})

    def native(self, call_type: str, outcome: str, seconds: float) -> None:
        self.native_duration.record(seconds, {"horde.call_type": call_type, "horde.outcome": outcome})

    def wake(self, source: str, found_finished: bool, found_done_without_generation: bool) -> None:
        self.wakes.add(
            1,
            {
                "horde.wake_source": source,
                "horde.found_finished": found_finished,
                "horde.found_done_without_generation": found_done_without_generation,
            },
        )
