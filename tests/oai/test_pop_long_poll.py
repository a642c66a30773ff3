"""A pop with `wait` (ADR 0024) is held until a request it can take arrives, woken by the queue's
signal (Redis pub/sub; without Redis, the process's own wake), not by a re-check; the wait's end
answers the empty pop as today; a pop without the key answers at once, unchanged; two workers
racing for one request: one gets it, the other keeps waiting. Over HTTP against daphne.

The re-check is set far above each test's bounds, so only the signal can explain a fast answer. Each
wake is asserted as an answer that came before the pop's wait (HELD seconds) could have ended it,
with the test's own clock started before the pop was sent: a pop the signal did not wake answers
HELD seconds after it arrived at the earliest, so a slow box cannot fail these checks and a missed
wake cannot pass them. A pop is known to be held when the server ran it twice (its first run and
the one after it registered for the signal, hordesite/wsgi_pool.py), not after a sleep.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from chat.models import Generation
from contract.text import TEXT_POP_WAIT_MAX_SECONDS
from tests.chat.test_chat_submit import counter_points, metric_reader  # noqa: F401  (fixture)
from tests.oai.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "Gryphe/MythoMax-L2-13b"
OTHER = "koboldcpp/LLaMA2-13B-Psyfighter2"
# The wait of the pops a signal must wake: ten seconds of slack for a loaded box, which a missed
# wake (answered at the wait's end) cannot get under.
HELD = 10


@pytest.fixture(autouse=True)
def _no_recheck(settings):
    settings.HORDE_POP_WAIT_RECHECK_SECONDS = 60.0


def pop_body(name: str, **overrides: Any) -> dict[str, Any]:
    body = {
        "name": name,
        "models": [MODEL],
        "max_length": 512,
        "max_context_length": 4096,
        "bridge_agent": "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp",
    }
    body.update(overrides)
    return body


class TimedPop:
    """One pop in a thread: its answer and when it came."""

    def __init__(self, url: str, key: str, body: dict[str, Any]):
        self.url, self.key, self.body = url, key, body
        self.response: httpx.Response | None = None
        self.started = self.answered = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TimedPop:
        self.started = time.monotonic()
        self.thread.start()
        return self

    def _run(self) -> None:
        self.response = httpx.post(
            f"{self.url}/api/v2/generate/text/pop", json=self.body, headers={"apikey": self.key}, timeout=40
        )
        self.answered = time.monotonic()

    def join(self, timeout: float = 30) -> httpx.Response:
        self.thread.join(timeout)
        assert self.response is not None, "the pop never answered"
        return self.response

    @property
    def done(self) -> bool:
        return self.response is not None


def queue_text(url: str, key: str, models: list[str] | None = None) -> tuple[str, float]:
    response = httpx.post(
        f"{url}/api/v2/generate/text/async",
        json={"prompt": "Once upon a time", "models": models or [MODEL], "params": {"max_length": 64}},
        headers={"apikey": key},
        timeout=10,
    )
    assert response.status_code == 202, response.text
    return response.json()["id"], time.monotonic()


def plain_pop(url: str, key: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(f"{url}/api/v2/generate/text/pop", json=body, headers={"apikey": key}, timeout=10)
    return response, time.monotonic() - started


@pytest.fixture
def people(make_user):
    return make_user(f"lp-owner-{uuid.uuid4().hex[:6]}"), make_user(f"lp-req-{uuid.uuid4().hex[:6]}", kudos=10_000)


@contextlib.contextmanager
def pops_served() -> Iterator[list[float]]:
    """When each pop the server handles meanwhile starts (Django's request_started: a held pop
    popped again runs through the handler again). Django's ASGI handler (the mounted front's routes)
    sends the signal with a scope, not an environ."""
    from django.core.signals import request_started

    pops: list[float] = []

    def count_pops(sender, environ=None, **kwargs):
        if environ is not None and environ.get("PATH_INFO") == "/api/v2/generate/text/pop":
            pops.append(time.monotonic())

    request_started.connect(count_pops)
    try:
        yield pops
    finally:
        request_started.disconnect(count_pops)


def held_pop(url: str, key: str, name: str, pops: list[float], wait: int = HELD) -> TimedPop:
    """A pop with `wait`, once the server holds it: it ran twice, the second time after registering
    for the signal (a loaded box can take longer than any fixed sleep to get there)."""
    before = len(pops)
    pop = TimedPop(url, key, pop_body(name, wait=wait)).start()
    assert wait_for(lambda: len(pops) >= before + 2, 15), "the pop was never held"
    assert not pop.done  # held: nothing to take yet
    return pop


def woken(pop: TimedPop) -> bool:
    """Answered before its wait could have ended it: only a wake explains that."""
    return pop.answered - pop.started < HELD


def test_a_waiting_pop_gets_a_request_created_200_ms_later_at_once(live_horde, people):
    owner, requester = people
    name = f"lp-{uuid.uuid4().hex[:6]}"
    plain_pop(live_horde.url, owner.key, pop_body(name))  # registered, and its empty answer remembered
    with pops_served() as pops:
        pop = held_pop(live_horde.url, owner.key, name, pops)
        time.sleep(0.2)  # as the test's name says; held meanwhile
        assert not pop.done
        request_id, _ = queue_text(live_horde.url, requester.key)
        job = pop.join().json()
    assert job["id"] is not None
    assert str(Generation.objects.get(pk=job["id"]).request_id) == request_id
    assert woken(pop), pop.answered - pop.started  # by the signal: the re-check is a minute away


@pytest.mark.redis_only
def test_a_request_for_another_model_does_not_wake_a_waiting_pop(live_horde, people):
    """The signal names the lists that grew (ADR 0051): a held pop is popped again only for its own.
    (Without Redis the embedded server's in-process wake wakes every held pop.)"""
    owner, requester = people
    name = f"lp-{uuid.uuid4().hex[:6]}"
    plain_pop(live_horde.url, owner.key, pop_body(name))
    with pops_served() as pops:
        pop = held_pop(live_horde.url, owner.key, name, pops)
        held = len(pops)
        queue_text(live_horde.url, requester.key, models=[OTHER])
        time.sleep(0.5)
        assert len(pops) == held and not pop.done  # not popped again
        request_id, _ = queue_text(live_horde.url, requester.key, models=[MODEL])
        job = pop.join().json()
    assert str(Generation.objects.get(pk=job["id"]).request_id) == request_id
    # Woken by its own list's signal, popped again once in all: a wake by the other model's signal,
    # however late it came, would have run it once more.
    assert woken(pop) and len(pops) == held + 1, (pop.answered - pop.started, len(pops) - held)


@pytest.mark.redis_only
def test_a_held_pop_whose_answer_is_remembered_is_not_popped_again_each_recheck(live_horde, people, settings):
    """A remembered empty answer changes only with its lists, whose growth the signal announces: the
    held pop is looked at again when the answer ages out, not every HORDE_POP_WAIT_RECHECK_SECONDS
    (ADR 0051). Without Redis nothing is remembered, and the re-check stays short."""
    settings.HORDE_POP_WAIT_RECHECK_SECONDS = 0.2
    owner, _ = people
    name = f"lp-{uuid.uuid4().hex[:6]}"
    plain_pop(live_horde.url, owner.key, pop_body(name))
    with pops_served() as pops:
        held = TimedPop(live_horde.url, owner.key, pop_body(name, wait=3)).start()
        assert held.join().json()["id"] is None
    # The pop, its first look again (which remembers the answer), and the last at the wait's end,
    # against about fifteen at a 0.2 s re-check.
    assert len(pops) <= 4, len(pops)
    assert held.answered - held.started >= 3.0


def test_the_wait_ends_with_the_empty_pop_and_its_skipped_counts(live_horde, people):
    owner, requester = people
    name = f"lp-{uuid.uuid4().hex[:6]}"
    queue_text(live_horde.url, requester.key, models=[OTHER])
    at_once, _ = plain_pop(live_horde.url, owner.key, pop_body(name))
    pop = TimedPop(live_horde.url, owner.key, pop_body(name, wait=1)).start()
    waited = pop.join()
    assert waited.status_code == 200
    assert waited.json() == at_once.json()
    assert waited.json()["id"] is None and waited.json()["skipped"] == {"models": 1}
    # Held for its one second and ended by it: not by the bound (20 s) nor by the re-check (a minute away).
    assert 1.0 <= pop.answered - pop.started < TEXT_POP_WAIT_MAX_SECONDS / 2


def test_a_pop_without_wait_answers_at_once_as_before(live_horde, people):
    owner, _ = people
    name = f"lp-{uuid.uuid4().hex[:6]}"
    first, _ = plain_pop(live_horde.url, owner.key, pop_body(name))
    for body in (pop_body(name), pop_body(name, wait=0)):
        with pops_served() as pops:
            again, elapsed = plain_pop(live_horde.url, owner.key, body)
        assert again.status_code == 200
        assert again.json() == first.json() == {
            "payload": {},
            "id": None,
            "ids": [],
            "messages": None,
            "ttl": None,
            "extra_source_images": [],
            "skipped": {},
            "softprompt": None,
            "model": None,
        }
        # Run once, not held: a held pop runs again at once, after registering for the signal.
        assert len(pops) == 1 and elapsed < 5, (len(pops), elapsed)


def test_a_wait_over_the_bound_is_held_to_it_and_a_bad_wait_is_refused(live_horde, people, settings):
    owner, _ = people
    name = f"lp-{uuid.uuid4().hex[:6]}"
    for wait in (-1, "soon", 1.5, True):
        refused, _ = plain_pop(live_horde.url, owner.key, pop_body(name, wait=wait))
        assert refused.status_code == 400, (wait, refused.text)
        assert refused.json()["message"] == "Input payload validation failed"
        assert "wait" in refused.json()["errors"]


def test_racing_long_polls_one_gets_the_request_the_other_keeps_waiting(live_horde, people):
    owner, requester = people
    names = [f"lp-a-{uuid.uuid4().hex[:6]}", f"lp-b-{uuid.uuid4().hex[:6]}"]
    for name in names:
        plain_pop(live_horde.url, owner.key, pop_body(name))
    with pops_served() as served:
        pops = [held_pop(live_horde.url, owner.key, name, served) for name in names]
        queue_text(live_horde.url, requester.key)
        assert wait_for(lambda: any(p.done for p in pops), HELD)
    winners = [p for p in pops if p.done]
    assert len(winners) == 1, "exactly one pop answers when the request arrives"
    winner = winners[0]
    assert winner.response.json()["id"] is not None
    assert woken(winner), winner.answered - winner.started
    loser = next(p for p in pops if p is not winner)
    empty = loser.join().json()
    assert empty["id"] is None
    assert loser.answered - loser.started >= HELD  # woken too, found nothing, waited on to the end
    assert Generation.objects.count() == 1


def test_a_job_given_back_wakes_a_waiting_pop(live_horde, people):
    owner, requester = people
    first, second = f"lp-f-{uuid.uuid4().hex[:6]}", f"lp-s-{uuid.uuid4().hex[:6]}"
    queue_text(live_horde.url, requester.key)
    taken, _ = plain_pop(live_horde.url, owner.key, pop_body(first))
    job_id = taken.json()["id"]
    assert job_id is not None
    plain_pop(live_horde.url, owner.key, pop_body(second))
    with pops_served() as pops:
        pop = held_pop(live_horde.url, owner.key, second, pops)
        fault = httpx.post(
            f"{live_horde.url}/api/v2/generate/text/submit",
            json={"id": job_id, "generation": "", "state": "faulted"},
            headers={"apikey": owner.key},
            timeout=10,
        )
        assert fault.status_code == 200, fault.text
        job = pop.join().json()
    assert job["id"] is not None and job["id"] != job_id
    assert woken(pop), pop.answered - pop.started


def test_a_worker_that_went_away_while_held_takes_no_job(live_horde, people):
    owner, requester = people
    gone, other = f"lp-gone-{uuid.uuid4().hex[:6]}", f"lp-other-{uuid.uuid4().hex[:6]}"
    plain_pop(live_horde.url, owner.key, pop_body(gone))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{live_horde.url}/api/v2/generate/text/pop",
            json=pop_body(gone, wait=10),
            headers={"apikey": owner.key},
            timeout=httpx.Timeout(10, read=0.3),
        )
    time.sleep(0.2)  # the server sees the disconnect
    request_id, _ = queue_text(live_horde.url, requester.key)

    def a_job() -> httpx.Response | None:
        answer, _ = plain_pop(live_horde.url, owner.key, pop_body(other))
        return answer if answer.json()["id"] else None

    # The job is still in the queue, or back in it at once if a loaded box ran the gone pop after it
    # was queued (ADR 0056); taken by the gone worker, it would stay away for its whole lease.
    taken = wait_for(a_job, 10)
    assert taken is not None, "the job never reached the other worker"
    assert str(Generation.objects.get(pk=taken.json()["id"]).request_id) == request_id


def test_a_held_pop_of_a_speed_capped_chat_worker_is_counted_once(
    live_horde, people, settings, metric_reader  # noqa: F811
):
    """horde.pop.lease_capacity_limited counts a worker's pops: the serving layer's runs of one held
    pop, however many, are one pop."""
    from workers.models import Worker
    from workers.services import worker_rows

    settings.HORDE_POP_WAIT_RECHECK_SECONDS = 0.2
    owner, _ = people
    name = f"lp-{uuid.uuid4().hex[:6]}"
    chat = {
        "chat_jobs": True,
        "model_id": MODEL,
        "chat_features": ["prompt_overflow_refused", "tool_choice_enforced", "structured_output_enforced"],
        "chat_limits": {"max_context_length": 8192, "max_length": 1024},
    }
    plain_pop(live_horde.url, owner.key, pop_body(name, **chat))
    Worker.objects.filter(name=name).update(speed=2.0)  # capacity 240, below its declared 1024
    worker_rows.forget(name)
    counted = counter_points(metric_reader, "horde.pop.lease_capacity_limited").get((("horde.gentype", "text"),), 0)
    with pops_served() as pops:
        held = TimedPop(live_horde.url, owner.key, pop_body(name, wait=2, **chat)).start()
        answer = held.join()
    assert answer.status_code == 200 and answer.json()["id"] is None, answer.text
    assert len(pops) >= 2  # run again while held
    assert counter_points(metric_reader, "horde.pop.lease_capacity_limited") == {
        (("horde.gentype", "text"),): counted + 1
    }
