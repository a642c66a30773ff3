"""A long mixed-load soak of the whole horde: what breaks, and what grows, over time.

    .venv/bin/python -m drills.soak                       # 30 minutes, 2 web processes, 3 bridges
    .venv/bin/python -m drills.soak --minutes 5 --keep    # shorter; keep the folder (logs, samples)

Processes, each on its own service (a PostgreSQL cluster and a redis-server of the soak's own, on free
loopback ports, as the fault drills start them, drills/__main__.py): the launcher `scripts/run.py web`
with HORDE_WEB_PROCESSES (default 2, the native API and /v1), `celery -A hordesite worker -B` (sweeps
every 2 s, job lease 10 s, front lease 10 s, requests live `--ttl` seconds, default 600), `--bridges`
reference workers (`python -m workers.bridge`, default 3, two jobs at once each) in front of a fake
OpenAI-compatible backend in this process (chat and legacy completions, whole or streamed a token at
a time, 0.2-3 s each). Every `--restart-every` seconds (default 180) one bridge is killed -9 and
started again 3 s later.

Clients, in this process, each a loop with a short think time: the openai SDK on /v1/chat/completions
whole and streamed (a fifth of the streams dropped by the client after the first content chunk), on
/v1/completions whole and streamed, and whole chat completions with a 1-3 s client timeout and no
retries (most time out); native text/async with status polling, a fifth cancelled with DELETE after
1-3 s; native chat/async with status polling.

Every 30 s (`--sample-every`) a sample goes to samples.jsonl in the folder: the RSS of each web
process, the launcher, the Celery processes and each bridge; pg_total_relation_size and row count of
every table; Redis used_memory and each database's key count. At the end: the load stops, calls in
flight finish, then drills/reconcile.py reconciles the calls of the last `ttl - 60` seconds (older
requests have expired, as they should) and the ledger, balances and holds of every row; generations
still processing past their lease; tracebacks in the logs; and each sampled figure's growth per
minute over the whole run and over its second half.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from drills.__main__ import (
    MODEL,
    PYTHON,
    Horde,
    Process,
    Template,
    free_port,
    log,
    native_request,
    poll_native_status,
    rc,
    submit_native,
)
from drills.reconcile import TAG, Call, new_tag, reconcile

BACKEND_MODEL = "soak-backend"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "soaking", "in", "the", "horde"]


# --- the fake backend ----------------------------------------------------------------------------------


def serve_backend(port: int) -> ThreadingHTTPServer:
    """An OpenAI-compatible backend: a 0.2-3 s reply of 4-24 words, streamed a word at a time when asked."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def handle(self) -> None:
            with contextlib.suppress(ConnectionError):  # a bridge killed -9 resets its kept connection
                super().handle()

        def _send(self, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):  # the bridge gave the job up
                self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                self._send(json.dumps({"object": "list", "data": [
                    {"id": BACKEND_MODEL, "object": "model", "owned_by": "soak"}]}).encode())
                return
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw)
            except ValueError:
                body = {}
            text_job = self.path.rstrip("/").endswith("/v1/completions")
            words = [random.choice(WORDS) for _ in range(random.randint(4, 24))]
            words = words[: max(1, int(body.get("max_tokens") or 64))]
            seconds = random.uniform(0.2, 3.0)
            if not body.get("stream"):
                time.sleep(seconds)
                reply = " ".join(words)
                choice = ({"index": 0, "text": " " + reply, "finish_reason": "stop"} if text_job else
                          {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"})
                self._send(json.dumps({
                    "id": "soak", "object": "text_completion" if text_job else "chat.completion",
                    "model": BACKEND_MODEL, "choices": [choice],
                    "usage": {"prompt_tokens": 10, "completion_tokens": len(words),
                              "total_tokens": 10 + len(words)}}).encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(payload: dict | str) -> None:
                data = payload if isinstance(payload, str) else json.dumps(payload)
                raw = f"data: {data}\n\n".encode()
                self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
                self.wfile.flush()

            def event(delta: dict | str, finish: str | None = None) -> dict:
                if text_job:
                    return {"id": "soak", "object": "text_completion", "model": BACKEND_MODEL,
                            "choices": [{"index": 0, "text": delta, "finish_reason": finish}]}
                return {"id": "soak", "object": "chat.completion.chunk", "model": BACKEND_MODEL,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

            try:
                if not text_job:
                    chunk(event({"role": "assistant", "content": ""}))
                for word in words:
                    time.sleep(seconds / len(words))
                    chunk(event(" " + word if text_job else {"content": word + " "}))
                chunk(event("" if text_job else {}, "stop"))
                chunk("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass  # the bridge gave the job up

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# --- the clients ----------------------------------------------------------------------------------------


class Clients:
    def __init__(self, base_url: str, keys: list[str], think: float):
        self.base_url, self.keys, self.think = base_url, keys, think
        self.calls: list[tuple[float, Call]] = []  # (wall time started, call)
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.threads: list[threading.Thread] = []
        self.gone_at: dict[str, float] = {}  # tag -> wall time the client went away (timeout, drop, cancel)

    def record(self, kind: str) -> Call:
        call = Call(kind=kind, tag=new_tag())
        with self.lock:
            self.calls.append((time.time(), call))
        return call

    def start(self) -> None:
        self.running.set()
        loops = [self.v1_chat, self.v1_chat_stream, self.v1_completion, self.v1_timeout, self.native_text,
                 self.native_chat]
        for i, loop in enumerate(loops):
            thread = threading.Thread(target=self.loop, args=(loop, self.keys[i % len(self.keys)]), daemon=True)
            self.threads.append(thread)
            thread.start()

    def stop(self, timeout: float = 150) -> None:
        self.running.clear()
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.1, deadline - time.monotonic()))

    def loop(self, body, key: str) -> None:
        while self.running.is_set():
            try:
                body(key)
            except Exception as exc:  # noqa: BLE001  (a soak reports, it does not stop)
                log(f"client {body.__name__}: {type(exc).__name__}: {exc}")
            time.sleep(random.uniform(0.5, 1.5) * self.think)

    def openai(self, key: str, **options):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, **{"timeout": 100, **options})

    @staticmethod
    def note_error(call: Call, exc: Exception) -> None:
        import openai

        if isinstance(exc, openai.APIStatusError):
            code = (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
            call.errors.append(f"{exc.status_code} {code or type(exc).__name__}")
        else:  # an error event in a stream carries its code (ChatStreamDiverged: spec chat_front.md)
            code = getattr(exc, "code", None)
            call.errors.append(f"{type(exc).__name__} {code}" if code else type(exc).__name__)

    def v1_chat(self, key: str) -> None:
        import openai

        call = self.record("v1 chat")
        with self.openai(key) as client:
            try:
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Soak drill-{call.tag}"}], max_tokens=64)
            except openai.APIError as exc:
                call.outcome = "error"
                self.note_error(call, exc)
                return
        call.outcome, call.answered_id = "answered", reply.id.removeprefix("chatcmpl-")

    def v1_chat_stream(self, key: str) -> None:
        import openai

        drop = random.random() < 0.2
        call = self.record("v1 chat stream" + (" dropped" if drop else ""))
        with self.openai(key) as client:
            try:
                stream = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Soak drill-{call.tag}"}], max_tokens=64,
                    stream=True)
                completion_id, finished = None, False
                for chunk in stream:
                    completion_id = chunk.id
                    content = chunk.choices[0].delta.content if chunk.choices else None
                    if drop and content:
                        self.gone_at[call.tag] = time.time()
                        stream.close()  # the client goes away mid-stream
                        call.outcome = "dropped"
                        return
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finished = True
            except openai.APIError as exc:
                call.outcome = "error"
                self.note_error(call, exc)
                return
        if finished and completion_id:
            call.outcome, call.answered_id = "answered", completion_id.removeprefix("chatcmpl-")
        else:
            call.outcome = "error"
            call.errors.append("stream ended without a finish")

    def v1_completion(self, key: str) -> None:
        import openai

        stream = random.random() < 0.5
        call = self.record("v1 completion" + (" stream" if stream else ""))
        with self.openai(key) as client:
            try:
                if stream:
                    completion_id, finished = None, False
                    for chunk in client.completions.create(model=MODEL, prompt=f"Soak drill-{call.tag}:",
                                                           max_tokens=64, stream=True):
                        completion_id = chunk.id
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finished = True
                    if not (finished and completion_id):
                        call.outcome = "error"
                        call.errors.append("stream ended without a finish")
                        return
                else:
                    completion_id = client.completions.create(model=MODEL, prompt=f"Soak drill-{call.tag}:",
                                                              max_tokens=64).id
            except openai.APIError as exc:
                call.outcome = "error"
                self.note_error(call, exc)
                return
        call.outcome, call.answered_id = "answered", completion_id.removeprefix("cmpl-")

    def v1_timeout(self, key: str) -> None:
        import openai

        call = self.record("v1 chat timeout")
        with self.openai(key, timeout=random.uniform(1.0, 3.0), max_retries=0) as client:
            try:
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Soak drill-{call.tag}"}], max_tokens=64)
            except openai.APITimeoutError:
                self.gone_at[call.tag] = time.time()
                call.outcome = "timed out"
                return
            except openai.APIError as exc:
                call.outcome = "error"
                self.note_error(call, exc)
                return
        call.outcome, call.answered_id = "answered", reply.id.removeprefix("chatcmpl-")

    def native_text(self, key: str) -> None:
        self.native(key, "text")

    def native_chat(self, key: str) -> None:
        self.native(key, "chat")

    def native(self, key: str, kind: str) -> None:
        cancel_after = random.uniform(1.0, 3.0) if kind == "text" and random.random() < 0.2 else None
        call = self.record(f"native {kind}" + (" cancelled" if cancel_after else ""))
        path, body = native_request(kind, call.tag, "Soak")
        with httpx.Client(base_url=f"{self.base_url}/api/v2/", timeout=15, headers={"apikey": key}) as client:
            request_id = submit_native(client, path, body, call)
            if request_id is None:
                call.outcome = "error"
                return
            status_path = f"generate/{kind}/status/{request_id}"
            ended = poll_native_status(client, status_path, call, seconds=90 if cancel_after is None else cancel_after)
            if ended == "answered":
                call.outcome, call.answered_id = "answered", request_id
                return
            if ended != "timeout":
                call.outcome = {"faulted": "faulted", "done": "cancelled by the horde", "gone": "error"}[ended]
                return
            # Cancelled by the client (or it gave up): its answer may still carry the reply.
            call.outcome = "cancelled" if cancel_after is not None else "gave up"
            self.gone_at[call.tag] = time.time()
            try:
                r = client.delete(status_path)
            except httpx.HTTPError as exc:
                call.errors.append(f"cancel {type(exc).__name__}")
                return
            if r.status_code != 200:
                call.errors.append(f"cancel {r.status_code} {rc(r)}")
                return
            if r.json().get("generations"):
                call.outcome, call.answered_id = "answered at cancel", request_id
                return
            # A job in flight at the cancel still submits and is paid (spec chat_requests.md, Pricing:
            # "its worker submits after the cancel and is paid for the reply as usual"), and the
            # status shows it: the client reads what it pays for.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and r.status_code == 200 and r.json().get("processing"):
                time.sleep(0.5)
                with contextlib.suppress(httpx.HTTPError):
                    r = client.get(status_path)
            if r.status_code == 200 and r.json().get("generations"):
                call.outcome, call.answered_id = "answered after cancel", request_id


# --- sampling ---------------------------------------------------------------------------------------------


def rss_kb(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def descendants(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def fds(pid: int) -> list[str]:
    """What the process's file descriptors point at."""
    found = []
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                found.append(os.readlink(fd))
    return found


def redis_call(port: int, *commands: str) -> list[bytes]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        return [client.execute_command(command) for command in commands]
    finally:
        client.close()


def sample(horde: Horde, bridges: list[Process]) -> dict:
    import redis

    out: dict = {"t": time.time()}
    rss: dict[str, int | None] = {}
    launcher = horde.web.proc.pid
    rss["web launcher"] = rss_kb(launcher)
    for i, pid in enumerate(sorted(children(launcher))):
        rss[f"web {i} (pid {pid})"] = rss_kb(pid)
    celery = horde.celery.proc.pid
    rss["celery parent"] = rss_kb(celery)
    for pid in descendants(celery):  # the pool's process (it holds a PostgreSQL connection) and beat's (-B)
        role = "pool" if any(fd.startswith("pipe:") for fd in fds(pid)) else "beat"  # the pool's pipes
        rss[f"celery {role} pid {pid}"] = rss_kb(pid)
    for bridge in bridges:
        if bridge.proc and bridge.proc.poll() is None:
            rss[bridge.name] = rss_kb(bridge.proc.pid)
    out["rss_kb"] = rss
    query = horde.query()
    tables = query("SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n"
                   " ON n.oid = c.relnamespace WHERE c.relkind = 'r' AND n.nspname = 'public'")
    out["pg_bytes"] = {name: size for name, size in tables}
    out["pg_rows"] = {name: query(f'SELECT count(*) FROM "{name}"')[0][0] for name, _ in tables}
    out["pg_database_bytes"] = query("SELECT pg_database_size(current_database())")[0][0]
    client = redis.Redis(host="127.0.0.1", port=horde.redis.port)
    try:
        out["redis_used_memory"] = client.info("memory")["used_memory"]
        out["redis_keys"] = {db: info["keys"] for db, info in client.info("keyspace").items()}
        # The key families of db 0 and 7, by their prefix up to the third ':'.
        families: dict[str, Counter] = {}
        for db in (0, 7):
            each = redis.Redis(host="127.0.0.1", port=horde.redis.port, db=db)
            try:
                families[f"db{db}"] = Counter(":".join(k.decode(errors="replace").split(":")[:3])
                                              for k in each.scan_iter(count=1000))
                families[f"db{db} no ttl"] = Counter(
                    ":".join(k.decode(errors="replace").split(":")[:3])
                    for k in each.scan_iter(count=1000) if each.ttl(k) == -1)
            finally:
                each.close()
        out["redis_families"] = {db: dict(c) for db, c in families.items()}
    finally:
        client.close()
    return out


def growth(samples: list[dict], pick) -> tuple[float | None, float | None, float | None, float | None]:
    """(first, last, per minute over the run, per minute over its second half): least squares."""
    points = [(s["t"], v) for s in samples if (v := pick(s)) is not None]
    if len(points) < 2:
        return (points[0][1] if points else None, None, None, None)

    def slope(pts):
        if len(pts) < 2:
            return None
        mt = sum(t for t, _ in pts) / len(pts)
        mv = sum(v for _, v in pts) / len(pts)
        den = sum((t - mt) ** 2 for t, _ in pts)
        return 60 * sum((t - mt) * (v - mv) for t, v in pts) / den if den else None

    half = points[len(points) // 2:]
    return points[0][1], points[-1][1], slope(points), slope(half)


# --- the soak -----------------------------------------------------------------------------------------------

_ACCESS_5XX = re.compile(r'"[A-Z]+ (\S+?)(?:\?\S*)?" (5\d\d) ')
_TRACEBACK = re.compile(r"^Traceback|^\S*(Error|Exception): |\bERROR\b", re.M)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--web-processes", type=int, default=2)
    parser.add_argument("--bridges", type=int, default=3)
    parser.add_argument("--ttl", type=int, default=600, help="the requests' time to live, seconds")
    parser.add_argument("--restart-every", type=float, default=180, help="seconds between bridge kills (0: none)")
    parser.add_argument("--sample-every", type=float, default=30)
    parser.add_argument("--think", type=float, default=1.0, help="each client's mean pause between calls, s")
    parser.add_argument("--keep", action="store_true", help="keep the folder (logs, samples.jsonl)")
    parser.add_argument("--celery-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of the Celery worker only (repeatable; e.g. to profile it)")
    args = parser.parse_args(argv)
    if not shutil.which("redis-server"):
        raise SystemExit("redis-server is needed")
    base = Path(tempfile.mkdtemp(prefix="horde-soak-"))
    base.chmod(0o755)
    started = time.time()
    log(f"soak in {base}: {args.minutes:g} min, {args.web_processes} web processes, {args.bridges} bridges")
    template = Template.build(base, requesters=3, workers=args.bridges)
    horde = Horde(base, template, "soak", web_processes=args.web_processes)
    horde.env["HORDE_TEXT_REQUEST_TTL_SECONDS"] = str(args.ttl)
    horde.celery.env = {**horde.env, **dict(item.split("=", 1) for item in args.celery_env)}
    backend_port = free_port()
    backend = serve_backend(backend_port)
    bridges: list[Process] = []
    for i in range(args.bridges):
        env = {**horde.env, "BRIDGE_API_KEY": template.workers[i]}
        bridges.append(Process(f"bridge-{i}", [
            PYTHON, "-m", "workers.bridge", "--horde-url", horde.base_url,
            "--backend", f"http://127.0.0.1:{backend_port}/v1", "--backend-kind", "openai",
            "--name", f"soak-bridge-{i}", "--horde-model", MODEL, "--threads", "2", "--quiet",
            # The fake backend's prompts are short: chat requests under the default conformance.
            "--feature", "prompt_overflow_refused"], env, horde.folder))
    samples: list[dict] = []
    samples_file = horde.folder / "samples.jsonl"
    clients = Clients(horde.base_url, template.requesters, args.think)
    restarts = 0
    clean = False
    try:
        horde.start()
        for bridge in bridges:
            bridge.start()
        time.sleep(5)
        clients.start()
        end = time.monotonic() + 60 * args.minutes
        next_sample = time.monotonic()
        next_restart = time.monotonic() + (args.restart_every or float("inf"))
        while time.monotonic() < end:
            if time.monotonic() >= next_sample:
                try:
                    s = sample(horde, bridges)
                    samples.append(s)
                    with samples_file.open("a") as out:
                        out.write(json.dumps(s) + "\n")
                    web = sum(v or 0 for k, v in s["rss_kb"].items() if k.startswith("web "))
                    log(f"sample: {len(clients.calls)} calls, web RSS {web / 1024:.0f} MB, db "
                        f"{s['pg_database_bytes'] / 1e6:.1f} MB, requests {s['pg_rows'].get('horde_requests')}, "
                        f"redis {s['redis_used_memory'] / 1e6:.2f} MB {s['redis_keys']}")
                except Exception as exc:  # noqa: BLE001
                    log(f"sample failed: {type(exc).__name__}: {exc}")
                next_sample += args.sample_every
            if time.monotonic() >= next_restart:
                victim = random.choice(bridges)
                victim.kill()
                log(f"{victim.name} killed -9")
                time.sleep(3)
                victim.start()
                restarts += 1
                next_restart += args.restart_every
            time.sleep(0.5)
        log("load stopping; calls in flight finishing")
        clients.stop()
        time.sleep(15)  # past the lease and a few sweeps
        samples.append(sample(horde, bridges))
        with samples_file.open("a") as out:
            out.write(json.dumps(samples[-1]) + "\n")
        for bridge in bridges:
            if bridge.proc and bridge.proc.poll() is None:
                bridge.proc.send_signal(signal.SIGINT)
        for bridge in bridges:
            with contextlib.suppress(Exception):
                bridge.proc.wait(30)
            bridge.kill()
        cutoff = time.time() - args.ttl + 60
        recent = [call for t, call in clients.calls if t >= cutoff]
        reconciliation = reconcile(horde.query(), recent, only_tags={call.tag for call in recent})
        stuck = horde.query()("SELECT count(*) FROM horde_generations WHERE state = 'processing'"
                              " AND lease_expires_at < now() - interval '6 seconds'")[0][0]
        clean = report(args, clients, recent, reconciliation, stuck, samples, horde, bridges, restarts,
                       time.time() - started)
    finally:
        clients.running.clear()
        backend.shutdown()
        for bridge in bridges:
            bridge.kill()
        horde.stop()
        if args.keep:
            log(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return 0 if clean else 1


# How long after a client goes the front's cancel may take to reach the horde (its disconnect noticed,
# the cancel sent): a reply submitted within it was done before the cancel.
FRONT_CANCEL_GRACE_SECONDS = 2.0


def report(args, clients: Clients, recent: list[Call], rec, stuck: int, samples: list[dict], horde: Horde,
           bridges: list[Process], restarts: int, seconds: float) -> bool:
    print(f"\n## Soak report ({seconds / 60:.1f} min; {args.web_processes} web processes, {args.bridges} bridges, "
          f"{restarts} bridge kills)")
    outcomes = Counter(f"{call.kind}: {call.outcome}" for _, call in clients.calls)
    print(f"- client calls: {len(clients.calls)}; " + ", ".join(f"{k} {n}" for k, n in sorted(outcomes.items())))
    errors = Counter(f"{call.kind}: {e}" for _, call in clients.calls for e in call.errors)
    print("- errors the clients saw: " + (", ".join(f"{k} x{n}" for k, n in sorted(errors.items())) or "none"))
    print(f"- reconciled (calls of the last {args.ttl - 60} s, {len(recent)}): {rec.summary()}")
    # A client that went away (a dropped stream, a timeout, a cancel) while its job was in flight is
    # charged as the spec says (chat_requests.md, Pricing): a streamed job settles at the cancel on
    # what its worker posted (generation state cancelled, kudos > 0); another job's submit after the
    # cancel is paid as usual (request cancelled, generation ok). Anything else is a finding.
    by_spec: Counter = Counter()
    unexplained = []
    for rid in rec.charged_for_nothing:
        rows = horde.query()(f"SELECT r.cancelled, g.state, extract(epoch FROM g.finished_at),"
                             f" concat(r.prompt, CAST(r.messages AS TEXT)) FROM horde_requests r JOIN horde_generations g"
                             f" ON g.request_id = r.id WHERE r.id = '{rid}' AND g.kudos > 0")
        gone = [clients.gone_at[tag] for *_, text in rows for tag in TAG.findall(text) if tag in clients.gone_at]
        if rows and gone and all(state == "ok" and float(finished) <= max(gone) for _, state, finished, _ in rows):
            # Its reply was finished before the client's timeout fired: nothing left to cancel.
            by_spec["finished before the client went away"] += 1
        elif rows and gone and all(
            not cancelled and state == "ok" and float(finished) <= max(gone) + FRONT_CANCEL_GRACE_SECONDS
            for cancelled, state, finished, _ in rows
        ):
            # Submitted in the moment between the client's going and the front's cancel reaching the
            # horde: the request was done, and a cancel of a done request changes nothing (ADR 0064).
            by_spec["finished as the client went away, before the front's cancel"] += 1
        elif rows and all(cancelled for cancelled, *_ in rows):
            by_spec["streamed, settled at the cancel on its posted content" if any(row[1] == "cancelled" for row in rows)
                    else "in flight at the cancel, its submit paid"] += 1
        else:
            unexplained.append(rid)
    if by_spec:
        print("- charged though the client went away, as the spec prices it: "
              + ", ".join(f"{what}: {n}" for what, n in sorted(by_spec.items())))
    charged = [f"{rid} ({rec.details.get(rid, '')})" for rid in unexplained]
    for label, items in (("lost", rec.lost), ("charged for nothing", charged), ("double-charged", rec.double_charged),
                         ("held by two", rec.two_workers), ("conflicting states", rec.conflicting_states),
                         ("balance != ledger", rec.balance_mismatch), ("holds", rec.hold_mismatch)):
        if items:
            print(f"- {label}: {', '.join(items[:10])}{' ...' if len(items) > 10 else ''}")
    print(f"- generations processing past their lease (+6 s): {stuck}")
    tracebacks = {}
    for log_file in sorted(horde.folder.glob("*.log")):
        if log_file.name in ("pg.log", "redis.log"):  # the servers' own: PostgreSQL logs each refused insert
            continue
        text = log_file.read_text(errors="replace")
        found = _TRACEBACK.findall(text)
        if found:
            tracebacks[log_file.name] = len(found)
    print(f"- error lines in the horde's logs (Traceback / *Error: / ERROR): {tracebacks or 'none'} (in {horde.folder})")
    pg_errors = Counter(re.sub(r"\d+", "N", line.split("ERROR:", 1)[1].strip())
                        for line in (horde.folder / "pg.log").read_text(errors="replace").splitlines() if "ERROR:" in line)
    print(f"- PostgreSQL's ERROR lines: {dict(pg_errors) or 'none'}")
    server_errors = [e for e in errors if re.search(r"\b5(?!03)\d\d\b|InternalServerError", e)]
    access = Counter(f"{m.group(2)} {re.sub('[0-9a-f-]{36}', '<id>', m.group(1))}" for m in _ACCESS_5XX.finditer((horde.folder / "web.log").read_text(errors="replace")))
    print(f"- 5xx answers in the web access log: {dict(access) or 'none'}")
    server_errors += [f"web access log {what}" for what in access]
    print(f"- server errors other than 503: {server_errors or 'none'}")
    print("\n| figure | first | last | per minute (run) | per minute (second half) |")
    print("|---|---:|---:|---:|---:|")
    keys: list[tuple[str, object]] = []
    for name in samples[-1]["rss_kb"]:
        keys.append((f"RSS kB {name}", lambda s, n=name: s["rss_kb"].get(n)))
    for name in sorted(samples[-1]["pg_bytes"]):
        keys.append((f"pg bytes {name}", lambda s, n=name: s["pg_bytes"].get(n)))
        keys.append((f"pg rows {name}", lambda s, n=name: s["pg_rows"].get(n)))
    keys.append(("pg database bytes", lambda s: s["pg_database_bytes"]))
    keys.append(("redis used_memory", lambda s: s["redis_used_memory"]))
    for db in sorted({db for s in samples for db in s["redis_keys"]}):
        keys.append((f"redis keys {db}", lambda s, d=db: s["redis_keys"].get(d, 0)))
    fmt = lambda v: "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else f"{v:,}"  # noqa: E731
    for label, pick in keys:
        first, last, run, half = growth(samples, pick)
        if first == last == 0:
            continue
        print(f"| {label} | {fmt(first)} | {fmt(last)} | {fmt(run)} | {fmt(half)} |")
    print("\n- redis key families at the end (no-TTL ones apart): "
          + json.dumps(samples[-1].get("redis_families", {}), sort_keys=True))
    clean = (not (rec.lost or rec.conflicting_states or rec.double_charged or rec.two_workers or unexplained
                  or rec.balance_mismatch or rec.hold_mismatch) and not stuck and not server_errors and not tracebacks)
    print(f"\n{'CLEAN' if clean else 'FINDINGS: see above'}")
    return clean


if __name__ == "__main__":
    sys.exit(main())
