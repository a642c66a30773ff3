"""What one database or Redis round trip costs a serving thread when another thread wants the
interpreter lock (ADR 0048): the status poll's and the progress post's one round trip, alone and
beside a busy thread (the web process's event loop under load), in the same run.

    .venv/bin/python bench/handoff.py                    # 2,000 calls a kind, 3 alternating pairs
    .venv/bin/python bench/handoff.py --calls 5000 --pairs 5

Each call is what the horde's hot routes make: a prepared `SELECT` on psycopg (as chat.sql runs
the status read) and a Redis `GET` through redis-py with the horde's socket timeout (as the
progress post's `EVALSHA`). It prints, for each, the calling thread's CPU (time.thread_time) and
wall time a call, alone and beside a thread running Python, and their ratio. The switch interval
is the launcher's default (1 ms; `--switch-interval-ms`). Nothing is written: a `SELECT` of its
argument and a `GET` of a key no one sets.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    p.add_argument("--calls", type=int, default=2000, help="round trips a measurement (default 2000)")
    p.add_argument("--pairs", type=int, default=3, help="alone / busy pairs, alternating (default 3)")
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=1.0,
        help="sys.setswitchinterval (default 1 ms, the launcher's)",
    )
    return p.parse_args()


def measure(call: Callable[[int], object], calls: int, *, busy: bool) -> tuple[float, float]:
    """(thread CPU, wall) seconds a call, with or without a thread running Python beside it."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    spinner = threading.Thread(target=spin, daemon=True) if busy else None
    if spinner:
        spinner.start()
        time.sleep(0.05)
    try:
        cpu, wall = time.thread_time(), time.perf_counter()
        for i in range(calls):
            call(i)
        return (time.thread_time() - cpu) / calls, (time.perf_counter() - wall) / calls
    finally:
        stop.set()
        if spinner:
            spinner.join()


def main() -> None:
    args = parse_args()
    import psycopg
    import redis

    sys.setswitchinterval(args.switch_interval_ms / 1000)
    pg = psycopg.connect(args.database_url, autocommit=True)
    cursor = pg.cursor()
    # The horde's Redis clients: a socket timeout (redis_guard), so each send and read polls first.
    client = redis.Redis.from_url(args.redis_url, socket_timeout=2, socket_connect_timeout=2)

    def select(i: int) -> object:
        cursor.execute("SELECT %s::bigint", (i,), prepare=True)
        return cursor.fetchone()

    def get(i: int) -> object:
        return client.get("bench:handoff:absent")

    kinds = {"PostgreSQL prepared SELECT": select, "Redis GET": get}
    for call in kinds.values():  # connect, prepare, warm
        for i in range(50):
            call(i)
    results: dict[str, dict[bool, list[tuple[float, float]]]] = {
        name: {False: [], True: []} for name in kinds
    }
    for pair in range(args.pairs):
        for busy in (False, True) if pair % 2 == 0 else (True, False):
            for name, call in kinds.items():
                results[name][busy].append(measure(call, args.calls, busy=busy))
    print(
        f"{args.calls} calls a measurement, {args.pairs} pairs, switch interval {args.switch_interval_ms} ms; medians"
    )
    print(
        "| round trip | alone: CPU / wall us | beside a busy thread: CPU / wall us | CPU ratio | wall ratio |"
    )
    print("|---|---|---|---:|---:|")
    for name, by_busy in results.items():
        alone_cpu = statistics.median(c for c, _ in by_busy[False]) * 1e6
        alone_wall = statistics.median(w for _, w in by_busy[False]) * 1e6
        busy_cpu = statistics.median(c for c, _ in by_busy[True]) * 1e6
        busy_wall = statistics.median(w for _, w in by_busy[True]) * 1e6
        print(
            f"| {name} | {alone_cpu:.1f} / {alone_wall:.1f} | {busy_cpu:.1f} / {busy_wall:.1f} |"
            f" {busy_cpu / alone_cpu:.2f} | {busy_wall / alone_wall:.1f} |"
        )
    pg.close()
    client.close()


if __name__ == "__main__":
    main()
