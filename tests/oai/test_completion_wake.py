"""The completion signal's wake of a background watcher or stream reader is undone whenever its block
ends, also when a cancel (a stop, a client that leaves) overtakes the register on its way to Redis:
no subscription is left behind on the shared listener's connection."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from types import SimpleNamespace

import pytest
import redis

from contract.chat_signal import CHAT_SIGNAL_CHANNEL_PREFIX
from oai.responses.background import completion_wake
from oai.waiter import CompletionSignalListener

pytestmark = pytest.mark.redis_only


def _subscribed(client: redis.Redis, ids: list[str]) -> list[str]:
    channels = [CHAT_SIGNAL_CHANNEL_PREFIX + request_id for request_id in ids]
    return [channel.decode() for channel, count in client.pubsub_numsub(*channels) if count]


def test_a_register_a_cancel_overtook_leaves_no_subscription(redis_url):
    ids: list[str] = []

    async def scenario() -> None:
        listener = CompletionSignalListener(redis_url)
        await listener.ensure_started()

        async def ensure_listener() -> CompletionSignalListener:
            return listener

        state = SimpleNamespace(ensure_listener=ensure_listener)

        async def held(request_id: str) -> None:
            async with completion_wake(state, request_id):
                await asyncio.Event().wait()

        try:
            # Cancelled after 0, 1, 2 ... turns of the loop: at the start, while the subscribe or
            # the ping is on its way, and once registered.
            for turns in range(40):
                ids.append(f"wake-test-{uuid.uuid4()}")
                task = asyncio.create_task(held(ids[-1]))
                for _ in range(turns):
                    await asyncio.sleep(0)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            # A block that ends on its own unregisters too.
            ids.append(f"wake-test-{uuid.uuid4()}")
            async with completion_wake(state, ids[-1]) as wake:
                assert wake is not None
                assert await asyncio.to_thread(_subscribed, client, ids[-1:]) == [CHAT_SIGNAL_CHANNEL_PREFIX + ids[-1]]
            # Checked while the listener's connection is still open (closing it drops every channel).
            deadline = time.monotonic() + 5
            while (left := await asyncio.to_thread(_subscribed, client, ids)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert left == []
        finally:
            await listener.close()

    client = redis.Redis.from_url(redis_url)
    asyncio.run(scenario())
