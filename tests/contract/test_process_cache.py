"""The one process cache type: ttl fixed at store, max entries (oldest stored goes first), the
build shared by threads, one reset for every cache."""

from __future__ import annotations

import threading

import pytest

from contract import process_cache
from contract.process_cache import ProcessCache, reset_process_caches


class Clock:
    """The caches' monotonic clock, moved by the test alone: a loaded box that pauses the test
    between two reads does not outrun a 50 ms ttl."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    moved = Clock()
    monkeypatch.setattr(process_cache, "monotonic", moved)
    return moved


def test_a_value_is_kept_for_its_ttl_and_then_missed(clock):
    cache = ProcessCache("t", ttl=0.05, max_entries=4)
    cache.set("a", 1)
    assert cache.get("a") == 1
    clock.advance(0.06)
    assert cache.get("a") is None


def test_the_ttl_is_read_when_storing_and_zero_stores_nothing():
    ttl = [60.0]
    cache = ProcessCache("t", ttl=lambda: ttl[0], max_entries=4)
    cache.set("a", 1)
    ttl[0] = 0
    assert cache.get("a") == 1  # stored under the ttl of its time
    cache.set("a", 2)  # a store under 0 drops the entry and keeps nothing
    assert cache.get("a") is None and len(cache) == 0


def test_past_max_entries_the_oldest_stored_goes():
    cache = ProcessCache("t", ttl=60, max_entries=2)
    cache.set("a", 1)
    cache.set("b", 2)
    cache.set("a", 3)  # stored again: now the newest
    cache.set("c", 4)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (3, None, 4)
    assert len(cache) == 2


def test_replace_keeps_the_expiry_and_adds_nothing(clock):
    cache = ProcessCache("t", ttl=0.05, max_entries=4)
    cache.replace("a", 1)
    assert cache.get("a") is None and len(cache) == 0
    cache.set("a", 1)
    clock.advance(0.03)
    cache.replace("a", 2)
    assert cache.get("a") == 2
    clock.advance(0.03)
    assert cache.get("a") is None  # expired on the first store's clock


def test_forget_and_clear():
    cache = ProcessCache("t", ttl=60, max_entries=4)
    cache.set("a", 1)
    cache.set("b", 2)
    cache.forget("a")
    cache.forget("missing")
    assert cache.get("a") is None and cache.get("b") == 2
    cache.clear()
    assert len(cache) == 0


def test_get_or_build_builds_once_and_keeps_an_expired_value_while_another_thread_builds(clock):
    cache = ProcessCache("t", ttl=0.05, max_entries=1)
    builds = []
    assert cache.get_or_build("v1", lambda: builds.append(1) or "one") == "one"
    assert cache.get_or_build("v1", lambda: builds.append(2) or "two") == "one"
    assert builds == [1]
    clock.advance(0.06)
    started, release = threading.Event(), threading.Event()

    def slow_build():
        started.set()
        release.wait(5)
        return "rebuilt"

    builder = threading.Thread(target=lambda: cache.get_or_build("v1", slow_build))
    builder.start()
    assert started.wait(5)
    # Expired but held: answered from it at once, not after the build.
    assert cache.get_or_build("v1", lambda: "never") == "one"
    release.set()
    builder.join(5)
    assert cache.get_or_build("v1", lambda: "never") == "rebuilt"
    # A new key (a new version) is built at once and replaces the one entry.
    assert cache.get_or_build("v2", lambda: "two") == "two"
    assert cache.get("v1") is None


def test_reset_process_caches_forgets_every_cache():
    first = ProcessCache("first", ttl=60, max_entries=4)
    second = ProcessCache("second", ttl=float("inf"), max_entries=4)
    first.set("a", 1)
    second.set("b", 2)
    reset_process_caches()
    assert first.get("a") is None and second.get("b") is None


def test_max_entries_must_be_positive():
    with pytest.raises(ValueError):
        ProcessCache("t", ttl=1, max_entries=0)


def test_a_new_key_drops_the_expired_entries_so_memory_follows_the_keys_in_use(clock):
    """A long-running process sees far more keys (API keys, workers) than are in use within a ttl:
    expired entries go as new keys arrive, not only past max_entries."""
    cache = ProcessCache("t", ttl=0.05, max_entries=100_000)
    for i in range(1000):
        cache.set(f"once-{i}", i)
    clock.advance(0.06)
    cache.set("now", 1)
    assert len(cache) == 1 and cache.get("now") == 1
    cache.set("again", 2)  # not expired: kept
    assert len(cache) == 2
