"""contract.aio.within: a bound on an await that never swallows a cancel (docs/adr/0117)."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from contract.aio import cancel_and_wait, within


def _reader_ends_on_one_cancel(bound) -> dict[int, bool]:
    """For each number of loop turns before the cancel, whether one cancel ended a loop that awaits
    results which are ready at once: the cancel then meets the result as it comes."""

    async def scenario() -> dict[int, bool]:
        loop = asyncio.get_running_loop()
        ended = {}
        for turns in range(6):

            stop = asyncio.Event()

            async def reader(stop: asyncio.Event = stop) -> None:
                while not stop.is_set():
                    ready = loop.create_future()
                    loop.call_soon(ready.set_result, None)
                    await bound(ready, 5)

            task = asyncio.create_task(reader())
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=0.5)
            ended[turns] = bool(done)
            stop.set()  # a loop that swallowed the cancel ends at its next turn
            await asyncio.wait({task})
        return ended

    return asyncio.run(scenario())


def test_one_cancel_ends_a_loop_bounded_by_within():
    assert _reader_ends_on_one_cancel(within) == {turns: True for turns in range(6)}


def test_asyncio_wait_for_swallows_such_a_cancel_on_this_python():
    """Why within exists: on Python 3.11 the same loop bounded by asyncio.wait_for goes on after the
    cancel; 3.12's wait_for, rewritten on asyncio.timeout, lets it through (then within could go)."""
    ended = _reader_ends_on_one_cancel(asyncio.wait_for)
    assert all(ended.values()) == (sys.version_info >= (3, 12))


@pytest.mark.parametrize("seconds", [0.01, 0])
def test_within_times_out_like_wait_for(seconds):
    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(5), seconds)
        assert await within(asyncio.sleep(0, result="done"), 1) == "done"
        assert await within(asyncio.sleep(0, result="done"), None) == "done"

    asyncio.run(scenario())


def test_cancel_and_wait_lets_the_callers_own_cancel_through():
    """A stop's step that closes a reader is bounded by the stop: when the bound lapses while the
    reader is still ending, the step ends then, and the steps after it in that bound do not run."""

    async def scenario() -> tuple[float, bool]:
        ended = asyncio.Event()

        async def reader() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                # A reader that takes its time to end: until the test has measured the step's end, or
                # 10 s (a step that waited for it would take them).
                await asyncio.shield(asyncio.wait_for(ended.wait(), 10))

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)
        next_step_ran = False

        async def close_then_next_step() -> None:
            nonlocal next_step_ran
            await cancel_and_wait(task)
            next_step_ran = True

        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await within(close_then_next_step(), 0.05)
        elapsed = time.monotonic() - started
        ended.set()
        await asyncio.wait({task})
        return elapsed, next_step_ran

    elapsed, next_step_ran = asyncio.run(scenario())
    assert elapsed < 5 and not next_step_ran


def test_cancel_and_wait_reads_a_failed_task_and_takes_none():
    async def scenario() -> None:
        async def failing() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                raise RuntimeError("failed as it stopped")

        task = asyncio.create_task(failing())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        assert task.done() and isinstance(task.exception(), RuntimeError)
        await cancel_and_wait(None)

    asyncio.run(scenario())
