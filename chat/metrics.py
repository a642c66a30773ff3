"""The horde's OpenTelemetry instruments (no-ops until a meter provider is configured)."""

from __future__ import annotations

from opentelemetry import metrics

meter = metrics.get_meter("horde")

chat_worker_faults = meter.create_counter(
    "horde.chat.worker_faults", description="Faulted chat submits, by the reason the worker sent"
)
chat_max_length_lowered = meter.create_counter(
    "horde.chat.max_length_lowered",
    description="Chat requests whose max_length was lowered to the largest declared by serving workers",
)
text_context_fit = meter.create_counter(
    "horde.text.context_fit", description="Requests whose context sizing trimmed or grew them"
)

# horde.size_bucket / TEXT_LENGTH_BUCKETS labels.
TEXT_LENGTH_BUCKETS = ((512, "<=512"), (1024, "513-1024"), (2048, "1025-2048"), (4096, "2049-4096"))


def size_bucket(max_length: int) -> str:
    for bound, label in TEXT_LENGTH_BUCKETS:
        if max_length <= bound:
            return label
    return ">4096"
