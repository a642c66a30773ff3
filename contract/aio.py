"""asyncio helpers every app's long-lived loops share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float | None) -> T:
    """`awaitable`'s result, or TimeoutError after `seconds` (None: no bound): asyncio.wait_for's
    use, without its flaw. On Python 3.11 a cancel that meets wait_for's inner result as it comes
    is swallowed: wait_for returns the result (gh-86296), so a loop cancelled to stop it goes on and
    the stop that awaits it waits for ever. asyncio.timeout runs the awaitable in the caller's task
    and lets every cancel through. The project uses this, never asyncio.wait_for (ruff TID251)."""
    async with asyncio.timeout(seconds):
        return await awaitable


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` and wait for its end. The caller's own cancel still reaches the caller (a
    suppressed `await task` would swallow it, and with `within` the stop's bound too), and the task's
    outcome is read, so a loop that failed as it stopped is not logged as never retrieved."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()
