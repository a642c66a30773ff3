"""An idle worker's empty pops are answered from memory until one of its queue lists grows: a new
request (text or chat) or a requeued job it could take reaches the very next pop, a request for
another model or of another kind leaves the answer in memory (ADR 0051), and a changed declaration
walks the queue. In process, under the lists' stamps in Redis (the path of a process without a live
subscription to the queue's signal, ADR 0057)."""

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


@pytest.fixture(autouse=True)
def _lists_stamps(monkeypatch):
    """These pops run in process, where a process serving pops through daphne would use what its
    subscription heard (tests/oai/test_empty_pops_signal.py): here the lists' stamps in Redis are
    read, as in any process without a live subscription."""
    from chat.services import pop_cache
    from chat.services.pop_wait import QueueGrowth

    monkeypatch.setattr(pop_cache, "queue_growth", QueueGrowth())


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


def _queue_chat(horde, key: str) -> None:
    """A chat request for MODEL through the chat route."""
    response = horde.client.post(
        "/api/v2/generate/chat/async",
        {"models": [MODEL], "messages": [{"role": "user", "content": "Hello"}]},
        format="json",
        HTTP_APIKEY=key,
    )
    assert response.status_code == 202, response.content


def test_a_new_chat_request_reaches_the_next_chat_pop(horde, people):
    requester, owner = people
    for _ in range(3):
        assert chat_pop(horde, owner.key).json()["id"] is None
    _queue_chat(horde, requester.key)
    assert chat_pop(horde, owner.key).json()["id"] is not None


def _remembered(horde, key: str, **pop) -> dict:
    """Two empty pops: the second reads the lists' counts and walks again, and is remembered."""
    for _ in range(2):
        answer = horde.pop(key, **pop).json()
        assert answer["id"] is None
    return answer


def test_a_request_for_another_model_leaves_the_answer_in_memory(horde, people):
    requester, owner = people
    remembered = _remembered(horde, owner.key)
    assert horde.text_async(requester.key, models=[OTHER]).status_code == 202
    with CaptureQueriesContext(connection) as queries:
        again = horde.pop(owner.key).json()
    assert _queue_reads(queries) == []
    # The remembered answer, skipped counts and all, as old as the answer (at most
    # HORDE_EMPTY_POP_CACHE_SECONDS).
    assert again == remembered


def test_a_chat_request_for_its_model_leaves_a_text_workers_answer_in_memory(horde, people):
    requester, owner = people
    assert chat_pop(horde, owner.key, name="chat-worker").json()["id"] is None  # serves the model
    _remembered(horde, owner.key)
    _queue_chat(horde, requester.key)
    with CaptureQueriesContext(connection) as queries:
        assert horde.pop(owner.key).json()["id"] is None  # it takes no chat jobs
    assert _queue_reads(queries) == []


def test_a_request_naming_no_model_reaches_the_next_pop(horde, people):
    requester, owner = people
    _remembered(horde, owner.key)
    request_id = horde.text_async(requester.key, models=[]).json()["id"]
    job = horde.pop(owner.key).json()
    assert job["id"] is not None
    assert Generation.objects.get(pk=job["id"]).request_id.hex == request_id.replace("-", "")


def test_a_request_for_one_of_its_models_reaches_the_next_pop(horde, people):
    requester, owner = people
    _remembered(horde, owner.key, models=[OTHER, MODEL])
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    job = horde.pop(owner.key, models=[OTHER, MODEL]).json()
    assert job["id"] is not None
    assert Generation.objects.get(pk=job["id"]).request_id.hex == request_id.replace("-", "")


def test_a_job_requeued_for_another_model_leaves_the_answer_in_memory(horde, people):
    requester, owner = people
    horde.text_async(requester.key, models=[OTHER])
    job = horde.pop(owner.key, name="other-worker", models=[OTHER]).json()["id"]
    _remembered(horde, owner.key)
    Generation.objects.filter(pk=job).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert tasks.abort_stale_generations.apply().get() == 1
    with CaptureQueriesContext(connection) as queries:
        assert horde.pop(owner.key).json()["id"] is None
    assert _queue_reads(queries) == []
    assert horde.pop(owner.key, name="other-worker", models=[OTHER]).json()["id"] is not None


def test_a_lists_stamp_expires_and_its_expiry_ends_the_answer(horde, people):
    """A list's key leaves Redis an hour after its last addition (made-up model names do not pile
    up), and a key gone ends the answers remembered under its stamp."""
    from django.core.cache import cache

    from chat.selectors.queue import QueueList
    from chat.services.pop_cache import QUEUE_ADDITIONS_KEY, QUEUE_LIST_STAMP_SECONDS, queue_list_token

    requester, owner = people
    horde.text_async(requester.key, models=[MODEL])
    assert horde.pop(owner.key).json()["id"] is not None
    redis = cache.client.get_client(write=True)
    key = cache.make_key(f"{QUEUE_ADDITIONS_KEY}:{queue_list_token(QueueList(False, MODEL))}")
    assert 0 < redis.ttl(key) <= QUEUE_LIST_STAMP_SECONDS
    _remembered(horde, owner.key)
    redis.delete(key)  # as when it expires
    with CaptureQueriesContext(connection) as queries:
        assert horde.pop(owner.key).json()["id"] is None
    assert _queue_reads(queries)  # walked again


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
