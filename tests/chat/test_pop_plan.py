"""The pop's generic plan walks the queue index in order and stops at the first eligible request,
whatever the table's statistics say (chat/services/pop.py, _eligible_select)."""

from __future__ import annotations

import re
from datetime import timedelta

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

import chat.services.pop as pop_service
from chat.models import GenerationRequest

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


def test_the_pop_walks_the_queue_index_in_order(horde, make_user, monkeypatch):
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
    assert job["id"] and job["model"] in MODELS[:4]  # the first eligible request in queue order
    plan = _generic_plan_of_the_last_pop(statements)
    rest = plan[next(i for i, line in enumerate(plan) if "CTE rest" in line) :]
    rest = rest[: next(i for i, line in enumerate(rest) if "CTE picked" in line)]
    walk = [line for line in rest if "Index Scan using request_queue_order" in line]
    assert walk and not any("Sort" in line or "Seq Scan on horde_requests" in line for line in rest), "\n".join(plan)
    # Why no table's statistics flip it to a scan and a sort: the planner expects many waiting
    # requests to match (the worker's rules as one opaque condition), so the first comes soon.
    # Spelled out, the rules' default selectivities multiplied to a handful of rows out of 3,000.
    expected = int(re.search(r"rows=(\d+)", walk[0]).group(1))
    assert expected >= 3000 // 4, walk[0]
