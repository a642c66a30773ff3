"""OpenAI front benchmark (issue 4): the front's added latency over the native path, the completion
signal's wake latency, and 1,000 concurrent waiting requests held by one web process, in one run.

    .venv/bin/python bench/front.py [--pairs 300 --waiters 1000 --hold 25]

1. Recreates and migrates its own database (default
   postgres://postgres@127.0.0.1:5432/horde_bench_front, or BENCH_FRONT_DATABASE_URL), flushes its
   Redis database (redis://127.0.0.1:6379/9, or BENCH_FRONT_REDIS_URL), creates a worker owner and
   a requester (manage.py horde_user), and starts daphne (hordesite.asgi:application: the native API
   and the mounted /v1/ front) on port 8785 with the rate limits lifted and the front's in-flight caps
   raised above --waiters. The mounted front calls the native API in process, the default
   (docs/adr/0008-oai-native-calls-in-process.md); --native-over-http points its native root at that
   same daphne over TCP loopback instead (the setup before 2026-11-30).
2. An instant test worker runs in this process: --worker-loops asyncio loops (one worker name
   each, declaring every chat feature for the model) that POST /generate/text/pop and, when a job
   comes, POST /generate/text/submit a fixed reply at once, recording when the submit returned.
   In the latency phase the worker is "kicked" when the client sends a request and pops
   back-to-back (--pop-retry apart) until it has the job, the same for both paths, so pick-up
   costs the same and idle pops do not load the server between requests; in the drain phase every
   loop pops back-to-back while jobs are waiting.
3. Added latency: --pairs sequential pairs, order alternating, after --warmup pairs:
     front   POST /v1/chat/completions (non-streamed) until the JSON reply is read;
     native  POST /api/v2/generate/chat/async, wait for the completion signal on Redis
             (horde:chat:<id>, one PSUBSCRIBE horde:chat:* made before the run, so no race and no
             extra read), then one GET /api/v2/generate/chat/status/<id>.
   p50/p99 of each, and the added latency (front minus native) at p50 and p99.
4. Wake latency: from the worker's submit returning 200 to the client holding the reply, for the
   front requests of step 3 (and the native ones for reference). With --poll-reference N, a second
   daphne (port+1) runs the front without Redis (HORDE_OAI_REDIS_URL="": status polled every
   HORDE_OAI_POLL_SECONDS) and N front requests measure the same there.
5. --waiters concurrent requests (half streamed with keepalive comments, half not), started over
   --ramp seconds, held --hold seconds with the worker paused, then served: errors (must be 0),
   keepalive comments received, the web process's RSS (before, peak, per waiting request) and the
   time to drain.

The database is dropped and recreated on every run and the Redis database flushed: do not point
them at data you keep.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT, Server, create_user_key, prepare, server_env, serving
from text_queue import pct

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/horde_bench_front"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/9"
MODEL = "Gryphe/MythoMax-L2-13b"
CLIENT_AGENT = "bench:1:front"
FEATURES = [
    "seed",
    "reasoning_effort",
    "presence_penalty",
    "frequency_penalty",
    "tools",
    "json_object",
    "json_schema",
    "tools_with_response_format",
    "tool_choice_enforced",
    "single_tool_call_enforced",
    "structured_output_enforced",
    "prompt_overflow_refused",
]
REPLY_TEXT = "An instant reply from the bench worker."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--pairs", type=int, default=300, help="measured front/native pairs (default 300)")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured pairs first (default 20)")
    p.add_argument("--waiters", type=int, default=1000, help="concurrent waiting requests (default 1000)")
    p.add_argument(
        "--ramp", type=float, default=20.0, help="seconds over which the waiters are started (default 20)"
    )
    p.add_argument(
        "--hold", type=float, default=25.0, help="seconds all waiters are held, worker paused (default 25)"
    )
    p.add_argument(
        "--requesters",
        type=int,
        default=20,
        help="requester keys the waiters are spread over (default 20). Each submit locks its requester's\n"
        "row (chat_request_create -> lock_requester), so one key's submits are serialised; on the 2-core\n"
        "box the web process's CPU limited admission first (1 key and 20 keys admitted alike)",
    )
    p.add_argument(
        "--recheck",
        type=float,
        default=30.0,
        help="HORDE_OAI_SIGNAL_RECHECK_SECONDS for daphne (default 30; the server default, 5, makes\n"
        "1,000 waiters read their status 200 times a second through the one web process)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=240.0,
        help="seconds the drain may take before the rest count as errors (default 240)",
    )
    p.add_argument(
        "--keepalive",
        type=float,
        default=5.0,
        help="HORDE_OAI_KEEPALIVE_SECONDS (default 5; server default 10)",
    )
    p.add_argument("--worker-loops", type=int, default=4, help="the instant worker's pop loops in the drain (default 4)")
    p.add_argument(
        "--latency-loops",
        type=int,
        default=1,
        help="of those, the loops that pop in the sequential latency phase (default 1; the earlier\n"
        "figures used all 4, whose empty pops contended with the measured request)",
    )
    p.add_argument(
        "--pop-retry",
        type=float,
        default=0.003,
        help="seconds between empty pops while kicked (default 0.003)",
    )
    p.add_argument(
        "--poll-reference",
        type=int,
        default=30,
        help="front requests against a no-Redis front (0: skip; default 30)",
    )
    p.add_argument(
        "--port", type=int, default=8785, help="daphne port (default 8785; the no-Redis front uses port+1)"
    )
    p.add_argument("--database-url", default=os.environ.get("BENCH_FRONT_DATABASE_URL", DEFAULT_DATABASE_URL))
    p.add_argument("--redis-url", default=os.environ.get("BENCH_FRONT_REDIS_URL", DEFAULT_REDIS_URL))
    p.add_argument("--skip-waiters", action="store_true", help="only the latency phases")
    p.add_argument(
        "--front-route",
        choices=sorted(FRONT_ROUTES),
        default="chat",
        help="the front's route measured against the native path: chat (/v1/chat/completions, the\n"
        "default) or responses (/v1/responses with the same text as its input; ADR 0101)",
    )
    p.add_argument(
        "--native-over-http",
        action="store_true",
        help="the front calls the native API over TCP loopback to its own daphne (HORDE_OAI_NATIVE_ROOTS\n"
        "set to it) instead of in process, the default when mounted",
    )
    p.add_argument(
        "--keep-server", action="store_true", help="leave daphne running at the end (prints its pid)"
    )
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for daphne (repeatable), e.g. HORDE_OAI_SIGNAL_RECHECK_SECONDS=5",
    )
    return p.parse_args(argv)


def bench_env(args: argparse.Namespace, port: int) -> dict[str, str]:
    env = server_env(
        args.database_url,
        args.redis_url,
        HORDE_TEXT_ASYNC_RATE_LIMITS="100000/second",
        HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP="100000/second",
        HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP="10000000/minute",
        HORDE_API_KEY_RATE_LIMITS="100000/second",  # one requester key submits the whole load
        HORDE_DEFAULT_CONCURRENCY="1000000",  # users made now: every waiter queued by one requester
        PORT=str(port),
        HORDE_OAI_MAX_INFLIGHT=str(max(2000, 2 * args.waiters)),
        HORDE_OAI_MAX_INFLIGHT_PER_SOURCE=str(max(50, 2 * args.waiters)),  # every bench request is 127.0.0.1
        HORDE_OAI_KEEPALIVE_SECONDS=str(args.keepalive),
        HORDE_OAI_SIGNAL_RECHECK_SECONDS=str(args.recheck),
    )
    # The front mounted in this process calls this process's native API: in process by default (the
    # one-process default), or with --native-over-http over TCP loopback to this same daphne.
    env.pop("HORDE_OAI_NATIVE_IN_PROCESS", None)
    env.pop("HORDE_OAI_NATIVE_ROOTS", None)
    if args.native_over_http:
        env["HORDE_OAI_NATIVE_ROOTS"] = f"http://127.0.0.1:{port}/api/v2"
    for item in args.server_env:
        name, _, value = item.partition("=")
        env[name] = value
    return env


def rss_kb(pid: int) -> tuple[int, int]:
    """VmRSS and VmHWM (peak) of a process, in kB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            name, value = line.split(":", 1)
            values[name] = int(value.split()[0])
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


def waiting_count(database_url: str) -> int:
    import psycopg

    with psycopg.connect(database_url.replace("postgres://", "postgresql://", 1), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM horde_requests WHERE jobs_waiting > 0 AND NOT faulted AND NOT cancelled"
        ).fetchone()
    return int(row[0])


# --- the instant worker -----------------------------------------------------------------------------


@dataclass
class InstantWorker:
    base: str
    key: str
    loops: int
    pop_retry: float
    latency_loops: int = 1
    submitted: dict[str, float] = field(default_factory=dict)  # request tag -> perf_counter at submit 200
    popped: dict[str, float] = field(default_factory=dict)
    demand: int = 0  # kicked requests not yet served (latency phase)
    drain: bool = False  # every loop pops back-to-back (drain phase)
    errors: dict[str, int] = field(default_factory=dict)
    jobs: int = 0
    pops: int = 0

    def __post_init__(self) -> None:
        self.wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def pop_body(self, i: int) -> dict:
        return {
            "name": f"bench-front-worker-{i}",
            "models": [MODEL],
            "max_length": 512,
            "max_context_length": 4096,
            "bridge_agent": "bench-front-worker:1:https://example.org",
            "chat_jobs": True,
            "prompt_jobs": False,
            "chat_features": FEATURES,
            "chat_limits": {"max_context_length": 8192, "max_length": 2048},
            "model_id": MODEL,
        }

    def kick(self) -> None:
        self.demand += 1
        self.wakeup.set()

    def _active(self, i: int) -> bool:
        # The latency phase sends one request at a time: one loop serves it. More loops would only
        # add empty pops that contend with the measured request for the one web process.
        return self.drain or (self.demand > 0 and i < self.latency_loops)

    def error(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1

    async def check_in(self, client) -> None:
        for i in range(self.loops):
            r = await client.post("/api/v2/generate/text/pop", json=self.pop_body(i))
            r.raise_for_status()
            if r.json().get("id"):
                raise SystemExit("the bench queue was not empty at check-in")

    def start(self, client) -> None:
        self._tasks = [asyncio.create_task(self._loop(client, i)) for i in range(self.loops)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task

    async def _loop(self, client, i: int) -> None:
        body = self.pop_body(i)
        while True:
            if not self._active(i):
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            try:
                r = await client.post("/api/v2/generate/text/pop", json=body)
                self.pops += 1
            except Exception as exc:  # noqa: BLE001
                self.error(f"pop {type(exc).__name__}")
                await asyncio.sleep(0.05)
                continue
            job = r.json() if r.status_code == 200 else {}
            if r.status_code != 200:
                self.error(f"pop HTTP {r.status_code}")
            job_id = job.get("id")
            if not job_id:
                await asyncio.sleep(self.pop_retry if not self.drain else 0)
                continue
            tag = job_tag(job)
            popped_at = time.perf_counter()
            if self.demand > 0:
                self.demand -= 1
            try:
                s = await client.post(
                    "/api/v2/generate/text/submit",
                    json={
                        "id": job_id,
                        "model_id": MODEL,
                        "message": {"role": "assistant", "content": REPLY_TEXT},
                        "finish_reason": "stop",
                    },
                )
            except Exception as exc:  # noqa: BLE001
                self.error(f"submit {type(exc).__name__}")
                continue
            done_at = time.perf_counter()
            if s.status_code != 200:
                self.error(f"submit HTTP {s.status_code}")
                continue
            self.jobs += 1
            # Keyed by the tag the client put in the prompt (a job carries no request id).
            self.submitted[tag] = done_at
            self.popped[tag] = popped_at


# --- the native path's signal listener --------------------------------------------------------------


class SignalListener:
    """One PSUBSCRIBE horde:chat:* made before any submit: a message is never missed, and no status
    read is needed to close a race (the fastest native wait)."""

    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self.seen: dict[str, float] = {}
        self.waiters: dict[str, asyncio.Future] = {}

    async def start(self) -> None:
        import redis.asyncio as aioredis

        # Imported here: bench/common.py has put the repository root on sys.path.
        from contract.chat_signal import CHAT_SIGNAL_CHANNEL_PREFIX

        self.client = aioredis.Redis.from_url(self.redis_url)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        await self.pubsub.psubscribe(CHAT_SIGNAL_CHANNEL_PREFIX + "*")
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            message = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is None or message.get("type") != "pmessage":
                continue
            try:
                data = json.loads(message["data"])
            except ValueError:
                continue
            if data.get("event") not in ("generation", "done", "faulted", "cancelled"):
                continue
            rid = str(data.get("id"))
            self.seen.setdefault(rid, time.perf_counter())
            future = self.waiters.pop(rid, None)
            if future is not None and not future.done():
                future.set_result(data)

    async def wait(self, rid: str, timeout: float = 30.0) -> None:
        if rid in self.seen:
            return
        future = asyncio.get_running_loop().create_future()
        self.waiters[rid] = future
        await asyncio.wait_for(future, timeout)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task
        with contextlib.suppress(Exception):
            await self.pubsub.aclose()
            await self.client.aclose()


# --- phases -----------------------------------------------------------------------------------------


TAG = re.compile(r"bench request ([0-9a-f]{32})")


def new_tag() -> str:
    return uuid.uuid4().hex


def job_tag(job: dict) -> str:
    for message in (job.get("payload") or {}).get("messages") or []:
        match = TAG.search(str(message.get("content")))
        if match:
            return match.group(1)
    return str(job.get("id"))


def responses_body(tag: str) -> dict:
    return {"model": MODEL, "input": f"Say hello, bench request {tag}.", "max_output_tokens": 32, "store": False}


def chat_body(tag: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Say hello, bench request {tag}."}],
        "max_tokens": 32,
    }


# --front-route: the front's path and body for a request tagged `tag`.
FRONT_ROUTES = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}
FRONT_BODIES = {"chat": chat_body, "responses": responses_body}
front_route = "chat"


@dataclass
class Latencies:
    front: list[float] = field(default_factory=list)
    native: list[float] = field(default_factory=list)
    front_wake: list[float] = field(default_factory=list)
    native_wake: list[float] = field(default_factory=list)
    front_pickup: list[float] = field(default_factory=list)  # client send -> worker popped
    native_pickup: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    pending: list[tuple[str, str, float, float]] = field(default_factory=list)  # path, tag, sent, replied

    def error(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1

    def settle(self, worker: InstantWorker) -> None:
        """Wake (worker's submit answer -> client's reply; negative when the reply came first) and
        pick-up of each measured request, once the worker recorded its submit."""
        for path, tag, t0, t1 in self.pending:
            if tag in worker.submitted:
                wake, pickup = (
                    (self.front_wake, self.front_pickup)
                    if path == "front"
                    else (self.native_wake, self.native_pickup)
                )
                wake.append(t1 - worker.submitted[tag])
                pickup.append(worker.popped[tag] - t0)
        self.pending.clear()


async def front_request(client, worker: InstantWorker, i: int, lat: Latencies | None) -> None:
    tag = new_tag()
    worker.kick()
    t0 = time.perf_counter()
    r = await client.post(FRONT_ROUTES[front_route], json=FRONT_BODIES[front_route](tag))
    t1 = time.perf_counter()
    if r.status_code != 200:
        if lat is not None:
            lat.error(f"front HTTP {r.status_code}: {r.text[:200]}")
        worker.demand = max(0, worker.demand - 1)
        return
    if lat is not None:
        lat.front.append(t1 - t0)
        # The front may hold its reply before the worker's submit answer returns (the signal goes out
        # inside the submit): the wake is taken once the worker recorded it (Latencies.settle).
        lat.pending.append(("front", tag, t0, t1))


async def native_request(
    client, worker: InstantWorker, listener: SignalListener, i: int, lat: Latencies | None
) -> None:
    tag = new_tag()
    body = chat_body(tag)
    body["horde"] = {"operation_key": str(uuid.uuid4())}
    worker.kick()
    t0 = time.perf_counter()
    r = await client.post("/api/v2/generate/chat/async", json=body)
    if r.status_code != 202:
        if lat is not None:
            lat.error(f"native submit HTTP {r.status_code}: {r.text[:200]}")
        worker.demand = max(0, worker.demand - 1)
        return
    rid = r.json()["id"]
    await listener.wait(rid)
    s = await client.get(f"/api/v2/generate/chat/status/{rid}")
    t1 = time.perf_counter()
    if s.status_code != 200 or not s.json().get("generations"):
        if lat is not None:
            lat.error(f"native status HTTP {s.status_code} generations={bool(s.json().get('generations'))}")
        return
    if lat is not None:
        lat.native.append(t1 - t0)
        lat.pending.append(("native", tag, t0, t1))


async def latency_phase(client, worker, listener, pairs: int, warmup: int) -> Latencies:
    for i in range(warmup):
        await front_request(client, worker, i, None)
        await native_request(client, worker, listener, i, None)
    lat = Latencies()
    for i in range(pairs):
        if i % 2 == 0:
            await front_request(client, worker, i, lat)
            await native_request(client, worker, listener, i, lat)
        else:
            await native_request(client, worker, listener, i, lat)
            await front_request(client, worker, i, lat)
        if (i + 1) % 50 == 0:
            print(
                f"  {i + 1}/{pairs} pairs: front p50 {pct(lat.front, 50) * 1000:.1f} ms, "
                f"native p50 {pct(lat.native, 50) * 1000:.1f} ms",
                flush=True,
            )
    return lat


async def poll_reference(base: str, worker: InstantWorker, key: str, count: int) -> list[float]:
    import httpx

    wakes: list[float] = []
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60
    ) as client:
        lat = Latencies()
        for i in range(count):
            await front_request(client, worker, 10_000 + i, lat)
        await asyncio.sleep(0.5)
        lat.settle(worker)
        wakes = lat.front_wake
        if lat.errors:
            print(f"  poll reference errors: {lat.errors}", flush=True)
    return wakes


@dataclass
class WaitResult:
    ok_stream: int = 0
    ok_plain: int = 0
    keepalives: int = 0
    streams_with_keepalive_after_first: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    finished_at: list[float] = field(default_factory=list)
    headers_at: list[float] = field(default_factory=list)

    def error(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1


async def one_waiter(client, key: str, streamed: bool, res: WaitResult) -> None:
    body = chat_body(new_tag())
    headers = {"Authorization": f"Bearer {key}"}
    try:
        if not streamed:
            r = await client.post("/v1/chat/completions", json=body, headers=headers)
            if r.status_code != 200:
                res.error(f"plain HTTP {r.status_code}: {r.text[:160]}")
                return
            content = r.json()["choices"][0]["message"]["content"]
            if content != REPLY_TEXT:
                res.error("plain wrong content")
                return
            res.ok_plain += 1
            res.finished_at.append(time.perf_counter())
            return
        body["stream"] = True
        keepalives = 0
        done = False
        content = ""
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                res.error(f"stream HTTP {r.status_code}: {r.text[:160]}")
                return
            res.headers_at.append(time.perf_counter())
            async for line in r.aiter_lines():
                if line.startswith(":"):
                    keepalives += 1
                elif line.startswith("data: "):
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error(f"stream error event: {str(chunk['error'])[:160]}")
                        return
                    for choice in chunk.get("choices") or []:
                        content += (choice.get("delta") or {}).get("content") or ""
        res.keepalives += keepalives
        if keepalives > 1:
            res.streams_with_keepalive_after_first += 1
        if not done or content != REPLY_TEXT:
            res.error(f"stream incomplete (done={done}, content={content[:40]!r})")
            return
        res.ok_stream += 1
        res.finished_at.append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001
        res.error(f"{'stream' if streamed else 'plain'} {type(exc).__name__}: {str(exc)[:120]}")


async def waiters_phase(args, base: str, keys: list[str], worker: InstantWorker, web_pid: int) -> dict:
    import httpx

    worker.drain = False
    worker.demand = 0
    await asyncio.sleep(0.5)
    rss_before, hwm_before = rss_kb(web_pid)
    res = WaitResult()
    limits = httpx.Limits(max_connections=args.waiters + 100, max_keepalive_connections=args.waiters + 100)
    timeout = httpx.Timeout(connect=30, read=None, write=30, pool=60)
    samples: list[tuple[float, int]] = []
    queue_samples: list[tuple[float, int]] = []
    stop_sampling = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def sample() -> None:
        while not stop_sampling.is_set():
            with contextlib.suppress(Exception):
                samples.append((time.perf_counter(), rss_kb(web_pid)[0]))
            if not worker.drain:
                with contextlib.suppress(Exception):
                    queue_samples.append(
                        (
                            time.perf_counter(),
                            await loop.run_in_executor(None, waiting_count, args.database_url),
                        )
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_sampling.wait(), 0.5)

    sampler = asyncio.create_task(sample())
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as client:
        t_start = time.perf_counter()
        tasks = []
        gap = args.ramp / max(1, args.waiters)
        for i in range(args.waiters):
            key = keys[i % len(keys)]
            tasks.append(asyncio.create_task(one_waiter(client, key, i % 2 == 0, res)))
            target = t_start + (i + 1) * gap
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        t_launched = time.perf_counter()
        print(
            f"  {args.waiters} waiters started in {t_launched - t_start:.1f} s; holding {args.hold:.0f} s",
            flush=True,
        )
        await asyncio.sleep(args.hold)
        queued = await loop.run_in_executor(None, waiting_count, args.database_url)
        rss_hold, _ = rss_kb(web_pid)
        errors_during_hold = sum(res.errors.values())
        streams_open = len(res.headers_at)
        keepalives_hold = res.keepalives  # counted at stream end; see below
        print(
            f"  end of hold: {queued} requests waiting in the horde, {streams_open} streams open, "
            f"RSS {rss_hold / 1024:.1f} MiB (before {rss_before / 1024:.1f}), errors so far {errors_during_hold}",
            flush=True,
        )
        t_release = time.perf_counter()
        worker.drain = True
        worker.wakeup.set()
        _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout)
        for task in pending:
            task.cancel()
            res.error(f"unfinished {args.drain_timeout:g} s after the release")
        if pending:
            await asyncio.wait(pending, timeout=5)
        t_drained = time.perf_counter()
        worker.drain = False
    stop_sampling.set()
    await sampler
    rss_after, hwm_after = rss_kb(web_pid)
    peak_hold = max((v for t, v in samples if t <= t_release), default=rss_hold)
    peak_all = max((v for _, v in samples), default=rss_after)
    admitted_by = {}
    for mark in (5, 10, 15, 20, 30, 40):
        values = [q for t, q in queue_samples if t - t_start <= mark]
        if values:
            admitted_by[mark] = values[-1]
    return {
        "admitted_by": admitted_by,
        "res": res,
        "queued_at_hold_end": queued,
        "rss_before": rss_before,
        "rss_hold": rss_hold,
        "rss_peak_hold": peak_hold,
        "rss_peak_all": peak_all,
        "rss_after": rss_after,
        "hwm_before": hwm_before,
        "hwm_after": hwm_after,
        "launch_seconds": t_launched - t_start,
        "drain_seconds": t_drained - t_release,
        "last_finished": (max(res.finished_at) - t_release) if res.finished_at else float("nan"),
        "errors_during_hold": errors_during_hold,
        "streams_open": streams_open,
        "keepalives_hold": keepalives_hold,
    }


# --- report -----------------------------------------------------------------------------------------


def ms(v: float) -> str:
    return f"{v * 1000:.1f}"


def report(args, lat: Latencies, poll_wakes: list[float], waits: dict | None, worker: InstantWorker) -> str:
    lines = [
        "",
        f"OpenAI front benchmark: {len(lat.front)} front + {len(lat.native)} native requests measured "
        f"(sequential, alternating), keepalive {args.keepalive:g} s",
        "",
    ]
    lines += ["| path | n | p50 ms | p90 ms | p99 ms | max ms |", "|---|---:|---:|---:|---:|---:|"]
    for label, values in (
        (f"front: POST {FRONT_ROUTES[args.front_route]}", lat.front),
        ("native: POST chat/async + signal + GET status", lat.native),
        ("  pick-up (send -> worker has the job), front", lat.front_pickup),
        ("  pick-up (send -> worker has the job), native", lat.native_pickup),
    ):
        lines.append(
            f"| {label} | {len(values)} | {ms(pct(values, 50))} | {ms(pct(values, 90))} | {ms(pct(values, 99))} | "
            f"{ms(max(values) if values else float('nan'))} |"
        )
    add50 = pct(lat.front, 50) - pct(lat.native, 50)
    add99 = pct(lat.front, 99) - pct(lat.native, 99)
    lines += [
        "",
        "| added latency (front - native) | measured ms | goal ms | met |",
        "|---|---:|---:|---|",
        f"| p50 | {ms(add50)} | < 15 | {'yes' if add50 < 0.015 else 'NO'} |",
        f"| p99 | {ms(add99)} | < 50 | {'yes' if add99 < 0.050 else 'NO'} |",
        "",
        "| wake latency (worker submit 200 -> client has the reply) | n | p50 ms | p95 ms | p99 ms | goal |",
        "|---|---:|---:|---:|---:|---|",
        f"| front, Redis signal | {len(lat.front_wake)} | {ms(pct(lat.front_wake, 50))} | "
        f"{ms(pct(lat.front_wake, 95))} | {ms(pct(lat.front_wake, 99))} | p95 < 25 ms: "
        f"{'met' if pct(lat.front_wake, 95) < 0.025 else 'NOT met'} |",
        f"| native, Redis signal + GET status | {len(lat.native_wake)} | {ms(pct(lat.native_wake, 50))} | "
        f"{ms(pct(lat.native_wake, 95))} | {ms(pct(lat.native_wake, 99))} | (reference) |",
    ]
    if poll_wakes:
        lines.append(
            f"| front without Redis (status polled every 1 s) | {len(poll_wakes)} | {ms(pct(poll_wakes, 50))} | "
            f"{ms(pct(poll_wakes, 95))} | {ms(pct(poll_wakes, 99))} | (reference) |"
        )
    lines.append(
        "| existing horde proxies, 2 s polling (expected: uniform 0-2 s) | | 1000 | 1900 | 1980 | (reference) |"
    )
    if lat.errors:
        lines.append(f"\nlatency phase errors: {lat.errors}")
    if waits:
        res: WaitResult = waits["res"]
        half = args.waiters // 2
        per_req = (waits["rss_hold"] - waits["rss_before"]) / args.waiters
        per_req_peak = (waits["rss_peak_hold"] - waits["rss_before"]) / args.waiters
        lines += [
            "",
            f"{args.waiters} concurrent waiting requests ({args.waiters - half} streamed, {half} not) from "
            f"{args.requesters} requester keys, signal recheck {args.recheck:g} s, "
            f"started over {waits['launch_seconds']:.1f} s, held {args.hold:g} s with the worker paused:",
            "",
            "| measure | value |",
            "|---|---:|",
            f"| requests waiting in the horde at the end of the hold | {waits['queued_at_hold_end']} |",
            "| requests queued in the horde by second after the first start | "
            + ", ".join(f"{k} s: {v}" for k, v in waits["admitted_by"].items())
            + " |",
            f"| streams open (200 + headers) at the end of the hold | {waits['streams_open']} |",
            f"| errors during the hold | {waits['errors_during_hold']} |",
            f"| completed: streamed / not streamed | {res.ok_stream} / {res.ok_plain} |",
            f"| errors in all | {sum(res.errors.values())} |",
            f"| keepalive comments received (streamed; the first is the opening comment) | {res.keepalives} |",
            f"| streams that got a keepalive after the opening one | {res.streams_with_keepalive_after_first} |",
            f"| web RSS before / end of hold / peak in hold, MiB | {waits['rss_before'] / 1024:.1f} / "
            f"{waits['rss_hold'] / 1024:.1f} / {waits['rss_peak_hold'] / 1024:.1f} |",
            f"| web RSS peak incl. drain / VmHWM after, MiB | {waits['rss_peak_all'] / 1024:.1f} / {waits['hwm_after'] / 1024:.1f} |",
            f"| memory per waiting request (end of hold / peak in hold) | {per_req:.1f} KB / {per_req_peak:.1f} KB "
            f"(goal < 100 KB: {'met' if per_req_peak < 100 else 'NOT met'}) |",
            f"| drain: worker released -> last reply received | {waits['drain_seconds']:.1f} s |",
        ]
        if res.errors:
            lines.append("")
            lines.append(
                "errors: "
                + "; ".join(f"{k}: {v}" for k, v in sorted(res.errors.items(), key=lambda kv: -kv[1])[:10])
            )
    lines.append(
        f"\ninstant worker: {worker.jobs} jobs, {worker.pops} pops, errors {worker.errors or 'none'}"
    )
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------------


async def run(
    args, env, key: str, keys: list[str], worker_key: str, server: Server, poll_server: Server | None
):
    import httpx

    global front_route
    front_route = args.front_route
    base = f"http://127.0.0.1:{args.port}"
    worker_client = httpx.AsyncClient(
        base_url=base,
        headers={"apikey": worker_key},
        timeout=30,
        limits=httpx.Limits(max_connections=args.worker_loops + 2),
    )
    worker = InstantWorker(base, worker_key, args.worker_loops, args.pop_retry, latency_loops=args.latency_loops)
    await worker.check_in(worker_client)
    worker.start(worker_client)
    listener = SignalListener(args.redis_url)
    await listener.start()
    try:
        async with httpx.AsyncClient(
            base_url=base,
            headers={"Authorization": f"Bearer {key}", "apikey": key, "Client-Agent": CLIENT_AGENT},
            timeout=60,
            limits=httpx.Limits(max_connections=4),
        ) as client:
            print(f"latency: {args.warmup} warm-up pairs, then {args.pairs} measured pairs ...", flush=True)
            lat = await latency_phase(client, worker, listener, args.pairs, args.warmup)
            await asyncio.sleep(0.5)  # the last submit answers reach the worker
            lat.settle(worker)
        poll_wakes: list[float] = []
        if poll_server is not None:
            print(
                f"poll reference: {args.poll_reference} front requests against the no-Redis front ...",
                flush=True,
            )
            poll_wakes = await poll_reference(
                f"http://127.0.0.1:{args.port + 1}", worker, key, args.poll_reference
            )
            poll_server.stop()
        waits = None
        if not args.skip_waiters:
            print(f"waiters: {args.waiters} concurrent requests ...", flush=True)
            waits = await waiters_phase(args, base, keys, worker, server.proc.pid)
        return lat, poll_wakes, waits, worker
    finally:
        await listener.stop()
        await worker.stop()
        await worker_client.aclose()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = (
        min(hard, max(soft, 4 * args.waiters + 1000))
        if hard != resource.RLIM_INFINITY
        else max(soft, 4 * args.waiters + 1000)
    )
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # inherited by daphne
    env = bench_env(args, args.port)
    prepare(env, django=False, note=f", open files {want}")
    worker_key = create_user_key(env, "bench-front-owner", "--trusted")
    key = create_user_key(env, "bench-front-requester", "--kudos", "100000000")
    keys = [key] + [
        create_user_key(env, f"bench-front-requester-{i}", "--kudos", "100000000")
        for i in range(1, max(1, args.requesters))
    ]

    server = Server(args.port, env, ROOT / "var" / "bench-front-daphne.log")
    poll_server = None
    if args.poll_reference > 0:
        poll_env = bench_env(args, args.port + 1)
        poll_env["HORDE_OAI_REDIS_URL"] = ""  # the front without Redis: waits poll the status route
        poll_server = Server(args.port + 1, poll_env, ROOT / "var" / "bench-front-poll-daphne.log")

    with serving(*(s for s in (server, poll_server) if s)):
        server.wait_ready()
        if poll_server:
            poll_server.wait_ready(announce=False)
        lat, poll_wakes, waits, worker = asyncio.run(
            run(args, env, key, keys, worker_key, server, poll_server)
        )
        print(report(args, lat, poll_wakes, waits, worker))
        if args.keep_server:
            server.leave_running()
    return 0


if __name__ == "__main__":
    sys.exit(main())
