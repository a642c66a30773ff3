"""A check-in that changes what a worker serves (its first pop, a changed declaration, its return
online) shows in every web process's status answers at once (issue 11, item 2): a request queued
right after a worker's first pop reads is_possible on every poll, not after the online workers
snapshot (5 s) or the availability cache (60 s) of some process catches up.

The second process is real where the suite has PostgreSQL and Redis: a daphne web process started
on the test database and Redis, holding its own snapshots. Everywhere else, the second process's
per-process snapshot is a second snapshot object taken before the check-in, as that process would
hold it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.utils import timezone

from chat.models import Generation, GenerationRequest
from chat.selectors import snapshots
from chat.selectors.availability import availability_cache_key
from chat.selectors.status import request_get
from contract.process_cache import ProcessCache
from contract.text import WORKER_ONLINE_SECONDS
from tests.chat.chat_route_helpers import ALL_DECLARATIONS, MODEL, chat_async, chat_status
from tests.ports import free_port
from workers.models import Worker
from workers.services import worker_rows, worker_update
from workers.serving_version import current_serving_version

ROOT = Path(__file__).resolve().parents[2]
WEATHER = {"type": "function", "function": {"name": "lookup_weather", "parameters": {"type": "object"}}}
WITHOUT_TOOLS = [value for value in ALL_DECLARATIONS if value != "tools"]


def _declaration(features=ALL_DECLARATIONS, **body) -> dict:
    return {
        "name": "volunteer-worker",
        "models": [MODEL],
        "threads": 2,
        "chat_jobs": True,
        "model_id": MODEL,
        "chat_features": list(features),
        "chat_limits": {"max_context_length": 8192, "max_length": 1024},
        **body,
    }


@pytest.fixture
def people(make_user):
    return make_user("client", kudos=10_000), make_user("volunteer")


def _database_url() -> str:
    db = connection.settings_dict
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.fixture
def second_process(transactional_db, tmp_path):
    """Another web process of the same horde: daphne on the test database and Redis."""
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "hordesite.settings",
        "DATABASE_URL": _database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_BROKER_URL": settings.REDIS_URL,
        "HORDE_TEXT_MODEL_REFERENCE": str(settings.HORDE_TEXT_MODEL_REFERENCE),
        "PYTHONUNBUFFERED": "1",
    }
    daphne = str(Path(sys.executable).with_name("daphne"))
    log = open(tmp_path / "daphne.log", "wb")  # noqa: SIM115 - kept open for the child's lifetime
    process = subprocess.Popen(
        [daphne, "-b", "127.0.0.1", "-p", str(port), "hordesite.asgi:application"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if client.get("/api/v2/status/heartbeat").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError((tmp_path / "daphne.log").read_text())
            time.sleep(0.1)
        yield client
    finally:
        client.close()
        process.terminate()
        process.wait(10)
        log.close()


def _polls(horde, second, request_id, *, chat: bool, count: int = 4) -> list[dict]:
    """Alternate polls of this process and the other one."""
    path = f"/api/v2/generate/{'chat' if chat else 'text'}/status/{request_id}"
    bodies = []
    for _ in range(count):
        here = horde.client.get(path)
        there = second.get(path)
        assert here.status_code == 200 and there.status_code == 200, (here.content, there.text)
        bodies += [here.json(), there.json()]
    return bodies


def _worker_count(horde, second) -> tuple[int, int]:
    """Both processes' online worker snapshots, as /status/performance reads them."""
    here = horde.client.get("/api/v2/status/performance").json()["text_worker_count"]
    return here, second.get("/api/v2/status/performance").json()["text_worker_count"]


@pytest.mark.postgres_only
@pytest.mark.redis_only
def test_a_request_queued_right_after_a_first_pop_is_possible_on_every_poll_of_two_processes(
    horde, people, second_process
):
    requester, owner = people
    assert _worker_count(horde, second_process) == (0, 0)  # both snapshots taken, nobody online
    assert horde.pop(owner.key, **_declaration()).json()["id"] is None  # the first pop: registers
    chat = chat_async(horde.client, requester.key, max_tokens=300)
    assert chat.status_code == 202 and chat.json()["warnings"] == [], chat.json()
    text_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    for body in _polls(horde, second_process, chat.json()["id"], chat=True):
        assert body["is_possible"] is True and body["eligible_worker_threads"] == 2, body
        assert body["impossible_reason"] is None
    for body in _polls(horde, second_process, text_id, chat=False):
        assert body["is_possible"] is True, body
    assert _worker_count(horde, second_process) == (1, 1)


@pytest.mark.postgres_only
@pytest.mark.redis_only
def test_a_withdrawn_feature_shows_as_a_declaration_gap_in_both_processes_at_once(horde, people, second_process):
    requester, owner = people
    assert horde.pop(owner.key, **_declaration()).json()["id"] is None
    created = chat_async(horde.client, requester.key, tools=[WEATHER], tool_choice="auto")
    request_id = created.json()["id"]
    for body in _polls(horde, second_process, request_id, chat=True, count=2):
        assert body["is_possible"] is True and body["eligible_worker_threads"] == 2, body
    # The worker pops again without tools: it cannot take the request, and every answer says why.
    assert horde.pop(owner.key, **_declaration(WITHOUT_TOOLS)).json()["id"] is None
    gap = {"kind": "declaration_gap", "missing_declarations": ["tools"], "exceeded_limits": []}
    for body in _polls(horde, second_process, request_id, chat=True):
        assert body["is_possible"] is False and body["eligible_worker_threads"] == 0, body
        assert body["impossible_reason"] == gap


@pytest.mark.postgres_only
@pytest.mark.redis_only
def test_a_worker_back_online_shows_in_both_processes_at_once(horde, people, second_process):
    requester, owner = people
    assert horde.pop(owner.key, **_declaration()).json()["id"] is None
    # The worker went quiet past the online window before the request came (and out of this
    # process's worker rows, which it keeps for seconds).
    Worker.objects.update(last_check_in=timezone.now() - timedelta(seconds=400))
    worker_rows.clear()
    request_id = horde.text_async(requester.key, models=[MODEL], params={"n": 2}).json()["id"]
    for body in _polls(horde, second_process, request_id, chat=False, count=2):
        assert body["is_possible"] is False, body  # cached in both processes from here on
    # It pops again and takes one of the two jobs: the other waits, possible in both at once.
    assert horde.pop(owner.key, **_declaration()).json()["id"] is not None
    for body in _polls(horde, second_process, request_id, chat=False):
        assert body["is_possible"] is True and body["waiting"] == 1 and body["processing"] == 1, body


# --- Without a second server: the other process's snapshot as it would hold it ------------------


def test_a_first_pop_shows_through_another_process_snapshot_at_once(horde, people, monkeypatch):
    requester, owner = people
    this_process = snapshots._online_workers
    other_process = ProcessCache(
        "online workers snapshot", ttl=snapshots.ONLINE_WORKERS_SNAPSHOT_SECONDS, max_entries=1
    )

    def taken(snapshot):
        return snapshot.get_or_build(current_serving_version(), snapshots._build_online_workers)

    # Both processes took their snapshot before the worker's first pop: nobody online.
    for snapshot in (this_process, other_process):
        assert taken(snapshot).workers == ()
    assert horde.pop(owner.key, **_declaration()).json()["id"] is None
    created = chat_async(horde.client, requester.key, max_tokens=300)
    assert created.status_code == 202 and created.json()["warnings"] == [], created.json()
    request_id = created.json()["id"]
    for snapshot in (other_process, this_process, other_process):
        monkeypatch.setattr(snapshots, "_online_workers", snapshot)
        body = chat_status(horde.client, request_id).json()
        assert body["is_possible"] is True and body["eligible_worker_threads"] == 2, body
    assert [w.name for w in taken(other_process).workers] == ["volunteer-worker"]


def test_an_unchanged_pop_leaves_the_serving_version_alone(horde, people):
    _, owner = people
    assert current_serving_version() is None  # nothing has changed since the table was made
    horde.pop(owner.key, **_declaration())
    first = current_serving_version()
    assert first is not None  # the first pop counted
    for _ in range(3):
        horde.pop(owner.key, **_declaration())
    assert current_serving_version() == first
    # Past the check-in refresh the row is rewritten (last_check_in), still without a change.
    Worker.objects.update(last_check_in=timezone.now() - timedelta(seconds=60))
    worker_rows.clear()
    horde.pop(owner.key, **_declaration())
    assert current_serving_version() == first
    horde.pop(owner.key, **_declaration(threads=3))  # a changed declaration
    assert current_serving_version() == first + 1
    worker = Worker.objects.get()
    worker_update(worker_id=worker.pk, actor=owner.user, maintenance=True)  # the owner's switch
    assert current_serving_version() == first + 2


def test_a_status_poll_reads_the_serving_version_with_its_request(horde, people):
    requester, owner = people
    request_id = horde.text_async(requester.key).json()["id"]
    before = request_get(request_id)
    horde.pop(owner.key, **_declaration())  # the first pop takes the request and changes the version
    after = request_get(request_id)
    assert before.serving_version is None and after.serving_version == current_serving_version() is not None


def test_a_worker_gone_quiet_leaves_the_cached_availability_with_the_snapshot(horde, people):
    requester, owner = people
    horde.pop(owner.key, **_declaration())
    request_id = chat_async(horde.client, requester.key).json()["id"]
    Generation.objects.filter(request_id=request_id).delete()  # nothing taken: the job waits
    GenerationRequest.objects.filter(pk=request_id).update(jobs_waiting=1)
    # Its last check-in is about to leave the online window: no check-in announces that.
    Worker.objects.update(last_check_in=timezone.now() - timedelta(seconds=WORKER_ONLINE_SECONDS - 1))
    snapshots.reset_snapshots()
    cache.delete(availability_cache_key(request_id))  # the pass is made late in its quiet spell
    assert chat_status(horde.client, request_id).json()["eligible_worker_threads"] == 2  # pass cached
    time.sleep(1.2)
    snapshots.reset_snapshots()  # as each process's snapshot lapses within its 5 s
    body = chat_status(horde.client, request_id).json()
    assert body["is_possible"] is False and body["eligible_worker_threads"] == 0, body
