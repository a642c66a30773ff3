"""Reference worker benchmark (issue 5): jobs per second one bridge sustains against an instant
backend, with the bridge's CPU seconds per job beside the web process's, in the same run.

    .venv/bin/python bench/bridge.py [--requests 1500 --threads 4 --duration 60]

1. Recreates the bench database (default postgres://postgres@127.0.0.1:5432/horde_bridge_bench;
   a sqlite:/// URL works too), flushes the Redis database (default /5), migrates.
2. Starts an instant OpenAI-compatible backend (bench/instant_backend.py: every chat completion
   answered at once with a fixed reply) and daphne.
3. Registers the worker by one pop with the bridge's declaration, then queues --requests chat
   requests through POST /api/v2/generate/chat/async (the web's CPU per request is reported).
4. Starts `python -m workers.bridge --backend <instant> --threads N --quiet` and lets it drain the
   queue. The window is measured from the 5% mark of finished generations to the 95% mark (or
   --duration seconds): jobs per second, and CPU seconds (utime+stime from /proc) of the bridge
   and of daphne per job. Goal: the bridge spends under a quarter of what the web spends per job.

The web's per-job CPU in the window is pop + submit (+ the bridge's idle pops), not request
creation, which is measured separately; so the ratio is conservative.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from common import PYTHON, ROOT, Server, create_user_key, prepare, server_env, serving, web_pids
from instant_backend import InstantBackend

MODEL = "bench/instant"
WORKER_NAME = "bench-bridge"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/horde_bridge_bench"))
    p.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/5"))
    p.add_argument("--port", type=int, default=8767)
    p.add_argument("--requests", type=int, default=1500, help="chat requests queued before the bridge starts")
    p.add_argument("--threads", type=int, default=4, help="the bridge's --threads")
    p.add_argument("--duration", type=float, default=60.0, help="longest measured window, seconds")
    p.add_argument("--fill-concurrency", type=int, default=8)
    return p.parse_args(argv)


def cpu_seconds(pid: int) -> float:
    """The process's CPU seconds with its live children's (the launcher's web processes, ADR 0046)."""
    total = 0.0
    for each in {pid, *web_pids(pid)}:
        fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return total


class DoneCounter:
    """Finished generations, read straight from the database (not through the web process)."""

    def __init__(self, database_url: str):
        self.url = database_url
        parts = urlparse(database_url)
        if parts.scheme.startswith("sqlite"):
            self.conn = sqlite3.connect(parts.path if not parts.path.startswith("//") else parts.path[1:])
            self.pg = False
        else:
            import psycopg

            self.conn = psycopg.connect(database_url.replace("postgres://", "postgresql://", 1), autocommit=True)
            self.pg = True

    def count(self) -> int:
        cur = self.conn.execute("SELECT count(*) FROM horde_generations WHERE state = 'ok'")
        return int(cur.fetchone()[0])


async def fill(url: str, key: str, count: int, concurrency: int) -> None:
    import httpx

    # best_effort: the instant backend is a generic OpenAI server, which declares no guarantee.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 32,
        "horde": {"conformance": "best_effort"},
    }
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"apikey": key}, timeout=60) as client:

        async def one() -> None:
            async with sem:
                response = await client.post("/api/v2/generate/chat/async", json=body)
                if response.status_code != 202:
                    raise SystemExit(f"chat/async answered {response.status_code}: {response.text}")

        await asyncio.gather(*(one() for _ in range(count)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import httpx

    from workers.bridge.backends import OpenAIBackend
    from workers.bridge.config import BridgeConfig
    from workers.bridge.worker import Bridge

    env = server_env(
        args.database_url,
        args.redis_url,
        HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP="100000/second",
        HORDE_DEFAULT_CONCURRENCY="1000000",  # users made now: the whole backlog queued by one requester
        HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP="10000000/minute",
        HORDE_API_KEY_RATE_LIMITS="100000/second",  # one requester key submits the whole load
    )
    prepare(env, django=False)
    worker_key = create_user_key(env, "bench-worker", "--trusted")
    requester_key = create_user_key(env, "bench-requester", "--kudos", "100000000")

    server = Server(args.port, env, ROOT / "var" / "bench-bridge-daphne.log")
    bridge_proc: subprocess.Popen | None = None
    url = f"http://127.0.0.1:{args.port}"
    with InstantBackend() as backend, serving(server):
        try:
            backend_url = backend.url
            server.wait_ready()
            assert server.proc is not None
            web_pid = server.proc.pid

            # Register the worker with the bridge's own declaration (one pop on an empty queue), so the
            # model is served when the requests are queued.
            config = BridgeConfig(horde_url=url, api_key=worker_key, worker_name=WORKER_NAME, backend=backend_url,
                                  horde_model=MODEL, threads=args.threads)
            registrar = Bridge(config, OpenAIBackend(backend_url), out=open(os.devnull, "w"))  # noqa: SIM115
            registrar.start()
            assert registrar.horde.pop(registrar.pop_body()).get("id") is None
            registrar.horde.close()

            cpu0, t0 = cpu_seconds(web_pid), time.monotonic()
            asyncio.run(fill(url, requester_key, args.requests, args.fill_concurrency))
            fill_seconds, fill_cpu = time.monotonic() - t0, cpu_seconds(web_pid) - cpu0
            print(f"queued {args.requests} chat requests in {fill_seconds:.1f} s "
                  f"(web CPU {1000 * fill_cpu / args.requests:.2f} ms per request)", flush=True)

            counter = DoneCounter(args.database_url)
            bridge_env = {**env, "BRIDGE_API_KEY": worker_key}
            bridge_proc = subprocess.Popen(
                [PYTHON, "-m", "workers.bridge", "--horde-url", url, "--backend", backend_url, "--name", WORKER_NAME,
                 "--horde-model", MODEL, "--threads", str(args.threads), "--quiet", "--pop-interval", "0.2"],
                cwd=ROOT, env=bridge_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            low, high = max(1, args.requests // 20), args.requests - max(1, args.requests // 20)
            give_up = time.monotonic() + 60
            while counter.count() < low:
                if bridge_proc.poll() is not None or time.monotonic() > give_up:
                    bridge_proc.send_signal(signal.SIGTERM)
                    raise SystemExit(f"the bridge served no job: {bridge_proc.communicate(timeout=30)[0]}")
                time.sleep(0.02)
            start = (time.monotonic(), counter.count(), cpu_seconds(web_pid), cpu_seconds(bridge_proc.pid))
            deadline = start[0] + args.duration
            while counter.count() < high and time.monotonic() < deadline:
                time.sleep(0.05)
            end = (time.monotonic(), counter.count(), cpu_seconds(web_pid), cpu_seconds(bridge_proc.pid))

            bridge_proc.send_signal(signal.SIGTERM)
            output = bridge_proc.communicate(timeout=30)[0]
            summary = next((line for line in output.splitlines() if "summary:" in line), "(no summary)")

            jobs = end[1] - start[1]
            seconds = end[0] - start[0]
            web_per_job = (end[2] - start[2]) / jobs
            bridge_per_job = (end[3] - start[3]) / jobs
            ratio = bridge_per_job / web_per_job if web_per_job else float("inf")
            print()
            print(f"database {args.database_url.split('@')[-1]}, bridge threads {args.threads}, instant backend")
            print(f"window: {jobs} jobs in {seconds:.1f} s = {jobs / seconds:.1f} jobs/s")
            print("| process | CPU s in window | CPU ms per job |")
            print("|---|---:|---:|")
            print(f"| web (daphne: pop + submit) | {end[2] - start[2]:.2f} | {1000 * web_per_job:.2f} |")
            print(f"| bridge | {end[3] - start[3]:.2f} | {1000 * bridge_per_job:.2f} |")
            print(f"bridge / web per job: {ratio:.3f} (goal < 0.25: {'met' if ratio < 0.25 else 'NOT met'})")
            print(f"bridge {summary.split('[bridge] ', 1)[-1]}")
            httpx.get(f"{url}/api/v2/status/heartbeat", timeout=5)
            return 0
        finally:
            if bridge_proc is not None and bridge_proc.poll() is None:
                bridge_proc.kill()


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
