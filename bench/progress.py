"""Progress route benchmark (issue 14): POST /api/v2/generate/text/progress at 1,000 concurrent
streaming jobs, against the heartbeat, in one run.

Registers W chat workers (trusted owners) on a real daphne web process, queues J streamed chat
requests (stream: true, through chat.services.create_chat.chat_request_create, the rows the chat route
makes), has the workers pop them all (each pop writes the job's stream lease), then alternates two
measured phases at the same client concurrency:

  heartbeat  GET  /api/v2/status/heartbeat
  progress   POST /api/v2/generate/text/progress, round robin over every job (one post in flight
             per job, seq counting up), a few tokens of content per post; most posts extend their
             job's lease, so they also write the generation's deadline to PostgreSQL

and prints throughput and p50/p95 latency of each and the ratio the issue sets as its goal:
progress req/s >= 0.5x heartbeat req/s.

    .venv/bin/python bench/progress.py [--jobs 1000 --workers 100 --duration 40]

It reuses bench/text_queue.py's machinery with its own database (default
postgres://postgres@127.0.0.1:5432/horde_bench_progress, recreated) and Redis database
(redis://127.0.0.1:6379/12, flushed). The leases and streams live on the chat signal database (7)
of that Redis server, as in production; they expire on their own (at most 15 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import deque
from dataclasses import dataclass

from common import ROOT, Server, prepare, serving
from text_queue import (  # the shared bench machinery
    VALIDATED_BRIDGE,
    PhaseResult,
    RawHTTPClient,
    bench_env,
    cpu_seconds_by_process,
    pct,
    phase_heartbeat,
    timed,
)

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/horde_bench_progress"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/12"
MODEL = "koboldcpp/bench-stream-8B"
CLIENT_AGENT = "bench:1:progress"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=1000, help="streaming jobs in flight (default 1000)")
    p.add_argument("--workers", type=int, default=100, help="chat workers holding them (default 100)")
    p.add_argument("--duration", type=float, default=40.0, help="measured seconds, split over rounds x 2 phases")
    p.add_argument("--rounds", type=int, default=4, help="rounds of (heartbeat, progress), order rotated (default 4)")
    p.add_argument("--concurrency", type=int, default=12, help="requests in flight, both phases (default 12)")
    p.add_argument("--port", type=int, default=8789, help="daphne port (default 8789)")
    p.add_argument("--database-url", default=os.environ.get("BENCH_PROGRESS_DATABASE_URL", DEFAULT_DATABASE_URL))
    p.add_argument("--redis-url", default=os.environ.get("BENCH_PROGRESS_REDIS_URL", DEFAULT_REDIS_URL))
    p.add_argument(
        "--server-env", action="append", default=[], metavar="NAME=VALUE",
        help="extra environment for daphne (repeatable), e.g. HORDE_WEB_THREADS=8",
    )
    return p.parse_args(argv)


@dataclass
class Job:
    id: str
    key: str
    seq: int = 0


def pop_body(name: str) -> dict:
    return {
        "name": name,
        "models": [MODEL],
        "max_length": 512,
        "max_context_length": 8192,
        "amount": 1,
        "threads": 1,
        "bridge_agent": VALIDATED_BRIDGE,
        "nsfw": False,
        "softprompts": [],
        "priority_usernames": [],
        "chat_jobs": True,
        "model_id": MODEL,
        "chat_features": ["prompt_overflow_refused", "tool_choice_enforced", "structured_output_enforced"],
        "chat_limits": {"max_context_length": 8192, "max_length": 1024},
        "image_transports": [],
    }


def make_owners(count: int) -> list[str]:
    from accounts.services import user_create

    return [user_create(username=f"bench-stream-owner-{i}", trusted=True)[1] for i in range(count)]


def fill(jobs: int) -> float:
    """`jobs` streamed chat requests from one requester, as the chat route stores them."""
    from accounts.models import HordeUser
    from accounts.services import user_create
    from chat.services.create_chat import chat_request_create
    from contract.chat_shapes import validate_chat_request

    user, _ = user_create(username="bench-stream-requester", kudos=10_000_000)
    HordeUser.objects.filter(pk=user.pk).update(concurrency=jobs + 100)
    user.refresh_from_db()
    started = time.perf_counter()
    for i in range(jobs):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Tell me story {i}."}],
            "max_tokens": 512,
            "stream": True,
        }
        chat_request_create(
            user=user, chat=validate_chat_request(body), client_agent=CLIENT_AGENT,
            ip_address="127.0.0.1",
        )
    return time.perf_counter() - started


async def pop_all(client, owners: list[str], jobs: int, concurrency: int) -> list[Job]:
    """Each worker pops until the queue is empty; every job carries the stream hint."""
    popped: list[Job] = []
    gate = asyncio.Semaphore(concurrency)

    async def worker(i: int, key: str):
        while len(popped) < jobs:
            async with gate:
                resp = await client.post("/api/v2/generate/text/pop", json=pop_body(f"stream-w{i}"), headers={"apikey": key})
            resp.raise_for_status()
            body = resp.json()
            if not body.get("id"):
                return
            assert body["payload"].get("stream_progress") is True, body["payload"]
            popped.append(Job(body["id"], key))

    await asyncio.gather(*(worker(i, key) for i, key in enumerate(owners)))
    return popped


async def phase_progress(client, seconds: float, concurrency: int, jobs: deque[Job]) -> PhaseResult:
    result = PhaseResult("progress")
    deadline = time.perf_counter() + seconds

    async def loop():
        while time.perf_counter() < deadline:
            job = jobs.popleft()  # one post in flight per job: the seq stays in order
            job.seq += 1
            body = {"id": job.id, "seq": job.seq, "delta": {"content": f" tok{job.seq} tok tok"}}
            resp = await timed(client, "POST", "/api/v2/generate/text/progress", result, result.latencies,
                               json=body, headers={"apikey": job.key})
            if resp is None:
                job.seq -= 1  # counted as an error; the job posts the same seq again later
            jobs.append(job)

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    result.seconds = time.perf_counter() - t0
    return result


async def measure(args, owners: list[str], server_pid: int) -> tuple[dict[str, PhaseResult], int]:
    totals = {name: PhaseResult(name) for name in ("heartbeat", "progress")}
    per_phase = args.duration / (2 * args.rounds)
    async with RawHTTPClient("127.0.0.1", args.port, args.concurrency) as client:
        for i, key in enumerate(owners):  # registration: the first pop of each worker
            (await client.post("/api/v2/generate/text/pop", json=pop_body(f"stream-w{i}"), headers={"apikey": key})).raise_for_status()
        from asgiref.sync import sync_to_async

        print(f"fill: {args.jobs} streamed chat requests ...", flush=True)
        fill_seconds = await sync_to_async(fill, thread_sensitive=True)(args.jobs)
        print(f"  filled in {fill_seconds:.1f}s; popping ...", flush=True)
        for _, writer in client.idle:  # the server closes keep-alive connections idle that long
            writer.close()
        client.idle.clear()
        jobs = deque(await pop_all(client, owners, args.jobs, args.concurrency))
        print(f"  {len(jobs)} streaming jobs in flight (leases written at pop)", flush=True)
        if len(jobs) < args.jobs:  # the figure is the route's rate at --jobs streaming jobs, or none
            raise SystemExit(f"only {len(jobs)} of {args.jobs} jobs popped: not measured")
        await phase_heartbeat(client, 2.0, args.concurrency)
        await phase_progress(client, 2.0, args.concurrency, jobs)
        order = ["heartbeat", "progress"]
        for r in range(args.rounds):
            for name in order[r % 2:] + order[: r % 2]:
                before = cpu_seconds_by_process(server_pid)
                if name == "heartbeat":
                    res = await phase_heartbeat(client, per_phase, args.concurrency)
                else:
                    res = await phase_progress(client, per_phase, args.concurrency, jobs)
                after = cpu_seconds_by_process(server_pid)
                res.cpu = {k: after[k] - before.get(k, 0.0) for k in after}
                print(res.round_line(r + 1, name), flush=True)
                totals[name].merge(res)
    return totals, len(jobs)


def report(args, totals: dict[str, PhaseResult], jobs: int) -> str:
    def rps(r: PhaseResult) -> float:
        return len(r.latencies) / r.seconds if r.seconds else 0.0

    lines = [
        "",
        f"progress bench: {jobs} streaming jobs, {args.workers} workers, concurrency {args.concurrency}, "
        f"{args.duration:.0f}s measured over {args.rounds} rounds",
        f"{'route':10s} {'requests':>9s} {'req/s':>9s} {'p50 ms':>8s} {'p95 ms':>8s} {'daphne ms/req':>14s} {'pg ms/req':>10s} errors",
    ]
    for name, r in totals.items():
        n = max(len(r.latencies), 1)
        lines.append(
            f"{name:10s} {len(r.latencies):9d} {rps(r):9.1f} {pct(r.latencies, 50) * 1000:8.2f} {pct(r.latencies, 95) * 1000:8.2f}"
            f" {r.cpu.get('daphne', 0) * 1000 / n:14.3f} {r.cpu.get('postgres', 0) * 1000 / n:10.3f} {r.errors or 0}"
        )
    ratio = rps(totals["progress"]) / rps(totals["heartbeat"]) if rps(totals["heartbeat"]) else float("nan")
    lines.append(f"progress req/s / heartbeat req/s = {ratio:.2f} (goal >= 0.5)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = bench_env(args)
    env.update(
        HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP="100000/second",
        HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP="100000/second",
        HORDE_CHAT_ADMISSION_ENABLED="true",
    )
    prepare(env)
    from django.db import connection

    server = Server(args.port, env, ROOT / "var" / "bench-progress-daphne.log")

    with serving(server):
        owners = make_owners(args.workers)
        connection.close()
        server.wait_ready()
        totals, jobs = asyncio.run(measure(args, owners, server.proc.pid))
        print(report(args, totals, jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
