"""The horde's OpenTelemetry instruments (no-ops until a meter provider is configured).

Instruments are created lazily from the current meter provider rather than at import: the API's
global provider can be set only once per process, so tests swap in their own provider with
use_meter_provider (an in-memory reader) and every instrument follows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics

METER_NAME = "horde"

_override: Any = None  # a provider set by use_meter_provider; None follows the global one
_instruments: dict[tuple[int, str], Any] = {}  # by (id of the override, or of None), name


def use_meter_provider(provider: Any) -> None:
    """Record every instrument on `provider` from now on (None: back to the global provider)."""
    global _override
    _override = provider
    _instruments.clear()


def _provider() -> Any:
    return _override if _override is not None else metrics.get_meter_provider()


class _LazyInstrument:
    kind = "counter"

    def __init__(self, name: str, description: str = "", unit: str = "") -> None:
        self.name = name
        self.description = description
        self.unit = unit

    def _instrument(self) -> Any:
        # Keyed by the override, not by the provider it resolves to: asking the API for the
        # global provider reads the environment on every call (a few us on every hot route's
        # count). An instrument made before the global provider is set is the API's proxy,
        # which records on that provider once it is set.
        key = (id(_override), self.name)
        instrument = _instruments.get(key)
        if instrument is None:
            provider = _provider()
            meter = provider.get_meter(METER_NAME)
            create = meter.create_histogram if self.kind == "histogram" else meter.create_counter
            instrument = create(self.name, unit=self.unit, description=self.description)
            _instruments[key] = instrument
        return instrument


class LazyCounter(_LazyInstrument):
    def add(self, amount: int | float, attributes: Mapping[str, Any] | None = None) -> None:
        self._instrument().add(amount, attributes=dict(attributes or {}))


class LazyHistogram(_LazyInstrument):
    kind = "histogram"

    def record(self, amount: int | float, attributes: Mapping[str, Any] | None = None) -> None:
        self._instrument().record(amount, attributes=dict(attributes or {}))


# Kept for code that creates instruments at import; those follow the global provider only, so new
# instruments should be LazyCounter / LazyHistogram.
meter = metrics.get_meter(METER_NAME)

chat_worker_faults = LazyCounter(
    "horde.chat.worker_faults", description="Faulted chat submits, by the reason the worker sent"
)
chat_max_length_lowered = LazyCounter(
    "horde.chat.max_length_lowered",
    description="Chat requests whose max_length was lowered to the largest declared by serving workers",
)
text_stale_aborts = LazyCounter(
    "horde.text.stale_aborts", description="Text and chat jobs aborted because the lease lapsed"
)
text_empty_generations = LazyCounter(
    "horde.text.empty_generations",
    description="Stored replies without text (a chat reply of tool calls is not empty), by the model that served them",
)
text_context_fit = LazyCounter(
    "horde.text.context_fit", description="Requests whose context sizing trimmed or grew them"
)
lease_renewals = LazyCounter(
    "horde.text.lease_renewals",
    description="Progress posts that extended a job lease (granted), and posts that found it at its cap (at_cap)",
)
lease_capacity_limited = LazyCounter(
    "horde.pop.lease_capacity_limited",
    description="Pops by a chat worker whose measured speed caps the chat output it is offered below its declared length",
)
gate_shadow_assignments = LazyCounter(
    "horde.text.gate_shadow.assignments", description="Jobs assigned over the worker's lease capacity"
)
gate_shadow_outcomes = LazyCounter(
    "horde.text.gate_shadow.outcomes", description="How over-capacity jobs ended: completed, faulted or aborted"
)
gate_shadow_service_seconds = LazyHistogram(
    "horde.text.gate_shadow.service_seconds", unit="s", description="Pop to submit time of completed over-capacity jobs"
)

free_allowance_decisions = LazyCounter(
    "horde.text.free_allowance.decisions",
    description="Request creations by how the free output allowance admitted them: free, funded, refused or downgraded",
)
free_allowance_estimated_wait = LazyHistogram(
    "horde.text.free_allowance.estimated_wait_seconds",
    unit="s",
    description="The estimated wait on the eligible workers a request's free output allowance was sized by",
)
queue_wait_seconds = LazyHistogram(
    "horde.text.queue_wait_seconds", unit="s", description="Each job's time from its request's creation to its pop"
)

# horde.size_bucket / TEXT_LENGTH_BUCKETS labels.
TEXT_LENGTH_BUCKETS = ((512, "<=512"), (1024, "513-1024"), (2048, "1025-2048"), (4096, "2049-4096"))


def size_bucket(max_length: int) -> str:
    for bound, label in TEXT_LENGTH_BUCKETS:
        if max_length <= bound:
            return label
    return ">4096"
