"""A web process serving pops answers an idle worker's empty pop from memory under what its
subscription to the queue's signal heard of the worker's queue lists (docs/adr/0057), with no Redis
round trip: the signal of another process naming one of those lists ends the answer at once, and
the signal of other lists leaves it. Over HTTP against daphne; the request the signal announces is
written as another web process writes it, and the signal is published as that process publishes it."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
import redis
from django.conf import settings as django_settings
from django.utils import timezone

from chat.models import GenerationRequest
from chat.selectors.queue import QueueList
from chat.services.pop_cache import queue_list_token
from chat.services.pop_wait import queue_growth, queue_signal_channel, queue_signal_message
from contract.text import TEXT_REQUEST_TTL_SECONDS
from tests.oai.test_pop_long_poll import plain_pop, pop_body

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis_only]

MODEL = "Gryphe/MythoMax-L2-13b"
OTHER = "koboldcpp/LLaMA2-13B-Psyfighter2"


@pytest.fixture(autouse=True)
def _long_memory(settings):
    settings.HORDE_EMPTY_POP_CACHE_SECONDS = 60.0


@pytest.fixture
def people(make_user):
    return make_user(f"sg-owner-{uuid.uuid4().hex[:6]}"), make_user(f"sg-req-{uuid.uuid4().hex[:6]}", kudos=10_000)


def written_elsewhere(requester, model: str) -> GenerationRequest:
    """A waiting text request as another web process stores it; this process hears of it only
    through the signal."""
    now = timezone.now()
    return GenerationRequest.objects.create(
        user=requester.user, prompt="Once upon a time", params={}, n=1, jobs_waiting=1, max_length=64,
        max_context_length=1024, requested_models=[model], any_model=False, kudos_quote=1, kudos_held=0,
        expires_at=now + timedelta(seconds=TEXT_REQUEST_TTL_SECONDS),
    )


def signal(model: str) -> None:
    """The queue's signal for the list of `model` (text), as another process's commit sends it."""
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    try:
        client.publish(queue_signal_channel(), queue_signal_message((queue_list_token(QueueList(False, model)),)))
    finally:
        client.close()


def remembered_empty(url: str, key: str, name: str) -> None:
    for _ in range(3):  # registered, then its empty answer remembered under what the process heard
        assert plain_pop(url, key, pop_body(name))[0].json()["id"] is None
    deadline = time.monotonic() + 5
    while queue_growth.version(("*",)) is None:  # the process's subscription is live
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_signal_for_its_list_ends_a_remembered_empty_answer(live_horde, people):
    owner, requester = people
    name = f"sg-{uuid.uuid4().hex[:6]}"
    remembered_empty(live_horde.url, owner.key, name)
    request = written_elsewhere(requester, MODEL)
    assert plain_pop(live_horde.url, owner.key, pop_body(name))[0].json()["id"] is None  # from memory
    signal(MODEL)
    deadline = time.monotonic() + 2
    while (job := plain_pop(live_horde.url, owner.key, pop_body(name))[0].json())["id"] is None:
        assert time.monotonic() < deadline, "the signal did not end the remembered answer"
        time.sleep(0.02)
    assert job["payload"]["prompt"] == "Once upon a time"
    assert GenerationRequest.objects.get(pk=request.pk).jobs_waiting == 0


def test_the_signal_for_other_lists_leaves_the_answer_in_memory(live_horde, people):
    owner, requester = people
    name = f"sg-o-{uuid.uuid4().hex[:6]}"
    remembered_empty(live_horde.url, owner.key, name)
    written_elsewhere(requester, MODEL)
    signal(OTHER)
    time.sleep(0.3)
    assert plain_pop(live_horde.url, owner.key, pop_body(name))[0].json()["id"] is None
