"""The pop's generic plan walks the queue lists of its worker's models in order and stops at the
first eligible request in each, whatever the tables' statistics say (chat/services/pop.py,
_eligible_select; docs/adr/0050-a-queue-list-per-model.md)."""

from __future__ import annotations

import re
from datetime import timedelta

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

import chat.services.pop as pop_service
from chat.models import Generation, GenerationRequest

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]

MODELS = [f"koboldcpp/plan-model-{i:02d}" for i in range(50)]


def _queue(requesters, count: int) -> None:
    """`count` waiting text requests spread over the requesters and two models each, as a busy
    horde's queue: most requests are for models a given worker does not serve."""
    now = timezone.now()
    GenerationRequest.objects.bulk_create(
        GenerationRequest(
            user=requesters[i % len(requesters)].user,
            prompt="A prompt.",
            params={},
            n=1,
            jobs_waiting=1,
            max_length=80,
            max_context_length=1024,
            requested_models=[MODELS[i % 50], MODELS[(i * 7 + 3) % 50]],
            any_model=False,
            queue_score=float(count - i),
            expires_at=now + timedelta(hours=1),
        )
        for i in range(count)
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE horde_requests")


def _generic_plan_of_the_last_pop(statements: list[tuple[str, list]]) -> list[str]:
    """EXPLAIN of the prepared pop statement (its generic plan, as every later pop runs it)."""
    _, params = statements[-1]
    raw = connection.connection
    name = raw.execute("SELECT name FROM pg_prepared_statements ORDER BY prepare_time DESC LIMIT 1").fetchone()[0]
    cursor = psycopg.ClientCursor(raw)
    cursor.execute(f"EXPLAIN EXECUTE {name}({', '.join(['%s'] * len(params))})", params)
    return [line for (line,) in cursor.fetchall()]


def test_the_pop_walks_its_models_queue_lists_in_order(horde, make_user, monkeypatch):
    requesters = [make_user(f"plan-requester-{i}") for i in range(20)]
    _queue(requesters, 3000)
    statements: list[tuple[str, list]] = []
    run_prepared = pop_service.run_prepared

    def capture(sql, params):
        statements.append((sql, list(params)))
        return run_prepared(sql, params)

    monkeypatch.setattr(pop_service, "run_prepared", capture)
    owner = make_user("plan-owner")
    job = horde.pop(owner.key, name="plan-worker", models=[MODELS[0], MODELS[1], MODELS[3]]).json()
    # The first request in queue order that lists one of the worker's models.
    first = next(i for i in range(3000) if {MODELS[i % 50], MODELS[(i * 7 + 3) % 50]} & {MODELS[0], MODELS[1], MODELS[3]})
    assert Generation.objects.get(id=job["id"]).request.queue_score == 3000 - first
    plan = _generic_plan_of_the_last_pop(statements)
    rest = plan[next(i for i, line in enumerate(plan) if "CTE rest" in line) :]
    rest = rest[: next(i for i, line in enumerate(rest) if "CTE picked" in line)]
    lists = next(i for i, line in enumerate(rest) if "Scan on queue_list" in line)
    walk = rest[lists:]
    # Each list is walked through its index in queue order, each candidate read by its key, and
    # the walk stops at the first it may take (the Limit over the lock); only the few lists' first
    # requests are sorted.
    assert any("Index Scan using queue_entry_order" in line for line in walk), "\n".join(plan)
    assert any("Index Scan using horde_requests_pkey" in line for line in walk), "\n".join(plan)
    assert not any("Sort" in line or "Seq Scan" in line or "Bitmap" in line for line in walk), "\n".join(plan)
    assert [re.sub(r"c_\d+\.", "c.", line.strip()) for line in rest if "Sort Key" in line] == [
        "Sort Key: c.list_score DESC, c.list_created"
    ]
    # The owner's and priority users' requests first, the same way: their own lists of the
    # worker's models, not every request they have queued.
    priority = plan[next(i for i, line in enumerate(plan) if "CTE priority" in line) :]
    priority = priority[: next(i for i, line in enumerate(priority) if "CTE rest" in line)]
    assert any("Index Scan using queue_entry_user_order" in line for line in priority), "\n".join(plan)
    assert not any("Seq Scan" in line or "Bitmap" in line for line in priority), "\n".join(plan)


def test_a_worker_in_maintenance_walks_only_its_owners_lists(horde, make_user, monkeypatch):
    """Its own statement (docs/adr/0083): the owner's lists of its models through the user index,
    and no walk of the rest of the queue."""
    owner = make_user("plan-owner")
    requesters = [make_user(f"plan-requester-{i}") for i in range(19)]
    _queue([owner, *requesters], 3000)
    statements: list[tuple[str, list]] = []
    run_prepared = pop_service.run_prepared

    def capture(sql, params):
        statements.append((sql, list(params)))
        return run_prepared(sql, params)

    assert horde.pop(owner.key, name="plan-worker", models=[MODELS[0]]).json()["id"] is not None
    GenerationRequest.objects.filter(user=owner.user).update(jobs_waiting=0)
    horde.client.put(
        f"/api/v2/workers/{Generation.objects.get().worker_id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key
    )
    monkeypatch.setattr(pop_service, "run_prepared", capture)
    refused = horde.pop(owner.key, name="plan-worker", models=[MODELS[0]])
    assert (refused.status_code, refused.json()["rc"]) == (403, "WorkerMaintenance")
    plan = _generic_plan_of_the_last_pop(statements)
    assert not any("CTE rest" in line for line in plan), "\n".join(plan)
    assert any("Index Scan using queue_entry_user_order" in line for line in plan), "\n".join(plan)
    assert not any("Seq Scan" in line or "Bitmap" in line for line in plan), "\n".join(plan)
