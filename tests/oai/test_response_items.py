"""oai.response_items: the output items kept for `item_reference`, per API key, in Redis or in the
process; a Redis that is down costs the keep nothing and makes a recall retryable."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from oai.response_items import RESPONSE_ITEMS_BACKOFF_SECONDS, ResponseItems, ResponseItemsUnavailable

ITEM = {"id": "msg_abc", "type": "message", "role": "assistant", "status": "completed", "content": []}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(coro):
    return asyncio.run(coro)


def test_in_the_process_an_item_is_found_only_by_the_key_that_made_it():
    async def scenario():
        items = ResponseItems(None, keep_seconds=60)
        await items.keep("key-a", [ITEM])
        return await items.recall("key-a", ["msg_abc", "msg_other"]), await items.recall("key-b", ["msg_abc"])

    mine, theirs = _run(scenario())
    assert mine == {"msg_abc": ITEM} and theirs == {}


def test_keeping_for_zero_seconds_keeps_nothing():
    async def scenario():
        items = ResponseItems(None, keep_seconds=0)
        await items.keep("key-a", [ITEM])
        return items.enabled, await items.recall("key-a", ["msg_abc"])

    assert _run(scenario()) == (False, {})


@pytest.mark.redis_only
def test_in_redis_an_item_expires_after_its_time():
    url = os.environ["REDIS_URL"]

    async def scenario():
        items = ResponseItems(url, keep_seconds=1)
        await items.keep("key-a", [{**ITEM, "id": "msg_expiring"}])
        found = await items.recall("key-a", ["msg_expiring"])
        await asyncio.sleep(2.1)
        gone = await items.recall("key-a", ["msg_expiring"])
        other = await items.recall("key-b", ["msg_expiring"])
        await items.close()
        return found, gone, other

    found, gone, other = _run(scenario())
    assert found["msg_expiring"]["id"] == "msg_expiring" and gone == {} and other == {}


def test_a_redis_that_refuses_connections_costs_the_keep_nothing_and_a_recall_is_retryable():
    async def scenario():
        items = ResponseItems(f"redis://127.0.0.1:{_closed_port()}/0", keep_seconds=60)
        started = time.monotonic()
        await items.keep("key-a", [ITEM])  # logged, not raised
        kept_in = time.monotonic() - started
        with pytest.raises(ResponseItemsUnavailable):
            await items.recall("key-a", ["msg_abc"])
        # Within the backoff no connection is tried: the recall fails at once.
        started = time.monotonic()
        with pytest.raises(ResponseItemsUnavailable):
            await items.recall("key-a", ["msg_abc"])
        return kept_in, time.monotonic() - started

    kept_in, second = _run(scenario())
    assert kept_in < 2 and second < 0.05 < RESPONSE_ITEMS_BACKOFF_SECONDS
