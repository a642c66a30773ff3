"""What a horde that runs for months keeps: the sweeps remove what outlived its request
(docs/adr/0082-what-a-long-running-horde-keeps.md)."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import F
from django.utils import timezone

from accounts.models import HordeUser
from chat import tasks
from chat.models import Generation, GenerationRequest
from workers.models import Worker

MODEL = "Gryphe/MythoMax-L2-13b"


def _finished_requests(requester, owner, count: int, *, expires_at, held: Decimal = Decimal("0")) -> list:
    """`count` requests as a busy horde leaves them: one settled generation each."""
    worker = Worker.objects.create(
        owner=owner.user, name=f"growth-worker-{count}", served_models=[MODEL], last_check_in=timezone.now()
    )
    requests = GenerationRequest.objects.bulk_create(
        GenerationRequest(
            user=requester.user, prompt="A prompt.", params={}, n=1, jobs_waiting=0, max_length=80,
            max_context_length=1024, requested_models=[MODEL], any_model=False, kudos_held=held,
            expires_at=expires_at,
        )
        for _ in range(count)
    )
    Generation.objects.bulk_create(
        Generation(request=request, worker=worker, model=MODEL, state=Generation.State.OK, text=" A reply.",
                   lease_expires_at=expires_at, finished_at=expires_at)
        for request in requests
    )
    HordeUser.objects.filter(pk=requester.user.pk).update(kudos_held=F("kudos_held") + held * count)
    return requests


@pytest.mark.django_db
def test_one_expiry_sweep_deletes_more_expired_requests_than_one_batch(make_user, settings):
    """A horde creating more than a batch of requests per sweep interval (1,000 a minute is 17 a
    second) must delete them as fast as they expire, or its tables grow for as long as it runs."""
    # The sweep's time bound (half an interval) is the last test's: a loaded CI box took over the
    # default's 30 s for these 1,250 deletes once, and the sweep rightly left 67 to the next.
    settings.HORDE_SWEEP_INTERVAL_SECONDS = 3600
    requester, owner = make_user("growth-requester", kudos=100_000), make_user("growth-owner")
    past = timezone.now() - timedelta(seconds=5)
    _finished_requests(requester, owner, 1_250, expires_at=past, held=Decimal("2"))
    live = _finished_requests(requester, owner, 3, expires_at=timezone.now() + timedelta(minutes=10))

    assert tasks.expire_requests.apply().get() == 1_250

    assert sorted(GenerationRequest.objects.values_list("id", flat=True)) == sorted(r.id for r in live)
    assert Generation.objects.count() == 3
    # Every expired request's hold is released (the 3 live ones hold none).
    assert HordeUser.objects.get(pk=requester.user.pk).kudos_held == 0


@pytest.mark.django_db
def test_the_orphan_sweep_finds_orphans_listed_after_more_live_objects_than_a_batch(make_user, settings):
    """A busy horde holds more live chat objects than one batch of the orphan sweep (10,000 images
    within a request's 20 minutes is 8 a second): the orphans listed after them are deleted too,
    not left for as long as those live objects sort first."""
    from pathlib import Path

    from chat.object_store import CHAT_ORPHAN_SWEEP_BATCH, chat_image_key
    from chat.services.sweeps import delete_orphaned_chat_objects

    requester = make_user("orphan-requester")
    live = GenerationRequest.objects.bulk_create(
        GenerationRequest(
            user=requester.user, is_chat=True, chat_has_images=True, prompt="", params={}, max_length=80,
            max_context_length=1024, requested_models=[MODEL], expires_at=timezone.now() + timedelta(minutes=20),
        )
        for _ in range(2 * CHAT_ORPHAN_SWEEP_BATCH)
    )
    store = Path(settings.STORAGES["chat_images"]["OPTIONS"]["location"])
    store.mkdir(parents=True, exist_ok=True)
    for request in live:
        (store / chat_image_key(request.id, 0)).write_bytes(b"jpeg")
    orphans = {chat_image_key(uuid.uuid4(), 0) for _ in range(40)}
    for key in orphans:
        (store / key).write_bytes(b"jpeg")

    assert delete_orphaned_chat_objects() == len(orphans)

    left = {path.name for path in store.iterdir()}
    assert not left & orphans
    assert len(left) == len(live)


@pytest.mark.postgres_only
@pytest.mark.django_db
def test_a_submit_reads_its_users_waiting_requests_not_every_finished_one(horde, make_user):
    """The concurrency check of every submit reads the user's waiting jobs. A busy user (the shared
    anonymous user, a front's) has many more finished requests within their time to live: the
    check must not read those (measured: 78 ms a check, twice a submit, at 200,000 of them)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    requester, owner = make_user("busy-requester", kudos=1_000_000), make_user("busy-owner")
    _finished_requests(requester, owner, 5_000, expires_at=timezone.now() + timedelta(minutes=20))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE horde_requests")
    with CaptureQueriesContext(connection) as queries:
        assert horde.text_async(requester.key, models=[MODEL], params={"max_length": 16}).status_code == 202
    checks = [q["sql"] for q in queries.captured_queries if 'SUM("horde_requests"."jobs_waiting")' in q["sql"]]
    assert checks
    with connection.cursor() as cursor:
        for sql in checks:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
            plan = cursor.fetchone()[0]
            plan = plan if isinstance(plan, list) else json.loads(plan)
            scanned = _rows_scanned(plan[0]["Plan"])
            assert scanned <= 10, (scanned, sql)


def _rows_scanned(node: dict) -> int:
    """Rows the plan's scans read (kept or filtered out), over all loops."""
    own = 0
    if "Scan" in node["Node Type"]:
        own = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * node.get("Actual Loops", 1)
    return own + sum(_rows_scanned(child) for child in node.get("Plans", []))


@pytest.mark.django_db
def test_a_sweep_past_its_time_leaves_the_rest_to_the_next_one_but_always_deletes_a_batch(make_user, settings):
    """The expiry sweep shares the Celery worker with the lease sweeps: past half its interval it
    stops, after one batch at least (never fewer than a sweep deleted before)."""
    from chat.services.sweeps import EXPIRE_BATCH

    settings.HORDE_SWEEP_INTERVAL_SECONDS = 0
    requester, owner = make_user("late-requester"), make_user("late-owner")
    _finished_requests(requester, owner, EXPIRE_BATCH + 5, expires_at=timezone.now() - timedelta(seconds=5))

    assert tasks.expire_requests.apply().get() == EXPIRE_BATCH
    assert tasks.expire_requests.apply().get() == 5
    assert not GenerationRequest.objects.exists()
