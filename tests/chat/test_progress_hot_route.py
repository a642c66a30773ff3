"""The progress route through the web process's serving layer: the same answers as Django's own ASGI
handler, and racing posts of one job (real connections, the layer's threads) with one winner."""

from __future__ import annotations

import asyncio

import pytest

from chat.services import progress
from contract.chat_progress import chat_progress_stream_key
from tests.chat.pop_helpers import chat_pop, queue_chat
from tests.hordesite.test_serving import _call, call, stacks  # noqa: F401  (fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis_only]

PROGRESS = "/api/v2/generate/text/progress"


def _job(horde, make_user):
    requester, owner = make_user("hot-req", kudos=100), make_user("hot-own")
    request = queue_chat(requester.user, {"stream": True})
    job_id = chat_pop(horde, owner.key).json()["id"]
    assert job_id
    return owner, request, job_id


def test_progress_answers_match_djangos(stacks, make_user, horde):  # noqa: F811
    _, hot, plain = stacks
    owner, _, job_id = _job(horde, make_user)
    stranger = make_user("hot-stranger")
    cases = [
        {"key": owner.key, "body": {"id": job_id, "seq": 1, "delta": {}}},  # 400 BadRequest
        {"key": owner.key, "body": {"id": "x", "seq": "1", "delta": []}},  # schema failure
        {"key": stranger.key, "body": {"id": job_id, "seq": 1, "delta": {"content": "x"}}},  # 403
        {"key": owner.key, "body": {"id": job_id, "seq": 3, "delta": {"content": "x"}}},  # 409
        {"key": owner.key, "body": {"id": "00000000-0000-0000-0000-000000000000", "seq": 1, "delta": {"content": "x"}}},
    ]
    for kw in cases:
        via_layer = call(hot, "POST", PROGRESS, **kw)
        via_django = call(plain, "POST", PROGRESS, **kw)
        assert via_layer.status == via_django.status, (kw, via_layer.body, via_django.body)
        assert via_layer.json() == via_django.json(), kw
        assert via_layer.header_set() == via_django.header_set(), kw
    accepted = call(hot, "POST", PROGRESS, key=owner.key, body={"id": job_id, "seq": 1, "delta": {"content": "Hi"}})
    assert accepted.status == 200 and accepted.json() == {"accepted_seq": 1, "cancelled": False}


def test_racing_posts_of_one_seq_have_one_winner(stacks, make_user, horde):  # noqa: F811
    _, hot, _ = stacks
    owner, request, job_id = _job(horde, make_user)

    async def race():
        return await asyncio.gather(
            *(
                _call(hot, "POST", PROGRESS, key=owner.key, body={"id": job_id, "seq": 1, "delta": {"content": f"v{i}"}})
                for i in range(8)
            )
        )

    answers = asyncio.run(race())
    statuses = sorted(a.status for a in answers)
    assert statuses == [200] + [409] * 7, [a.body for a in answers]
    assert all(a.json()["expected_seq"] == 2 for a in answers if a.status == 409)
    entries = progress.progress_redis().xrange(chat_progress_stream_key(request.pk))
    assert len(entries) == 1
    winner = next(a for a in answers if a.status == 200)
    assert winner.json() == {"accepted_seq": 1, "cancelled": False}
