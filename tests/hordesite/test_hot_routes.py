"""The hot route layer (pop, submit, text status) answers exactly as Django does, serves the
whole worker loop, leaves odd requests to Django, and keeps one winner of racing submits.

Requests go through the project's ASGI stack in process: BodyLimitMiddleware, then the layer, then
Django's ASGI handler; the same requests through the layer disabled give Django's own answers.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest
from django.core.asgi import get_asgi_application
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from chat.models import Generation, GenerationRequest
from hordesite.body_limits import BodyLimitMiddleware
from hordesite.hot_routes import HotRoutesASGI
from tests.chat.pop_helpers import queue_chat

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
    """Django's ASGI application, counting the requests that reach it."""

    def __init__(self):
        self.app = get_asgi_application()
        self.calls = 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        await self.app(scope, receive, send)


@pytest.fixture
def stacks():
    django_app = CountingApp()
    hot = HotRoutesASGI(django_app, enabled=True, threads=4)
    yield django_app, BodyLimitMiddleware(hot), BodyLimitMiddleware(HotRoutesASGI(django_app, enabled=False))
    if hot._pool is not None:
        hot._pool.shutdown(wait=True)


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
    django_app, hot, plain = stacks
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
        before = django_app.calls
        via_layer = call(hot, method, path, **kw)
        assert django_app.calls == before, f"{method} {path} {kw} went to Django"
        via_django = call(plain, method, path, **kw)
        assert via_layer.status == via_django.status, (path, kw, via_layer.body, via_django.body)
        assert via_layer.json() == via_django.json(), (path, kw)
        assert via_layer.header_set() == via_django.header_set(), (path, kw)
    assert call(hot, "GET", f"/api/v2/generate/text/status/{queued}").json()["waiting"] == 1


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
def test_requests_it_does_not_fully_understand_go_to_django(stacks, make_user, body, headers, query):
    django_app, hot, plain = stacks
    worker = make_user("odd-owner")
    before = django_app.calls
    via_layer = call(hot, "POST", "/api/v2/generate/text/pop", key=worker.key, body=body, headers=headers, query=query)
    assert django_app.calls == before + 1
    via_django = call(plain, "POST", "/api/v2/generate/text/pop", key=worker.key, body=body, headers=headers, query=query)
    assert (via_layer.status, via_layer.body) == (via_django.status, via_django.body)
    assert via_layer.status in (200, 400, 406, 415)


def test_a_body_over_djangos_memory_bound_is_413_before_either(stacks, make_user, settings):
    django_app, hot, plain = stacks
    worker = make_user("big-body-owner")
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = pop_body(softprompts=["x" * 2000])
    before = django_app.calls
    via_layer = call(hot, "POST", "/api/v2/generate/text/pop", key=worker.key, body=body)
    via_django = call(plain, "POST", "/api/v2/generate/text/pop", key=worker.key, body=body)
    assert django_app.calls == before  # BodyLimitMiddleware answered, Django never read it
    assert (via_layer.status, via_layer.body) == (via_django.status, via_django.body)
    assert via_layer.status == 413 and via_layer.json()["rc"] == "RequestTooLarge"


def test_other_routes_and_methods_go_to_django(stacks, make_user, horde):
    django_app, hot, _ = stacks
    requester = make_user("cancel-requester", kudos=100)
    queued = queue_request(horde, requester.key)
    before = django_app.calls
    assert call(hot, "GET", "/api/v2/status/heartbeat").json()["message"] == "OK"
    cancelled = call(hot, "DELETE", f"/api/v2/generate/text/status/{queued}", key=requester.key)
    assert cancelled.status == 200 and cancelled.json()["done"] is True
    assert call(hot, "GET", "/api/v2/generate/text/pop").status == 405
    assert call(hot, "GET", "/api/v2/generate/text/status/NOT-A-UUID").status == 404
    assert django_app.calls == before + 4


def test_the_worker_loop_through_the_layer_settles_kudos(stacks, make_user, horde):
    django_app, hot, _ = stacks
    worker, requester = make_user("loop-owner"), make_user("loop-requester", kudos=100)
    queued = queue_request(horde, requester.key, params={"max_length": 80})
    before = django_app.calls
    popped = call(hot, "POST", "/api/v2/generate/text/pop", key=worker.key, body=pop_body())
    assert popped.status == 200 and popped.json()["id"] is not None
    assert popped.json()["payload"]["prompt"] == "Once upon a time"
    submitted = call(
        hot, "POST", "/api/v2/generate/text/submit", key=worker.key,
        body={"id": popped.json()["id"], "generation": "A reply through the hot layer.", "state": "ok"},
    )
    assert submitted.status == 200 and submitted.json()["reward"] > 0
    status = call(hot, "GET", f"/api/v2/generate/text/status/{queued}").json()
    assert status["done"] is True and status["generations"][0]["text"] == "A reply through the hot layer."
    assert django_app.calls == before  # pop, submit and status never reached Django
    generation = Generation.objects.get(pk=popped.json()["id"])
    assert generation.state == Generation.State.OK
    assert float(generation.kudos) == pytest.approx(submitted.json()["reward"], abs=0.01)
    assert worker.refresh().kudos > 0 and requester.refresh().kudos < 100
    assert GenerationRequest.objects.get(pk=queued).jobs_waiting == 0


@pytest.mark.postgres_only
def test_racing_submits_through_the_layer_have_one_winner(stacks, make_user, horde):
    _, hot, _ = stacks
    worker, requester = make_user("race-owner"), make_user("race-requester", kudos=100)
    queue_request(horde, requester.key)
    job = call(hot, "POST", "/api/v2/generate/text/pop", key=worker.key, body=pop_body()).json()["id"]
    body = {"id": job, "generation": "First!", "state": "ok"}

    async def race():
        return await asyncio.gather(
            *(_call(hot, "POST", "/api/v2/generate/text/submit", key=worker.key, body=body) for _ in range(4))
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
    Django does (the layer's own answer or, for what it does not take, Django's)."""
    _, hot, plain = stacks
    worker = make_user()
    headers = {"Content-Type": content_type, **({"Accept": accept} if accept else {})}
    raw = json.dumps(body).encode()
    kw = {"key": worker.key, "body": raw, "headers": headers}
    via_layer = call(hot, "POST", "/api/v2/generate/text/submit", **kw)
    via_django = call(plain, "POST", "/api/v2/generate/text/submit", **kw)
    assert (via_layer.status, via_layer.body) == (via_django.status, via_django.body), (body, headers)
    assert via_layer.header_set() == via_django.header_set()
    assert via_layer.status < 500
