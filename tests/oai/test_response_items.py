"""oai.response_items: the output items kept for `item_reference`, per API key, in Redis or in the
process; a Redis that is down costs the keep nothing and makes a recall retryable."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from oai.response_items import (
    MAX_RESPONSE_CHAIN,
    RESPONSE_ITEMS_BACKOFF_SECONDS,
    ResponseChainTooLong,
    ResponseItems,
    ResponseItemsUnavailable,
)
from tests.ports import free_port

ITEM = {"id": "msg_abc", "type": "message", "role": "assistant", "status": "completed", "content": []}


def _run(coro):
    return asyncio.run(coro)


async def _keep(items: ResponseItems, key: str, item: dict, *, response: str = "resp_1", previous=None, turn=None):
    await items.keep(
        key,
        response={"id": response, "object": "response", "status": "completed", "output": [item]},
        previous_response_id=previous,
        turn_input=turn or [],
    )


def test_in_the_process_an_item_is_found_only_by_the_key_that_made_it():
    async def scenario():
        items = ResponseItems(None, keep_seconds=60)
        await _keep(items, "key-a", ITEM)
        return await items.recall("key-a", ["msg_abc", "msg_other"]), await items.recall("key-b", ["msg_abc"])

    mine, theirs = _run(scenario())
    assert mine == {"msg_abc": ITEM} and theirs == {}


def test_keeping_for_zero_seconds_keeps_nothing():
    async def scenario():
        items = ResponseItems(None, keep_seconds=0)
        await _keep(items, "key-a", ITEM)
        return items.enabled, await items.recall("key-a", ["msg_abc"]), await items.conversation("key-a", "resp_1")

    assert _run(scenario()) == (False, {}, None)


@pytest.mark.redis_only
def test_in_redis_an_item_expires_after_its_time():
    url = os.environ["REDIS_URL"]

    async def scenario():
        items = ResponseItems(url, keep_seconds=1)
        await _keep(items, "key-a", {**ITEM, "id": "msg_expiring"}, response="resp_expiring")
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
        items = ResponseItems(f"redis://127.0.0.1:{free_port()}/0", keep_seconds=60)
        started = time.monotonic()
        await _keep(items, "key-a", ITEM)  # logged, not raised
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


@pytest.mark.parametrize("redis", [False, pytest.param(True, marks=pytest.mark.redis_only)])
def test_a_conversation_is_each_turns_input_then_output_oldest_first(redis):
    def message(text: str) -> dict:
        return {"type": "message", "role": "user", "content": text}

    async def scenario():
        items = ResponseItems(os.environ["REDIS_URL"] if redis else None, keep_seconds=60)
        suffix = os.urandom(4).hex()
        await _keep(items, "key-a", {**ITEM, "id": f"msg_1{suffix}"}, response=f"resp_1{suffix}", turn=[message("one")])
        await _keep(
            items,
            "key-a",
            {**ITEM, "id": f"msg_2{suffix}"},
            response=f"resp_2{suffix}",
            previous=f"resp_1{suffix}",
            turn=[message("two")],
        )
        mine = await items.conversation("key-a", f"resp_2{suffix}")
        theirs = await items.conversation("key-b", f"resp_2{suffix}")
        unknown = await items.conversation("key-a", "resp_unknown")
        await items.close()
        return suffix, mine, theirs, unknown

    suffix, mine, theirs, unknown = _run(scenario())
    assert [item.get("content") if item["type"] == "message" and item.get("role") == "user" else item["id"] for item in mine] == [
        "one",
        f"msg_1{suffix}",
        "two",
        f"msg_2{suffix}",
    ]
    assert theirs is None and unknown is None


def test_a_chain_longer_than_the_bound_is_not_followed():
    async def scenario():
        items = ResponseItems(None, keep_seconds=60)
        previous = None
        for n in range(MAX_RESPONSE_CHAIN + 1):
            await _keep(items, "key-a", {**ITEM, "id": f"msg_{n}"}, response=f"resp_{n}", previous=previous)
            previous = f"resp_{n}"
        with pytest.raises(ResponseChainTooLong):
            await items.conversation("key-a", previous)
        return await items.conversation("key-a", f"resp_{MAX_RESPONSE_CHAIN - 1}")

    longest = _run(scenario())
    assert len(longest) == MAX_RESPONSE_CHAIN


def test_a_chain_longer_than_the_front_continues_is_refused_as_such_not_as_not_found():
    from oai.errors import ChatFrontError
    from oai.responses.references import resolve_references

    async def scenario():
        items = ResponseItems(None, keep_seconds=60)
        previous = None
        for n in range(MAX_RESPONSE_CHAIN + 1):
            await _keep(items, "key-a", {**ITEM, "id": f"msg_{n}"}, response=f"resp_{n}", previous=previous)
            previous = f"resp_{n}"
        with pytest.raises(ChatFrontError) as caught:
            await resolve_references({"input": "Go on.", "previous_response_id": previous}, "key-a", items)
        return caught.value

    error = _run(scenario())
    assert error.status == 400 and error.param == "previous_response_id"
    assert error.code == "ConversationTooLong" and "not found" not in error.message
    assert f"{MAX_RESPONSE_CHAIN} responses" in error.message


def test_a_hung_redis_costs_the_keep_a_bounded_wait_and_a_recall_is_retryable():
    """A Redis that accepts connections and never answers (stopped, or its host gone quiet)."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)

        async def scenario():
            items = ResponseItems(f"redis://127.0.0.1:{hung.getsockname()[1]}/0", keep_seconds=60)
            started = time.monotonic()
            await _keep(items, "key-a", ITEM)  # logged, not raised
            kept_in = time.monotonic() - started
            with pytest.raises(ResponseItemsUnavailable):
                await items.recall("key-a", ["msg_abc"])
            await items.close()
            return kept_in

        assert _run(scenario()) < 3


@pytest.mark.parametrize("redis", [False, pytest.param(True, marks=pytest.mark.redis_only)])
def test_a_conversation_that_goes_on_is_kept_from_its_last_turn_not_its_first(redis):
    """Each continuation reads the responses and items it names, and each read keeps them its whole
    time again: a conversation continued within that time is never cut at its oldest turn."""

    async def scenario():
        items = ResponseItems(os.environ["REDIS_URL"] if redis else None, keep_seconds=2)
        suffix = os.urandom(4).hex()
        first, second = f"resp_1{suffix}", f"resp_2{suffix}"
        await _keep(items, "key-a", {**ITEM, "id": f"msg_1{suffix}"}, response=first)
        await asyncio.sleep(1.2)
        assert await items.conversation("key-a", first) and await items.recall("key-a", [f"msg_1{suffix}"])
        await _keep(items, "key-a", {**ITEM, "id": f"msg_2{suffix}"}, response=second, previous=first)
        await asyncio.sleep(1.2)  # 2.4 s after the first turn was kept, 1.2 s after it was read
        conversation = await items.conversation("key-a", second)
        recalled = await items.recall("key-a", [f"msg_1{suffix}"])
        await items.close()
        return conversation, recalled

    conversation, recalled = _run(scenario())
    assert conversation is not None and [item["id"] for item in conversation][0].startswith("msg_1")
    assert list(recalled) and list(recalled)[0].startswith("msg_1")


@pytest.mark.parametrize("redis", [False, pytest.param(True, marks=pytest.mark.redis_only)])
def test_a_record_is_read_by_its_key_and_forgotten_with_its_items(redis):
    async def scenario():
        items = ResponseItems(os.environ["REDIS_URL"] if redis else None, keep_seconds=60)
        suffix = os.urandom(4).hex()
        item = {**ITEM, "id": f"msg_{suffix}"}
        await _keep(items, "key-a", item, response=f"resp_{suffix}", turn=[{"type": "message", "role": "user", "content": "hi"}])
        record = await items.record("key-a", f"resp_{suffix}")
        theirs = await items.record("key-b", f"resp_{suffix}")
        not_theirs_to_forget = await items.forget("key-b", f"resp_{suffix}")
        forgotten = await items.forget("key-a", f"resp_{suffix}")
        after = (
            await items.record("key-a", f"resp_{suffix}"),
            await items.recall("key-a", [item["id"]]),
            await items.forget("key-a", f"resp_{suffix}"),
        )
        await items.close()
        return suffix, record, theirs, not_theirs_to_forget, forgotten, after

    suffix, record, theirs, not_theirs_to_forget, forgotten, after = _run(scenario())
    assert record["response"] == {"id": f"resp_{suffix}", "object": "response", "status": "completed"}
    assert record["output"] == [{**ITEM, "id": f"msg_{suffix}"}] and record["input"][0]["content"] == "hi"
    assert theirs is None and not_theirs_to_forget is False and forgotten is True
    assert after == (None, {}, False)


def test_a_forget_that_redis_cannot_answer_is_retryable():
    async def scenario():
        items = ResponseItems(f"redis://127.0.0.1:{free_port()}/0", keep_seconds=60)
        with pytest.raises(ResponseItemsUnavailable):
            await items.forget("key-a", "resp_1")

    _run(scenario())


@pytest.mark.parametrize("redis", [False, pytest.param(True, marks=pytest.mark.redis_only)])
def test_a_finished_background_record_is_kept_only_over_its_pending_one(redis):
    """The watcher, a GET and a cancel may each find a background response ended: the first keeps
    it; a later one, or one after a DELETE, writes nothing (no finished reply overwritten, no
    deleted record brought back)."""

    async def scenario():
        items = ResponseItems(os.environ["REDIS_URL"] if redis else None, keep_seconds=60)
        suffix = os.urandom(4).hex()
        rid, item = f"resp_{suffix}", {**ITEM, "id": f"msg_{suffix}"}
        queued = {"id": rid, "object": "response", "status": "queued", "output": []}
        await items.keep_pending("key-a", response=queued, previous_response_id=None, turn_input=[], background={"request_id": "r"})

        async def finish(status: str, key: str = "key-a") -> bool:
            response = {**queued, "status": status, "output": [item] if status == "completed" else []}
            return await items.keep_finished(
                key, response=response, previous_response_id=None, turn_input=[], queued_model="m"
            )

        theirs = await finish("completed", key="key-b")
        first, second = await finish("completed"), await finish("cancelled")
        kept = await items.record("key-a", rid)
        await items.forget("key-a", rid)
        await items.keep_pending("key-a", response={**queued, "id": f"{rid}x"}, previous_response_id=None, turn_input=[], background={})
        await items.forget("key-a", f"{rid}x")
        after_delete = await items.keep_finished(
            "key-a",
            response={**queued, "id": f"{rid}x", "status": "cancelled"},
            previous_response_id=None,
            turn_input=[],
            queued_model="m",
        )
        gone = await items.record("key-a", f"{rid}x")
        await items.close()
        return theirs, first, second, kept, after_delete, gone

    theirs, first, second, kept, after_delete, gone = _run(scenario())
    assert (theirs, first, second) == (False, True, False)
    assert kept["response"]["status"] == "completed" and "background" not in kept
    assert after_delete is False and gone is None
