"""An idle worker's empty pops are answered from memory until the queue grows: a new request (text
or chat) or a requeued job reaches the very next pop, and a changed declaration walks the queue."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from chat import tasks
from chat.models import Generation
from tests.chat.pop_helpers import chat_pop

pytestmark = pytest.mark.redis_only

MODEL = "Gryphe/MythoMax-L2-13b"
OTHER = "koboldcpp/LLaMA2-13B-Psyfighter2"


def _queue_reads(queries) -> list[str]:
    return [q["sql"] for q in queries if "horde_requests" in q["sql"]]


@pytest.fixture
def people(make_user):
    return make_user("requester", kudos=1000), make_user("owner")


def test_second_empty_pop_reads_no_queue_and_keeps_the_skipped_counts(horde, people):
    requester, owner = people
    horde.text_async(requester.key, models=[OTHER])
    first = horde.pop(owner.key).json()
    assert first["id"] is None and first["skipped"] == {"models": 1}
    horde.pop(owner.key)  # reads the queue's addition count, walks once more, remembers it
    with CaptureQueriesContext(connection) as queries:
        again = horde.pop(owner.key).json()
    assert again["id"] is None and again["skipped"] == {"models": 1}
    assert _queue_reads(queries) == []


def test_a_new_request_reaches_the_next_pop(horde, people):
    requester, owner = people
    for _ in range(3):
        assert horde.pop(owner.key).json()["id"] is None
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    job = horde.pop(owner.key).json()
    assert job["id"] is not None
    assert Generation.objects.get(pk=job["id"]).request_id.hex == request_id.replace("-", "")


def test_a_new_chat_request_reaches_the_next_chat_pop(horde, people):
    requester, owner = people
    for _ in range(3):
        assert chat_pop(horde, owner.key).json()["id"] is None
    response = horde.client.post(
        "/api/v2/generate/chat/async",
        {"models": [MODEL], "messages": [{"role": "user", "content": "Hello"}]},
        format="json",
        HTTP_APIKEY=requester.key,
    )
    assert response.status_code == 202, response.content
    assert chat_pop(horde, owner.key).json()["id"] is not None


def test_a_requeued_job_reaches_the_next_pop(horde, people):
    requester, owner = people
    horde.text_async(requester.key, models=[MODEL])
    job = horde.pop(owner.key).json()["id"]
    for _ in range(3):
        assert horde.pop(owner.key, name="worker-2").json()["id"] is None
    Generation.objects.filter(pk=job).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert tasks.abort_stale_generations.apply().get() == 1
    retry = horde.pop(owner.key, name="worker-2").json()
    assert retry["id"] is not None and retry["id"] != job


def test_a_changed_declaration_walks_the_queue(horde, people):
    requester, owner = people
    horde.text_async(requester.key, models=[OTHER])
    for _ in range(3):
        assert horde.pop(owner.key).json()["id"] is None
    assert horde.pop(owner.key, models=[MODEL, OTHER]).json()["id"] is not None


def test_the_answer_is_remembered_for_a_bounded_time(horde, people, settings):
    requester, owner = people
    for _ in range(3):
        horde.pop(owner.key)
    settings.HORDE_EMPTY_POP_CACHE_SECONDS = 0.000001
    with CaptureQueriesContext(connection) as queries:
        assert horde.pop(owner.key).json()["id"] is None
    assert _queue_reads(queries)  # too old: walked again


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_request_passed_over_locked_reaches_the_next_pop(horde, people):
    """The pop's SKIP LOCKED passes over a request another transaction holds (a pop, a submit
    settling): that empty answer is not remembered, since no queue addition will announce the
    request once the lock is gone."""
    import threading

    from django.db import transaction

    from chat.models import GenerationRequest

    requester, owner = people
    for _ in range(2):
        assert horde.pop(owner.key).json()["id"] is None
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    locked, release = threading.Event(), threading.Event()

    def hold_the_row() -> None:
        try:
            with transaction.atomic():
                list(GenerationRequest.objects.select_for_update().filter(pk=request_id))
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    try:
        assert locked.wait(10)
        passed_over = horde.pop(owner.key).json()
    finally:
        release.set()
        holder.join(10)
    assert passed_over["id"] is None
    job = horde.pop(owner.key).json()
    assert job["id"] is not None
    assert Generation.objects.get(pk=job["id"]).request_id.hex == request_id.replace("-", "")
