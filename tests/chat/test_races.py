"""Races on real PostgreSQL connections: each thread has its own connection, as web processes do."""

from __future__ import annotations

from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from accounts.models import KudosTransaction
from chat.models import Generation
from tests.chat.chat_jobs import make_chat_request, make_chat_worker, pop_chat_job, reply
from tests.chat.chat_jobs import submit as chat_submit
from tests.conftest import Horde
from tests.races import race
from workers.models import Worker

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

MODEL = "Gryphe/MythoMax-L2-13b"


def test_two_workers_racing_for_one_job_get_it_once(make_user):
    requester, owner = make_user("r", kudos=100), make_user("o")
    horde = Horde(APIClient())
    for round_ in range(5):
        request_id = horde.text_async(requester.key, models=[MODEL], prompt=f"round {round_}").json()["id"]
        pops = race([lambda n=n: Horde(APIClient()).pop(owner.key, name=f"racer-{n}").json() for n in range(4)])
        winners = [p for p in pops if p["id"]]
        assert len(winners) == 1, pops
        status = horde.status(request_id).json()
        assert (status["processing"], status["waiting"]) == (1, 0)
        horde.submit(owner.key, winners[0]["id"])


def test_two_submits_of_one_job_pay_once(make_user):
    requester, owner = make_user("r", kudos=100), make_user("o")
    horde = Horde(APIClient())
    horde.text_async(requester.key, models=[MODEL], prompt="a" * 4000, params={"max_length": 200})
    job = horde.pop(owner.key).json()
    results = race([lambda: Horde(APIClient()).submit(owner.key, job["id"], "b" * 400) for _ in range(3)])
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 400, 400]
    assert {r.json()["rc"] for r in results if r.status_code == 400} == {"DuplicateGen"}
    assert owner.refresh().kudos == Decimal("17.63")
    assert KudosTransaction.objects.filter(kind="generation_reward").count() == 1
    assert KudosTransaction.objects.filter(kind="generation_charge").count() == 1


def test_concurrent_submits_cannot_exceed_concurrency(make_user):
    requester = make_user("r")
    results = race([lambda: Horde(APIClient()).text_async(requester.key, params={"n": 20}) for _ in range(3)])
    assert sorted(r.status_code for r in results) == [202, 429, 429]


def test_racing_submits_of_one_worker_each_keep_their_speed_sample(make_user):
    # Trusted: seven workers of one owner (upstream lets an untrusted owner register four).
    requester, owner = make_user("r", kudos=1000), make_user("o", trusted=True)
    horde = Horde(APIClient())
    horde.text_async(requester.key, models=[MODEL], params={"n": 4})
    job = horde.pop(owner.key, amount=4).json()
    assert len(job["ids"]) == 4
    results = race([lambda gid=gid: Horde(APIClient()).submit(owner.key, gid, "c" * 200) for gid in job["ids"]])
    assert [r.status_code for r in results] == [200] * 4
    worker = Worker.objects.get(name="worker-1")
    # Each sample is written from the row as locked by its own update: none lost to another's.
    assert worker.fulfilments == 4 and len(worker.speed_samples) == 4
    assert worker.speed == pytest.approx(sum(worker.speed_samples) / 4)


def test_racing_chat_submits_of_one_worker_each_keep_their_speed_sample(make_user):
    # Trusted: seven workers of one owner (upstream lets an untrusted owner register four).
    requester, owner = make_user("r", kudos=1000), make_user("o", trusted=True)
    worker = make_chat_worker(owner.user)
    jobs = [pop_chat_job(make_chat_request(requester.user), worker)[0] for _ in range(4)]
    results = race([lambda job=job: chat_submit(APIClient(), owner.key, job.id, reply("A reply of some words.")) for job in jobs])
    assert [r.status_code for r in results] == [200] * 4
    worker.refresh_from_db()
    # Each submit reads the samples with the worker's row locked: none lost to another's.
    assert worker.fulfilments == 4 and len(worker.speed_samples) == 4


def test_workers_racing_over_two_queue_lists_never_share_a_request(make_user):
    """Each pop locks the first request of each of its lists and keeps one (ADR 0050): racing pops
    skip each other's locks, so no request is handed out twice and none is left behind."""
    # Trusted: seven workers of one owner (upstream lets an untrusted owner register four).
    requester, owner = make_user("r", kudos=1000), make_user("o", trusted=True)
    horde = Horde(APIClient())
    other = "koboldcpp/Pernicious_Prophecy_70B"
    queued = {horde.text_async(requester.key, models=[[MODEL, other][i % 2]]).json()["id"] for i in range(8)}
    pops = race([lambda n=n: Horde(APIClient()).pop(owner.key, name=f"racer-{n}", models=[MODEL, other]).json() for n in range(6)])
    jobs = [p["id"] for p in pops if p["id"]]
    while job := horde.pop(owner.key, name="sweeper", models=[MODEL, other]).json()["id"]:
        jobs.append(job)
    taken = list(Generation.objects.filter(pk__in=jobs).values_list("request_id", flat=True))
    assert len(taken) == len(jobs) == 8 and {str(r) for r in taken} == queued


def test_racing_first_pops_of_new_names_cannot_exceed_the_owners_worker_bound(make_user):
    """An untrusted owner with three workers may register one more (upstream's bound): new names
    popping at once register one of them, and the others are refused TooManyWorkers."""
    owner = make_user("o")
    horde = Horde(APIClient())
    for n in range(3):
        assert horde.pop(owner.key, name=f"kept-{n}").status_code == 200
    for round_ in range(3):
        pops = race([lambda n=n, r=round_: Horde(APIClient()).pop(owner.key, name=f"new-{r}-{n}") for n in range(4)])
        assert Worker.objects.filter(owner=owner.user).count() == 4, [p.status_code for p in pops]
        codes = sorted(p.status_code for p in pops)
        assert codes == ([200, 403, 403, 403] if round_ == 0 else [403] * 4), [p.content for p in pops]


def test_racing_first_pops_of_one_new_name_at_the_bound_all_check_in(make_user):
    """The fourth worker's first pops, at once: one registers it, the others check in on its row
    (none is refused as a fifth)."""
    owner = make_user("o")
    horde = Horde(APIClient())
    for n in range(3):
        assert horde.pop(owner.key, name=f"kept-{n}").status_code == 200
    pops = race([lambda: Horde(APIClient()).pop(owner.key, name="fourth") for _ in range(4)])
    assert [p.status_code for p in pops] == [200] * 4, [p.content for p in pops]
    assert Worker.objects.filter(owner=owner.user).count() == 4
