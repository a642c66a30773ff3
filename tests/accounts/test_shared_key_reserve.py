"""A limited shared key's kudos are reserved by its requests' jobs not yet settled (docs/adr/0089):
a creation is admitted when what the key has left after that reserve covers it, so the requests
queued on a key together cannot be charged past its kudos."""

from __future__ import annotations

import math
import uuid
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from accounts.models import KudosTransaction, SharedKey
from chat.models import GenerationRequest
from chat.services.admission import SHARED_KEY_DOWNGRADED_PRIORITY
from tests.accounts.test_shared_keys import SMALL, _worker_online, lend
from tests.chat.chat_route_helpers import chat_async, chat_worker
from tests.conftest import Horde
from tests.races import race


@pytest.fixture
def lender(make_user):
    return make_user("lender", kudos=1000)


# The 3B model's quote of 200 tokens: 7.27 kudos a job, and the tax of 1.
JOB = Decimal("7.27")


def _make(horde, key_id, **body):
    return horde.text_async(key_id, models=[SMALL], params={"max_length": 200}, **body)


def _key(key_id) -> SharedKey:
    return SharedKey.objects.get(pk=key_id)


def _charges(user) -> Decimal:
    rows = KudosTransaction.objects.filter(user=user, kind=KudosTransaction.Kind.GENERATION_CHARGE)
    return -sum((row.amount for row in rows), Decimal("0"))


def test_queued_requests_reserve_the_keys_kudos_and_their_charges_stay_within_it(horde, api, lender, make_user):
    """A key of 20: two requests are admitted (each 8.27 with its tax); the third would find 18 kudos
    of which 14.54 are reserved by the two queued jobs, and is refused. Served at full length, the
    two are charged what they reserved: the key ends at 3.46 and was never overdrawn (it admitted all
    three, and was charged 24.81 against its 20)."""
    worker_owner = make_user("owner")
    _worker_online(horde, worker_owner, models=[SMALL])
    key_id = lend(api, lender.key, kudos=20).json()["id"]
    made = [_make(horde, key_id) for _ in range(2)]
    assert [m.status_code for m in made] == [202, 202], [m.json() for m in made]
    refused = _make(horde, key_id)
    assert refused.status_code == 403
    assert refused.json() == {
        "message": "This shared key does not have enough remaining kudos (3.46 once its queued requests' 14.54 are "
                   "set aside) to fulfill this request (8.27).",
        "rc": "SharedKeyInsufficientKudos",
    }
    assert GenerationRequest.objects.filter(shared_key_id=key_id).count() == 2
    for _ in range(2):
        job = horde.pop(worker_owner.key, models=[SMALL]).json()
        assert horde.submit(worker_owner.key, job["id"], "b" * 4000).status_code == 200
    key = _key(key_id)
    assert (key.kudos, key.utilized) == (Decimal("3.46"), Decimal("16.54"))
    assert _charges(lender.user) == 2 * JOB
    # Nothing is reserved any more: what is left is spent again, up to the key.
    assert _make(horde, key_id).status_code == 403  # 3.46 < 8.27
    SharedKey.objects.filter(pk=key_id).update(kudos=Decimal("8.27"))
    assert _make(horde, key_id).status_code == 202


def test_a_job_being_generated_keeps_its_reserve_until_it_is_settled(horde, api, lender, make_user):
    """A short reply settles below its reserve and gives the rest back at once."""
    worker_owner = make_user("owner")
    _worker_online(horde, worker_owner, models=[SMALL])
    key_id = lend(api, lender.key, kudos=15).json()["id"]
    assert _make(horde, key_id).status_code == 202  # 14 left, 7.27 reserved
    job = horde.pop(worker_owner.key, models=[SMALL]).json()
    assert job["id"] is not None
    refused = _make(horde, key_id)
    assert (refused.status_code, refused.json()["rc"]) == (403, "SharedKeyInsufficientKudos")
    assert horde.submit(worker_owner.key, job["id"], "short").status_code == 200
    assert _key(key_id).kudos > Decimal("8.27")
    assert _make(horde, key_id).status_code == 202


def test_with_allow_downgrade_a_key_its_queue_reserves_queues_at_the_anonymous_priority(horde, api, lender, make_user):
    _worker_online(horde, make_user("owner"), models=[SMALL])
    key_id = lend(api, lender.key, kudos=10).json()["id"]
    assert _make(horde, key_id).status_code == 202
    created = _make(horde, key_id, allow_downgrade=True)
    assert created.status_code == 202, created.json()
    assert GenerationRequest.objects.get(pk=created.json()["id"]).priority == SHARED_KEY_DOWNGRADED_PRIORITY


def test_queued_chat_requests_reserve_the_key_too(api, lender, make_user):
    """A chat request of 16 tokens reserves its job's quote (the tax aside): a key covering it twice
    over, less its tax, admits a second one only once the first is no longer reserved."""
    chat_worker(make_user("owner"))
    probe = lend(api, lender.key, kudos=100).json()["id"]
    assert chat_async(api, probe, max_tokens=16).status_code == 202
    reserve = GenerationRequest.objects.get().shared_key_reserve
    upfront = reserve + 1
    assert reserve > 0
    GenerationRequest.objects.all().delete()
    kudos = math.ceil(2 * upfront) - 1  # covers one request, not two
    assert kudos >= upfront
    key_id = lend(api, lender.key, kudos=kudos).json()["id"]
    assert chat_async(api, key_id, max_tokens=16).status_code == 202
    refused = chat_async(api, key_id, max_tokens=16)
    assert (refused.status_code, refused.json()["rc"]) == (403, "SharedKeyInsufficientKudos"), refused.json()
    GenerationRequest.objects.filter(shared_key_id=key_id).update(jobs_waiting=0)  # as if settled at nothing
    assert chat_async(api, key_id, max_tokens=16).status_code == 202


def test_an_unlimited_key_reserves_nothing(horde, api, lender, make_user):
    _worker_online(horde, make_user("owner"), models=[SMALL])
    key_id = lend(api, lender.key, kudos=-1).json()["id"]
    assert _make(horde, key_id).status_code == 202
    assert GenerationRequest.objects.get().shared_key_reserve == 0


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_creations_racing_on_one_key_are_admitted_within_its_kudos(make_user):
    """A key of 18 covers two requests (8.27 each, its tax included), not three: of four made at
    the same instant on separate connections, two are admitted."""
    owner = make_user("lender", kudos=1000)
    horde = Horde(APIClient())
    _worker_online(horde, make_user("owner"), models=[SMALL])
    key_id = lend(APIClient(), owner.key, kudos=18).json()["id"]
    answers = race([lambda: _make(Horde(APIClient()), key_id).status_code for _ in range(4)])
    assert sorted(answers) == [202, 202, 403, 403]
    key = _key(key_id)
    reserved = sum(r.shared_key_reserve * r.jobs_waiting for r in GenerationRequest.objects.filter(shared_key_id=key_id))
    assert key.kudos == Decimal("16") and reserved == 2 * JOB and reserved <= key.kudos


BIG = "koboldcpp/Pernicious_Prophecy_70B"


def test_a_request_without_models_is_checked_at_the_dearest_model_a_worker_could_serve_it_with(
    horde, api, lender, make_user
):
    """A text request that lists no model is served by whatever model a worker runs, and charged at
    that model's rate (a 70B reply of 200 tokens here: over 200 kudos). Quoted as an unknown 2.7B
    model, a key of 20 admitted it and was drawn to 0, the owner paying the rest. Checked at the
    reference's dearest model, the key refuses it; with allow_downgrade it queues at the anonymous
    priority, as any request the key cannot cover."""
    worker_owner = make_user("owner")
    _worker_online(horde, worker_owner, models=[BIG])
    key_id = lend(api, lender.key, kudos=20).json()["id"]
    refused = horde.text_async(key_id, params={"max_length": 200})
    assert (refused.status_code, refused.json()["rc"]) == (403, "SharedKeyInsufficientKudos"), refused.json()
    assert not GenerationRequest.objects.exists()
    assert _key(key_id).kudos == 20
    downgraded = horde.text_async(key_id, params={"max_length": 200}, allow_downgrade=True)
    assert downgraded.status_code == 202, downgraded.json()
    assert GenerationRequest.objects.get().priority == SHARED_KEY_DOWNGRADED_PRIORITY


def test_a_cancelled_faulted_or_expired_request_stops_reserving(horde, api, lender, make_user):
    """A key of 9 covers one request (8.27), not two. Whatever ends the first request's waiting
    job frees its reserve for the next: the requester's cancel, a fault (a submit's fault of its
    job past the retries), the expiry sweep. A job faulted once goes back to waiting and keeps it."""
    from datetime import timedelta

    from django.utils import timezone

    from chat.models import Generation
    from chat.services.sweeps import expire_requests

    worker_owner = make_user("owner")
    _worker_online(horde, worker_owner, models=[SMALL])
    key_id = lend(api, lender.key, kudos=100).json()["id"]

    def refill() -> None:  # the next creation finds 9 kudos: one request's worth
        SharedKey.objects.filter(pk=key_id).update(kudos=Decimal("9"))

    # The cancel.
    refill()
    first = _make(horde, key_id).json()["id"]
    refill()
    assert _make(horde, key_id).status_code == 403
    assert horde.cancel(first).status_code == 200
    refill()
    second = _make(horde, key_id)
    assert second.status_code == 202, second.json()

    # A job faulted once waits again and still reserves; the request faulted reserves nothing.
    job = horde.pop(worker_owner.key, models=[SMALL]).json()
    assert str(Generation.objects.get(pk=job["id"]).request_id) == second.json()["id"]
    assert horde.submit(worker_owner.key, job["id"], "", state="faulted").status_code == 200
    request = GenerationRequest.objects.get(pk=second.json()["id"])
    assert (request.faulted, request.jobs_waiting) == (False, 1)
    refill()
    assert _make(horde, key_id).status_code == 403
    for _ in range(10):  # faulted again until the request faults
        job = horde.pop(worker_owner.key, models=[SMALL]).json()
        if job["id"] is None:
            break
        assert horde.submit(worker_owner.key, job["id"], "", state="faulted").status_code == 200
    assert GenerationRequest.objects.get(pk=request.pk).faulted
    refill()
    third = _make(horde, key_id)
    assert third.status_code == 202, third.json()

    # The expiry sweep.
    GenerationRequest.objects.filter(pk=third.json()["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    refill()
    assert _make(horde, key_id).status_code == 403  # until the sweep deletes it
    assert expire_requests() >= 1
    refill()
    assert _make(horde, key_id).status_code == 202


@pytest.mark.django_db(transaction=True)
def test_a_request_inserted_by_the_previous_code_without_the_reserve_reserves_nothing(horde, lender, make_user):
    """The column has the database's default (migration chat/0011): during a deploy a process still
    running the code before it inserts requests without the column, and they are stored, with no
    reserve, instead of failing every creation."""
    from django.db import connection

    _worker_online(horde, make_user("owner"), models=[SMALL])
    made = horde.text_async(lender.key, models=[SMALL], params={"max_length": 200})
    assert made.status_code == 202, made.json()
    table = GenerationRequest._meta.db_table
    columns = ", ".join(
        connection.ops.quote_name(field.column)
        for field in GenerationRequest._meta.concrete_fields
        if field.column not in ("id", "shared_key_reserve")
    )
    new_id = uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (id, {columns}) SELECT %s, {columns} FROM {table} WHERE id = %s",
            [
                GenerationRequest._meta.pk.get_db_prep_value(new_id, connection),
                GenerationRequest._meta.pk.get_db_prep_value(uuid.UUID(made.json()["id"]), connection),
            ],
        )
    assert GenerationRequest.objects.get(pk=new_id).shared_key_reserve == Decimal("0")
