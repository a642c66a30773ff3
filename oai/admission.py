"""Admission: the front's in-flight caps, overall and per client address (spec: chat_front.md); a
request over either cap is refused with FrontAtCapacity before it is submitted."""

from __future__ import annotations

import collections

from oai.errors import ChatFrontError

FRONT_AT_CAPACITY_RETRY_AFTER_SECONDS = 2


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



def front_at_capacity(limiter: InflightLimiter, source: str) -> ChatFrontError:
    """The refusal, naming the cap that was reached: a client over its own address's cap learns
    that its own requests hold the slots, not that the front is full."""
    if limiter.by_source[source] >= limiter.max_per_source:
        message = (
            f"This AI Horde front holds {limiter.max_per_source} requests from your address, its limit "
            "per address; try again when one of them ends."
        )
    else:
        message = "This AI Horde front is at its in-flight request limit; try again shortly."
    return ChatFrontError(
        503,
        "FrontAtCapacity",
        message,
        type="api_error",
        retry_after=FRONT_AT_CAPACITY_RETRY_AFTER_SECONDS,
        should_retry=True,
    )
