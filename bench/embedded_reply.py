"""The embedded default's reply time (ADR 0054): `make run` with nothing configured (SQLite, no
Redis), its demo worker, and a chat completion through the OpenAI front, against the native
route's own completion time in the same run.

    .venv/bin/python bench/embedded_reply.py [--requests 30 --gap 0.6] [--text]

It starts `scripts/run.py` (the web process, the Celery worker and the demo worker, as `make run`)
on a free port with its own SQLite file (`var/bench-embedded.sqlite3`, deleted first) and demo
worker key file, then alternates, one at a time and `--gap` seconds apart (the shipped limit on
creates is 2 a second per client address):

  front   a chat completion through the openai client at /v1 (whole), timed by the client
  native  POST /api/v2/generate/chat/async, then its status read every 5 ms until done: when the
          horde itself had the reply, seen by an eager poller (the baseline)

With --text the same for a text request: /v1/completions against /api/v2/generate/text/async and
its status (ADR 0055).

and prints p50 / p90 / max of each and the front's p50 over the native's.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

from common import PYTHON, ROOT, create_user_key, free_port, migrate, recreate_database, server_env

DEMO_MODEL = "scripted"  # scripts/run.py DEMO_MODEL


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=30, help="requests of each kind (default 30)")
    p.add_argument("--gap", type=float, default=0.6, help="seconds between two requests (default 0.6)")
    p.add_argument("--text", action="store_true", help="text requests (/v1/completions) instead of chat")
    return p.parse_args()


def percentiles(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return f"{statistics.median(ordered):7.1f} / {p90:7.1f} / {ordered[-1]:7.1f}"


def wait_for_demo_worker(url: str, proc: subprocess.Popen, log_path: str) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"scripts/run.py exited with {proc.returncode}; see {log_path}")
        try:
            models = httpx.get(f"{url}/api/v2/status/models?type=text&chat=true", timeout=2)
            if models.status_code == 200 and any(m.get("name") == DEMO_MODEL for m in models.json()):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the demo worker did not declare {DEMO_MODEL!r} within 120 s; see {log_path}")


def main() -> int:
    args = parse_args()
    import httpx
    import openai

    var = ROOT / "var"
    var.mkdir(exist_ok=True)
    database_url = f"sqlite:///{var / 'bench-embedded.sqlite3'}"
    port = free_port()
    key_file = var / "bench-embedded-demo.key"
    key_file.unlink(missing_ok=True)
    env = server_env(database_url, "", CELERY_BROKER_URL="", PORT=str(port), HORDE_DEMO_WORKER_KEY_FILE=str(key_file))
    env.pop("HORDE_DEMO_WORKER", None)
    recreate_database(database_url)
    migrate(env)
    key = create_user_key(env, "bench-embedded", "--kudos", "1000000")
    log_path = var / "bench-embedded.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [PYTHON, "scripts/run.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_demo_worker(url, proc, str(log_path))
        print(f"make run's processes on {url} (log {log_path}); {args.requests} requests of each kind", flush=True)
        front = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        native = httpx.Client(base_url=f"{url}/api/v2/", headers={"apikey": key}, timeout=60)
        messages = [{"role": "user", "content": "Hello, horde"}]
        timings: dict[str, list[float]] = {"front": [], "native": []}
        for i in range(args.requests * 2):
            kind = "front" if i % 2 == 0 else "native"
            started = time.perf_counter()
            if kind == "front" and args.text:
                completion = front.completions.create(model=DEMO_MODEL, prompt="Hello, horde", max_tokens=16)
                assert completion.choices[0].text, completion
            elif kind == "front":
                reply = front.chat.completions.create(model=DEMO_MODEL, messages=messages, max_tokens=16)
                assert reply.choices[0].message.content == "Scripted reply to: Hello, horde", reply
            else:
                family, body = (
                    ("text", {"models": [DEMO_MODEL], "prompt": "Hello, horde", "params": {"max_length": 16}})
                    if args.text
                    else ("chat", {"model": DEMO_MODEL, "messages": messages, "max_tokens": 16})
                )
                created = native.post(f"generate/{family}/async", json=body)
                assert created.status_code == 202, created.text
                status_path = f"generate/{family}/status/{created.json()['id']}"
                while not native.get(status_path).json()["done"]:
                    time.sleep(0.005)
            timings[kind].append((time.perf_counter() - started) * 1000)
            time.sleep(args.gap)
        native.close()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print()
    print("| kind | p50 / p90 / max ms |")
    print("|---|---|")
    route = "/v1/completions" if args.text else "/v1/chat/completions"
    print(f"| front: {route} through the openai client | {percentiles(timings['front'])} |")
    print(f"| native: create, then status every 5 ms until done | {percentiles(timings['native'])} |")
    print()
    print(f"front p50 / native p50 = {statistics.median(timings['front']) / statistics.median(timings['native']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
