"""The serving layer's threads (hordesite.wsgi_pool.WebThreads): at most `count` calls at once,
each call's result or exception handed back to the awaiting request, one thread's context kept
from call to call (as a WSGI server's thread), and the calls queued before a close finished first.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from hordesite.wsgi_pool import WebThreads


def test_results_and_exceptions_reach_the_awaiting_request():
    threads = WebThreads(2)

    def fails():
        raise ValueError("from the view")

    async def main():
        assert await threads.run(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ValueError, match="from the view"):
            await threads.run(fails)

    try:
        asyncio.run(main())
    finally:
        threads.close()


def test_no_more_than_count_calls_run_at_once():
    threads = WebThreads(3)
    running = peak = 0
    lock = threading.Lock()

    def call():
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.02)
        with lock:
            running -= 1
        return threading.current_thread().name

    async def main():
        return await asyncio.gather(*(threads.run(call) for _ in range(12)))

    try:
        names = asyncio.run(main())
    finally:
        threads.close()
    assert peak == 3
    assert len(set(names)) == 3 and all(name.startswith("web_") for name in names)


def test_a_thread_keeps_its_own_context_from_call_to_call():
    """Django keeps a cache backend and a connection per context: one thread makes them once."""
    threads = WebThreads(1)
    seen = contextvars.ContextVar("seen", default=0)

    def count():
        seen.set(seen.get() + 1)
        return seen.get()

    async def main():
        seen.set(100)  # the event loop's context is not the thread's
        return [await threads.run(count) for _ in range(3)]

    try:
        assert asyncio.run(main()) == [1, 2, 3]
    finally:
        threads.close()


def test_a_request_that_went_away_does_not_break_the_thread():
    threads = WebThreads(1)
    release = threading.Event()

    async def main():
        first = threads.run(release.wait, 5)
        first.cancel()  # the client went away while its call ran
        release.set()
        return await threads.run(lambda: "next")

    try:
        assert asyncio.run(main()) == "next"
    finally:
        threads.close()


def test_close_finishes_the_calls_queued_before_it():
    threads = WebThreads(1)
    done: list[int] = []

    async def main():
        for i in range(5):
            threads.run(lambda i=i: (time.sleep(0.01), done.append(i)))
        await asyncio.sleep(0)

    asyncio.run(main())
    threads.close()
    assert done == [0, 1, 2, 3, 4]
