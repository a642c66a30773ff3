"""CPU per request of the worker and status views in process (ADR 0036): heartbeat, pop, submit and
status through Django's test client on PostgreSQL and Redis, without the serving layer, so the
views' own cost shows apart from daphne's and the box's load.

    .venv/bin/python bench/view_cpu.py --fill            # recreate the database, queue 3,000 requests
    .venv/bin/python bench/view_cpu.py --requests 300    # measure (again: it re-queues the filled requests)
    .venv/bin/python bench/view_cpu.py --profile tottime --only pop   # cProfile of one kind

Each round is one heartbeat, one pop (by the next of 50 workers), its submits, one status poll of
a random queued request, as in text_queue.py, and one poll of a request the warm-up finished (`done`:
the client's last poll, with its results) and one text request created (`create`: KoboldAI Lite's
body, by a requester of its own, whose requests are deleted after the run), and one pop of an idle
worker answered from memory (`idle`, ADR 0051). It prints each kind's
median CPU time (time.process_time) and its multiple of the heartbeat's in the same run. Before
measuring it puts every filled request back in the queue (its generations deleted), so runs of two
worktrees against one database compare the same queue.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pickle
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import text_queue
from common import ROOT, prepare, server_env


def workers_file(database_url: str) -> Path:
    """The filled workers' keys, beside the database they belong to (shared by worktrees)."""
    name = urlparse(database_url).path.strip("/") or "bench"
    return Path(tempfile.gettempdir()) / f"bench-view-cpu-{name}.pickle"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", default="postgres://postgres@127.0.0.1:5432/horde_bench_views")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    p.add_argument("--fill", action="store_true", help="recreate the database and queue --queued requests")
    p.add_argument("--queued", type=int, default=3000, help="requests the fill queues (default 3000)")
    p.add_argument("--requests", type=int, default=300, help="rounds measured (default 300)")
    p.add_argument("--profile", default="", help="cProfile sort key (tottime, cumulative); off by default")
    p.add_argument("--only", default="pop", help="with --profile: the kind profiled (heartbeat, pop, submit, status, done, create)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--callers", default="", help="with --profile: also print the callers of the functions matching this")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    env = server_env(
        args.database_url,
        args.redis_url,
        ALLOWED_HOSTS="testserver",
        # One requester creates a request every round.
        HORDE_TEXT_ASYNC_RATE_LIMITS="1000000/second",
        HORDE_API_KEY_RATE_LIMITS="1000000/second",
    )
    if args.fill:
        prepare(env)
        fill_args = argparse.Namespace(requests=args.queued, models=50, requesters=20, fill_threads=1, workers=50)
        workers, seconds = text_queue.fill(fill_args, random.Random(2))
        workers_file(args.database_url).write_bytes(pickle.dumps(workers))
        print(f"filled {args.queued} requests in {seconds:.0f}s")
        return
    import os

    os.chdir(ROOT)
    os.environ.update(env)
    import django

    django.setup()
    from django.core.cache import cache
    from django.db import connection
    from django.test import Client

    filled = workers_file(args.database_url)
    if not filled.exists():
        raise SystemExit(f"no filled queue for {args.database_url}: run bench/view_cpu.py --fill first")
    workers = pickle.loads(filled.read_bytes())
    with connection.cursor() as cursor:  # the same queue for every run
        cursor.execute("DELETE FROM horde_generations")
        cursor.execute(
            "UPDATE horde_requests SET jobs_waiting = n, kudos_held = kudos_quote,"
            " expires_at = now() + interval '2 hours'"
        )
    cache.clear()
    client = Client()
    headers = {"HTTP_CLIENT_AGENT": "bench:1:view_cpu"}

    def pop(w):
        return client.post(
            "/api/v2/generate/text/pop", data=json.dumps(text_queue.pop_body(w)),
            content_type="application/json", HTTP_APIKEY=w.api_key, **headers,
        )

    def submit(w, generation_id):
        body = {"id": generation_id, "generation": "The bench worker wrote this. " * 8, "state": "ok", "seed": 1,
                "gen_metadata": []}
        return client.post(
            "/api/v2/generate/text/submit", data=json.dumps(body), content_type="application/json",
            HTTP_APIKEY=w.api_key, **headers,
        )

    ids = text_queue.queued_ids(2000)
    rng = random.Random(1)
    for w in workers:  # warm: every worker checked in, every statement prepared
        for generation_id in pop(w).json().get("ids") or []:
            submit(w, generation_id)
    client.get("/api/v2/status/heartbeat")
    from chat.models import Generation

    done_ids = [str(pk) for pk in Generation.objects.filter(state="ok").values_list("request_id", flat=True)]
    from accounts.models import HordeUser
    from accounts.services import user_create

    requester, requester_key = user_create(username=f"bench-requester-{random.getrandbits(32):08x}", kudos=10**9)
    HordeUser.objects.filter(pk=requester.pk).update(concurrency=10**6)
    create_body = json.dumps(
        {  # KoboldAI Lite's text request
            "prompt": "You: Tell me a story about a dragon.\nKoboldAI: " * 20,
            "params": {
                "n": 1, "max_context_length": 4096, "max_length": 240, "rep_pen": 1.07, "temperature": 0.7,
                "top_p": 0.92, "top_k": 100, "top_a": 0, "typical": 1, "tfs": 1, "rep_pen_range": 360,
                "rep_pen_slope": 0.7, "sampler_order": [6, 0, 1, 3, 4, 2, 5], "use_default_badwordsids": False,
                "stop_sequence": ["You:", "\nYou "], "min_p": 0, "dynatemp_range": 0, "dynatemp_exponent": 1,
                "smoothing_factor": 0,
            },
            "models": workers[0].models[:1],
            "workers": [],
        }
    )

    def create():
        return client.post(
            "/api/v2/generate/text/async", data=create_body, content_type="application/json",
            HTTP_APIKEY=requester_key, **headers,
        )

    # A worker whose model nobody asks for: after two empty pops its answer is remembered, and
    # each later pop is answered from memory (ADR 0051), the pop idle workers make most.
    idle = text_queue.WorkerSpec(
        name="bench-view-cpu-idle", api_key=requester_key, models=["koboldcpp/bench-view-cpu-idle"],
        max_length=512, max_context_length=4096, amount=1,
    )
    for _ in range(2):
        assert pop(idle).json()["id"] is None
    times: dict[str, list[float]] = {
        "heartbeat": [], "pop": [], "submit": [], "status": [], "done": [], "create": [], "idle": []
    }
    profile = cProfile.Profile(time.process_time)

    def measure(kind, call):
        profiled = args.profile and kind == args.only
        if profiled:
            profile.enable()
        started = time.process_time()
        response = call()
        times[kind].append(time.process_time() - started)
        if profiled:
            profile.disable()
        assert response.status_code in (200, 202), (kind, response.status_code, response.content[:200])
        return response

    for k in range(args.requests):
        w = workers[k % len(workers)]
        measure("heartbeat", lambda: client.get("/api/v2/status/heartbeat"))
        popped = measure("pop", lambda w=w: pop(w))
        for generation_id in popped.json().get("ids") or []:
            measure("submit", lambda w=w, g=generation_id: submit(w, g))
        measure("status", lambda: client.get(f"/api/v2/generate/text/status/{rng.choice(ids)}"))
        measure("done", lambda: client.get(f"/api/v2/generate/text/status/{rng.choice(done_ids)}"))
        measure("create", create)
        measure("idle", lambda: pop(idle))
    requester.requests.all().delete()  # the filled queue stays as it was
    requester.delete()

    heartbeat = statistics.median(times["heartbeat"])
    for kind, values in times.items():
        if values:
            median = statistics.median(values)
            print(f"{kind:10s} n={len(values):4d}  median {median * 1000:.2f} ms  {median / heartbeat:.2f}x heartbeat")
    if args.profile:
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out).sort_stats(args.profile)
        stats.print_stats(args.top)
        if args.callers:
            stats.print_callers(args.callers)
        print(out.getvalue())


if __name__ == "__main__":
    main()
