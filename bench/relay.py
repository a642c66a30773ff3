"""Relayed deltas benchmark (issue 14, "Must show"): worker post -> SSE chunk at the client, beside a
raw XADD -> XREAD loop, in one run.

One real daphne web process (hordesite.asgi: the native API and the mounted /v1 front, its native
calls in process, its delta stream reader on the chat signal database) serves S streamed
/v1/chat/completions requests from one client; S chat workers (trusted owners) pop one job each
(the pop writes the stream lease), then each posts POST /api/v2/generate/text/progress R times a
second for the measured seconds, one post in flight per job. Each post's content carries a tag; the
client reads its streams' SSE chunks and times each tag from just before its post was written to
the moment its chunk was read. Then every job submits its whole reply and each stream must end
with the rest (none), one finish chunk and [DONE].

The raw loop then does the same over Redis alone: S streams, R XADDs a second each on one client
connection, one XREAD BLOCK reader over all S streams (as the front's reader), timing each entry
from just before its XADD to its XREAD reply.

Memory: the web process's resident set (VmRSS) before the streams open and with the S streams open
and waiting (subscribed, keepalives), divided by S.

    .venv/bin/python bench/relay.py [--streams 100 --rate 20 --duration 20]

Goals: p50 within raw + 5 ms, p99 within raw + 20 ms, 0 errors, memory per open stream <= 100 KB.
It reuses bench/text_queue.py's machinery with its own database (default
postgres://postgres@127.0.0.1:5432/horde_bench_relay, recreated) and Redis database
(redis://127.0.0.1:6379/11, flushed); streams and leases live on that server's database 7 and
expire on their own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

from common import ROOT, Server, prepare, serving, web_pids
from progress import make_owners, pop_body
from text_queue import (  # the shared bench machinery
    RawHTTPClient,
    bench_env,
    cpu_seconds_by_process,
    pct,
)

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/horde_bench_relay"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/11"
MODEL = "koboldcpp/bench-stream-8B"
STREAM_DB = 7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=100, help="concurrent streams (default 100)")
    p.add_argument("--rate", type=float, default=20.0, help="posts a second per stream (default 20)")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per loop (default 20)")
    p.add_argument("--port", type=int, default=8788, help="daphne port (default 8788)")
    p.add_argument("--database-url", default=os.environ.get("BENCH_RELAY_DATABASE_URL", DEFAULT_DATABASE_URL))
    p.add_argument("--redis-url", default=os.environ.get("BENCH_RELAY_REDIS_URL", DEFAULT_REDIS_URL))
    p.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument(
        "--reader-streams", default="100,1000,5000",
        help="the front's reader alone (oai.deltas.DeltaStreamReader, no HTTP) with this many streams "
        "registered, --streams of them posting: comma list (default 100,1000,5000; empty: skip)",
    )
    p.add_argument("--skip-relay", action="store_true", help="only the raw loop and the reader phases (no server)")
    return p.parse_args(argv)


def rss_kb(pid: int) -> int:
    """The web process's resident set; with HORDE_WEB_PROCESSES above 1, its web processes' sum."""
    total = 0
    for each in web_pids(pid):
        for line in Path(f"/proc/{each}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def make_requester(streams: int) -> str:
    from accounts.models import HordeUser
    from accounts.services import user_create

    user, key = user_create(username="bench-relay-requester", kudos=10_000_000)
    HordeUser.objects.filter(pk=user.pk).update(concurrency=streams + 100)
    return key


class SseStream:
    """One streamed request over a raw connection; records when each tagged content chunk arrives."""

    def __init__(self, index: int):
        self.index = index
        self.received: dict[str, float] = {}
        self.content: list[str] = []
        self.finishes = 0
        self.done = False
        self.error: str | None = None
        self.status: int | None = None
        self.opened = asyncio.Event()

    async def run(self, port: int, key: str) -> None:
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Tell me story {self.index}."}],
                "max_tokens": 512,
                "stream": True,
            }
        ).encode()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            status_line = await reader.readline()
            self.status = int(status_line.split()[1])
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            self.opened.set()
            while True:
                line = await reader.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                now = time.perf_counter()
                data = line[6:].strip()
                if data == b"[DONE]":
                    self.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    self.error = event["error"].get("code")
                    continue
                for choice in event.get("choices") or ():
                    text = choice["delta"].get("content")
                    if text:
                        self.content.append(text)
                        for tag in text.split("|")[:-1]:
                            self.received.setdefault(tag, now)
                    if choice.get("finish_reason"):
                        self.finishes += 1
            writer.close()
        except Exception as error:  # counted as the stream's error
            self.error = repr(error)
            self.opened.set()


def first_post_offset(index: int, streams: int, interval: float) -> float:
    """When stream `index` posts first: the streams spread evenly over one interval, so the posts
    arrive at an even rate (not in bursts, which would measure the queue a burst builds)."""
    return index * interval / max(streams, 1)


async def post_loop(
    client, job: dict, key: str, index: int, streams: int, rate: float, seconds: float, sent: dict, errors: list,
    answered: list,
):
    seq = 0
    interval = 1.0 / rate
    start = time.perf_counter()
    deadline = start + seconds
    texts: list[str] = []
    next_at = start + first_post_offset(index, streams, interval)
    while True:
        now = time.perf_counter()
        if now < next_at:
            await asyncio.sleep(next_at - now)
        if time.perf_counter() >= deadline:
            break
        seq += 1
        tag = f"s{index}.{seq}"
        text = f"{tag}|"
        sent[tag] = time.perf_counter()
        try:
            resp = await client.post(
                "/api/v2/generate/text/progress",
                json={"id": job["id"], "seq": seq, "delta": {"content": text}},
                headers={"apikey": key},
            )
            answered.append(time.perf_counter() - sent[tag])
            if resp.status_code != 200:
                errors.append(f"progress {resp.status_code}")
                seq -= 1
                sent.pop(tag, None)
            else:
                texts.append(text)
        except Exception as error:
            errors.append(repr(error))
            seq -= 1
            sent.pop(tag, None)
        next_at += interval
    return "".join(texts)


async def relay_loop(args, owners: list[str], requester: str, server_pid: int) -> dict:
    streams = [SseStream(i) for i in range(args.streams)]
    async with RawHTTPClient("127.0.0.1", args.port, args.streams + 10) as client:
        for i, key in enumerate(owners):  # registration: the first pop of each worker
            (await client.post("/api/v2/generate/text/pop", json=pop_body(f"relay-w{i}"), headers={"apikey": key})).raise_for_status()
        # Warm the front (its state, reader and listener) with one stream, then measure the baseline.
        warm = SseStream(-1)
        warm_task = asyncio.create_task(warm.run(args.port, requester))
        await asyncio.wait_for(warm.opened.wait(), 30)
        resp = await client.post("/api/v2/generate/text/pop", json=pop_body("relay-w0"), headers={"apikey": owners[0]})
        job = resp.json()
        await client.post(
            "/api/v2/generate/text/progress", json={"id": job["id"], "seq": 1, "delta": {"content": "w|"}},
            headers={"apikey": owners[0]},
        )
        await client.post(
            "/api/v2/generate/text/submit",
            json={"id": job["id"], "model_id": MODEL, "message": {"role": "assistant", "content": "w|"}, "finish_reason": "stop"},
            headers={"apikey": owners[0]},
        )
        await asyncio.wait_for(warm_task, 30)
        await asyncio.sleep(1.0)
        rss_before = rss_kb(server_pid)
        # In two halves: the second half's growth is what one more open stream costs, without the
        # process's one-time growth (its native call threads, their connections, allocator arenas).
        half = len(streams) // 2
        tasks = [asyncio.create_task(s.run(args.port, requester)) for s in streams[:half]]
        await asyncio.wait_for(asyncio.gather(*(s.opened.wait() for s in streams[:half])), 60)
        await asyncio.sleep(2.0)
        rss_half = rss_kb(server_pid)
        tasks += [asyncio.create_task(s.run(args.port, requester)) for s in streams[half:]]
        await asyncio.wait_for(asyncio.gather(*(s.opened.wait() for s in streams)), 60)
        await asyncio.sleep(2.0)
        rss_open = rss_kb(server_pid)
        jobs: list[tuple[dict, str]] = []
        for i, key in enumerate(owners):
            resp = await client.post("/api/v2/generate/text/pop", json=pop_body(f"relay-w{i}"), headers={"apikey": key})
            body = resp.json()
            if body.get("id"):
                assert body["payload"].get("stream_progress") is True, body["payload"]
                jobs.append((body, key))
        print(f"  {len(streams)} streams open, {len(jobs)} jobs popped; posting ...", flush=True)
        sent: dict[str, float] = {}
        errors: list[str] = []
        answered: list[float] = []
        cpu_before, posting_started = cpu_seconds_by_process(server_pid), time.perf_counter()
        texts = await asyncio.gather(
            *(
                post_loop(client, job, key, i, len(jobs), args.rate, args.duration, sent, errors, answered)
                for i, (job, key) in enumerate(jobs)
            )
        )
        posting_seconds = time.perf_counter() - posting_started
        await asyncio.sleep(0.5)
        cpu_after = cpu_seconds_by_process(server_pid)
        for (job, key), text in zip(jobs, texts, strict=True):
            resp = await client.post(
                "/api/v2/generate/text/submit",
                json={"id": job["id"], "model_id": MODEL, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"},
                headers={"apikey": key},
            )
            if resp.status_code != 200:
                errors.append(f"submit {resp.status_code} {resp.content[:200]!r}")
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    received = {}
    for s in streams:
        received.update(s.received)
    latencies = [received[tag] - t for tag, t in sent.items() if tag in received]
    missing = len(sent) - len(latencies)
    stream_errors = [s.error for s in streams if s.error or not s.done or s.finishes != 1 or s.status != 200]
    return {
        "posts": len(sent),
        "latencies": latencies,
        "answered": answered,
        "missing": missing,
        "errors": errors + [str(e) for e in stream_errors],
        "rss_before_kb": rss_before,
        "rss_half_kb": rss_half,
        "half": half,
        "rss_open_kb": rss_open,
        "streams": len(streams),
        "jobs": len(jobs),
        "scheduled": int(len(jobs) * args.rate * args.duration),
        "seconds": posting_seconds,
        "cpu": {name: cpu_after.get(name, 0.0) - cpu_before.get(name, 0.0) for name in ("daphne", "client")},
    }


async def reader_loop(args, registered: int) -> dict:
    """The front's reader alone: `registered` streams registered, --streams of them appended to as
    in the raw loop (same writer, same rate); each entry timed from just before its XADD to the
    moment its request's subscription is woken and takes it."""
    import redis.asyncio as aioredis

    from oai.deltas import DeltaStreamReader

    pool = aioredis.ConnectionPool.from_url(args.redis_url)
    pool.connection_kwargs["db"] = STREAM_DB
    writer = aioredis.Redis(connection_pool=pool)
    reader = DeltaStreamReader(args.redis_url, db=STREAM_DB, client_name="bench-relay-reader")
    ids = [str(uuid.uuid4()) for _ in range(max(registered, args.streams))]
    subscriptions = [reader.register(request_id) for request_id in ids]
    await asyncio.sleep(0.3)
    sent: dict[str, float] = {}
    latencies: list[float] = []

    async def consume(subscription) -> None:
        while True:
            await subscription.event.wait()
            now = time.perf_counter()
            for batch in subscription.take():
                for entry in batch:
                    latencies.append(now - sent[entry.content])

    consumers = [asyncio.create_task(consume(sub)) for sub in subscriptions[: args.streams]]

    async def post(i: int) -> None:
        key = subscriptions[i].key
        interval = 1.0 / args.rate
        start = time.perf_counter()
        next_at = start + first_post_offset(i, args.streams, interval)
        seq = 0
        while time.perf_counter() < start + args.duration:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            seq += 1
            tag = f"s{i}.{seq}"
            sent[tag] = time.perf_counter()
            await writer.xadd(key, {b"gen": b"g", b"seq": seq, b"content": tag, b"worker": b"w", b"model": b"m"})
            next_at += interval

    reads_before, cpu_before = reader.reads, time.process_time()
    await asyncio.gather(*(post(i) for i in range(args.streams)))
    deadline = time.monotonic() + 10
    while len(latencies) < len(sent) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cpu = time.process_time() - cpu_before
    reads = reader.reads - reads_before
    for task in consumers:
        task.cancel()
    await reader.close()
    await writer.delete(*(sub.key for sub in subscriptions[: args.streams]))
    await writer.aclose()
    return {"registered": len(ids), "posts": len(sent), "latencies": latencies, "reads": reads, "cpu": cpu}


async def raw_loop(args) -> dict:
    import redis.asyncio as aioredis

    def client():
        pool = aioredis.ConnectionPool.from_url(args.redis_url)
        pool.connection_kwargs["db"] = STREAM_DB
        return aioredis.Redis(connection_pool=pool)

    writer, reader = client(), client()
    run = uuid.uuid4().hex[:8]
    keys = [f"bench:relay:raw:{run}:{i}".encode() for i in range(args.streams)]
    last = {k: b"0-0" for k in keys}
    sent: dict[bytes, float] = {}
    latencies: list[float] = []
    stop = asyncio.Event()

    async def read() -> None:
        while not stop.is_set() or len(latencies) < len(sent):
            result = await reader.xread(dict(last), block=250)
            now = time.perf_counter()
            for key, entries in result or ():
                for _entry_id, fields in entries:
                    latencies.append(now - sent[fields[b"t"]])
                last[key] = entries[-1][0]
            if stop.is_set() and not result:
                break

    async def post(i: int) -> None:
        interval = 1.0 / args.rate
        start = time.perf_counter()
        next_at = start + first_post_offset(i, args.streams, interval)
        seq = 0
        while time.perf_counter() < start + args.duration:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            seq += 1
            tag = f"s{i}.{seq}".encode()
            sent[tag] = time.perf_counter()
            await writer.xadd(keys[i], {b"t": tag, b"content": tag + b"|"})
            next_at += interval

    reading = asyncio.create_task(read())
    await asyncio.gather(*(post(i) for i in range(args.streams)))
    stop.set()
    await asyncio.wait_for(reading, 10)
    await writer.delete(*keys)
    await writer.aclose()
    await reader.aclose()
    return {"posts": len(sent), "latencies": latencies}


def report(args, relay: dict | None, raw: dict, readers: list[dict]) -> str:
    def ms(values, q):
        return pct(values, q) * 1000

    w50, w99 = ms(raw["latencies"], 50), ms(raw["latencies"], 99)
    lines = [
        "",
        f"relay bench: {args.streams} streams, {args.rate:g} posts/s each, {args.duration:g} s per loop",
        f"{'loop':40s} {'entries':>8s} {'p50 ms':>8s} {'p99 ms':>8s}",
    ]
    if relay is not None:
        lines += [
            f"{'worker post -> SSE chunk':40s} {len(relay['latencies']):8d} {ms(relay['latencies'], 50):8.2f} "
            f"{ms(relay['latencies'], 99):8.2f}",
            f"{'worker post -> its 200':40s} {len(relay['answered']):8d} {ms(relay['answered'], 50):8.2f} "
            f"{ms(relay['answered'], 99):8.2f}",
        ]
    lines.append(f"{'raw XADD -> XREAD':40s} {len(raw['latencies']):8d} {w50:8.2f} {w99:8.2f}")
    for reader in readers:
        name = f"XADD -> front reader, {reader['registered']} registered"
        lines.append(
            f"{name:40s} {len(reader['latencies']):8d} {ms(reader['latencies'], 50):8.2f} "
            f"{ms(reader['latencies'], 99):8.2f}   {reader['reads']} reads, "
            f"{1e6 * reader['cpu'] / max(reader['reads'], 1):.0f} us of this process's CPU a read"
        )
    if relay is not None:
        r50, r99 = ms(relay["latencies"], 50), ms(relay["latencies"], 99)
        per_stream = (relay["rss_open_kb"] - relay["rss_before_kb"]) / max(relay["streams"], 1)
        marginal = (relay["rss_open_kb"] - relay["rss_half_kb"]) / max(relay["streams"] - relay["half"], 1)
        lines += [
            f"p50 - raw p50 = {r50 - w50:.2f} ms (goal <= 5), p99 - raw p99 = {r99 - w99:.2f} ms (goal <= 20)",
            f"posts {relay['posts']} of {relay['scheduled']} scheduled ({relay['posts'] / relay['seconds']:.0f}/s), "
            f"chunks missing {relay['missing']}, errors {len(relay['errors'])} (goal 0)"
            + (f": {relay['errors'][:5]}" if relay["errors"] else ""),
            f"CPU per post while posting (user + system): web process "
            f"{1000 * relay['cpu']['daphne'] / max(relay['posts'], 1):.3f} ms, this client "
            f"{1000 * relay['cpu']['client'] / max(relay['posts'], 1):.3f} ms",
            f"web process RSS {relay['rss_before_kb']} KB before, {relay['rss_half_kb']} KB with half the streams "
            f"open, {relay['rss_open_kb']} KB with all: {marginal:.1f} KB per open stream, the second half's "
            f"growth (goal <= 100); {per_stream:.1f} KB averaged from before",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = bench_env(args)
    env.update(
        HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP="100000/second",
        HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP="100000/second",
        # One requester key opens every stream: its shipped 2/second would stagger the opening (ADR 0032).
        HORDE_API_KEY_RATE_LIMITS="100000/second",
        HORDE_OAI_MAX_INFLIGHT_PER_SOURCE="100000",
        HORDE_OAI_KEEPALIVE_SECONDS="10",
    )
    for item in args.server_env:
        name, _, value = item.partition("=")
        env[name] = value
    registered = [int(n) for n in args.reader_streams.split(",") if n.strip()]
    if args.skip_relay:
        raw = asyncio.run(raw_loop(args))
        print(report(args, None, raw, [asyncio.run(reader_loop(args, n)) for n in registered]))
        return 0
    prepare(env)
    from django.db import connection

    server = Server(args.port, env, ROOT / "var" / "bench-relay-daphne.log")

    with serving(server):
        owners = make_owners(args.streams)
        requester = make_requester(args.streams)
        connection.close()
        server.wait_ready()
        relay = asyncio.run(relay_loop(args, owners, requester, server.proc.pid))
        server.stop()
        raw = asyncio.run(raw_loop(args))
        readers = [asyncio.run(reader_loop(args, n)) for n in registered]
        print(report(args, relay, raw, readers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
