"""The empty pop's counts on PostgreSQL (one statement per declaration shape, prepared, with each
worker's own id and chat capacity bound per call: ADR 0051) count what the ORM's aggregate counts,
for workers of every kind over a queue that holds a request for each skip reason."""

from __future__ import annotations

import dataclasses

import pytest

from chat.selectors.queue import (
    WorkerView,
    _counts_statement,
    _counts_through_the_orm,
    declaration_shape,
    empty_pop_counts,
)
from tests.chat.pop_helpers import ALL_GUARANTEES, MODEL, OTHER, chat_pop, queue_chat
from workers.models import Worker

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]


def _views(horde, owner_key: str, second_owner_key: str) -> dict[str, WorkerView]:
    """Workers registered by their first pop: text, chat, both, with other limits and models (over
    two untrusted owners: upstream's pop lets one register four)."""
    pops = {
        "text": lambda: horde.pop(owner_key, name="text"),
        "text-small": lambda: horde.pop(owner_key, name="text-small", max_length=64, max_context_length=512),
        "text-other": lambda: horde.pop(owner_key, name="text-other", models=[OTHER]),
        "chat": lambda: chat_pop(horde, owner_key, name="chat", features=ALL_GUARANTEES),
        "chat-tools": lambda: chat_pop(
            horde, second_owner_key, name="chat-tools", features=[*ALL_GUARANTEES, "tools"],
            limits={"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 1.0},
        ),
        "both": lambda: chat_pop(horde, second_owner_key, name="both", prompt_jobs=True, models=[MODEL]),
    }
    for name, pop in pops.items():
        assert pop().status_code == 200, name
    workers = Worker.objects.select_related("owner").filter(name__in=pops)
    return {worker.name: WorkerView.of(worker) for worker in workers}


def test_the_prepared_counts_are_the_orms_for_every_kind_of_worker(horde, make_user):
    requester, owner = make_user("requester", kudos=10_000), make_user("owner")
    views = _views(horde, owner.key, make_user("second-owner").key)
    listed = str(Worker.objects.get(name="text").id)
    for body in (
        {"models": [MODEL]},
        {"models": [OTHER]},
        {"models": []},
        {"models": [MODEL], "params": {"max_length": 400}},
        {"models": [MODEL], "params": {"max_context_length": 4000}},
        {"models": [MODEL], "workers": [listed]},
        {"models": [MODEL], "trusted_workers": True},
    ):
        assert horde.text_async(requester.key, **body).status_code == 202, body
    queue_chat(requester.user)
    queue_chat(requester.user, models=[OTHER])
    queue_chat(requester.user, max_length=4096)
    queue_chat(requester.user, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})
    queue_chat(requester.user, trusted_workers=True)

    seen = set()
    for name, view in views.items():
        prepared = empty_pop_counts(view)
        orm = _counts_through_the_orm(view)
        takeable = orm.pop("horde_takeable")
        assert (prepared.skipped, prepared.takeable) == ({k: v for k, v in orm.items() if v}, takeable), name
        seen.update(prepared.skipped)
    # The queue tries every reason the workers here can be refused for.
    assert {"models", "max_length", "max_context_length", "worker_id", "untrusted"} <= seen, seen


def test_one_statement_serves_every_worker_of_a_shape_with_its_own_id(horde, make_user):
    """A request that names one worker: skipped for another of the same declaration, takeable for it."""
    requester, owner = make_user("requester", kudos=1000), make_user("owner")
    for name in ("named", "unnamed"):
        assert horde.pop(owner.key, name=name).json()["id"] is None
    named, unnamed = (
        WorkerView.of(Worker.objects.select_related("owner").get(name=name)) for name in ("named", "unnamed")
    )
    assert declaration_shape(named) == declaration_shape(unnamed)
    horde.text_async(requester.key, models=[MODEL], workers=[str(named.id)])
    _counts_statement.cache_clear()
    assert empty_pop_counts(unnamed).skipped == {"worker_id": 1}
    assert empty_pop_counts(named).takeable == 1
    assert _counts_statement.cache_info().currsize == 1
    # A chat worker's capacity is bound per call as well.
    for name in ("chat", "other-chat"):
        assert chat_pop(horde, owner.key, name=name).status_code == 200
    chat = WorkerView.of(Worker.objects.select_related("owner").get(name="chat"))
    queue_chat(requester.user, max_length=1024)
    # Under capacity, the request goes to it only while no capable worker but itself is online,
    # and the other registered worker (unmeasured: capacity 1200) is one.
    slow, fast = dataclasses.replace(chat, chat_capacity=600), dataclasses.replace(chat, chat_capacity=2000)
    assert (empty_pop_counts(fast).takeable, empty_pop_counts(slow).takeable) == (1, 0)
    assert _counts_through_the_orm(slow)["horde_takeable"] == 0
    assert _counts_statement.cache_info().currsize == 2
