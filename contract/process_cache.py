"""One small cache type for what a process keeps in memory: values for a time (ttl), up to a count
(max entries), and one reset for all of them.

A process cache holds only what the database or Redis holds. What must show at once in every
process goes into the key (a version read from the source, e.g. workers.serving_version): a changed
source is then a miss in every process, with no message to send. What may show late shows within
the ttl.

Reads take no lock (the status route reads several caches per poll): a hit is one dict lookup and
one monotonic-clock compare. An entry's expiry is fixed when it is stored. Writes take the cache's
lock, so that evicting the oldest entry never iterates a dict another write is changing.

Pure Python and no project import: every app may import it (it lives in `contract`, the ground
floor; see docs/adr/0027-one-process-cache.md).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from time import monotonic
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_caches: weakref.WeakSet[ProcessCache] = weakref.WeakSet()


class ProcessCache(Generic[K, V]):
    """Up to `max_entries` values, each kept `ttl` seconds from when it was stored (a number, or a
    callable read at each store, e.g. a setting; 0 or less stores nothing). Past the count, the
    entry stored longest ago goes. Values are shared by the process's threads: store immutable
    values or copies. A new key drops the expired entries stored first, so what is held is what
    was stored within a ttl, not every key the process ever saw."""

    __slots__ = ("name", "max_entries", "_ttl", "_entries", "_lock", "_build_lock", "__weakref__")

    def __init__(self, name: str, *, ttl: float | Callable[[], float], max_entries: int):
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.name = name
        self.max_entries = max_entries
        self._ttl = ttl
        # key -> (expiry on the monotonic clock, value), in the order stored.
        self._entries: dict[K, tuple[float, V]] = {}
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        _caches.add(self)

    def __repr__(self) -> str:
        return f"<ProcessCache {self.name!r}: {len(self._entries)}/{self.max_entries}>"

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The value stored under `key` if it has not expired, else None."""
        entry = self._entries.get(key)
        if entry is not None and monotonic() < entry[0]:
            return entry[1]
        return None

    def set(self, key: K, value: V) -> None:
        ttl = self._ttl() if callable(self._ttl) else self._ttl
        if ttl <= 0:
            self.forget(key)
            return
        now = monotonic()
        with self._lock:
            entries = self._entries
            # Stored again: it moves to the end (the newest).
            if entries.pop(key, None) is None:
                while len(entries) >= self.max_entries:
                    del entries[next(iter(entries))]
                # A new key also drops the expired entries stored before the others: a process
                # that saw 50,000 API keys once would otherwise hold them all for as long as it
                # runs, where a few seconds' worth are of use (docs/adr/0082).
                while entries and entries[first := next(iter(entries))][0] <= now:
                    del entries[first]
            entries[key] = (now + ttl, value)

    def replace(self, key: K, value: V) -> None:
        """A new value for an entry kept under `key`, with the entry's expiry (the caller's change
        does not make the rest of the value any younger); nothing when there is none."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries[key] = (entry[0], value)

    def get_or_build(self, key: K, build: Callable[[], V]) -> V:
        """The value under `key`, built (and stored) when it is missing or expired. One thread
        builds at a time; while an expired value is still held the others keep answering with it
        meanwhile, and without one (a new key, e.g. a new version) they wait for the build."""
        entry = self._entries.get(key)
        if entry is not None and monotonic() < entry[0]:
            return entry[1]
        if not self._build_lock.acquire(blocking=entry is None):
            assert entry is not None  # not blocking only when an entry was held
            return entry[1]
        try:
            entry = self._entries.get(key)
            if entry is not None and monotonic() < entry[0]:
                return entry[1]  # built by the thread this one waited for
            value = build()
            self.set(key, value)
            return value
        finally:
            self._build_lock.release()

    def forget(self, key: K) -> None:
        if key in self._entries:
            with self._lock:
                self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def reset_process_caches() -> None:
    """Forget every process cache (tests; an operator's change that must apply at once)."""
    for cache in list(_caches):
        cache.clear()
