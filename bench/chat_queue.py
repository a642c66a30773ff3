"""Chat queue benchmark (issue 3): chat pop against text pop, chat status against heartbeat, in one run.

Fills N queued requests (half text through chat.services.create_text.text_request_create, half chat through
chat.services.create_chat.chat_request_create, with varied features, tools, response formats and limits) over
M models, registers W workers of varied declarations (text-only, chat+text, chat-only) on a real
daphne web process, then alternates four measured phases at the same client concurrency:

  heartbeat    GET  /api/v2/status/heartbeat
  text_pop     the text-only workers loop: POST /api/v2/generate/text/pop, then
               POST /api/v2/generate/text/submit when a job came (the baseline)
  chat_pop     the chat-capable workers loop the same, submitting a verified structured reply for
               a chat job (tool calls, JSON objects, schema instances, reasoning) and text for a text job
  chat_status  GET  /api/v2/generate/chat/status/<id> on random still-queued chat ids

and prints throughput and p50/p95 latency of each, with the ratios the issue sets as goals:
chat pop p95 <= 2x text pop p95 and chat pop req/s >= 0.5x text pop req/s; chat status p95 <= 2x
heartbeat p95.

    .venv/bin/python bench/chat_queue.py [--requests 10000 --models 50 --workers 200 --duration 120]

It reuses bench/text_queue.py's machinery (database, Redis, migrations, daphne, phases, percentiles)
with its own database (default postgres://postgres@127.0.0.1:5432/horde_bench_chat), Redis database
(redis://127.0.0.1:6379/10) and port (8775), so both benchmarks can run side by side. The database
is dropped and recreated on every run and the Redis database flushed: do not point them at data you keep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field

from common import ROOT, Server, prepare, serving
from text_queue import (  # the shared bench machinery
    PhaseResult,
    WorkerSpec,
    analyze,
    bench_env,
    fill_in_threads,
    model_names,
    pct,
    phase_gets,
    phase_heartbeat,
    pop_body,
    text_request_input,
    timed,
)

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/horde_bench_chat"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/10"
CLIENT_AGENT = "bench:1:chat_queue"
PHASES = ("heartbeat", "text_pop", "chat_pop", "chat_status")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--requests", type=int, default=10_000, help="queued requests to fill (default 10000)")
    p.add_argument(
        "--chat-share", type=float, default=0.5, help="share of the requests that are chat (default 0.5)"
    )
    p.add_argument("--models", type=int, default=50, help="distinct model names (default 50)")
    p.add_argument("--workers", type=int, default=200, help="registered workers (default 200)")
    p.add_argument(
        "--text-only-share",
        type=float,
        default=0.4,
        help="share of the workers that are text-only (default 0.4); of the rest a quarter are chat-only",
    )
    p.add_argument(
        "--requesters", type=int, default=50, help="requesting users the fill is spread over (default 50)"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=120.0,
        help="total measured seconds, split evenly over rounds x 4 phases (default 120)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of the four phases, order rotated (default 3)"
    )
    p.add_argument("--fill-threads", type=int, default=4, help="threads filling the queue (default 4)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=12,
        help="requests in flight, the same for every phase (default 12)",
    )
    p.add_argument("--port", type=int, default=8775, help="daphne port (default 8775)")
    p.add_argument("--database-url", default=os.environ.get("BENCH_CHAT_DATABASE_URL", DEFAULT_DATABASE_URL))
    p.add_argument("--redis-url", default=os.environ.get("BENCH_CHAT_REDIS_URL", DEFAULT_REDIS_URL))
    p.add_argument("--no-analyze", action="store_true", help="skip ANALYZE after the fill")
    p.add_argument("--seed", type=int, default=3, help="random seed of the fill and the workers (default 3)")
    p.add_argument(
        "--keep-server", action="store_true", help="leave daphne running at the end (prints its pid)"
    )
    return p.parse_args(argv)


# --- Workers: varied declarations -----------------------------------------------------------------

# Chat feature tiers a chat worker declares (features and guarantees share the chat_features list).
BASIC = ["prompt_overflow_refused", "seed", "presence_penalty", "frequency_penalty"]
TOOLS = BASIC + ["tools", "tool_choice_enforced", "single_tool_call_enforced", "reasoning_effort"]
FULL = TOOLS + ["json_object", "json_schema", "structured_output_enforced", "tools_with_response_format"]
LOOSE = ["seed", "tools", "json_object", "json_schema", "reasoning_effort"]  # no guarantees: best_effort only
FEATURE_TIERS = [("basic", BASIC, 25), ("tools", TOOLS, 30), ("full", FULL, 35), ("loose", LOOSE, 10)]


@dataclass
class BenchWorker(WorkerSpec):
    kind: str = "text"  # text | chat | chat-only
    chat: dict | None = None  # the pop's chat declaration fields

    def body(self) -> dict:
        body = pop_body(self)
        if self.chat:
            body.update(self.chat)
        return body


def make_workers(args: argparse.Namespace, rng: random.Random, owners: list[str]) -> list[BenchWorker]:
    models = model_names(args.models)
    text_only = round(args.workers * args.text_only_share)
    chat_capable = args.workers - text_only
    chat_only = chat_capable // 4
    workers = []
    for i in range(args.workers):
        served = {models[i % args.models]}
        for _ in range(rng.randint(0, 2)):
            served.add(models[min(int(rng.paretovariate(1.2)) - 1, args.models - 1)])
        w = BenchWorker(
            name=f"bench-chat-worker-{i:03d}",
            api_key=owners[i],
            models=sorted(served),
            max_length=rng.choice([256, 512, 512, 1024]),
            max_context_length=rng.choice([2048, 4096, 8192, 8192]),
            amount=rng.choice([1, 1, 1, 2]),
        )
        if i >= text_only:
            k = i - text_only
            w.kind = "chat-only" if k < chat_only else "chat"
            # model_id: one of the worker's models; every model gets chat workers (k % models).
            model_id = models[k % args.models]
            w.models = sorted(set(w.models) | {model_id})
            tier = rng.choices([t for t in FEATURE_TIERS], weights=[t[2] for t in FEATURE_TIERS])[0]
            features = list(tier[1])
            transports = []
            if rng.random() < 0.15:
                features.append("vision")
                transports = rng.choice([["url"], ["base64"], ["url", "base64"]])
            limits = {
                "max_context_length": rng.choice([4096, 8192, 8192, 16384, 32768]),
                "max_length": rng.choice([256, 512, 1024, 1024, 2048]),
            }
            temp = rng.choice([None, None, 0.7, 1.0, 1.2])
            if temp is not None:
                limits["tools_max_temperature"] = temp
            w.chat = {
                "chat_jobs": True,
                "prompt_jobs": w.kind == "chat",
                "chat_features": features,
                "chat_limits": limits,
                "model_id": model_id,
                "image_transports": transports,
            }
        workers.append(w)
    return workers


# --- Chat request bodies --------------------------------------------------------------------------

TOOL_DEFS = [
    ("get_weather", {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}),
    ("search_web", {"query": {"type": "string"}, "limit": {"type": "integer"}}),
    ("calculate", {"expression": {"type": "string"}}),
    ("lookup_order", {"order_id": {"type": "string"}, "include_items": {"type": "boolean"}}),
    ("send_email", {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}}),
    ("get_time", {"timezone": {"type": "string"}}),
]

RESPONSE_SCHEMAS = [
    (
        "answer",
        {
            "type": "object",
            "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
            "required": ["answer", "confidence"],
            "additionalProperties": False,
        },
    ),
    (
        "person",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "age", "tags"],
            "additionalProperties": False,
        },
    ),
    (
        "verdict",
        {
            "type": "object",
            "properties": {
                "verdict": {"type": "string", "enum": ["yes", "no"]},
                "reasons": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"why": {"type": "string"}, "weight": {"type": "number"}},
                        "required": ["why", "weight"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["verdict", "reasons"],
            "additionalProperties": False,
        },
    ),
]

# (profile, weight): what a chat request uses beyond messages.
PROFILES = [
    ("plain", 20),
    ("sampling", 15),
    ("tools_auto", 12),
    ("tools_required", 10),
    ("tools_none", 5),
    ("tools_function", 5),
    ("json_object", 10),
    ("json_schema_strict", 10),
    ("json_schema", 4),
    ("tools_and_json", 4),
    ("tool_history", 5),
]


def tool(name: str, props: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The bench's {name.replace('_', ' ')} tool.",
            "parameters": {
                "type": "object",
                "properties": props,
                "required": list(props),
                "additionalProperties": False,
            },
        },
    }


def chat_body(rng: random.Random, i: int, models: list[str]) -> tuple[dict, str]:
    """A varied native chat body (without models) and its profile name."""
    profile = rng.choices([p for p, _ in PROFILES], weights=[w for _, w in PROFILES])[0]
    messages = [{"role": "system", "content": "You are a concise assistant. Answer in JSON when asked."}]
    for turn in range(rng.choice([0, 0, 1, 2, 4])):
        messages.append(
            {"role": "user", "content": f"Earlier question {turn} of chat {i}. " * rng.randint(1, 6)}
        )
        messages.append({"role": "assistant", "content": f"Earlier answer {turn}. " * rng.randint(1, 8)})
    body: dict = {"max_tokens": rng.choice([64, 128, 256, 256, 512, 1024, 2048])}
    horde: dict = {}
    if rng.random() < 0.5:
        horde["max_context_length"] = rng.choice([2048, 4096, 4096, 8192, 16384, 32768])
    if rng.random() < 0.2:
        horde["conformance"] = "best_effort"
    if rng.random() < 0.1:
        horde["validated_backends"] = True
    if rng.random() < 0.6:
        body["temperature"] = rng.choice([0.2, 0.5, 0.7, 0.8, 1.0, 1.3])
    tools = [tool(n, p) for n, p in rng.sample(TOOL_DEFS, rng.randint(1, 4))]
    if profile == "sampling":
        if rng.random() < 0.6:
            body["seed"] = rng.randint(0, 2**31)
        if rng.random() < 0.5:
            body["presence_penalty"] = rng.choice([-0.5, 0.3, 0.8])
        if rng.random() < 0.5:
            body["frequency_penalty"] = rng.choice([0.2, 0.5, 1.1])
        if rng.random() < 0.4:
            body["reasoning_effort"] = rng.choice(["low", "medium", "high"])
        body["top_p"] = rng.choice([0.8, 0.9, 0.95])
    elif profile.startswith("tools") or profile == "tool_history":
        body["tools"] = tools
        choice = {
            "tools_auto": "auto",
            "tools_required": "required",
            "tools_none": "none",
            "tools_and_json": "auto",
            "tool_history": "auto",
        }.get(profile)
        if profile == "tools_function":
            choice = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        body["tool_choice"] = choice
        if profile != "tools_none" and rng.random() < 0.3:
            body["parallel_tool_calls"] = False
        if profile == "tools_and_json":
            body["response_format"] = {"type": "json_object"}
        if profile == "tool_history":
            name = tools[0]["function"]["name"]
            messages.append({"role": "user", "content": f"Use {name} please."})
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": "{}"}}
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": '{"ok": true}'})
        if rng.random() < 0.3:
            body["reasoning_effort"] = rng.choice(["low", "medium"])
    elif profile == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif profile.startswith("json_schema"):
        name, schema = rng.choice(RESPONSE_SCHEMAS)
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": profile == "json_schema_strict"},
        }
        if rng.random() < 0.3:
            body["seed"] = rng.randint(0, 2**31)
    messages.append(
        {
            "role": "user",
            "content": f"Bench chat {i} ({profile}): reply in JSON if asked. " * rng.randint(1, 10),
        }
    )
    body["messages"] = messages
    if horde:
        body["horde"] = horde
    return body, profile


def may_serve(worker: BenchWorker, body: dict, req) -> bool:
    """Rules 2-3, roughly (the fill uses it to pick models a chat worker can serve)."""
    chat = worker.chat or {}
    if not set(req.declarations) <= set(chat.get("chat_features", [])):
        return False
    limits = chat["chat_limits"]
    context = (body.get("horde") or {}).get("max_context_length", 2048)
    if context > limits["max_context_length"]:
        return False
    ceiling = limits.get("tools_max_temperature")
    return req.tools_temperature is None or ceiling is None or req.tools_temperature <= ceiling


def chat_models_for(
    body: dict, rng: random.Random, models: list[str], chat_workers: list[BenchWorker]
) -> list[str]:
    """1-2 models on a skewed spread; the first is, nine times in ten, one a declared chat worker can
    serve, so about a tenth of the chat requests may wait for a worker that never comes."""
    from contract.chat_policy import chat_request_requirements

    req = chat_request_requirements(body)
    first = models[min(int(rng.paretovariate(1.2)) - 1, len(models) - 1)]
    able = sorted({w.chat["model_id"] for w in chat_workers if may_serve(w, body, req)})
    if able and first not in able and rng.random() < 0.9:
        first = rng.choice(able)
    served = sorted({w.chat["model_id"] for w in chat_workers})
    if first not in served:
        first = rng.choice(served)  # UnknownChatModel/NoEligibleWorker otherwise
    wanted = [first]
    if rng.random() < 0.25:
        wanted.append(rng.choice(served))
    return list(dict.fromkeys(wanted))


# --- Fill -----------------------------------------------------------------------------------------


def make_owners(count: int) -> list[str]:
    from accounts.services import user_create

    return [user_create(username=f"bench-chat-owner-{i}")[1] for i in range(count)]


def fill(
    args: argparse.Namespace, rng: random.Random, workers: list[BenchWorker]
) -> tuple[float, dict[str, int], dict[str, int]]:
    """Requesters and the queued requests, text and chat interleaved; returns the fill's seconds,
    the chat profiles and the refusals met."""
    from rest_framework.exceptions import ValidationError

    from accounts.models import HordeUser
    from accounts.services import user_create
    from chat.services.create_chat import chat_request_create
    from chat.services.create_text import text_request_create
    from contract.chat_shapes import validate_chat_request
    from contract.errors import HordeError

    models = model_names(args.models)
    chat_workers = [w for w in workers if w.chat]
    requesters = []
    for i in range(args.requesters):
        user, _ = user_create(
            username=f"bench-chat-requester-{i}", kudos=rng.choice([100_000, 1_000_000, 10_000_000])
        )
        requesters.append(user)
    HordeUser.objects.filter(pk__in=[u.pk for u in requesters]).update(concurrency=args.requests + 100)
    for user in requesters:
        user.refresh_from_db()

    specs = []
    profiles: dict[str, int] = {}
    for i in range(args.requests):
        user = requesters[i % len(requesters)]
        if rng.random() < args.chat_share:
            body, profile = chat_body(rng, i, models)
            body["models"] = chat_models_for(body, rng, models, chat_workers)
            profiles[profile] = profiles.get(profile, 0) + 1
            specs.append((user, "chat", validate_chat_request(body)))
        else:
            specs.append((user, "text", text_request_input(rng, i, models)))

    refused: dict[str, int] = {}
    lock = threading.Lock()

    def create(spec: tuple) -> None:
        user, kind, data = spec
        try:
            if kind == "chat":
                chat_request_create(user=user, chat=data, client_agent=CLIENT_AGENT, ip_address="127.0.0.1")
            else:
                text_request_create(user=user, data=data, client_agent=CLIENT_AGENT, ip_address="127.0.0.1")
        except (HordeError, ValidationError) as exc:
            with lock:
                key = f"{kind} {getattr(exc, 'rc', type(exc).__name__)}"
                refused[key] = refused.get(key, 0) + 1

    seconds = fill_in_threads(specs, create, requesters=len(requesters), threads=args.fill_threads)
    return seconds, profiles, refused


class KeepOnline:
    """Keeps the registered workers online (last_check_in) while the fill runs longer than a pop
    would take: chat_request_create needs an online chat worker serving the models. A shortcut
    for the pops the workers would make meanwhile; stopped before the measured phases."""

    def __init__(self, every: float = 60.0):
        self.every = every
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        from django.db import connection
        from django.utils import timezone

        from workers.models import Worker

        try:
            while not self.stop_event.wait(self.every):
                Worker.objects.filter(name__startswith="bench-chat-worker-").update(
                    last_check_in=timezone.now()
                )
        finally:
            connection.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join()


def queue_counts() -> dict[str, int]:
    from django.db.models import Count

    from chat.selectors.queue import waiting_requests

    rows = waiting_requests().values("is_chat").annotate(n=Count("id"))
    return {("chat" if r["is_chat"] else "text"): r["n"] for r in rows}


def queued_chat_ids(limit: int = 5000) -> list[str]:
    from chat.selectors.queue import waiting_requests

    return [str(pk) for pk in waiting_requests().filter(is_chat=True).values_list("id", flat=True)[:limit]]


# --- A chat worker's reply ------------------------------------------------------------------------


def instance_of(schema: dict, depth: int = 0):
    """A small valid instance of the bench's schemas (object, array, string, enum, numbers, bool)."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return {k: instance_of(v, depth + 1) for k, v in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [instance_of(schema.get("items") or {}, depth + 1)] if depth < 4 else []
    if kind == "integer":
        return 7
    if kind == "number":
        return 0.5
    if kind == "boolean":
        return True
    return "bench"


def chat_reply(gen_id: str, model_id: str, payload: dict, rng: random.Random) -> dict:
    """A structured reply that passes verification, read off the job payload as a worker would."""
    tools = payload.get("tools") or []
    choice = payload.get("tool_choice")
    response_format = payload.get("response_format") or {}
    call = bool(tools) and (choice == "required" or (choice in (None, "auto") and rng.random() < 0.5))
    message: dict = {"role": "assistant"}
    if call:
        fn = rng.choice(tools)["function"]
        message["content"] = None
        message["tool_calls"] = [
            {
                "id": f"call_{gen_id[:8]}",
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "arguments": json.dumps(instance_of(fn.get("parameters") or {})),
                },
            }
        ]
        finish = "tool_calls"
    else:
        kind = response_format.get("type")
        if kind == "json_schema":
            content = json.dumps(instance_of(response_format["json_schema"]["schema"]))
        elif kind == "json_object":
            content = json.dumps({"answer": "The bench worker wrote this.", "ok": True})
        else:
            content = "The bench worker wrote this. " * 8
        message["content"] = content
        finish = "stop"
    if payload.get("reasoning_effort"):
        message["reasoning_content"] = "Thinking it over briefly. " * 4
    return {
        "id": gen_id,
        "state": "ok",
        "model_id": model_id,
        "message": message,
        "finish_reason": finish,
        "prompt_tokens": 120,
        "completion_tokens": 40,
    }


def text_reply(gen_id: str) -> dict:
    return {
        "id": gen_id,
        "generation": "The bench worker wrote this. " * 8,
        "state": "ok",
        "seed": 1,
        "gen_metadata": [],
    }


# --- Measurement ----------------------------------------------------------------------------------


@dataclass
class PopResult(PhaseResult):
    chat_jobs: int = 0
    text_jobs: int = 0
    empty: int = 0
    by_outcome: dict[str, list[float]] = field(default_factory=dict)  # pop latency by what it handed out
    error_samples: list[str] = field(default_factory=list)

    def merge(self, other: PhaseResult) -> None:
        super().merge(other)
        if isinstance(other, PopResult):
            self.chat_jobs += other.chat_jobs
            self.text_jobs += other.text_jobs
            self.empty += other.empty
            for k, v in other.by_outcome.items():
                self.by_outcome.setdefault(k, []).extend(v)
            self.error_samples = (self.error_samples + other.error_samples)[:8]


async def phase_pop(
    client,
    name: str,
    seconds: float,
    concurrency: int,
    workers: list[BenchWorker],
    rng: random.Random,
    once: bool = False,
) -> PopResult:
    """Every worker loops pop -> submit (once only with `once`); a semaphore keeps `concurrency`
    requests in flight."""
    result = PopResult(name)
    deadline = time.perf_counter() + seconds
    gate = asyncio.Semaphore(concurrency)

    async def worker_loop(w: BenchWorker):
        headers = {"apikey": w.api_key, "Client-Agent": CLIENT_AGENT}
        body = w.body()
        first = once
        while first or (not once and time.perf_counter() < deadline):
            first = False
            async with gate:
                t0 = time.perf_counter()
                resp = await timed(
                    client,
                    "POST",
                    "/api/v2/generate/text/pop",
                    result,
                    result.latencies,
                    json=body,
                    headers=headers,
                )
                took = time.perf_counter() - t0
            if resp is None:
                continue
            job = resp.json()
            ids = job.get("ids") or []
            is_chat = bool(job.get("chat"))
            outcome = ("chat job" if is_chat else "text job") if ids else "no job"
            result.by_outcome.setdefault(f"{w.kind} worker, {outcome}", []).append(took)
            if not ids:
                result.empty += 1
            for gen_id in ids:
                result.jobs += 1
                if is_chat:
                    result.chat_jobs += 1
                    submit = chat_reply(gen_id, job.get("model") or "", job.get("payload") or {}, rng)
                else:
                    result.text_jobs += 1
                    submit = text_reply(gen_id)
                async with gate:
                    t0 = time.perf_counter()
                    try:
                        r = await client.post("/api/v2/generate/text/submit", headers=headers, json=submit)
                    except Exception as exc:  # noqa: BLE001
                        result.error(f"submit {type(exc).__name__}")
                        continue
                    result.other_latencies.append(time.perf_counter() - t0)
                if r.status_code >= 400:
                    result.error(f"submit HTTP {r.status_code}")
                    if len(result.error_samples) < 8:
                        result.error_samples.append(
                            f"{r.status_code} {r.text[:300]} <- {json.dumps(submit)[:300]}"
                        )

    t0 = time.perf_counter()
    await asyncio.gather(*(worker_loop(w) for w in workers))
    result.seconds = time.perf_counter() - t0
    return result


async def phase_chat_status(
    client, seconds: float, concurrency: int, ids: list[str], rng: random.Random
) -> PhaseResult:
    return await phase_gets(
        client, "chat_status", seconds, concurrency, lambda: f"/api/v2/generate/chat/status/{rng.choice(ids)}"
    )


async def register_workers(client, workers: list[BenchWorker], concurrency: int) -> None:
    """Each worker's first pop registers it (and its chat declaration); nothing is queued yet."""
    gate = asyncio.Semaphore(concurrency)

    async def first(w: BenchWorker):
        async with gate:
            resp = await client.post(
                "/api/v2/generate/text/pop", json=w.body(), headers={"apikey": w.api_key}
            )
        if resp.status_code >= 400:
            raise SystemExit(f"registering {w.name} failed: {resp.status_code} {resp.text[:400]}")

    await asyncio.gather(*(first(w) for w in workers))


async def measure(
    args: argparse.Namespace, workers: list[BenchWorker], rng: random.Random
) -> dict[str, PhaseResult]:
    import httpx
    from asgiref.sync import sync_to_async

    base = f"http://127.0.0.1:{args.port}"
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    totals: dict[str, PhaseResult] = {
        "heartbeat": PhaseResult("heartbeat"),
        "text_pop": PopResult("text_pop"),
        "chat_pop": PopResult("chat_pop"),
        "chat_status": PhaseResult("chat_status"),
    }
    text_workers = [w for w in workers if not w.chat]
    chat_workers = [w for w in workers if w.chat]
    per_phase = args.duration / (len(PHASES) * args.rounds)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:
        print("warming up (every worker pops and submits once, then 2 s of heartbeat) ...", flush=True)
        warm = await phase_pop(client, "warmup", 0, args.concurrency, workers, rng, once=True)
        print(
            f"  warm-up: {warm.text_jobs} text + {warm.chat_jobs} chat jobs, errors {warm.errors}", flush=True
        )
        for sample in warm.error_samples[:3]:
            print(f"  error sample: {sample}", flush=True)
        await phase_heartbeat(client, 2.0, args.concurrency)
        for r in range(args.rounds):
            rotated = list(PHASES[r % 4 :] + PHASES[: r % 4])
            for name in rotated:
                if name == "heartbeat":
                    res = await phase_heartbeat(client, per_phase, args.concurrency)
                elif name == "text_pop":
                    res = await phase_pop(client, name, per_phase, args.concurrency, text_workers, rng)
                elif name == "chat_pop":
                    res = await phase_pop(client, name, per_phase, args.concurrency, chat_workers, rng)
                else:
                    ids = await sync_to_async(queued_chat_ids)()
                    res = await phase_chat_status(client, per_phase, args.concurrency, ids, rng)
                extra = ""
                if isinstance(res, PopResult):
                    extra = f", jobs {res.text_jobs} text + {res.chat_jobs} chat, {res.empty} empty pops"
                print(res.round_line(r + 1, name, extra), flush=True)
                totals[name].merge(res)
    return totals


# --- Report ---------------------------------------------------------------------------------------


def report(args, totals, workers, fill_seconds, profiles, refused, depth_before, depth_after) -> str:
    hb, tp, cp, cs = (totals[n] for n in PHASES)

    def rps(r: PhaseResult, lat=None) -> float:
        return len(r.latencies if lat is None else lat) / r.seconds if r.seconds else 0.0

    def ms(v: float) -> str:
        return f"{v * 1000:.1f}"

    kinds: dict[str, int] = {}
    for w in workers:
        kinds[w.kind] = kinds.get(w.kind, 0) + 1
    per_phase = args.duration / (len(PHASES) * args.rounds)
    lines = [
        "",
        f"Chat queue benchmark: {args.requests} requests ({args.chat_share:.0%} chat) over {args.models} models, "
        f"{args.workers} workers ({kinds.get('text', 0)} text-only, {kinds.get('chat', 0)} chat+text, "
        f"{kinds.get('chat-only', 0)} chat-only), {args.concurrency} in flight, {args.rounds} rounds x 4 phases x "
        f"{per_phase:.0f}s, {'no ANALYZE' if args.no_analyze else 'ANALYZE'} after the fill",
        f"fill: {fill_seconds:.1f}s through text_request_create / chat_request_create; chat profiles "
        + ", ".join(f"{k} {v}" for k, v in sorted(profiles.items()))
        + (f"; refused {refused}" if refused else ""),
        f"queue before the measured phases {depth_before}, after {depth_after}",
        "",
        "| route | requests | req/s | p50 ms | p95 ms | errors |",
        "|---|---:|---:|---:|---:|---|",
    ]
    rows = [
        ("heartbeat  GET /status/heartbeat", hb, hb.latencies, True),
        ("text pop   POST /generate/text/pop (text-only workers)", tp, tp.latencies, True),
        ("           POST /generate/text/submit (text pop phase)", tp, tp.other_latencies, False),
        ("chat pop   POST /generate/text/pop (chat workers)", cp, cp.latencies, True),
        ("           POST /generate/text/submit (chat pop phase)", cp, cp.other_latencies, False),
        ("chat status GET /generate/chat/status/<id>", cs, cs.latencies, True),
    ]
    for label, r, lat, main_row in rows:
        errors = r.errors if main_row else {}
        if isinstance(r, PopResult) and not main_row:
            errors = {k: v for k, v in r.errors.items() if k.startswith("submit")}
        elif isinstance(r, PopResult):
            errors = {k: v for k, v in r.errors.items() if not k.startswith("submit")}
        err = ", ".join(f"{k}: {v}" for k, v in errors.items())
        lines.append(
            f"| {label} | {len(lat)} | {rps(r, lat):.1f} | {ms(pct(lat, 50))} | {ms(pct(lat, 95))} | {err} |"
        )
    lines += [
        "",
        "Pops by worker kind and what they handed out:",
        "",
        "| pops | count | p50 ms | p95 ms |",
        "|---|---:|---:|---:|",
    ]
    for r in (tp, cp):
        for k, lat in sorted(r.by_outcome.items()):
            lines.append(f"| {r.name}: {k} | {len(lat)} | {ms(pct(lat, 50))} | {ms(pct(lat, 95))} |")
    for r in (tp, cp):
        lines.append(
            f"\n{r.name}: {r.jobs} jobs popped and submitted ({r.jobs / r.seconds if r.seconds else 0:.1f} jobs/s; "
            f"{r.text_jobs} text, {r.chat_jobs} chat), {r.empty} empty pops"
        )
        for sample in r.error_samples[:3]:
            lines.append(f"  error sample: {sample}")
    tp_p95, cp_p95, hb_p95, cs_p95 = (pct(x.latencies, 95) for x in (tp, cp, hb, cs))
    p95_ratio = cp_p95 / tp_p95 if tp_p95 else float("inf")
    rps_ratio = rps(cp) / rps(tp) if rps(tp) else 0.0
    jobs_ratio = (
        (cp.jobs / cp.seconds) / (tp.jobs / tp.seconds) if tp.jobs and cp.seconds and tp.seconds else 0.0
    )
    st_ratio = cs_p95 / hb_p95 if hb_p95 else float("inf")
    lines += [
        "",
        "| ratio | measured | goal | met |",
        "|---|---:|---:|---|",
        f"| chat pop p95 / text pop p95 | {p95_ratio:.2f} | <= 2.0 | {'yes' if p95_ratio <= 2 else 'NO'} |",
        f"| chat pop req/s / text pop req/s | {rps_ratio:.2f} | >= 0.5 | {'yes' if rps_ratio >= 0.5 else 'NO'} |",
        f"| chat pop jobs/s / text pop jobs/s | {jobs_ratio:.2f} | (reported) | |",
        f"| chat status p95 / heartbeat p95 | {st_ratio:.2f} | <= 2.0 | {'yes' if st_ratio <= 2 else 'NO'} |",
        f"| chat status p50 / heartbeat p50 | {pct(cs.latencies, 50) / pct(hb.latencies, 50):.2f} | (reported) | |",
        f"| text pop req/s / heartbeat req/s | {rps(tp) / rps(hb) if rps(hb) else 0:.3f} | (reported) | |",
        f"| chat status req/s / heartbeat req/s | {rps(cs) / rps(hb) if rps(hb) else 0:.3f} | (reported) | |",
    ]
    return "\n".join(lines)


# --- Main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    env = bench_env(args)
    env.update(
        HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP="100000/second",
        HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP="100000/second",
        HORDE_CHAT_ADMISSION_ENABLED="true",
    )
    prepare(env)
    from django.db import connection

    server = Server(args.port, env, ROOT / "var" / "bench-chat-daphne.log")

    with serving(server):
        workers = make_workers(args, rng, make_owners(args.workers))
        connection.close()
        server.wait_ready()

        async def register():
            import httpx

            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=60) as client:
                await register_workers(client, workers, args.concurrency)

        print(f"registering {len(workers)} workers (first pop each, before the fill) ...", flush=True)
        asyncio.run(register())
        print(f"fill: {args.requests} requests over {args.models} models ...", flush=True)
        with KeepOnline():
            fill_seconds, profiles, refused = fill(args, rng, workers)
        if not args.no_analyze:
            analyze()
        depth_before = queue_counts()
        connection.close()
        totals = asyncio.run(measure(args, workers, rng))
        depth_after = queue_counts()
        connection.close()
        print(report(args, totals, workers, fill_seconds, profiles, refused, depth_before, depth_after))
        if args.keep_server:
            server.leave_running()
    return 0


if __name__ == "__main__":
    sys.exit(main())
