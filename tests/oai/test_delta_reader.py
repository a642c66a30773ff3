"""The delta stream reader against a real Redis (chat_front.md, "Relayed deltas" and "Spans"): one
XREAD loop for every registered stream, from each stream's start, entries read together queued
together, a read that fails made again after DELTA_READ_RETRY_SECONDS without skipping an entry, a
black-holed read abandoned after DELTA_READ_TIMEOUT_SECONDS, a recreated stream's lower ids not
produced, and the horde.oai.delta_read root span."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid

import pytest
from django.conf import settings

from contract.chat_progress import chat_progress_stream_key
from oai.deltas import (
    DELTA_READ_BLOCK_MILLISECONDS,
    DELTA_READ_RETRY_SECONDS,
    DELTA_READ_TIMEOUT_SECONDS,
    SPAN_DELTA_READ,
    DeltaStreamReader,
)

pytestmark = pytest.mark.redis_only
STREAM_DB = 7


def test_the_spec_values():
    assert (DELTA_READ_BLOCK_MILLISECONDS, DELTA_READ_TIMEOUT_SECONDS, DELTA_READ_RETRY_SECONDS) == (
        250,
        5.0,
        2.0,
    )


@pytest.fixture
def redis_sync():
    import redis

    pool = redis.ConnectionPool.from_url(settings.REDIS_URL)
    pool.connection_kwargs["db"] = STREAM_DB
    client = redis.Redis(connection_pool=pool)
    yield client
    client.close()


@pytest.fixture
def spans():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


async def _until(predicate, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


def _entries(subscription) -> list:
    return [entry for batch in subscription.batches for entry in batch]


def test_one_read_serves_every_stream_from_its_start_and_records_a_root_span(redis_sync, spans):
    tracer, exporter = spans
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    # Appended before the registration: read from the stream's start.
    redis_sync.xadd(
        chat_progress_stream_key(first), {"gen": "g1", "seq": 1, "content": "Hé", "worker": "w", "model": "m"}
    )

    async def scenario():
        reader = DeltaStreamReader(settings.REDIS_URL, db=STREAM_DB, tracer=tracer)
        a = reader.register(first)
        b = reader.register(second)
        await _until(lambda: a.batches, 3)
        redis_sync.xadd(chat_progress_stream_key(second), {"gen": "g2", "seq": 1, "content": "x"})
        redis_sync.xadd(chat_progress_stream_key(second), {"gen": "g2", "ended": 1})
        await _until(lambda: len(_entries(b)) == 2, 3)
        await reader.close()
        return a, b

    a, b = asyncio.run(scenario())
    entry = _entries(a)[0]
    assert (entry.gen, entry.seq, entry.content, entry.worker, entry.model, entry.ended) == (
        "g1",
        1,
        "Hé",
        "w",
        "m",
        False,
    )
    assert [e.ended for e in _entries(b)] == [False, True]
    read_spans = [s for s in exporter.get_finished_spans() if s.name == SPAN_DELTA_READ]
    assert read_spans and all(s.parent is None for s in read_spans)
    assert sum(s.attributes["horde.entry_count"] for s in read_spans) == 3
    first_span = read_spans[0]
    # gen, g1, seq, 1, content, Hé (3 bytes), worker, w, model, m
    assert first_span.attributes["horde.entry_count"] == 1
    assert first_span.attributes["horde.byte_count"] == 3 + 2 + 3 + 1 + 7 + 3 + 6 + 1 + 5 + 1
    assert 0 <= first_span.attributes["horde.first_entry_lag_seconds"] < 5


@pytest.fixture
def long_reads(monkeypatch) -> int:
    """The reader's reads block for 10 s (DELTA_READ_BLOCK_MILLISECONDS, 250 ms as shipped) and are
    abandoned after 30 s, not 5: only an unblock can end one early, and a loaded box cannot let it
    run out before the unblock comes. The block's seconds."""
    from oai import deltas

    block_seconds = 10
    monkeypatch.setattr(deltas, "DELTA_READ_TIMEOUT_SECONDS", 30.0)
    monkeypatch.setattr(
        deltas,
        "_XREAD_HEAD",
        deltas._bulk(b"XREAD") + deltas._bulk(b"BLOCK") + deltas._bulk(b"%d" % (block_seconds * 1000))
        + deltas._bulk(b"STREAMS"),
    )
    return block_seconds


async def _blocked(redis_sync, name: str) -> None:
    """Until the reader named `name` is blocked in its XREAD (CLIENT LIST's flag b)."""
    await _until(lambda: [c for c in redis_sync.client_list() if c.get("name") == name and "b" in c["flags"]], 5)


def test_a_new_registration_is_read_without_waiting_for_the_block(redis_sync, long_reads):
    name = f"test-delta-new-{uuid.uuid4().hex[:8]}"

    async def scenario():
        reader = DeltaStreamReader(settings.REDIS_URL, db=STREAM_DB, client_name=name)
        reader.register(str(uuid.uuid4()))  # the reader now blocks on this stream
        await _blocked(redis_sync, name)
        request = str(uuid.uuid4())
        redis_sync.xadd(chat_progress_stream_key(request), {"gen": "g", "seq": 1, "content": "a"})
        subscription = reader.register(request)
        waited = await _until(lambda: subscription.batches, long_reads)
        await reader.close()
        return waited

    assert asyncio.run(scenario()) < long_reads / 2


def test_a_failed_read_is_made_again_after_two_seconds_without_skipping(redis_sync):
    request = str(uuid.uuid4())
    key = chat_progress_stream_key(request)

    name = f"test-delta-reader-{uuid.uuid4().hex[:8]}"

    async def scenario():
        reader = DeltaStreamReader(settings.REDIS_URL, db=STREAM_DB, client_name=name)
        subscription = reader.register(request)
        redis_sync.xadd(key, {"gen": "g", "seq": 1, "content": "a"})
        await _until(lambda: len(_entries(subscription)) == 1, 3)
        await asyncio.sleep(0.05)
        # Kill the reader's connection (the one blocked in XREAD), then append while it is down.
        for client in redis_sync.client_list():
            if client.get("name") == name:
                redis_sync.client_kill_filter(_id=client["id"])
        killed = time.monotonic()
        redis_sync.xadd(key, {"gen": "g", "seq": 2, "content": "b"})
        redis_sync.xadd(key, {"gen": "g", "seq": 3, "content": "c"})
        await _until(lambda: len(_entries(subscription)) == 3, 6)
        recovered = time.monotonic() - killed
        failures = reader.failures
        await reader.close()
        return subscription, recovered, failures

    subscription, recovered, failures = asyncio.run(scenario())
    assert [e.seq for e in _entries(subscription)] == [1, 2, 3]
    assert failures >= 1 and DELTA_READ_RETRY_SECONDS - 0.1 <= recovered < DELTA_READ_RETRY_SECONDS + 2


def test_a_black_holed_read_is_abandoned_after_five_seconds():
    """A server that accepts and never answers: each read is abandoned at DELTA_READ_TIMEOUT_SECONDS."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[tuple[float, socket.socket]] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append((time.monotonic(), conn))

    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]

    async def scenario():
        reader = DeltaStreamReader(f"redis://127.0.0.1:{port}/0", db=STREAM_DB)
        reader.register(str(uuid.uuid4()))
        await _until(lambda: len(accepted) >= 2, DELTA_READ_TIMEOUT_SECONDS + 3)
        await reader.close()

    asyncio.run(scenario())
    listener.close()
    gap = accepted[1][0] - accepted[0][0]
    assert DELTA_READ_TIMEOUT_SECONDS - 0.2 <= gap < DELTA_READ_TIMEOUT_SECONDS + 1.5
    for _, conn in accepted:
        conn.close()


def test_a_recreated_stream_does_not_produce_ids_below_the_last_read(redis_sync):
    request = str(uuid.uuid4())
    key = chat_progress_stream_key(request)

    async def scenario():
        reader = DeltaStreamReader(settings.REDIS_URL, db=STREAM_DB)
        subscription = reader.register(request)
        redis_sync.xadd(key, {"gen": "g", "seq": 1, "content": "a"}, id="5000000000000-0")
        await _until(lambda: len(_entries(subscription)) == 1, 3)
        redis_sync.delete(key)  # as a failover that lost the key
        redis_sync.xadd(key, {"gen": "g", "seq": 2, "content": "lost"}, id="4000000000000-0")
        redis_sync.xadd(key, {"gen": "g", "seq": 2, "content": "b"}, id="5000000000001-0")
        await _until(lambda: len(_entries(subscription)) == 2, 3)
        await asyncio.sleep(0.3)
        await reader.close()
        return subscription

    subscription = asyncio.run(scenario())
    assert [e.content for e in _entries(subscription)] == ["a", "b"]


def test_a_registration_during_a_blocked_read_unblocks_it_on_the_same_connection(redis_sync, long_reads):
    block_seconds = long_reads
    name = f"test-delta-unblock-{uuid.uuid4().hex[:8]}"

    def reader_connections() -> list[int]:
        return [c["id"] for c in redis_sync.client_list() if c.get("name") == name]

    async def scenario():
        reader = DeltaStreamReader(settings.REDIS_URL, db=STREAM_DB, client_name=name)
        reader.register(str(uuid.uuid4()))
        await _blocked(redis_sync, name)
        before = reader_connections()
        request = str(uuid.uuid4())
        subscription = reader.register(request)
        await asyncio.sleep(0.02)
        redis_sync.xadd(chat_progress_stream_key(request), {"gen": "g", "seq": 1, "content": "a"})
        waited = await _until(lambda: subscription.batches, block_seconds)
        after = reader_connections()
        unblocks = reader.unblocks
        await reader.close()
        return before, after, unblocks, waited

    before, after, unblocks, waited = asyncio.run(scenario())
    assert len(before) == 1 and after == before  # the read was ended, its connection kept
    assert unblocks == 1
    assert waited < block_seconds / 2


def test_a_reply_split_over_reads_is_parsed_whole():
    from oai.deltas import RespError, _Incomplete, _parse

    reply = (
        b"*1\r\n*2\r\n$5\r\nkey:1\r\n*1\r\n*2\r\n$3\r\n1-0\r\n*4\r\n$3\r\ngen\r\n$1\r\ng\r\n$7\r\ncontent\r\n$4\r\nH\xc3\xa9!\r\n"
    )
    for cut in range(1, len(reply)):
        with pytest.raises(_Incomplete):
            _parse(reply[:cut], 0)
    assert _parse(reply + b":7\r\n", 0) == (
        [[b"key:1", [[b"1-0", [b"gen", b"g", b"content", "Hé!".encode()]]]]],
        len(reply),
    )
    assert _parse(b"*-1\r\n", 0) == (None, 5)
    error, _ = _parse(b"-ERR wrong\r\n", 0)
    assert isinstance(error, RespError) and str(error) == "ERR wrong"
