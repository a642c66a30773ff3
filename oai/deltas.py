"""Relayed deltas (spec: chat_front.md, "Relayed deltas"; chat_requests.md, "Streaming progress").

`DeltaStreamReader` is one background task per process, modelled on the completion signal listener:
every relayed request registers its progress stream (horde:chat:stream:<request id>, on
HORDE_OAI_STREAM_REDIS_DB) and the reader reads them all with one XREAD BLOCK, from each stream's
start, queueing each read's entries on the request's `DeltaSubscription` and setting its event, so
a stream wakes on the delta itself and not on a poll. A registration while a read blocks abandons
that read (the entries stay in the streams, nothing is skipped) so a new request's first delta is
not held back by the block.

`DeltaRelay` is one request's reconciliation: it pins one generation, decides what each entry
sends, and reconciles the relayed text with the final reply. `RelayedStream` joins the two for the
stream in oai.streaming and turns what the relay decides into SSE events, counters and the error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context

from contract.aio import cancel_and_wait
from contract.chat_progress import chat_progress_stream_key
from oai import sse
from oai.errors import ChatFrontError
from oai.mapping import Completion, build_system_fingerprint

log = logging.getLogger("oai.deltas")

# One XREAD for every registered stream blocks this long for new entries.
DELTA_READ_BLOCK_MILLISECONDS = 250
# A read taking longer is abandoned and made again: a connection a network fault black-holes.
DELTA_READ_TIMEOUT_SECONDS = 5.0
# A failed read is made again after this long, from the last entry read.
DELTA_READ_RETRY_SECONDS = 2.0

SPAN_DELTA_READ = "horde.oai.delta_read"
STREAM_DIVERGED_CODE = "ChatStreamDiverged"


@dataclass(frozen=True, slots=True)
class DeltaEntry:
    """One stream entry: a delta (gen, seq, content, reasoning, worker, model) or an ended marker."""

    entry_id: str
    gen: str
    seq: int | None
    content: str
    reasoning: str | None
    worker: str | None
    model: str | None
    ended: bool


def _text(fields: dict[bytes, bytes], name: bytes) -> str | None:
    value = fields.get(name)
    return value.decode("utf-8", "replace") if value is not None else None


def parse_entry(entry_id: bytes | str, fields: dict[bytes, bytes]) -> DeltaEntry:
    seq_raw = fields.get(b"seq")
    try:
        seq = int(seq_raw) if seq_raw is not None else None
    except ValueError:
        seq = None
    return DeltaEntry(
        entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        gen=_text(fields, b"gen") or "",
        seq=seq,
        content=_text(fields, b"content") or "",
        reasoning=_text(fields, b"reasoning_content") or None,
        worker=_text(fields, b"worker"),
        model=_text(fields, b"model"),
        ended=fields.get(b"ended") == b"1",
    )


def _bulk(value: bytes) -> bytes:
    """One RESP bulk string: a piece of a command packed once and reused."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


_XREAD_HEAD = (
    _bulk(b"XREAD") + _bulk(b"BLOCK") + _bulk(str(DELTA_READ_BLOCK_MILLISECONDS).encode()) + _bulk(b"STREAMS")
)
_CLIENT_ID = b"*2\r\n" + _bulk(b"CLIENT") + _bulk(b"ID")


class RespError(Exception):
    """An error reply (-ERR ...)."""


class _Incomplete(Exception):
    """The buffer ends inside a reply: read more before parsing it."""


def _parse(buf: bytes, pos: int) -> tuple[Any, int]:
    """One RESP2 reply from buf[pos:], parsed in one pass; raises _Incomplete when it is not all there."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind = buf[pos]
    if kind == 36:  # $ bulk string
        size = int(buf[pos + 1 : end])
        if size < 0:
            return None, end + 2
        stop = end + 2 + size
        if stop + 2 > len(buf):
            raise _Incomplete
        return buf[end + 2 : stop], stop + 2
    if kind == 42:  # * array
        count = int(buf[pos + 1 : end])
        pos = end + 2
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = _parse(buf, pos)
            items.append(item)
        return items, pos
    if kind == 58:  # : integer
        return int(buf[pos + 1 : end]), end + 2
    if kind == 43:  # + simple string
        return buf[pos + 1 : end], end + 2
    if kind == 45:  # - error
        return RespError(buf[pos + 1 : end].decode("utf-8", "replace")), end + 2
    raise RespError(f"unexpected reply type {chr(kind)!r}")


def _pack(*args: bytes | str | int) -> bytes:
    pieces = [arg if isinstance(arg, bytes) else str(arg).encode() for arg in args]
    return b"*%d\r\n" % len(pieces) + b"".join(_bulk(piece) for piece in pieces)


class RespConnection:
    """The reader's own Redis connection: asyncio streams and a parser that reads a whole reply in
    one pass. redis-py's asyncio parser awaits each element of a reply, about five times the CPU
    for an XREAD reply of many entries (ADR 0029). Plain, TLS (rediss://, default verification or
    ssl_cert_reqs=none) and unix socket URLs; the URL's user and password are sent with AUTH."""

    def __init__(self, url: str, *, db: int, name: str, connect_timeout: float = 2.0):
        from redis.connection import parse_url

        self.options = parse_url(url)
        self.db = db
        self.name = name
        self.connect_timeout = connect_timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._buffer = b""

    async def connect(self) -> None:
        options = self.options
        async with asyncio.timeout(self.connect_timeout):
            if options.get("path"):
                self._reader, self._writer = await asyncio.open_unix_connection(options["path"])
            else:
                context = None
                if "SSL" in getattr(options.get("connection_class"), "__name__", ""):
                    import ssl

                    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
                    if options.get("ssl_cert_reqs") in ("none", "CERT_NONE"):
                        context.check_hostname = False
                        context.verify_mode = ssl.CERT_NONE
                self._reader, self._writer = await asyncio.open_connection(
                    options.get("host") or "localhost", int(options.get("port") or 6379), ssl=context
                )
        commands = []
        if options.get("password") is not None:
            credentials = [options["username"]] if options.get("username") else []
            commands.append(_pack("AUTH", *credentials, options["password"]))
        commands += [_pack("SELECT", self.db), _pack("CLIENT", "SETNAME", self.name)]
        self._writer.write(b"".join(commands))
        for _ in commands:
            await self.read_reply()

    async def command(self, packed: bytes) -> Any:
        assert self._writer is not None, "sent after connect, before close"
        self._writer.write(packed)
        return await self.read_reply()

    async def read_reply(self) -> Any:
        while True:
            if self._buffer:
                try:
                    reply, used = _parse(self._buffer, 0)
                except _Incomplete:
                    pass  # the rest of the reply is still on its way
                else:
                    self._buffer = self._buffer[used:]
                    if isinstance(reply, RespError):
                        raise reply
                    return reply
            assert self._reader is not None, "read after connect"
            data = await self._reader.read(65536)
            if not data:
                raise ConnectionError("the Redis server closed the connection")
            self._buffer += data

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


class DeltaSubscription:
    """One request's queue of read batches (entries read together stay together)."""

    __slots__ = ("request_id", "key", "last_id", "packed_key", "packed_id", "batches", "event")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.key = chat_progress_stream_key(request_id).encode()
        self.last_id: bytes = b"0-0"
        # This stream's pieces of the reader's XREAD, packed once (the id again only when it moves).
        self.packed_key = _bulk(self.key)
        self.packed_id = _bulk(self.last_id)
        self.batches: list[list[DeltaEntry]] = []
        self.event = asyncio.Event()

    def advance(self, last_id: bytes) -> None:
        self.last_id = last_id
        self.packed_id = _bulk(last_id)

    def push(self, batch: list[DeltaEntry]) -> None:
        self.batches.append(batch)
        self.event.set()

    def take(self) -> list[list[DeltaEntry]]:
        batches, self.batches = self.batches, []
        self.event.clear()
        return batches


class DeltaStreamReader:
    """One XREAD loop per process over every registered request's progress stream.

    The command is sent packed (each stream's key and id packed once, ADR 0029): redis-py packs a
    command argument by argument, which for an XREAD over thousands of streams costs more than the
    read. A registration while a read blocks ends that read with CLIENT UNBLOCK from a second
    connection (the read answers as one that found nothing, its connection stays open), so the
    loop itself is one awaited read after another, with no task or wait set up per read."""

    def __init__(
        self, redis_url: str, *, db: int, tracer: Any = None, client_name: str = "horde-oai-delta-reader"
    ):
        self.redis_url = redis_url
        self.db = db
        self.client_name = client_name
        self._tracer = tracer
        self._subscriptions: dict[bytes, DeltaSubscription] = {}
        self._changed = asyncio.Event()
        self._connection: Any = None
        self._connection_id: bytes | None = None
        self._control: Any = None
        self._task: asyncio.Task | None = None
        self._unblocking: asyncio.Task | None = None
        # The read in flight (a count: the unblock ends only the read it was asked for).
        self._read_number = 0
        self._reading = False
        self._closing = False
        self.reads = 0
        self.failures = 0
        self.unblocks = 0

    def register(self, request_id: str) -> DeltaSubscription:
        subscription = DeltaSubscription(request_id)
        self._subscriptions[subscription.key] = subscription
        self._changed.set()
        if self._task is None:
            # A context of its own: the reader's spans are root spans, not part of the first request's trace.
            self._task = asyncio.create_task(
                self._run(), name="oai-delta-reader", context=contextvars.Context()
            )
        elif self._reading and self._unblocking is None:
            self._unblocking = asyncio.create_task(
                self._unblock(self._read_number), name="oai-delta-unblock", context=contextvars.Context()
            )
        return subscription

    def unregister(self, subscription: DeltaSubscription) -> None:
        if self._subscriptions.get(subscription.key) is subscription:
            del self._subscriptions[subscription.key]

    @property
    def registered(self) -> int:
        return len(self._subscriptions)

    async def close(self) -> None:
        self._closing = True
        for task in (self._unblocking, self._task):
            await cancel_and_wait(task)
        await self._drop()
        await self._drop_control()

    async def _connect(self) -> None:
        connection = RespConnection(self.redis_url, db=self.db, name=self.client_name)  # CLIENT LIST shows it
        self._connection = connection
        await connection.connect()
        self._connection_id = str(await connection.command(_CLIENT_ID)).encode()

    async def _drop(self) -> None:
        connection, self._connection, self._connection_id = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()

    async def _drop_control(self) -> None:
        control, self._control = self._control, None
        if control is not None:
            with contextlib.suppress(Exception):
                await control.close()

    async def _unblock(self, read_number: int) -> None:
        """End read `read_number` early, so the next read has the new streams. CLIENT UNBLOCK
        answers 0 while the read is on its way (not yet blocked): sent again until it ends it or
        that read answered by itself. On a failure the read just runs its block out."""
        try:
            while self._reading and self._read_number == read_number:
                if self._connection_id is None:  # connecting: its first read has the new streams
                    return
                async with asyncio.timeout(DELTA_READ_TIMEOUT_SECONDS):
                    if self._control is None:
                        self._control = RespConnection(
                            self.redis_url, db=self.db, name=f"{self.client_name}-control"
                        )
                        await self._control.connect()
                    if await self._control.command(_pack("CLIENT", "UNBLOCK", self._connection_id)) == 1:
                        self.unblocks += 1
                        return
                await asyncio.sleep(0.001)
        except Exception as error:
            log.warning("delta stream read not unblocked (%s): it ends with its block", error)
            await self._drop_control()
        finally:
            self._unblocking = None

    def _command(self) -> bytes:
        subscriptions = self._subscriptions.values()
        return b"".join(
            (
                b"*%d\r\n" % (4 + 2 * len(self._subscriptions)),
                _XREAD_HEAD,
                b"".join([sub.packed_key for sub in subscriptions]),
                b"".join([sub.packed_id for sub in subscriptions]),
            )
        )

    async def _read(self) -> Any:
        if self._connection is None:
            await self._connect()
        return await self._connection.command(self._command())

    async def _run(self) -> None:
        while not self._closing:
            if not self._subscriptions:
                self._changed.clear()
                await self._changed.wait()
                continue
            self._changed.clear()
            self._read_number += 1
            self._reading = True
            try:
                async with asyncio.timeout(DELTA_READ_TIMEOUT_SECONDS):
                    result = await self._read()
            except TimeoutError:
                # A black-holed read: read again on a new connection (cancelling it disconnected it).
                log.warning("delta stream read took over %s s: reading again", DELTA_READ_TIMEOUT_SECONDS)
                await self._drop()
                continue
            except Exception as error:
                self.failures += 1
                log.warning(
                    "delta stream read failed (%s): reading again in %s s", error, DELTA_READ_RETRY_SECONDS
                )
                await self._drop()
                await asyncio.sleep(DELTA_READ_RETRY_SECONDS)
                continue
            finally:
                self._reading = False
            self.reads += 1
            if result:
                self._dispatch(result, time.time())

    def _dispatch(self, result: Any, returned_at: float) -> None:
        entry_count = byte_count = 0
        oldest_ms: int | None = None
        streams = result.items() if isinstance(result, dict) else result
        for key, raw_entries in streams:
            subscription = self._subscriptions.get(key)
            batch: list[DeltaEntry] = []
            for entry_id, flat in raw_entries:
                entry_count += 1
                fields = dict(zip(flat[::2], flat[1::2], strict=True)) if isinstance(flat, list) else flat
                byte_count += sum(len(name) + len(value) for name, value in fields.items())
                ms = int(entry_id.split(b"-", 1)[0])
                oldest_ms = ms if oldest_ms is None else min(oldest_ms, ms)
                if subscription is not None:
                    batch.append(parse_entry(entry_id, fields))
            if subscription is not None and raw_entries:
                subscription.advance(raw_entries[-1][0])
                subscription.push(batch)
        if entry_count:
            tracer = self._tracer or trace.get_tracer("horde.oai")
            span = tracer.start_span(
                SPAN_DELTA_READ,
                context=Context(),
                attributes={
                    "horde.entry_count": entry_count,
                    "horde.byte_count": byte_count,
                    "horde.first_entry_lag_seconds": max(0.0, returned_at - (oldest_ms or 0) / 1000),
                },
            )
            span.end()


def build_delta_reader(redis_url: str | None, db: int) -> DeltaStreamReader | None:
    """The process's reader, or None on a front without Redis (every stream is delivered whole)."""
    return DeltaStreamReader(redis_url, db=db) if redis_url else None


# --- one request's reconciliation ------------------------------------------------------------------


class DeltaRelay:
    """Pins one generation and decides what each entry sends (pieces: the deltas of the chunks).

    `outcome` is set when the relay diverged on an entry: replaced_attempt (another gen after
    exposure), ended (the pinned gen's ended marker) or gap (a seq out of order)."""

    def __init__(self, *, include_reasoning: bool, fallback_model: str):
        self.include_reasoning = include_reasoning
        self.fallback_model = fallback_model
        self.pinned: str | None = None
        self.last_seq = 0
        self.exposed = False
        self.model = fallback_model
        self.fingerprint: str | None = None
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self.outcome: str | None = None

    def _pin(self, entry: DeltaEntry) -> None:
        self.pinned = entry.gen
        self.last_seq = 0
        self.model = entry.model or self.fallback_model
        self.fingerprint = build_system_fingerprint(entry.worker, entry.model or self.fallback_model)

    def _unpin(self) -> None:
        self.pinned = None
        self.last_seq = 0

    def feed(self, batch: list[DeltaEntry]) -> list[dict[str, Any]]:
        """The chunk deltas one read's entries send; stops at a divergence (`outcome` set)."""
        pieces: list[dict[str, Any]] = []
        ended_gens = {entry.gen for entry in batch if entry.ended}
        for entry in batch:
            if self.outcome is not None:
                break
            if not self.exposed:
                self._before_exposure(entry, ended_gens, pieces)
                continue
            if entry.gen != self.pinned:
                # A previous attempt's late ended marker says nothing of the pinned one (ADR 0023).
                if not entry.ended:
                    self.outcome = "replaced_attempt"
            elif entry.ended:
                self.outcome = "ended"
            elif entry.seq != self.last_seq + 1:
                self.outcome = "gap"
            else:
                self.last_seq = entry.seq
                self._send(entry, pieces)
        return pieces

    def _before_exposure(self, entry: DeltaEntry, ended_gens: set[str], pieces: list[dict[str, Any]]) -> None:
        # Nothing was sent yet: ended attempts and gaps are dropped, and the next attempt may pin.
        if entry.ended or entry.gen in ended_gens:
            if entry.gen == self.pinned:
                self._unpin()
            return
        if entry.seq == 1 and entry.gen != self.pinned:
            self._pin(entry)
        elif entry.gen != self.pinned:
            return
        elif entry.seq != self.last_seq + 1:
            self._unpin()
            return
        self.last_seq = entry.seq or 0
        self._send(entry, pieces)

    def _send(self, entry: DeltaEntry, pieces: list[dict[str, Any]]) -> None:
        out: list[dict[str, Any]] = []
        if entry.reasoning and self.include_reasoning:
            out.append({"reasoning_content": entry.reasoning})
            self.reasoning_parts.append(entry.reasoning)
        if entry.content:
            out.append({"content": entry.content})
            self.content_parts.append(entry.content)
        if out and not self.exposed:
            self.exposed = True
            out.insert(0, {"role": "assistant"})
        pieces.extend(out)

    def reconcile(self, completion: Completion) -> tuple[str, list[dict[str, Any]]]:
        """(outcome, the final pieces before the finish chunk): equal, prefix or mismatch."""
        relayed = "".join(self.content_parts)
        final = completion.content or ""
        if not final.startswith(relayed):
            return "mismatch", []
        pieces: list[dict[str, Any]] = []
        reasoning = completion.reasoning or ""
        relayed_reasoning = "".join(self.reasoning_parts)
        if (
            self.include_reasoning
            and len(reasoning) > len(relayed_reasoning)
            and reasoning.startswith(relayed_reasoning)
        ):
            pieces.append({"reasoning_content": reasoning[len(relayed_reasoning) :]})
        if final == relayed:
            return "equal", pieces
        pieces.append({"content": final[len(relayed) :]})
        return "prefix", pieces


def stream_diverged(detail: str) -> ChatFrontError:
    return ChatFrontError(
        502,
        STREAM_DIVERGED_CODE,
        f"The relayed stream diverged from the reply: {detail}. The text sent so far is not part of a "
        "reply the AI Horde delivered; send the request again.",
        type="api_error",
        should_retry=False,
    )


DIVERGENCE_DETAILS = {
    "mismatch": "the final reply does not start with the text relayed",
    "replaced_attempt": "another attempt replaced the one relayed",
    "ended": "the attempt relayed ended before its reply",
    "gap": "a progress entry arrived out of order",
}


class RelayedStream:
    """One streamed request's relay: its subscription, its relay, its chunks and counters."""

    def __init__(
        self,
        reader: DeltaStreamReader,
        *,
        request_id: str,
        created: int,
        include_reasoning: bool,
        fallback_model: str,
        metrics: Any,
    ):
        self.reader = reader
        self.subscription = reader.register(request_id)
        self.relay = DeltaRelay(include_reasoning=include_reasoning, fallback_model=fallback_model)
        self.completion_id = f"chatcmpl-{request_id}"
        self.created = created
        self.metrics = metrics
        self.outcome_recorded = False

    @property
    def event(self) -> asyncio.Event:
        return self.subscription.event

    @property
    def exposed(self) -> bool:
        return self.relay.exposed

    def _events(self, pieces: list[dict[str, Any]]) -> list[bytes]:
        return [
            sse.build_delta_event(
                self.completion_id, self.created, self.relay.model, self.relay.fingerprint, piece
            )
            for piece in pieces
        ]

    def pending_events(self) -> list[bytes]:
        """The chunks of the entries read since the last call, up to a divergence, as one write; the
        caller sends it, then checks `diverged`. The chunks that expose the stream are the request's
        first content: the caller records it (oai.streaming)."""
        was_exposed = self.relay.exposed
        pieces: list[dict[str, Any]] = []
        for batch in self.subscription.take():
            pieces.extend(self.relay.feed(batch))
            if self.relay.outcome is not None:
                break
        if self.relay.exposed and not was_exposed:
            self.metrics.stream_relayed.add(1)
        # One write for everything read together: one ASGI send, one socket write, not one per chunk.
        events = self._events(pieces)
        return [b"".join(events)] if events else []

    @property
    def diverged(self) -> ChatFrontError | None:
        outcome = self.relay.outcome
        if outcome is None:
            return None
        self._record(outcome)
        return stream_diverged(DIVERGENCE_DETAILS[outcome])

    def final_events(self, completion: Completion, *, include_usage: bool) -> list[bytes]:
        """The end of an exposed stream: the rest and the finish, or raises ChatStreamDiverged."""
        outcome, pieces = self.relay.reconcile(completion)
        self._record(outcome)
        if outcome == "mismatch":
            raise stream_diverged(DIVERGENCE_DETAILS[outcome])
        # The final chunks carry the first delta's model and fingerprint, as every chunk before them.
        completion.model = self.relay.model
        completion.fingerprint = self.relay.fingerprint
        # Tool calls are never relayed (the horde verifies them on the whole reply): they follow the text.
        if completion.tool_calls:
            pieces.append(sse.tool_calls_delta(completion))
        return self._events(pieces) + sse.build_completion_tail_events(
            completion, include_usage=include_usage
        )

    def _record(self, outcome: str) -> None:
        if not self.outcome_recorded:
            self.outcome_recorded = True
            self.metrics.stream_relay_outcomes.add(1, {"horde.outcome": outcome})

    def close(self) -> None:
        self.reader.unregister(self.subscription)
