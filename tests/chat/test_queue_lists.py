"""The queue lists the pop walks (chat.models.QueueEntry, migration 0009): PostgreSQL keeps a
request under each of its models while it waits, and drops it when it stops
(docs/adr/0050-a-queue-list-per-model.md). Driven through the routes and sweeps that change a
request, read from the table itself."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from chat import tasks
from chat.models import Generation, GenerationRequest, QueueEntry
from tests.chat.pop_helpers import queue_chat

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

MODEL = "Gryphe/MythoMax-L2-13b"
OTHER = "koboldcpp/Pernicious_Prophecy_70B"


@pytest.fixture
def people(make_user):
    return make_user("requester", kudos=10_000), make_user("owner")


def lists_of(request_id) -> set[tuple[bool, str]]:
    rows = QueueEntry.objects.filter(request_id=request_id).values_list("is_chat", "model", "queue_score", "created")
    request = GenerationRequest.objects.get(pk=request_id)
    # Each row carries its request's place in the queue.
    assert all((score, created) == (request.queue_score, request.created) for _, _, score, created in rows)
    return {(is_chat, model) for is_chat, model, _, _ in rows}


def test_a_waiting_request_is_listed_under_each_of_its_models(horde, people):
    requester, _ = people
    named = horde.text_async(requester.key, models=[MODEL, OTHER, MODEL]).json()["id"]
    unnamed = horde.text_async(requester.key).json()["id"]
    assert lists_of(named) == {(False, MODEL), (False, OTHER)}
    assert lists_of(unnamed) == {(False, "")}  # any model: the list every text worker walks


def test_a_chat_request_is_listed_as_chat(people):
    requester, _ = people
    request = queue_chat(requester.user, models=[MODEL])
    assert lists_of(request.id) == {(True, MODEL)}


def test_the_last_job_handed_out_unlists_it_and_a_lapsed_one_lists_it_again(horde, people):
    requester, owner = people
    request_id = horde.text_async(requester.key, models=[MODEL], params={"n": 2}).json()["id"]
    first = horde.pop(owner.key, amount=1).json()
    assert first["id"] and lists_of(request_id) == {(False, MODEL)}  # one job still waiting
    second = horde.pop(owner.key, name="worker-2", amount=1).json()
    assert second["id"] and lists_of(request_id) == set()
    Generation.objects.filter(pk=second["id"]).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert tasks.abort_stale_generations.apply().get() == 1
    assert lists_of(request_id) == {(False, MODEL)}  # back in the queue, where it was
    assert horde.pop(owner.key, name="worker-3").json()["id"]


def test_cancelled_faulted_and_deleted_requests_leave_the_lists(horde, people):
    requester, owner = people
    cancelled = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    faulted = horde.text_async(requester.key, models=[OTHER]).json()["id"]
    expired = horde.text_async(requester.key, models=[MODEL, OTHER]).json()["id"]
    assert horde.cancel(cancelled, requester.key).status_code == 200
    assert lists_of(cancelled) == set()
    for _ in range(3):
        job = horde.pop(owner.key, models=[OTHER]).json()
        assert horde.submit(owner.key, job["id"], "", state="faulted").json() == {"reward": 0}
        assert GenerationRequest.objects.get(pk=faulted).faulted or lists_of(faulted) == {(False, OTHER)}
    assert lists_of(faulted) == set()
    GenerationRequest.objects.filter(pk=expired).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert tasks.expire_requests.apply().get() == 1
    assert not QueueEntry.objects.filter(request_id=expired).exists()
    assert QueueEntry.objects.count() == 0


def test_a_worker_takes_the_first_request_across_its_models_lists(horde, people, make_user):
    requester, owner = people
    rich = make_user("rich", kudos=1_000_000)
    for_model = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    for_other = horde.text_async(rich.key, models=[OTHER]).json()["id"]  # a higher queue score
    for_any = horde.text_async(requester.key).json()["id"]
    order = sorted(
        GenerationRequest.objects.filter(pk__in=[for_model, for_other, for_any]),
        key=lambda r: (-r.queue_score, r.created),
    )
    assert order[0].id.hex == for_other.replace("-", "")
    taken = [
        str(Generation.objects.get(pk=horde.pop(owner.key, name=f"w{i}", models=[MODEL, OTHER]).json()["id"]).request_id)
        for i in range(3)
    ]
    assert taken == [str(r.id) for r in order]
    assert horde.pop(owner.key, name="w3", models=[MODEL, OTHER]).json()["id"] is None


def test_a_worker_of_another_model_passes_over_the_lists_it_does_not_serve(horde, people):
    requester, owner = people
    for _ in range(5):
        horde.text_async(requester.key, models=[MODEL])
    wanted = horde.text_async(requester.key, models=[OTHER]).json()["id"]
    job = horde.pop(owner.key, models=[OTHER]).json()
    assert str(Generation.objects.get(pk=job["id"]).request_id) == wanted


def test_the_migration_lists_the_requests_already_waiting(people):
    """Migration 0009 on a queue that already holds waiting requests lists each, and only those."""
    requester, _ = people
    now = timezone.now()
    waiting, taken = GenerationRequest.objects.bulk_create(
        GenerationRequest(
            user=requester.user, prompt="p", max_length=80, max_context_length=1024, requested_models=[MODEL],
            any_model=False, jobs_waiting=jobs, expires_at=now + timedelta(hours=1),
        )
        for jobs in (1, 0)
    )
    from django.core.management import call_command

    call_command("migrate", "chat", "0008", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT to_regclass('horde_queue_entries'), to_regproc('horde_queue_entries_follow'),"
            " to_regproc('horde_request_listed_models')"
        )
        assert cursor.fetchone() == (None, None, None)  # reversed: the table, its triggers and functions
    call_command("migrate", "chat", verbosity=0)
    assert lists_of(waiting.id) == {(False, MODEL)} and lists_of(taken.id) == set()


def test_the_owners_requests_come_first_in_queue_order_among_those_the_worker_may_take(horde, people, make_user):
    """The owner's and priority users' requests are walked in the worker's own lists too: the
    owner's requests for a model the worker does not serve neither block nor delay it."""
    requester, owner = people
    friend = make_user("friend")
    rich = make_user("rich", kudos=1_000_000)
    for _ in range(3):
        horde.text_async(owner.key, models=[OTHER], prompt="owner, other model")
    horde.text_async(rich.key, models=[MODEL], prompt="rich")
    horde.text_async(owner.key, models=[MODEL], prompt="owner, first")
    horde.text_async(friend.key, models=[MODEL], prompt="friend")
    horde.text_async(owner.key, models=[MODEL], prompt="owner, second")
    alias = f"friend#{friend.user.pk}"
    prompts = [horde.pop(owner.key, name=f"w{i}", priority_usernames=[alias]).json()["payload"]["prompt"] for i in range(4)]
    # The priority users' requests in queue order, then the rest.
    priority = GenerationRequest.objects.filter(user__in=[owner.user, friend.user], requested_models=[MODEL])
    assert prompts == [r.prompt for r in priority.order_by("-queue_score", "created")] + ["rich"]
    assert sorted(prompts[:3]) == ["friend", "owner, first", "owner, second"]
    assert horde.pop(owner.key, name="w0").json()["id"] is None  # the owner's OTHER requests are not its


def test_a_model_name_with_quotes_and_percent_signs_is_walked_as_named(horde, people):
    """The statement spells the worker's lists out as literals: a name is quoted, never read as SQL
    or as a placeholder."""
    requester, owner = people
    odd = "it's 100%s; DROP TABLE horde_requests; --"
    request_id = horde.text_async(requester.key, models=[odd]).json()["id"]
    assert lists_of(request_id) == {(False, odd)}
    job = horde.pop(owner.key, models=[odd, MODEL]).json()
    assert str(Generation.objects.get(pk=job["id"]).request_id) == request_id and job["model"] == odd
