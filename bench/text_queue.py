"""Text queue benchmark (issue 2): pop+submit and status against heartbeat, in one run.

Fills N queued text requests over M models (PostgreSQL + Redis), starts a real daphne web
process, then alternates four measured phases at the same client concurrency:

  heartbeat  GET  /api/v2/status/heartbeat
  pop        W registered workers loop: POST /api/v2/generate/text/pop, then
             POST /api/v2/generate/text/submit when a job came
  pop-alone  the same workers loop on POST /api/v2/generate/text/pop only (the jobs they take
             stay in flight; the lease outlasts the run); its ratio counts the pops that
             handed out work
  status     GET  /api/v2/generate/text/status/<id> on random queued ids

and prints throughput and p50/p95 latency of each, with the ratios the issue sets as goals:
pop rps >= 0.5x heartbeat rps, status p95 <= 2x heartbeat p95.

The phases above are closed loops: 12 requests always in flight keep the web process saturated,
so their latencies are mostly queueing and the status p95 ratio reads the CPU ratio of the two
routes. Then, with the status phase, the offered-load phases (ADR 0053) send the heartbeat and the
status poll at the same fixed rates, fractions of the status phase's own closed-loop rate, as
clients that poll on a clock do: each request is sent when due, without waiting for an earlier
answer, so a slower route shows in its latency, not in a lower rate. The pop phase's pop rate is at
most half the heartbeat's by construction (each job is a pop and a submit on the same stack, ADR
0048); the pop-alone phase measures the pop's own rate (ADR 0049).

    .venv/bin/python bench/text_queue.py [--requests 10000 --models 50 --workers 100 --duration 90]

The bench database (DATABASE_URL, default postgres://postgres@127.0.0.1:5432/horde_bench) is
dropped and recreated on every run; the Redis database (REDIS_URL, default
redis://127.0.0.1:6379/14) is flushed. Do not point them at data you keep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common import ROOT, Server, prepare, server_env, serving

if TYPE_CHECKING:
    from chat.services.create_text import TextRequestInput

PHASES = ("heartbeat", "pop", "pop-alone", "status")
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/horde_bench"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/14"
VALIDATED_BRIDGE = "AI Horde Worker reGen:9.0.0:https://github.com/Haidra-Org/horde-worker-reGen"


def _phase_names(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = sorted(set(names) - set(PHASES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown phases {unknown}; known: {', '.join(PHASES)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--requests", type=int, default=10_000, help="queued text requests to fill (default 10000)"
    )
    p.add_argument("--models", type=int, default=50, help="distinct model names (default 50)")
    p.add_argument("--workers", type=int, default=100, help="registered workers popping (default 100)")
    p.add_argument(
        "--requesters", type=int, default=50, help="requesting users the fill is spread over (default 50)"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=90.0,
        help="total measured seconds, split evenly over rounds x phases (default 90)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of every phase, order rotated (default 3)"
    )
    p.add_argument(
        "--phases",
        type=_phase_names,
        default=",".join(PHASES),
        help=f"the measured phases, comma separated (default {','.join(PHASES)}; heartbeat is always run)",
    )
    p.add_argument(
        "--offered-loads",
        default="0.25,0.5,0.75",
        help="with the status phase: fixed rates, as fractions of the status phase's measured rate, at "
        "which heartbeat and status are sent (open loop, ADR 0053); empty: none (default 0.25,0.5,0.75)",
    )
    p.add_argument(
        "--offered-seconds", type=float, default=6.0, help="seconds per route at each offered load (default 6)"
    )
    p.add_argument("--fill-threads", type=int, default=4, help="threads filling the queue (default 4)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=12,
        help="requests in flight, the same for every phase (default 12)",
    )
    p.add_argument("--port", type=int, default=8765, help="daphne port (default 8765)")
    p.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DATABASE_URL))
    p.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS_URL))
    p.add_argument(
        "--no-analyze",
        action="store_true",
        help="skip ANALYZE after the fill (autovacuum would do it in production; it may be off locally)",
    )
    p.add_argument("--seed", type=int, default=2, help="random seed of the fill and the workers (default 2)")
    p.add_argument(
        "--keep-server", action="store_true", help="leave daphne running at the end (prints its pid)"
    )
    p.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="load generator: raw (keep-alive HTTP/1.1 over asyncio streams, light) or httpx (default raw)",
    )
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for daphne (repeatable), e.g. HORDE_WEB_THREADS=8",
    )
    return p.parse_args(argv)


# --- Environment: database, Redis, migrations ---------------------------------------------------


def bench_env(args: argparse.Namespace) -> dict[str, str]:
    env = server_env(
        args.database_url,
        args.redis_url,
        HORDE_TEXT_ASYNC_RATE_LIMITS="100000/second",
        HORDE_API_KEY_RATE_LIMITS="100000/second",  # one requester key submits the whole load
    )
    for item in getattr(args, "server_env", []):
        name, _, value = item.partition("=")
        env[name] = value
    return env


# --- The web process ----------------------------------------------------------------------------


# --- Fill ---------------------------------------------------------------------------------------


@dataclass
class WorkerSpec:
    name: str
    api_key: str
    models: list[str]
    max_length: int
    max_context_length: int
    amount: int


def model_names(count: int) -> list[str]:
    return [f"koboldcpp/bench-model-{i:02d}" for i in range(count)]


def text_request_input(rng: random.Random, i: int, models: list[str]) -> TextRequestInput:
    """The i-th queued text request: 1-2 models, a skewed spread so some models have deep queues."""
    from chat.services.create_text import TextRequestInput

    first = min(int(rng.paretovariate(1.2)) - 1, len(models) - 1)
    wanted = [models[first]]
    if rng.random() < 0.3:
        wanted.append(rng.choice(models))
    return TextRequestInput(
        prompt=f"Bench prompt {i}. " + "Once upon a time " * rng.randint(5, 60),
        params={"temperature": 0.7, "top_p": 0.9, "rep_pen": 1.1},
        n=1,
        max_length=rng.choice([64, 80, 120, 160, 256, 512]),
        max_context_length=rng.choice([1024, 2048, 4096, 8192]),
        models=list(dict.fromkeys(wanted)),
    )


def fill_in_threads(specs: list[tuple], create: Callable[[tuple], None], *, requesters: int, threads: int) -> float:
    """create(spec) for every spec (whose first item is its requester, the i-th spec the i-th
    requester round robin) on up to `threads` threads, one share of the requesters each, so no two
    threads lock the same requester row; returns the seconds it took."""
    done = 0
    lock = threading.Lock()
    started = time.perf_counter()

    def fill_share(share: list[tuple]) -> None:
        nonlocal done
        from django.db import connection

        try:
            for spec in share:
                create(spec)
                with lock:
                    done += 1
                    if done % 2000 == 0:
                        print(f"  filled {done}/{len(specs)} ({time.perf_counter() - started:.1f}s)", flush=True)
        finally:
            connection.close()

    threads = max(1, min(threads, requesters))
    shares = [[spec for k, spec in enumerate(specs) if (k % requesters) % threads == t] for t in range(threads)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for future in [pool.submit(fill_share, share) for share in shares]:
            future.result()
    return time.perf_counter() - started


def fill(args: argparse.Namespace, rng: random.Random) -> tuple[list[WorkerSpec], float]:
    """Requesters and queued requests through chat.services.create_text.text_request_create (the same rows a
    POST /generate/text/async makes, without the HTTP round trip); worker owners.
    Returns the worker specs and the fill's seconds."""
    from accounts.models import HordeUser
    from accounts.services import user_create
    from chat.services.create_text import text_request_create

    models = model_names(args.models)
    requesters = []
    for i in range(args.requesters):
        user, _ = user_create(username=f"bench-requester-{i}", kudos=rng.choice([10_000, 100_000, 1_000_000]))
        requesters.append(user)
    HordeUser.objects.filter(pk__in=[u.pk for u in requesters]).update(concurrency=args.requests + 100)
    for user in requesters:
        user.refresh_from_db()

    specs = [(requesters[i % len(requesters)], text_request_input(rng, i, models)) for i in range(args.requests)]

    def create(spec: tuple) -> None:
        user, data = spec
        text_request_create(user=user, data=data, client_agent="bench:1:text_queue", ip_address="127.0.0.1")

    fill_seconds = fill_in_threads(specs, create, requesters=len(requesters), threads=args.fill_threads)

    workers = []
    for i in range(args.workers):
        _, api_key = user_create(username=f"bench-owner-{i}")
        # Most workers serve popular models; every model is served by someone.
        served = {models[i % args.models]}
        for _ in range(rng.randint(0, 2)):
            served.add(models[min(int(rng.paretovariate(1.2)) - 1, args.models - 1)])
        workers.append(
            WorkerSpec(
                name=f"bench-worker-{i:03d}",
                api_key=api_key,
                models=sorted(served),
                max_length=rng.choice([256, 512, 512, 1024]),
                max_context_length=rng.choice([2048, 4096, 8192, 8192]),
                amount=rng.choice([1, 1, 1, 2]),
            )
        )
    return workers, fill_seconds


def queued_ids(limit: int = 5000) -> list[str]:
    from chat.selectors.queue import waiting_requests

    return [str(pk) for pk in waiting_requests().values_list("id", flat=True)[:limit]]


def queue_depth() -> int:
    from chat.selectors.queue import waiting_requests

    return waiting_requests().count()


def analyze() -> None:
    """ANALYZE after a fill, as autovacuum would do in production; the fill's connection closed."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    connection.close()


# --- The load generator -------------------------------------------------------------------------


class RawResponse:
    def __init__(self, status_code: int, content: bytes):
        self.status_code = status_code
        self.content = content

    def json(self):
        return json.loads(self.content)

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise RuntimeError(f"HTTP {self.status_code}: {self.content[:200]!r}")


class RawHTTPClient:
    """Keep-alive HTTP/1.1 connections over asyncio streams, at most `limit` open. The load
    generator shares the machine's cores with daphne and PostgreSQL; httpx spends 2-3 ms of CPU
    per request, this about a tenth of that, so the server's figures are less its client's."""

    def __init__(self, host: str, port: int, limit: int, timeout: float = 60.0):
        self.host, self.port, self.timeout = host, port, timeout
        self.gate = asyncio.Semaphore(limit)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def __aenter__(self) -> RawHTTPClient:
        return self

    async def __aexit__(self, *exc) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()

    async def post(self, url: str, **kw) -> RawResponse:
        return await self.request("POST", url, **kw)

    async def request(self, method: str, url: str, *, json: object = None, headers: dict | None = None) -> RawResponse:
        async with self.gate:
            conn = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
            try:
                response, keep = await asyncio.wait_for(self._exchange(conn, method, url, json, headers), self.timeout)
            except BaseException:
                conn[1].close()
                raise
            if keep:
                self.idle.append(conn)
            else:
                conn[1].close()
            return response

    async def _exchange(self, conn, method: str, url: str, body_json: object, headers: dict | None):
        reader, writer = conn
        body = b"" if body_json is None else _json_dumps(body_json).encode()
        head = [f"{method} {url} HTTP/1.1", f"Host: {self.host}:{self.port}", "Accept: */*"]
        if body_json is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        raw_head = await reader.readuntil(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip()
        if "content-length" in fields:
            content = await reader.readexactly(int(fields["content-length"]))
        elif fields.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunks.append(await reader.readexactly(size + 2))
                if size == 0:
                    break
            content = b"".join(c[:-2] for c in chunks)
        else:
            content = await reader.read()
            return RawResponse(status, content), False
        return RawResponse(status, content), fields.get("connection", "").lower() != "close"


def _json_dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


# --- Measurement --------------------------------------------------------------------------------

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds_by_process(server_pid: int | None) -> dict[str, float]:
    """CPU seconds (user + system) so far of daphne (its process group and, with more than one web
    process, the launcher's children), PostgreSQL's processes, Redis and this client, from /proc
    (Linux; empty elsewhere). Sampled around each phase, the differences say where each request's
    CPU went on this machine."""
    totals: dict[str, float] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return totals
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        ppid, pgid = int(fields[1]), int(fields[2])
        if int(entry.name) == os.getpid():
            group = "client"
        elif server_pid is not None and server_pid in (pgid, ppid):  # ppid: HORDE_WEB_PROCESSES > 1
            group = "daphne"
        elif cmdline.startswith("postgres") or "postgres:" in cmdline:
            group = "postgres"
        elif "redis-server" in cmdline:
            group = "redis"
        else:
            continue
        totals[group] = totals.get(group, 0.0) + seconds
    return totals


@dataclass
class PhaseResult:
    name: str
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # of the phase's measured route
    other_latencies: list[float] = field(default_factory=list)  # submits, in the pop phase
    lateness: list[float] = field(default_factory=list)  # sends behind their due time, offered load
    errors: dict[str, int] = field(default_factory=dict)
    jobs: int = 0
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per process group

    def error(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1

    def round_line(self, round_number: int, label: str, extra: str = "") -> str:
        """The phase's line in a bench's progress output: its rate, p50 and p95, and its errors."""
        rate = len(self.latencies) / self.seconds if self.seconds else 0.0
        errors = f", errors {self.errors}" if self.errors else ""
        return (
            f"  round {round_number} {label:11s} {rate:8.1f} req/s  p50 {pct(self.latencies, 50) * 1000:7.2f} ms  "
            f"p95 {pct(self.latencies, 95) * 1000:7.2f} ms{extra}{errors}"
        )

    def merge(self, other: PhaseResult) -> None:
        self.seconds += other.seconds
        self.latencies += other.latencies
        self.other_latencies += other.other_latencies
        self.lateness += other.lateness
        self.jobs += other.jobs
        for k, v in other.errors.items():
            self.errors[k] = self.errors.get(k, 0) + v
        for k, v in other.cpu.items():
            self.cpu[k] = self.cpu.get(k, 0.0) + v


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def pop_body(w: WorkerSpec) -> dict:
    return {
        "name": w.name,
        "models": w.models,
        "max_length": w.max_length,
        "max_context_length": w.max_context_length,
        "amount": w.amount,
        "threads": 1,
        "bridge_agent": VALIDATED_BRIDGE,
        "nsfw": False,
        "softprompts": [],
        "priority_usernames": [],
    }


async def timed(client, method: str, url: str, result: PhaseResult, bucket: list[float], **kw):
    t0 = time.perf_counter()
    try:
        resp = await client.request(method, url, **kw)
    except Exception as exc:  # noqa: BLE001  (counted, the phase goes on)
        result.error(type(exc).__name__)
        return None
    bucket.append(time.perf_counter() - t0)
    if resp.status_code >= 400:
        result.error(f"HTTP {resp.status_code}")
        return None
    return resp


async def phase_gets(
    client, name: str, seconds: float, concurrency: int, path: Callable[[], str]
) -> PhaseResult:
    """`concurrency` loops of GET `path()` for `seconds`: the heartbeat's and the status polls' phases."""
    result = PhaseResult(name)
    deadline = time.perf_counter() + seconds

    async def loop():
        while time.perf_counter() < deadline:
            await timed(client, "GET", path(), result, result.latencies)

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    result.seconds = time.perf_counter() - t0
    return result


async def phase_offered(client, name: str, seconds: float, rate: float, path: Callable[[], str]) -> PhaseResult:
    """GET `path()` at a fixed `rate` for `seconds`, whatever the answers' pace (an open loop): each
    request is sent when it is due, without waiting for an earlier answer, and timed from its send.
    `lateness` records how late each send was against its due time (the client's timer rounds to a
    millisecond; more than that means the client fell behind and the figures are the client's)."""
    result = PhaseResult(name)
    sent: list[asyncio.Task] = []
    start = time.perf_counter()
    count = int(rate * seconds)

    async def one(due: float) -> None:
        t0 = time.perf_counter()
        result.lateness.append(t0 - due)
        try:
            response = await client.request("GET", path())
        except Exception as exc:  # noqa: BLE001  (counted, the phase goes on)
            result.error(type(exc).__name__)
            return
        result.latencies.append(time.perf_counter() - t0)
        if response.status_code >= 400:
            result.error(f"HTTP {response.status_code}")

    for i in range(count):
        due = start + i / rate
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        sent.append(asyncio.ensure_future(one(due)))
    await asyncio.gather(*sent)
    result.seconds = time.perf_counter() - start
    return result


def _offered_loads(value: str) -> list[float]:
    return [float(part) for part in value.split(",") if part.strip()]


async def measure_offered(
    args: argparse.Namespace, status_rps: float, rng: random.Random
) -> list[tuple[float, float, PhaseResult, PhaseResult]]:
    """At each offered load: (fraction, rate, heartbeat, status), each route sent at that rate in
    two halves, heartbeat, status, status, heartbeat, so that a drift of the box falls on both."""
    from asgiref.sync import sync_to_async

    loads = _offered_loads(args.offered_loads)
    if not loads or not status_rps:
        return []
    ids = await sync_to_async(queued_ids)()
    half = args.offered_seconds / 2
    rows = []
    async with RawHTTPClient("127.0.0.1", args.port, limit=512) as client:
        # Opens the connections the highest rate needs, so that no measured request pays a connect.
        await phase_offered(client, "warm-up", 1.0, max(loads) * status_rps, lambda: "/api/v2/status/heartbeat")
        for fraction in loads:
            rate = fraction * status_rps
            results = {"heartbeat": PhaseResult("heartbeat"), "status": PhaseResult("status")}
            for name in ("heartbeat", "status", "status", "heartbeat"):
                if name == "heartbeat":
                    res = await phase_offered(client, name, half, rate, lambda: "/api/v2/status/heartbeat")
                else:
                    res = await phase_offered(
                        client, name, half, rate, lambda: f"/api/v2/generate/text/status/{rng.choice(ids)}"
                    )
                results[name].merge(res)
            hb, st = results["heartbeat"], results["status"]
            print(
                f"  offered {fraction:.2f} x status ({rate:.0f} req/s): heartbeat p95 {pct(hb.latencies, 95) * 1000:.2f} ms, "
                f"status p95 {pct(st.latencies, 95) * 1000:.2f} ms; sends late p99 "
                f"{pct(hb.lateness + st.lateness, 99) * 1000:.2f} ms",
                flush=True,
            )
            rows.append((fraction, rate, hb, st))
    return rows


async def phase_heartbeat(client, seconds: float, concurrency: int) -> PhaseResult:
    return await phase_gets(client, "heartbeat", seconds, concurrency, lambda: "/api/v2/status/heartbeat")


async def phase_status(
    client, seconds: float, concurrency: int, ids: list[str], rng: random.Random
) -> PhaseResult:
    return await phase_gets(
        client, "status", seconds, concurrency, lambda: f"/api/v2/generate/text/status/{rng.choice(ids)}"
    )


async def phase_pop(
    client, seconds: float, concurrency: int, workers: list[WorkerSpec], *, submit: bool = True
) -> PhaseResult:
    """Every worker loops pop -> submit (with `submit` false, pop alone: the jobs it takes stay in
    flight, and `jobs` counts the pops that handed out work); a semaphore keeps `concurrency`
    requests in flight."""
    result = PhaseResult("pop" if submit else "pop-alone")
    deadline = time.perf_counter() + seconds
    gate = asyncio.Semaphore(concurrency)

    async def worker_loop(w: WorkerSpec):
        headers = {"apikey": w.api_key, "Client-Agent": "bench:1:text_queue"}
        body = pop_body(w)
        while time.perf_counter() < deadline:
            async with gate:
                resp = await timed(
                    client, "POST", "/api/v2/generate/text/pop", result, result.latencies, json=body, headers=headers
                )
            ids = (resp.json().get("ids") or []) if resp is not None else []
            if not submit:
                result.jobs += bool(ids)
                continue
            for gen_id in ids:
                result.jobs += 1
                async with gate:
                    await timed(
                        client,
                        "POST",
                        "/api/v2/generate/text/submit",
                        result,
                        result.other_latencies,
                        headers=headers,
                        json={
                            "id": gen_id,
                            "generation": "The bench worker wrote this. " * 8,
                            "state": "ok",
                            "seed": 1,
                            "gen_metadata": [],
                        },
                    )

    t0 = time.perf_counter()
    await asyncio.gather(*(worker_loop(w) for w in workers))
    result.seconds = time.perf_counter() - t0
    return result


async def register_workers(client, workers: list[WorkerSpec], concurrency: int) -> None:
    """Each worker's first pop registers it (as upstream); its job, if any, is submitted."""
    gate = asyncio.Semaphore(concurrency)

    async def first(w: WorkerSpec):
        headers = {"apikey": w.api_key}
        async with gate:
            resp = await client.post("/api/v2/generate/text/pop", json=pop_body(w), headers=headers)
        resp.raise_for_status()
        for gen_id in resp.json().get("ids") or []:
            async with gate:
                r = await client.post(
                    "/api/v2/generate/text/submit",
                    headers=headers,
                    json={
                        "id": gen_id,
                        "generation": "warm-up",
                        "state": "ok",
                        "seed": 1,
                        "gen_metadata": [],
                    },
                )
            r.raise_for_status()

    await asyncio.gather(*(first(w) for w in workers))


def phase_order(args: argparse.Namespace) -> list[str]:
    """The phases to run, in PHASES' order (heartbeat, the baseline, always)."""
    return [name for name in PHASES if name == "heartbeat" or name in args.phases]


async def measure(
    args: argparse.Namespace, workers: list[WorkerSpec], rng: random.Random, server_pid: int | None = None
) -> dict[str, PhaseResult]:
    import httpx
    from asgiref.sync import sync_to_async

    base = f"http://127.0.0.1:{args.port}"
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    if args.client == "raw":
        client_context = RawHTTPClient("127.0.0.1", args.port, args.concurrency)
    else:
        client_context = httpx.AsyncClient(base_url=base, limits=limits, timeout=60)
    order = phase_order(args)
    totals = {name: PhaseResult(name) for name in PHASES}
    per_phase = args.duration / (len(order) * args.rounds)
    async with client_context as client:
        print(f"registering {len(workers)} workers (first pop each) and warming up ...", flush=True)
        await register_workers(client, workers, args.concurrency)
        await phase_heartbeat(client, 2.0, args.concurrency)
        for r in range(args.rounds):
            rotated = order[r % len(order) :] + order[: r % len(order)]
            for name in rotated:
                ids = await sync_to_async(queued_ids)() if name == "status" else []
                before = cpu_seconds_by_process(server_pid)
                if name == "heartbeat":
                    res = await phase_heartbeat(client, per_phase, args.concurrency)
                elif name == "pop":
                    res = await phase_pop(client, per_phase, args.concurrency, workers)
                elif name == "pop-alone":
                    res = await phase_pop(client, per_phase, args.concurrency, workers, submit=False)
                else:
                    res = await phase_status(client, per_phase, args.concurrency, ids, rng)
                after = cpu_seconds_by_process(server_pid)
                res.cpu = {k: after[k] - before.get(k, 0.0) for k in after}
                extra = {"pop": f", {res.jobs} jobs submitted", "pop-alone": f", {res.jobs} handed work"}.get(name, "")
                print(res.round_line(r + 1, name, extra), flush=True)
                totals[name].merge(res)
    return totals


# --- Report -------------------------------------------------------------------------------------


def report(
    args,
    totals: dict[str, PhaseResult],
    fill_seconds: float,
    depth_before: int,
    depth_after: int,
    offered: Sequence[tuple[float, float, PhaseResult, PhaseResult]] = (),
) -> str:
    hb, pop, alone, st = totals["heartbeat"], totals["pop"], totals["pop-alone"], totals["status"]
    ran = phase_order(args)
    phases = len(ran)

    def rps(r: PhaseResult) -> float:
        return len(r.latencies) / r.seconds if r.seconds else 0.0

    def ms(v: float) -> str:
        return f"{v * 1000:.1f}"

    hb_rps, pop_rps, st_rps = rps(hb), rps(pop), rps(st)
    hb_p95, pop_p95, st_p95 = pct(hb.latencies, 95), pct(pop.latencies, 95), pct(st.latencies, 95)
    pop_all_rps = (len(pop.latencies) + len(pop.other_latencies)) / pop.seconds if pop.seconds else 0.0
    lines = [
        "",
        f"Text queue benchmark: {args.requests} requests over {args.models} models, {args.workers} workers, "
        f"{args.concurrency} in flight, {args.rounds} rounds x {phases} phases x {args.duration / (phases * args.rounds):.1f}s, "
        f"pooled PostgreSQL connections, {'no ANALYZE' if args.no_analyze else 'ANALYZE'} after the fill, "
        f"{args.client} client" + (f", server env {' '.join(args.server_env)}" if args.server_env else ""),
        f"fill: {fill_seconds:.1f}s through text_request_create; queue depth {depth_before} before the "
        f"measured phases, {depth_after} after",
        "",
        "| route | requests | req/s | p50 ms | p95 ms | errors |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, r, others in (
        ("heartbeat  GET /status/heartbeat", hb, None),
        ("pop        POST /generate/text/pop", pop, None),
        ("submit     POST /generate/text/submit (pop phase)", pop, pop.other_latencies),
        ("pop alone  POST /generate/text/pop (no submits)", alone, None),
        ("status     GET /generate/text/status/<id>", st, None),
    ):
        if r.name not in ran:
            continue
        lat = others if others is not None else r.latencies
        count = len(lat)
        rate = count / r.seconds if r.seconds else 0
        errors = ", ".join(f"{k}: {v}" for k, v in r.errors.items()) if others is None and r.errors else ""
        lines.append(
            f"| {label} | {count} | {rate:.1f} | {ms(pct(lat, 50))} | {ms(pct(lat, 95))} | {errors} |"
        )
    lines.append("")
    if "pop" in ran:
        lines.append(
            f"pop phase: {pop.jobs} jobs popped and submitted ({pop.jobs / pop.seconds if pop.seconds else 0:.1f} jobs/s), "
            f"{pop_all_rps:.1f} req/s pop+submit together"
        )
    if "pop-alone" in ran:
        lines.append(f"pop-alone phase: {alone.jobs} of {len(alone.latencies)} pops handed out work")
    lines += [
        "",
        "CPU per request (ms, user + system, from /proc; the pop phase counts pops and submits):",
        "",
        "| phase | daphne | postgres | redis | client |",
        "|---|---:|---:|---:|---:|",
    ]
    for r, count in (
        (hb, len(hb.latencies)),
        (pop, len(pop.latencies) + len(pop.other_latencies)),
        (alone, len(alone.latencies)),
        (st, len(st.latencies)),
    ):
        if r.name not in ran:
            continue
        cells = [f"{r.cpu.get(g, 0.0) / count * 1000:.2f}" if count and r.cpu else "-" for g in ("daphne", "postgres", "redis", "client")]
        busy = [f"{r.cpu.get(g, 0.0) / r.seconds * 100:.0f}%" if r.seconds and r.cpu else "-" for g in ("daphne", "postgres", "redis", "client")]
        lines.append(f"| {r.name} | " + " | ".join(f"{c} ({b})" for c, b in zip(cells, busy, strict=True)) + " |")
    lines += [
        "",
        "(in parentheses: share of one core over the phase)",
        "",
        "| ratio | measured | goal | met |",
        "|---|---:|---:|---|",
    ]
    pop_ratio = pop_rps / hb_rps if hb_rps else 0.0
    # Only the pops that handed out work: an empty pop is answered from the process's memory once
    # its worker's models run dry, and would count a cheaper request (ADR 0049).
    alone_ratio = alone.jobs / alone.seconds / hb_rps if hb_rps and alone.seconds else 0.0
    pop_p95_ratio = pop_p95 / hb_p95 if hb_p95 else float("inf")
    st_ratio = st_p95 / hb_p95 if hb_p95 else float("inf")
    ratios = (
        ("pop", f"| pop req/s / heartbeat req/s | {pop_ratio:.3f} | >= 0.5 | {'yes' if pop_ratio >= 0.5 else 'NO'} |"),
        ("pop-alone", f"| pops handing out work alone, req/s / heartbeat req/s | {alone_ratio:.3f} | >= 0.5 | {'yes' if alone_ratio >= 0.5 else 'NO'} |"),
        ("pop", f"| pop p95 / heartbeat p95 | {pop_p95_ratio:.1f} | (reported) | |"),
        ("status", f"| status p95 / heartbeat p95 | {st_ratio:.2f} | <= 2.0 | {'yes' if st_ratio <= 2.0 else 'NO'} |"),
        ("status", f"| status req/s / heartbeat req/s | {st_rps / hb_rps if hb_rps else 0:.3f} | (reported) | |"),
    )
    lines += [line for phase, line in ratios if phase in ran]
    for fraction, _rate, o_hb, o_st in offered:
        ratio = pct(o_st.latencies, 95) / pct(o_hb.latencies, 95)
        lines.append(
            f"| status p95 / heartbeat p95, both offered {fraction:.2f}x the status rate | {ratio:.2f} | <= 2.0 | "
            f"{'yes' if ratio <= 2.0 else 'NO'} |"
        )
    if offered:
        lines += [
            "",
            "Offered load (open loop, ADR 0053): each route sent at the same fixed rate, each request sent when "
            "due and timed from its send:",
            "",
            "| offered | req/s | heartbeat p50 / p95 / p99 ms | status p50 / p95 / p99 ms | sends late p99 ms | errors |",
            "|---|---:|---|---|---:|---|",
        ]
        for fraction, rate, o_hb, o_st in offered:
            cells = [
                " / ".join(f"{pct(r.latencies, q) * 1000:.2f}" for q in (50, 95, 99)) for r in (o_hb, o_st)
            ]
            errors = ", ".join(f"{k}: {v}" for r in (o_hb, o_st) for k, v in r.errors.items())
            late = pct(o_hb.lateness + o_st.lateness, 99) * 1000
            lines.append(f"| {fraction:.2f}x status | {rate:.0f} | {cells[0]} | {cells[1]} | {late:.2f} | {errors} |")
    return "\n".join(lines)


# --- Main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    env = bench_env(args)
    prepare(env)

    server = Server(args.port, env, ROOT / "var" / "bench-daphne.log")
    with serving(server):
        print(f"fill: {args.requests} requests over {args.models} models ...", flush=True)
        workers, fill_seconds = fill(args, rng)
        if not args.no_analyze:
            analyze()
        server.wait_ready()
        depth_before = queue_depth()
        from django.db import connection

        connection.close()
        totals = asyncio.run(measure(args, workers, rng, server.proc.pid))
        offered = []
        if "status" in args.phases:
            status = totals["status"]
            status_rps = len(status.latencies) / status.seconds if status.seconds else 0.0
            offered = asyncio.run(measure_offered(args, status_rps, rng))
        depth_after = queue_depth()
        print(report(args, totals, fill_seconds, depth_before, depth_after, offered))
        if args.keep_server:
            server.leave_running()
    return 0


if __name__ == "__main__":
    sys.exit(main())
