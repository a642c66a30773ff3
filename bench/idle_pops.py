"""Idle pops benchmark (ADR 0051): workers whose models have nothing queued, popping while requests
for other models keep arriving, against the heartbeat, in one run.

Fills N queued text requests over M models (bench/text_queue.py's fill), registers W idle workers,
each serving a model nobody asks for, starts a real daphne web process and, for the whole
measurement, creates --feed-rate requests a second for the queued models from this process (through
chat.services.create_text.text_request_create: the rows and the queue's Redis bumps another web
process's POST /generate/text/async makes). Then it alternates two measured phases at the same
client concurrency:

  heartbeat  GET  /api/v2/status/heartbeat
  idle       the idle workers loop on POST /api/v2/generate/text/pop; every answer is empty
  held       the idle workers' pops carry `wait` (the reference worker's long poll, ADR 0024) and
             are held by the web process, while the heartbeat loop runs as in its own phase

and prints the idle pops' rate against the heartbeat's, what each cost daphne and PostgreSQL, and
the heartbeat's rate while the idle workers' pops are held against its rate alone.
An empty pop is answered from the web process's memory while nothing joined its worker's queue
lists; before ADR 0051 any addition to the queue ended every such answer, so each idle pop after
one walked the queue and counted its skipped requests, and every held pop was popped again.

    .venv/bin/python bench/idle_pops.py [--requests 10000 --workers 100 --feed-rate 20 --duration 40]

Its own database (default postgres://postgres@127.0.0.1:5432/horde_bench_idle, recreated) and
Redis database (redis://127.0.0.1:6379/6, flushed); port 8805.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import threading
import time

from common import ROOT, Server, prepare, serving
from text_queue import (  # the shared bench machinery
    PhaseResult,
    RawHTTPClient,
    WorkerSpec,
    analyze,
    bench_env,
    cpu_seconds_by_process,
    fill,
    model_names,
    pct,
    phase_heartbeat,
    phase_pop,
    pop_body,
    register_workers,
    timed,
)

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/horde_bench_idle"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/6"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000, help="queued text requests to fill (default 10000)")
    p.add_argument("--models", type=int, default=50, help="distinct queued model names (default 50)")
    p.add_argument("--workers", type=int, default=100, help="idle workers popping (default 100)")
    p.add_argument("--requesters", type=int, default=50, help="requesting users (default 50)")
    p.add_argument("--feed-rate", type=float, default=20.0, help="new requests a second for queued models (default 20)")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds, split over rounds x 3 phases")
    p.add_argument("--rounds", type=int, default=4, help="rounds of (heartbeat, idle, held), order rotated (default 4)")
    p.add_argument("--concurrency", type=int, default=12, help="requests in flight, every phase (default 12)")
    p.add_argument("--wait", type=int, default=10, help="the held pops' `wait`, seconds (default 10)")
    p.add_argument("--fill-threads", type=int, default=4, help="threads filling the queue (default 4)")
    p.add_argument("--port", type=int, default=8805, help="daphne port (default 8805)")
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--database-url", default=os.environ.get("BENCH_IDLE_DATABASE_URL", DEFAULT_DATABASE_URL))
    p.add_argument("--redis-url", default=os.environ.get("BENCH_IDLE_REDIS_URL", DEFAULT_REDIS_URL))
    p.add_argument(
        "--server-env", action="append", default=[], metavar="NAME=VALUE",
        help="extra environment for daphne (repeatable), e.g. HORDE_WEB_THREADS=8",
    )
    return p.parse_args(argv)


def idle_workers(count: int) -> list[WorkerSpec]:
    """Workers each serving a model no request names."""
    from accounts.services import user_create

    workers = []
    for i in range(count):
        _, api_key = user_create(username=f"bench-idle-owner-{i}")
        workers.append(
            WorkerSpec(
                name=f"bench-idle-worker-{i:03d}",
                api_key=api_key,
                models=[f"koboldcpp/bench-idle-{i:03d}"],
                max_length=512,
                max_context_length=4096,
                amount=1,
            )
        )
    return workers


class Feeder(threading.Thread):
    """New requests for the queued models at a steady rate, as other web processes would queue them."""

    def __init__(self, rate: float, models: list[str], rng: random.Random):
        super().__init__(name="bench-feeder", daemon=True)
        self.rate, self.models, self.rng = rate, models, rng
        self.stopped = threading.Event()
        self.created = 0

    def run(self) -> None:
        from django.db import connection

        from accounts.models import HordeUser
        from chat.services.create_text import TextRequestInput, text_request_create

        requesters = list(HordeUser.objects.filter(username__startswith="bench-requester-"))
        next_at = time.monotonic()
        try:
            while not self.stopped.is_set():
                text_request_create(
                    user=requesters[self.created % len(requesters)],
                    data=TextRequestInput(
                        prompt="Fed while the idle workers pop. " * 10,
                        params={"temperature": 0.7},
                        n=1,
                        max_length=128,
                        max_context_length=2048,
                        models=[self.rng.choice(self.models)],
                    ),
                    client_agent="bench:1:idle_pops",
                    ip_address="127.0.0.1",
                )
                self.created += 1
                next_at += 1.0 / self.rate
                self.stopped.wait(max(0.0, next_at - time.monotonic()))
        finally:
            connection.close()


async def phase_held(args: argparse.Namespace, seconds: float, workers: list[WorkerSpec]) -> PhaseResult:
    """The heartbeat loop while every idle worker's pop is held (`wait`), each on its own connection."""
    held = PhaseResult("held pops")
    deadline = time.perf_counter() + seconds

    async def hold(client: RawHTTPClient, w: WorkerSpec) -> None:
        headers = {"apikey": w.api_key, "Client-Agent": "bench:1:idle_pops"}
        body = {**pop_body(w), "wait": args.wait}
        while time.perf_counter() < deadline:
            await timed(client, "POST", "/api/v2/generate/text/pop", held, held.latencies, json=body, headers=headers)

    async with RawHTTPClient("127.0.0.1", args.port, len(workers)) as pops:
        holders = [asyncio.ensure_future(hold(pops, w)) for w in workers]
        await asyncio.sleep(0.5)  # every pop held
        async with RawHTTPClient("127.0.0.1", args.port, args.concurrency) as client:
            result = await phase_heartbeat(client, max(0.0, deadline - time.perf_counter()), args.concurrency)
        for holder in holders:  # the held pops left go with their connections
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    result.name = "held"
    result.jobs = len(held.latencies)
    return result


async def measure(args: argparse.Namespace, workers: list[WorkerSpec], server_pid: int) -> dict[str, PhaseResult]:
    phases = ("heartbeat", "idle", "held")
    totals = {name: PhaseResult(name) for name in phases}
    per_phase = args.duration / (len(phases) * args.rounds)
    async with RawHTTPClient("127.0.0.1", args.port, args.concurrency) as client:
        print(f"registering {len(workers)} idle workers (first pop each) ...", flush=True)
        await register_workers(client, workers, args.concurrency)
        await phase_pop(client, 2.0, args.concurrency, workers, submit=False)  # warm: answers remembered
        for r in range(args.rounds):
            for name in phases[r % len(phases):] + phases[: r % len(phases)]:
                before = cpu_seconds_by_process(server_pid)
                if name == "heartbeat":
                    result = await phase_heartbeat(client, per_phase, args.concurrency)
                elif name == "held":
                    result = await phase_held(args, per_phase, workers)
                else:
                    result = await phase_pop(client, per_phase, args.concurrency, workers, submit=False)
                    result.name = "idle"
                after = cpu_seconds_by_process(server_pid)
                result.cpu = {k: after[k] - before.get(k, 0.0) for k in after}
                print(result.round_line(r + 1, name), flush=True)
                totals[name].merge(result)
    return totals


def report(args: argparse.Namespace, totals: dict[str, PhaseResult], fed: int, handed_out: int) -> str:
    heartbeat, idle, held = totals["heartbeat"], totals["idle"], totals["held"]

    def rate(r: PhaseResult) -> float:
        return len(r.latencies) / r.seconds if r.seconds else 0.0

    lines = [
        "",
        f"Idle pops: {args.requests} queued over {args.models} models, {args.workers} idle workers, "
        f"{fed} requests fed ({args.feed_rate:g}/s), {args.concurrency} in flight, {args.rounds} rounds",
        "",
        "| phase | requests | req/s | p50 ms | p95 ms | daphne ms a request | PostgreSQL ms a request |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (heartbeat, idle, held):
        count = len(r.latencies)
        cpu = [f"{r.cpu.get(g, 0.0) / count * 1000:.2f}" if count else "-" for g in ("daphne", "postgres")]
        lines.append(
            f"| {r.name} | {count} | {rate(r):.1f} | {pct(r.latencies, 50) * 1000:.1f} | "
            f"{pct(r.latencies, 95) * 1000:.1f} | {cpu[0]} | {cpu[1]} |"
        )
    ratio = rate(idle) / rate(heartbeat) if rate(heartbeat) else 0.0
    kept = rate(held) / rate(heartbeat) if rate(heartbeat) else 0.0
    lines += [
        "",
        "(the held row is the heartbeat loop while the idle workers' pops are held; its CPU per",
        " request counts everything daphne did meanwhile, held pops included)",
        "",
        f"idle pop req/s / heartbeat req/s: {ratio:.3f}",
        f"heartbeat req/s with {args.workers} pops held (wait {args.wait} s) / alone: {kept:.3f}",
        f"held pops answered: {held.jobs}",
    ]
    if handed_out:
        lines.append(f"WARNING: {handed_out} idle pops handed out work (the idle models were asked for)")
    if idle.errors or heartbeat.errors:
        lines.append(f"errors: idle {idle.errors}, heartbeat {heartbeat.errors}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    env = bench_env(args)
    prepare(env)
    server = Server(args.port, env, ROOT / "var" / "bench-idle-daphne.log")
    feeder = Feeder(args.feed_rate, model_names(args.models), random.Random(args.seed + 1))

    try:
        with serving(server):
            print(f"fill: {args.requests} requests over {args.models} models ...", flush=True)
            fill_args = argparse.Namespace(
                requests=args.requests, models=args.models, requesters=args.requesters,
                fill_threads=args.fill_threads, workers=0,
            )
            fill(fill_args, rng)
            workers = idle_workers(args.workers)
            analyze()
            server.wait_ready()
            feeder.start()
            totals = asyncio.run(measure(args, workers, server.proc.pid))
            feeder.stopped.set()
            feeder.join(10)
            print(report(args, totals, feeder.created, totals["idle"].jobs))
    finally:
        feeder.stopped.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
