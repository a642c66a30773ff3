"""GET /api/v2/stats/text/totals and /stats/text/models (ADR 0100): served requests counted, per
window and per model, the same before and after their requests expire, and once."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone
from rest_framework.test import APIClient

from chat import tasks
from chat.model_reference import is_known_text_model
from chat.models import Generation, GenerationRequest, TextGenerationStat
from chat.services.text_stats import COMPACT_AFTER, EARLIER
from tests.conftest import Horde
from tests.races import race

MODEL = "Gryphe/MythoMax-L2-13b"
CUSTOM = "someone/a-custom-finetune"


@pytest.fixture
def people(make_user):
    return make_user("requester", kudos=10000), make_user("owner")


def _served(horde, requester, owner, model: str, max_length: int) -> str:
    request_id = horde.text_async(requester.key, models=[model], params={"max_length": max_length}).json()["id"]
    job = horde.pop(owner.key, models=[model]).json()
    assert job["id"], job
    assert horde.submit(owner.key, job["id"], "A reply.").status_code == 200
    return request_id


def _read(api, path: str):
    cache.clear()  # both routes answer from a 50 s cache, as upstream's
    response = api.get(f"/api/v2/stats/text/{path}")
    assert response.status_code == 200, response.content
    return response.json()


def _finished_ago(request_id: str, ago: timedelta) -> None:
    Generation.objects.filter(request_id=request_id).update(finished_at=timezone.now() - ago)


def _expire_all() -> None:
    GenerationRequest.objects.update(expires_at=timezone.now() - timedelta(seconds=1))


EXPECTED_TOTALS = {
    "minute": {"requests": 1, "tokens": 50},
    "hour": {"requests": 1, "tokens": 50},
    "day": {"requests": 2, "tokens": 150},
    "month": {"requests": 2, "tokens": 150},
    "total": {"requests": 3, "tokens": 350},
}
EXPECTED_MODELS = {"day": {CUSTOM: 1, MODEL: 1}, "month": {CUSTOM: 1, MODEL: 1}, "total": {CUSTOM: 1, MODEL: 2}}


def test_served_requests_are_counted_per_window_and_model_before_and_after_they_expire(horde, api, people):
    assert is_known_text_model(MODEL) and not is_known_text_model(CUSTOM)
    requester, owner = people
    zero = {"requests": 0, "tokens": 0}
    assert _read(api, "totals") == dict.fromkeys(("minute", "hour", "day", "month", "total"), zero)
    assert _read(api, "models") == {"day": {}, "month": {}, "total": {}}
    two_hours = _served(horde, requester, owner, MODEL, 100)
    forty_days = _served(horde, requester, owner, MODEL, 200)
    _served(horde, requester, owner, CUSTOM, 50)
    # Neither a job still processing nor one faulted is counted.
    waiting = horde.text_async(requester.key, models=[MODEL], params={"max_length": 300}).json()["id"]
    assert horde.pop(owner.key, name="worker-2").json()["id"]
    _finished_ago(two_hours, timedelta(hours=2))
    _finished_ago(forty_days, timedelta(days=40))

    for _ in range(2):  # served, then expired (deleted): the same answers; a second sweep adds nothing
        assert _read(api, "totals") == EXPECTED_TOTALS
        assert _read(api, "models") == EXPECTED_MODELS
        assert _read(api, "models?model_state=known") == {"day": {MODEL: 1}, "month": {MODEL: 1}, "total": {MODEL: 2}}
        assert _read(api, "models?model_state=custom") == {"day": {CUSTOM: 1}, "month": {CUSTOM: 1}, "total": {CUSTOM: 1}}
        _expire_all()
        tasks.expire_requests.apply().get()
        assert not GenerationRequest.objects.exists()
    assert horde.status(waiting).status_code == 404
    # The second sweep moved the 40-day-old minute into the model's all-time row; the answers hold.
    assert list(TextGenerationStat.objects.filter(minute=EARLIER).values_list("model", "requests", "tokens")) == [
        (MODEL, 1, 200)
    ]
    assert TextGenerationStat.objects.filter(minute__lt=timezone.now() - COMPACT_AFTER, minute__gt=EARLIER).count() == 0
    assert _read(api, "totals") == EXPECTED_TOTALS
    assert _read(api, "models") == EXPECTED_MODELS


def test_model_state_is_known_custom_or_all(api):
    response = api.get("/api/v2/stats/text/models?model_state=popular")
    assert response.status_code == 400
    assert response.json()["rc"] == "BadRequest"


def test_the_answers_are_cached_as_upstreams(horde, api, people):
    requester, owner = people
    assert api.get("/api/v2/stats/text/totals").json()["total"]["requests"] == 0
    _served(horde, requester, owner, MODEL, 100)
    assert api.get("/api/v2/stats/text/totals").json()["total"]["requests"] == 0
    assert _read(api, "totals")["total"] == {"requests": 1, "tokens": 100}


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_two_racing_expiry_sweeps_count_each_generation_once(make_user):
    requester, owner = make_user("requester", kudos=10000), make_user("owner")
    horde = Horde(APIClient())
    for max_length in (20, 30, 40, 50):
        _served(horde, requester, owner, MODEL, max_length)
    _expire_all()
    results = race([lambda: tasks.expire_requests.apply().get() for _ in range(2)])
    assert sum(results) == 4
    api = APIClient()
    assert _read(api, "totals")["total"] == {"requests": 4, "tokens": 140}
    assert _read(api, "models")["total"] == {MODEL: 4}


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_two_racing_compactions_move_each_old_minute_once():
    from django.db import transaction

    from chat.services.text_stats import compact_text_stats, fold_finished_generations

    long_ago = timezone.now() - timedelta(days=45)
    with transaction.atomic():
        fold_finished_generations(
            finished=[(MODEL, long_ago - timedelta(minutes=i)) for i in range(300)] + [(CUSTOM, long_ago)],
            max_length=10,
        )
    results = race([compact_text_stats, compact_text_stats])
    assert sorted(results) == [0, 301]
    rows = TextGenerationStat.objects.order_by("model").values_list("model", "minute", "requests", "tokens")
    assert list(rows) == [(MODEL, EARLIER, 300, 3000), (CUSTOM, EARLIER, 1, 10)]
    assert _read(APIClient(), "totals")["total"] == {"requests": 301, "tokens": 3010}
