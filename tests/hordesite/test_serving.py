"""The web process's serving layer (Django's WSGI handler on a pool of threads under ASGI,
hordesite/wsgi_pool.py) answers exactly as Django's own ASGI handler does, serves the whole worker
loop, refuses an oversized body before Django reads it, and keeps one winner of racing submits.

Requests go through the layer in process, as daphne hands them over; the same requests through
Django's ASGI handler give Django's own answers to compare.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest
from django.core.asgi import get_asgi_application
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from chat.models import Generation, GenerationRequest
from contract.text import TEXT_POP_WAIT_MAX_SECONDS
from hordesite.db_guard import retrying_wsgi
from hordesite.wsgi_pool import PooledWSGI
from tests.chat.pop_helpers import queue_chat
from tests.oai.conftest import _restore_anonymous_user
from tests.oai.test_pop_long_poll import pops_served

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "Gryphe/MythoMax-L2-13b"
BRIDGE = "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def json(self):
        return json.loads(self.body)

    def header_set(self) -> set[tuple[str, str]]:
        return {(k.lower(), v) for k, v in self.headers}


class CountingApp:
    """The native WSGI application as hordesite.asgi builds it, counting the requests that reach it."""

    def __init__(self):
        self.app = retrying_wsgi(get_wsgi_application())
        self.calls = 0

    def __call__(self, environ, start_response):
        self.calls += 1
        return self.app(environ, start_response)


@pytest.fixture
def stacks():
    """(the WSGI application, the serving layer over it, Django's own ASGI handler)"""
    wsgi_app = CountingApp()
    pooled = PooledWSGI(wsgi_app, threads=4)
    yield wsgi_app, pooled, get_asgi_application()
    pooled.close()


async def _call(app, method: str, path: str, *, key: str | None = None, body=None, headers=None, query: bytes = b""):
    raw = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
    sent_headers = [(b"host", b"testserver")]
    if key:
        sent_headers.append((b"apikey", key.encode()))
    if body is not None and not any(k.lower() == "content-type" for k, _ in (headers or {}).items()):
        sent_headers.append((b"content-type", b"application/json"))
    sent_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if raw:
        sent_headers.append((b"content-length", str(len(raw)).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": sent_headers,
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }
    pending = [{"type": "http.request", "body": raw, "more_body": False}]
    finished = asyncio.Event()
    messages = []

    async def receive():
        if pending:
            return pending.pop(0)
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            finished.set()

    await app(scope, receive, send)
    start = next(m for m in messages if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return Answer(start["status"], [(k.decode(), v.decode()) for k, v in start["headers"]], body)


def call(app, method: str, path: str, **kw) -> Answer:
    return asyncio.run(_call(app, method, path, **kw))


def pop_body(**overrides):
    body = {"name": "hot-worker", "models": [MODEL], "max_length": 512, "max_context_length": 4096, "bridge_agent": BRIDGE}
    body.update(overrides)
    return body


def queue_request(horde, key: str, **body) -> str:
    body.setdefault("models", [MODEL])
    response = horde.text_async(key, **body)
    assert response.status_code == 202, response.content
    return response.json()["id"]


def test_answers_match_djangos_for_the_same_requests(stacks, make_user, horde):
    wsgi_app, pooled, plain = stacks
    worker, requester = make_user("hot-owner"), make_user("hot-requester", kudos=100)
    queued = queue_request(horde, requester.key)
    chat = queue_chat(requester.user)
    cases = [
        ("POST", "/api/v2/generate/text/pop", {"key": "not-a-key", "body": pop_body()}),
        ("POST", "/api/v2/generate/text/pop", {"body": pop_body()}),
        ("POST", "/api/v2/generate/text/pop", {"key": worker.key, "body": pop_body(models="one")}),
        ("POST", "/api/v2/generate/text/pop", {"key": worker.key, "body": pop_body(max_length=5)}),
        # No job for a model nobody asked for: an empty pop with its skipped counts (the first
        # call registers the worker; both answers come after it).
        ("POST", "/api/v2/generate/text/pop", {"key": worker.key, "body": pop_body(models=["nobody/wants-this"])}),
        ("POST", "/api/v2/generate/text/submit", {"key": worker.key, "body": {"id": "00000000-0000-0000-0000-000000000000", "generation": "x"}}),
        ("POST", "/api/v2/generate/text/submit", {"key": worker.key, "body": {"id": "not-a-uuid", "generation": "x"}}),
        ("POST", "/api/v2/generate/text/submit", {"key": worker.key, "body": {"generation": "x", "state": "nonsense"}}),
        ("POST", "/api/v2/generate/text/submit", {"key": worker.key, "body": [1, 2]}),
        ("GET", f"/api/v2/generate/text/status/{queued}", {}),
        ("GET", "/api/v2/generate/text/status/00000000-0000-0000-0000-000000000000", {}),
        ("GET", f"/api/v2/generate/chat/status/{chat.id}", {}),
        ("GET", "/api/v2/generate/chat/status/00000000-0000-0000-0000-000000000000", {}),
    ]
    call(plain, "POST", "/api/v2/generate/text/pop", key=worker.key, body=pop_body(models=["nobody/wants-this"]))
    for method, path, kw in cases:
        before = wsgi_app.calls
        via_layer = call(pooled, method, path, **kw)
        assert wsgi_app.calls == before + 1, f"{method} {path} {kw} did not run once"
        via_django = call(plain, method, path, **kw)
        assert via_layer.status == via_django.status, (path, kw, via_layer.body, via_django.body)
        assert via_layer.json() == via_django.json(), (path, kw)
        assert via_layer.header_set() == via_django.header_set(), (path, kw)
    assert call(pooled, "GET", f"/api/v2/generate/text/status/{queued}").json()["waiting"] == 1


@pytest.mark.parametrize(
    ("body", "headers", "query"),
    [
        (b'{"name": "hot-worker", "models": [', {}, b""),  # does not parse: DRF's parse error
        (b'{"name": NaN}', {}, b""),  # DRF's strict JSON refuses NaN
        (b"name=hot-worker", {"Content-Type": "application/x-www-form-urlencoded"}, b""),
        (json.dumps(pop_body()).encode(), {"Accept": "text/html"}, b""),
        (json.dumps(pop_body()).encode(), {}, b"format=json"),
        (b"", {}, b""),
    ],
)
def test_odd_requests_get_djangos_own_answer(stacks, make_user, body, headers, query):
    _, pooled, plain = stacks
    worker = make_user("odd-owner")
    via_layer = call(pooled, "POST", "/api/v2/generate/text/pop", key=worker.key, body=body, headers=headers, query=query)
    via_django = call(plain, "POST", "/api/v2/generate/text/pop", key=worker.key, body=body, headers=headers, query=query)
    assert (via_layer.status, via_layer.body) == (via_django.status, via_django.body)
    assert via_layer.status in (200, 400, 406, 415)


def test_a_body_over_djangos_memory_bound_is_413_before_either(stacks, make_user, settings):
    wsgi_app, pooled, plain = stacks
    worker = make_user("big-body-owner")
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = pop_body(softprompts=["x" * 2000])
    before = wsgi_app.calls
    via_layer = call(pooled, "POST", "/api/v2/generate/text/pop", key=worker.key, body=body)
    via_django = call(plain, "POST", "/api/v2/generate/text/pop", key=worker.key, body=body)
    assert wsgi_app.calls == before  # the layer answered, Django never read it
    assert (via_layer.status, via_layer.body) == (via_django.status, via_django.body)
    assert via_layer.status == 413 and via_layer.json()["rc"] == "RequestTooLarge"


def test_other_routes_and_methods_are_served_the_same_way(stacks, make_user, horde):
    wsgi_app, pooled, _ = stacks
    requester = make_user("cancel-requester", kudos=100)
    queued = queue_request(horde, requester.key)
    before = wsgi_app.calls
    assert call(pooled, "GET", "/api/v2/status/heartbeat").json()["message"] == "OK"
    cancelled = call(pooled, "DELETE", f"/api/v2/generate/text/status/{queued}", key=requester.key)
    assert cancelled.status == 200 and cancelled.json()["done"] is True
    assert call(pooled, "GET", "/api/v2/generate/text/pop").status == 405
    assert call(pooled, "GET", "/api/v2/generate/text/status/NOT-A-UUID").status == 404
    assert wsgi_app.calls == before + 4


def test_the_worker_loop_through_the_layer_settles_kudos(stacks, make_user, horde):
    _, pooled, _ = stacks
    worker, requester = make_user("loop-owner"), make_user("loop-requester", kudos=100)
    queued = queue_request(horde, requester.key, params={"max_length": 80})
    popped = call(pooled, "POST", "/api/v2/generate/text/pop", key=worker.key, body=pop_body())
    assert popped.status == 200 and popped.json()["id"] is not None
    assert popped.json()["payload"]["prompt"] == "Once upon a time"
    submitted = call(
        pooled, "POST", "/api/v2/generate/text/submit", key=worker.key,
        body={"id": popped.json()["id"], "generation": "A reply through the pool.", "state": "ok"},
    )
    assert submitted.status == 200 and submitted.json()["reward"] > 0
    status = call(pooled, "GET", f"/api/v2/generate/text/status/{queued}").json()
    assert status["done"] is True and status["generations"][0]["text"] == "A reply through the pool."
    generation = Generation.objects.get(pk=popped.json()["id"])
    assert generation.state == Generation.State.OK
    assert float(generation.kudos) == pytest.approx(submitted.json()["reward"], abs=0.01)
    assert worker.refresh().kudos > 0 and requester.refresh().kudos < 100
    assert GenerationRequest.objects.get(pk=queued).jobs_waiting == 0


@pytest.mark.postgres_only
def test_racing_submits_have_one_winner(stacks, make_user, horde):
    _, pooled, _ = stacks
    worker, requester = make_user("race-owner"), make_user("race-requester", kudos=100)
    queue_request(horde, requester.key)
    job = call(pooled, "POST", "/api/v2/generate/text/pop", key=worker.key, body=pop_body()).json()["id"]
    body = {"id": job, "generation": "First!", "state": "ok"}

    async def race():
        return await asyncio.gather(
            *(_call(pooled, "POST", "/api/v2/generate/text/submit", key=worker.key, body=body) for _ in range(4))
        )

    answers = asyncio.run(race())
    assert sorted(a.status for a in answers) == [200, 400, 400, 400]
    assert {a.json().get("rc") for a in answers if a.status == 400} == {"DuplicateGen"}
    worker_kudos = worker.refresh().kudos
    reward = next(a.json()["reward"] for a in answers if a.status == 200)
    assert float(worker_kudos) == pytest.approx(reward, abs=0.01)  # paid once


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_submit_bodies = st.fixed_dictionaries(
    {},
    optional={
        "id": st.uuids().map(str) | st.text(max_size=40) | _json,
        "generation": st.text(max_size=40) | _json,
        "state": st.sampled_from(["ok", "censored", "faulted", "csam", "nonsense"]) | _json,
        "seed": st.integers(-(2**70), 2**70) | _json,
        "gen_metadata": _json,
        "message": _json,
        "finish_reason": _json,
    },
) | _json
_content_types = st.sampled_from(
    ["application/json", "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded"]
)
_accepts = st.sampled_from(["", "*/*", "application/json", "application/*", "text/html", "application/json, text/plain"])


@hypothesis_settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=_submit_bodies, content_type=_content_types, accept=_accepts)
def test_fuzzed_submits_get_djangos_answer(stacks, make_user, body, content_type, accept):
    """Whatever the body and headers, the layer answers a submit of no existing job exactly as
    Django's own ASGI handler does."""
    _, pooled, plain = stacks
    worker = make_user()
    headers = {"Content-Type": content_type, **({"Accept": accept} if accept else {})}
    raw = json.dumps(body).encode()
    kw = {"key": worker.key, "body": raw, "headers": headers}
    via_layer = call(pooled, "POST", "/api/v2/generate/text/submit", **kw)
    via_django = call(plain, "POST", "/api/v2/generate/text/submit", **kw)
    assert (via_layer.status, via_layer.body) == (via_django.status, via_django.body), (body, headers)
    assert via_layer.header_set() == via_django.header_set()
    assert via_layer.status < 500


def nested(depth: int) -> bytes:
    """A small JSON object whose prompt nests `depth` arrays deep (2 KB at 1,000)."""
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "models": ["m"]}'


@pytest.mark.parametrize("caller", ["anonymous", "keyed"])
@pytest.mark.parametrize("path", ["/api/v2/generate/text/pop", "/api/v2/generate/text/submit"])
def test_a_body_nested_a_thousand_deep_is_a_400_in_the_native_shape(stacks, make_user, caller, path):
    """Pop and submit refuse a 2 KB body nested 1,000 deep in {"message", "rc"}, as Django's own ASGI
    handler does (issue 12 saw daphne's HTML 500 for it from the hot route layer)."""
    _restore_anonymous_user()  # a transactional test's flush removed the migration's row
    _, pooled, plain = stacks
    key = make_user(f"deep-{caller}").key if caller == "keyed" else None
    via_layer = call(pooled, "POST", path, key=key, body=nested(1_000))
    via_django = call(plain, "POST", path, key=key, body=nested(1_000))
    assert (via_layer.status, via_layer.json()) == (via_django.status, via_django.json())
    assert dict(via_layer.headers)["Content-Type"] == "application/json"
    if caller == "anonymous":
        # Anonymous may not own workers: refused before its body is read, in the same shape.
        assert via_layer.status == 403 and via_layer.json()["rc"] == "AnonForbiddenWorker", via_layer.body
    else:
        assert via_layer.status == 400, via_layer.body
        assert via_layer.json() == {"message": "The request body nests too deeply.", "rc": "BadRequest"}


def test_an_empty_pop_that_waits_is_held_and_the_wait_header_never_leaves(stacks, make_user, settings):
    """A pop with `wait` that finds nothing is held on the event loop (ADR 0024) up to its wait, then
    answers the empty pop; the layer's internal header is not sent."""
    _, pooled, _ = stacks
    settings.HORDE_POP_WAIT_RECHECK_SECONDS = 0.2
    worker = make_user("wait-owner")
    started = asyncio.run(_timed(pooled, worker.key, pop_body(models=["nobody/wants-this"], wait=1)))
    answer, elapsed = started
    assert answer.status == 200 and answer.json()["id"] is None
    assert 1.0 <= elapsed < TEXT_POP_WAIT_MAX_SECONDS / 2  # ended by its wait, not the bound's 20 s
    assert all(
        name.lower() not in ("x-horde-pop-wait", "x-horde-pop-lists", "x-horde-pop-recheck") for name, _ in answer.headers
    )
    with pops_served() as runs:
        at_once, elapsed = asyncio.run(_timed(pooled, worker.key, pop_body(models=["nobody/wants-this"])))
    # Not held: run once (a held pop runs again at once, after registering for the signal).
    assert at_once.json() == answer.json() and len(runs) == 1 and elapsed < 5, (len(runs), elapsed)


async def _timed(app, key: str, body) -> tuple[Answer, float]:
    import time

    started = time.monotonic()
    answer = await _call(app, "POST", "/api/v2/generate/text/pop", key=key, body=body)
    return answer, time.monotonic() - started
