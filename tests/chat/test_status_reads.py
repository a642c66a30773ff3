"""The status routes' cheap reads: request_get compiled once per process, the online-worker and
queue snapshots with their derived facts, and each poll's one cache read and one database read."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.db import connection
from django.db.models import Count, Q
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from chat import sql
from chat.models import Generation, GenerationRequest
from chat.selectors import snapshots
from chat.selectors import status as selectors
from chat.selectors.availability import (
    _chat_pass,
    _text_eligible,
    availability_cache_key,
    chat_request_availability,
)
from chat.selectors.queue import worker_may_take
from contract.process_cache import reset_process_caches
from tests.chat.chat_route_helpers import MODEL, chat_async, chat_status, chat_worker
from workers.models import Worker

OTHER = "koboldcpp/Marx-3B-V3"
THIRD = "koboldcpp/Enterredaas-65b"


@pytest.fixture
def owner(make_user):
    return make_user("owner")


@pytest.fixture
def requester(make_user):
    return make_user("r", kudos=100_000)


def _orm_read(request_id, *, is_chat: bool) -> GenerationRequest | None:
    counts = {
        f"gen_{state}": Count("generations", filter=Q(generations__state=state)) for state in Generation.State.values
    }
    return (
        GenerationRequest.objects.filter(pk=request_id, is_chat=is_chat)
        .defer("prompt", "submitted_prompt", "messages", "params", "chat_extras")
        .annotate(**counts)
        .first()
    )


def _facts(request: GenerationRequest) -> dict:
    loaded = {f.attname: getattr(request, f.attname) for f in GenerationRequest._meta.concrete_fields
              if f.attname in request.__dict__}
    loaded.update({k: v for k, v in request.__dict__.items() if k.startswith("gen_")})
    return loaded


# --- request_get ------------------------------------------------------------------------------


def test_compiled_read_matches_the_orm_read(horde, owner, requester):
    horde.pop(owner.key, name="w")  # registers the worker
    request_id = horde.text_async(
        requester.key, models=[MODEL, OTHER], params={"n": 3, "max_length": 100}
    ).json()["id"]
    worker = Worker.objects.get(name="w")
    lease = timezone.now() + timedelta(seconds=150)
    for state in ("processing", "ok", "faulted", "ok"):
        Generation.objects.create(request_id=request_id, worker=worker, model=MODEL, state=state,
                                  lease_expires_at=lease)
    compiled = selectors.request_get(request_id)
    expected = _orm_read(request_id, is_chat=False)
    assert _facts(compiled) == _facts(expected)
    assert compiled.gen_ok == 2 and compiled.gen_processing == 1 and compiled.gen_faulted == 1
    assert compiled.requested_models == [MODEL, OTHER]  # JSON converted as the ORM converts it
    assert compiled._state.adding is False and compiled._state.db == "default"
    # Deferred fields load on access, as from the ORM read.
    assert compiled.prompt == "Once upon a time"


def test_compiled_read_keeps_route_families_apart(horde, owner, requester):
    chat_worker(owner)
    chat_id = chat_async(horde.client, requester.key).json()["id"]
    text_id = horde.text_async(requester.key).json()["id"]
    assert selectors.request_get(chat_id) is None
    assert selectors.request_get(text_id, is_chat=True) is None
    assert selectors.request_get(uuid.uuid4()) is None
    chat = selectors.request_get(chat_id, is_chat=True)
    assert _facts(chat) == _facts(_orm_read(chat_id, is_chat=True))
    assert str(selectors.request_get(str(text_id)).pk) == text_id  # a string id reads too


def test_compiled_reads_are_forgotten_by_the_process_reset(horde, requester):
    request_id = horde.text_async(requester.key).json()["id"]
    assert selectors.request_get(request_id) is not None
    assert sql._request_reads
    reset_process_caches()
    assert not sql._request_reads
    assert selectors.request_get(request_id) is not None


def test_every_status_poll_is_one_query(horde, owner, requester):
    horde.pop(owner.key, name="w", models=[MODEL])
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    horde.status(request_id)  # snapshots taken
    for _ in range(2):  # no body is kept between polls: the second reads the row again
        with CaptureQueriesContext(connection) as queries:
            body = horde.status(request_id).json()
        # The request, its counts and the workers' serving version, with or without Redis.
        assert len(queries) == 1, [q["sql"] for q in queries]
        assert body["is_possible"] is True and body["queue_position"] == 0 and body["waiting"] == 1


def test_a_done_text_poll_reads_its_results_in_one_more_query(horde, owner, requester):
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    job = horde.pop(owner.key, name="w", models=[MODEL]).json()["id"]
    assert horde.submit(owner.key, job, generation="Done.").status_code == 200
    with CaptureQueriesContext(connection) as queries:
        body = horde.status(request_id).json()
    # The row (only the columns the body reads) and the finished generations with their workers.
    assert len(queries) == 2, [q["sql"] for q in queries]
    assert body["done"] is True and body["finished"] == 1 and body["kudos"] > 0
    assert [(g["text"], g["worker_name"], g["model"]) for g in body["generations"]] == [("Done.", "w", MODEL)]


def test_the_finished_generations_read_matches_the_orm_read(horde, owner, requester):
    horde.pop(owner.key, name="w1")  # registers the workers
    horde.pop(owner.key, name="w2")
    request_id = horde.text_async(requester.key, models=[MODEL], params={"n": 4}).json()["id"]
    w1, w2 = Worker.objects.get(name="w1"), Worker.objects.get(name="w2")
    now = timezone.now()
    lease = now + timedelta(seconds=150)
    rows = [  # (worker, state, finished seconds ago): listed by finish, the oldest first
        (w2, "ok", 1), (w1, "censored", 3), (w1, "faulted", 2), (w2, "processing", None), (w1, "ok", 2),
    ]
    for index, (worker, state, ago) in enumerate(rows):
        Generation.objects.create(
            request_id=request_id, worker=worker, model=MODEL, state=state, text=f"t{index}", seed=index,
            gen_metadata=[{"type": "info", "value": str(index)}], lease_expires_at=lease,
            finished_at=None if ago is None else now - timedelta(seconds=ago),
        )
    expected = list(
        Generation.objects.filter(request_id=request_id, state__in=Generation.FINISHED_STATES)
        .select_related("worker").order_by("finished_at")
    )
    with CaptureQueriesContext(connection) as queries:
        loaded = sql.finished_generations(uuid.UUID(request_id))
        shown = [(g.text, g.seed, g.gen_metadata, g.worker_id, g.worker.name, g.model, g.state, g.created)
                 for g in loaded]
    assert len(queries) == 1, [q["sql"] for q in queries]  # every field the body reads is loaded
    assert shown == [(g.text, g.seed, g.gen_metadata, g.worker_id, g.worker.name, g.model, g.state, g.created)
                     for g in expected]
    assert [g.text for g in loaded] == ["t1", "t4", "t0"]
    assert sql.finished_generations(uuid.uuid4()) == []


def test_a_change_shows_on_the_next_poll_with_nothing_announced(horde, owner, requester):
    horde.pop(owner.key, name="w", models=[MODEL])
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    assert horde.status(request_id).json()["waiting"] == 1
    # A write no service announces (an operator's UPDATE): the very next poll shows it.
    GenerationRequest.objects.filter(pk=request_id).update(jobs_waiting=0, cancelled=True)
    body = horde.status(request_id).json()
    assert (body["waiting"], body["done"]) == (0, True)


# --- The online-worker snapshot's facts ---------------------------------------------------------


def _worker(owner, name, models, **fields) -> Worker:
    defaults = dict(
        max_length=512, max_context_length=4096, threads=1, last_check_in=timezone.now(),
        bridge_agent="KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp",
    )
    defaults.update(fields)
    return Worker.objects.create(name=name, owner=owner.user, served_models=models, **defaults)


def test_candidates_are_the_workers_serving_a_requested_model_in_snapshot_order(owner):
    a = _worker(owner, "a", [MODEL, OTHER], threads=2)
    b = _worker(owner, "b", [OTHER])
    c = _worker(owner, "c", [THIRD], accepts_prompt_jobs=False)
    d = chat_worker(owner, model=OTHER)  # text jobs too (served_models [OTHER])
    online = snapshots.online_workers_of([a, b, c, d])
    assert online.tokens_per_second == 10.0 * 5
    assert [w.name for w in online.text_candidates([OTHER, MODEL], any_model=False)] == ["a", "b", d.name]
    assert online.text_candidates([THIRD], any_model=False) == []  # c takes no prompt jobs
    assert [w.name for w in online.text_candidates([], any_model=True)] == ["a", "b", d.name]
    assert [w.name for w in online.chat_candidates([MODEL, OTHER])] == [d.name]
    assert online.chat_candidates([MODEL]) == []


def test_the_indexed_pass_finds_what_the_full_pass_finds(horde, owner, requester):
    workers = [
        _worker(owner, "a", [MODEL], threads=2),
        _worker(owner, "b", [MODEL, OTHER], max_length=64),
        _worker(owner, "c", [OTHER], max_context_length=1024, threads=3),
        _worker(owner, "d", [THIRD], bridge_agent="unknown:1:x"),
        _worker(owner, "e", [MODEL], speed=0.5),
        _worker(owner, "f", [MODEL], accepts_prompt_jobs=False),
        chat_worker(owner, model=MODEL, max_length=256),
        chat_worker(owner, model=OTHER, features=[]),
    ]
    online = snapshots.online_workers_of(workers)
    bodies = [
        {"models": [MODEL]},
        {"models": [OTHER], "params": {"max_length": 100, "max_context_length": 2048}},
        {"models": [MODEL, OTHER, THIRD], "params": {"max_length": 100}},
        {"models": [THIRD], "validated_backends": False},
        {"models": [MODEL], "slow_workers": False},
        {"models": []},
        {"models": ["nobody/serves-this"]},
    ]
    for body in bodies:
        request = GenerationRequest.objects.get(pk=horde.text_async(requester.key, **body).json()["id"])
        full = sum(max(w.threads, 1) for w in workers if worker_may_take(w, request, set()))
        assert _text_eligible(request, online).threads == full, body
    chat_request = GenerationRequest.objects.get(
        pk=chat_async(horde.client, requester.key, models=[MODEL, OTHER], max_tokens=128).json()["id"]
    )
    full = sum(max(w.threads, 1) for w in workers if worker_may_take(w, chat_request, set()))
    assert full > 0 and _chat_pass(chat_request, online).eligible_worker_threads == full


def test_requests_of_one_shape_share_a_pass_and_every_poll_finds_its_own_answer(horde, owner, requester):
    """The snapshot keeps a text pass per request shape: each request's status still shows what a
    pass of its own would find, for shapes that differ in any rule and for worker lists."""
    horde.pop(owner.key, name="a", models=[MODEL], threads=2, max_length=256)
    horde.pop(owner.key, name="b", models=[MODEL, OTHER], max_length=512)
    b = Worker.objects.get(name="b")
    bodies = [
        {"models": [MODEL]},
        {"models": [MODEL]},  # the same shape as the first
        {"models": [MODEL], "params": {"max_length": 300}},  # only b takes it
        {"models": [MODEL], "params": {"max_length": 600}},  # nobody
        {"models": [MODEL], "workers": [str(b.id)]},  # b alone
        {"models": [MODEL], "workers": [str(b.id)], "worker_blacklist": True},  # a alone
        {"models": [MODEL], "trusted_workers": True},  # the owner is not trusted
        {"models": [OTHER]},
    ]
    ids = [horde.text_async(requester.key, **body).json()["id"] for body in bodies]
    snapshots.reset_snapshots()
    online = snapshots.online_worker_facts()
    for _ in range(2):  # the second round reads every shape from the snapshot
        for body, request_id in zip(bodies, ids, strict=True):
            request = GenerationRequest.objects.get(pk=request_id)
            listed = set(request.worker_rows.values_list("worker_id", flat=True)) if body.get("workers") else set()
            own = sum(max(w.threads, 1) for w in online.workers if worker_may_take(w, request, listed))
            assert chat_request_availability(request).eligible_worker_threads == own, body
            assert horde.status(request_id).json()["is_possible"] is (own > 0), body
    assert [chat_request_availability(GenerationRequest.objects.get(pk=i)).eligible_worker_threads for i in ids] == [
        3, 3, 1, 0, 1, 2, 0, 1
    ]
    assert snapshots.online_worker_facts() is online  # one snapshot answered every poll


def test_wait_time_uses_the_eligible_workers_throughput(horde, owner, requester):
    horde.pop(owner.key, name="a", models=[MODEL], threads=2)
    horde.pop(owner.key, name="b", models=[OTHER])
    first = horde.text_async(requester.key, models=[MODEL], params={"max_length": 300}).json()["id"]
    second = horde.text_async(requester.key, models=[MODEL], params={"max_length": 300}).json()["id"]
    snapshots.reset_snapshots()
    body = horde.status(second).json()
    assert body["queue_position"] == 1
    # 600 tokens over worker a's 2 threads at 10 tokens/s; worker b serves another model (ADR 0040).
    assert body["wait_time"] == 30
    assert horde.status(first).json()["queue_position"] == 0


# --- The queue snapshot ---------------------------------------------------------------------


def test_queue_snapshot_positions_and_tokens(horde, requester, make_user):
    rich = make_user("rich", kudos=1_000_000)
    ids = [horde.text_async(requester.key, params={"max_length": 100 + i, "n": 1}).json()["id"] for i in range(3)]
    ahead = horde.text_async(rich.key, params={"max_length": 50, "n": 2}).json()["id"]
    GenerationRequest.objects.filter(pk=ids[2]).update(cancelled=True)
    snapshots.reset_snapshots()
    places = {i: snapshots.queue_place(uuid.UUID(i)) for i in [ahead, *ids]}
    assert places[ahead] == snapshots.QueuePlace(position=0, tokens_ahead=0)
    assert places[ids[0]] == snapshots.QueuePlace(position=1, tokens_ahead=100)
    assert places[ids[1]] == snapshots.QueuePlace(position=2, tokens_ahead=200)
    assert places[ids[2]] is None  # not waiting


def test_a_request_newer_than_the_snapshot_is_counted_live(horde, requester):
    first = horde.text_async(requester.key, params={"max_length": 80}).json()["id"]
    assert horde.status(first).json()["queue_position"] == 0  # the snapshot is taken
    newer = horde.text_async(requester.key, params={"max_length": 80}).json()["id"]
    assert snapshots.queue_place(uuid.UUID(newer)) is None
    assert horde.status(newer).json()["queue_position"] == 1


# --- The status poll's cache read ------------------------------------------------------------


def _cache_calls(monkeypatch) -> list[str]:
    calls, depth = [], [0]
    for name in ("get", "get_many", "set", "set_many"):
        original = getattr(cache, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            if not depth[0]:  # the callers' calls, not the backend's own (locmem's get_many gets)
                calls.append(_name)
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(cache, name, spy)
    return calls


@pytest.mark.redis_only
def test_a_text_poll_leaves_the_cache_alone(horde, owner, requester, monkeypatch):
    horde.pop(owner.key, name="w", models=[MODEL], threads=2)
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    cache.clear()
    calls = _cache_calls(monkeypatch)
    for _ in range(2):
        assert horde.status(request_id).json()["is_possible"] is True
        # The serving version comes with the request's row; the pass is made from the snapshot.
        assert calls == []
    assert cache.get(availability_cache_key(request_id)) is None


@pytest.mark.redis_only
def test_a_chat_poll_reads_its_pass_and_writes_it_once(
    horde, owner, requester, monkeypatch
):
    chat_worker(owner, threads=2)
    request_id = chat_async(horde.client, requester.key).json()["id"]
    cache.clear()
    calls = _cache_calls(monkeypatch)
    assert chat_status(horde.client, request_id).json()["eligible_worker_threads"] == 2
    assert calls == ["get", "set"]  # one read, then the pass it made
    assert cache.get(availability_cache_key(request_id)).eligible_worker_threads == 2
    calls.clear()
    assert chat_status(horde.client, request_id).json()["eligible_worker_threads"] == 2
    assert calls == ["get"]  # the cached pass: one read


def test_a_chat_poll_with_its_pass_cached_is_one_query(horde, owner, requester):
    """Its queue estimate reads the workers the cached pass found: no query of its own."""
    chat_worker(owner, threads=2)
    request_id = chat_async(horde.client, requester.key).json()["id"]
    chat_status(horde.client, request_id)  # the pass and the snapshots are made
    with CaptureQueriesContext(connection) as queries:
        body = chat_status(horde.client, request_id).json()
    assert len(queries) == 1, [q["sql"] for q in queries]
    assert body["eligible_worker_threads"] == 2 and body["queue_position"] == 0


def test_an_unknown_request_is_404_and_writes_nothing(horde, requester):
    request_id = uuid.uuid4()
    cache.clear()
    assert horde.client.get(f"/api/v2/generate/text/status/{request_id}").status_code == 404
    assert chat_status(horde.client, request_id).status_code == 404
    assert cache.get(availability_cache_key(request_id)) is None


def test_the_chat_status_reads_a_cached_pass(horde, owner, requester):
    chat_worker(owner, threads=3, max_length=1024)
    request_id = chat_async(horde.client, requester.key, max_tokens=512).json()["id"]
    request = GenerationRequest.objects.get(pk=request_id)
    assert chat_request_availability(request).eligible_worker_threads == 3  # the pass is cached
    Worker.objects.update(maintenance=True)
    snapshots.reset_snapshots()
    body = chat_status(horde.client, request_id).json()
    assert body["eligible_worker_threads"] == 3 and body["is_possible"] is True  # cached 60 s
    cache.clear()
    body = chat_status(horde.client, request_id).json()
    assert body["eligible_worker_threads"] == 0 and body["is_possible"] is False


@pytest.mark.redis_only
def test_the_chat_pass_keeps_its_lifetime_on_redis(horde, owner, requester):
    from django_redis import get_redis_connection

    chat_worker(owner)
    request_id = chat_async(horde.client, requester.key).json()["id"]
    cache.clear()
    chat_status(horde.client, request_id)
    availability_ttl = get_redis_connection("default").pttl(cache.make_key(availability_cache_key(request_id)))
    assert 50_000 < availability_ttl <= 60_000


@pytest.mark.redis_only
def test_status_answers_with_the_cache_down(horde, owner, requester, settings):
    horde.pop(owner.key, name="w", models=[MODEL], threads=2)
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    chat_worker(owner)
    chat_id = chat_async(horde.client, requester.key).json()["id"]
    settings.CACHES = {
        "default": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",  # a closed port
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.2, "SOCKET_TIMEOUT": 0.2, "IGNORE_EXCEPTIONS": True},
        }
    }
    body = horde.status(request_id).json()
    assert body["waiting"] == 1 and body["is_possible"] is True
    chat = chat_status(horde.client, chat_id).json()
    assert chat["waiting"] == 1 and chat["eligible_worker_threads"] == 1


def test_the_text_status_route_reads_no_key_as_upstream(horde, requester):
    """The id is the credential, as upstream: KoboldAI Lite polls and cancels without a key, and a
    key the horde does not know is not read on these routes either (no 401)."""
    request_id = horde.text_async(requester.key).json()["id"]
    assert horde.status(request_id).json()["waiting"] == 1
    polled = horde.status(request_id, key="a-key-no-user-has")
    assert polled.status_code == 200 and polled.json()["waiting"] == 1
    cancelled = horde.cancel(request_id, key="a-key-no-user-has")
    assert cancelled.status_code == 200 and cancelled.json()["waiting"] == 0
    assert GenerationRequest.objects.get(pk=request_id).cancelled
