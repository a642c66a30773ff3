"""What a pop and a submit write, row by row (on PostgreSQL each is one statement; on SQLite a
transaction of ORM statements): the same rows either way."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from accounts.models import HordeUser, KudosTransaction
from chat.models import Generation, GenerationRequest
from workers.models import Worker

MODEL = "Gryphe/MythoMax-L2-13b"
OTHER = "koboldcpp/LLaMA2-13B-Psyfighter2"


def test_a_pop_creates_its_generations_and_takes_the_jobs(horde, make_user):
    requester, owner = make_user("r", kudos=1000), make_user("o")
    created = horde.text_async(requester.key, models=[OTHER, MODEL], params={"n": 3})
    request_id = created.json()["id"]
    before = timezone.now()
    job = horde.pop(owner.key, models=[MODEL, OTHER], amount=2).json()
    after = timezone.now()

    assert len(job["ids"]) == 2 and job["id"] == job["ids"][0]
    # The request's own order picks the model among those the worker serves.
    assert job["model"] == OTHER
    worker = Worker.objects.get(name="worker-1")
    rows = list(Generation.objects.filter(request_id=request_id).order_by("created"))
    assert sorted(str(g.id) for g in rows) == sorted(job["ids"])
    for g in rows:
        assert g.worker_id == worker.id and g.model == OTHER and g.state == Generation.State.PROCESSING
        assert before <= g.created <= after
        assert g.lease_expires_at - g.created == pytest.approx(timedelta(seconds=150), abs=timedelta(seconds=1))
        assert g.text is None and g.kudos == 0 and g.gen_metadata == [] and g.finished_at is None
        assert g.assigned_model is None  # a text job records no chat declaration
    request = GenerationRequest.objects.get(pk=request_id)
    assert request.jobs_waiting == 1
    assert before + timedelta(minutes=20) <= request.expires_at <= after + timedelta(minutes=20)

    # The last job; a third pop finds nothing, and the request's row says so.
    assert horde.pop(owner.key, models=[MODEL, OTHER], amount=5).json()["ids"] != []
    assert horde.pop(owner.key, models=[MODEL, OTHER]).json()["id"] is None
    assert GenerationRequest.objects.get(pk=request_id).jobs_waiting == 0
    assert Generation.objects.filter(request_id=request_id).count() == 3


def test_an_owner_serving_its_own_request_is_charged_and_rewarded_once_each(horde, make_user):
    account = make_user("self-served", kudos=1000)
    request_id = horde.text_async(account.key, models=[MODEL], params={"max_length": 100}).json()["id"]
    before = HordeUser.objects.get(pk=account.user.pk)
    consumed_before = GenerationRequest.objects.get(pk=request_id).consumed_kudos  # the horde tax
    job = horde.pop(account.key).json()
    assert job["id"]
    reward = Decimal(str(horde.submit(account.key, job["id"], "A reply of a few words.").json()["reward"]))
    assert reward > 0

    after = HordeUser.objects.get(pk=account.user.pk)
    # Paid and earned the same amount: the balance is unchanged, the hold released.
    assert after.kudos == before.kudos
    assert after.kudos_held == 0
    ledger = KudosTransaction.objects.filter(generation_id=job["id"]).order_by("kind")
    assert [(t.user_id, t.amount, t.kind) for t in ledger] == [
        (account.user.pk, -reward, KudosTransaction.Kind.GENERATION_CHARGE),
        (account.user.pk, reward, KudosTransaction.Kind.GENERATION_REWARD),
    ]
    request = GenerationRequest.objects.get(pk=request_id)
    assert request.consumed_kudos == consumed_before + reward and request.kudos_held == 0


def test_a_losing_submit_writes_nothing(horde, make_user):
    requester, owner = make_user("r", kudos=1000), make_user("o")
    horde.text_async(requester.key, models=[MODEL])
    job = horde.pop(owner.key).json()
    assert horde.submit(owner.key, job["id"], "first").status_code == 200
    balances = {u.pk: (u.kudos, u.kudos_held) for u in HordeUser.objects.filter(pk__in=[requester.user.pk, owner.user.pk])}
    worker = Worker.objects.get(name="worker-1")

    again = horde.submit(owner.key, job["id"], "second")
    assert again.status_code == 400 and again.json()["rc"] == "DuplicateGen"
    assert {u.pk: (u.kudos, u.kudos_held) for u in HordeUser.objects.filter(pk__in=balances)} == balances
    assert KudosTransaction.objects.filter(generation_id=job["id"]).count() == 2
    fresh = Worker.objects.get(pk=worker.pk)
    assert (fresh.fulfilments, fresh.speed_samples) == (worker.fulfilments, worker.speed_samples) == (1, worker.speed_samples)
    assert Generation.objects.get(pk=job["id"]).text == "first"


def test_a_submit_after_its_request_is_gone_is_an_invalid_job(horde, make_user):
    requester, owner = make_user("r", kudos=1000), make_user("o")
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    job = horde.pop(owner.key).json()
    GenerationRequest.objects.filter(pk=request_id).delete()  # as the expiry sweep does

    late = horde.submit(owner.key, job["id"], "too late")
    assert late.status_code == 404 and late.json()["rc"] == "InvalidJobID"
    assert not KudosTransaction.objects.filter(generation_id=job["id"]).exists()
    assert Worker.objects.get(name="worker-1").fulfilments == 0


def test_a_submit_by_another_user_is_refused_and_the_owner_still_submits(horde, make_user):
    requester, owner, stranger = make_user("r", kudos=1000), make_user("o"), make_user("s")
    horde.text_async(requester.key, models=[MODEL])
    job = horde.pop(owner.key).json()

    refused = horde.submit(stranger.key, job["id"], "not mine")
    assert refused.status_code == 403 and refused.json()["rc"] == "WrongCredentials"
    assert horde.submit(owner.key, job["id"], "mine").status_code == 200
    assert Generation.objects.get(pk=job["id"]).text == "mine"


def test_a_worker_keeps_its_last_twenty_speed_samples(horde, make_user):
    requester, owner = make_user("r", kudos=1000), make_user("o")
    horde.text_async(requester.key, models=[MODEL])
    job = horde.pop(owner.key).json()
    old = [float(i) for i in range(1, 21)]
    Worker.objects.filter(name="worker-1").update(speed_samples=old, speed=10.5)

    assert horde.submit(owner.key, job["id"], "A reply of several words for the sample.").status_code == 200
    worker = Worker.objects.get(name="worker-1")
    assert len(worker.speed_samples) == 20 and worker.speed_samples[:19] == old[1:]
    assert worker.speed_samples[19] > 0
    assert worker.speed == pytest.approx(sum(worker.speed_samples) / 20)


@pytest.mark.postgres_only
def test_a_text_submit_is_one_statement_priced_from_its_pop(horde, make_user, django_assert_num_queries):
    """The pop stores the job's price (rate, max_length, the owner's trust); the submit settles
    from the row in one statement, in whichever process it lands, at the formula's reward."""
    from chat.pricing import text_generation_kudos

    requester, owner = make_user("priced-r", kudos=1000), make_user("priced-o")
    prompt = "A prompt of a few words. " * 40
    request_id = horde.text_async(requester.key, prompt=prompt, models=[MODEL], params={"max_length": 80}).json()["id"]
    job = horde.pop(owner.key, models=[MODEL]).json()
    generation = Generation.objects.get(pk=job["id"])
    assert generation.price_max_length == 80 and generation.price_owner_trusted is False
    assert generation.price_rate > 0 and generation.price_flat == 0
    reply = "A reply long enough to pass the floor of twenty tokens, counted by characters. " * 3
    from chat.services.submit import TextSubmit, job_submit

    with django_assert_num_queries(1):
        reward = job_submit(user=owner.user, generation_id=generation.pk, text=TextSubmit(text=reply), chat_body=None)
    assert reward == text_generation_kudos(
        model=MODEL, prompt=prompt, generation=reply, max_length=80, owner_trusted=False
    )
    generation.refresh_from_db()
    assert generation.state == Generation.State.OK and generation.kudos == reward
    assert KudosTransaction.objects.filter(generation_id=generation.pk).count() == 2
    assert GenerationRequest.objects.get(pk=request_id).consumed_kudos == Decimal("1") + reward


def test_a_nul_in_a_text_submit_is_replaced_and_the_job_is_paid(horde, make_user):
    """A NUL in a worker's text (which PostgreSQL's text cannot hold) is stored as U+FFFD, as the chat
    submit stores it (build_stored_reply): a 400 would make the scribe drop a job it has done
    (docs/adr/0116). A lone surrogate, which no UTF-8 text holds, is still refused."""
    requester, owner = make_user("r", kudos=1000), make_user("o")
    horde.text_async(requester.key, models=[MODEL], params={"n": 2})
    first, second = horde.pop(owner.key, amount=2).json()["ids"]

    surrogate = horde.client.post(
        "/api/v2/generate/text/submit",
        '{"id": "' + second + '", "generation": "lone \\ud800"}',
        content_type="application/json",
        HTTP_APIKEY=owner.key,
    )
    assert surrogate.status_code == 400
    assert surrogate.json()["errors"] == {"generation": "Surrogate characters are not allowed: U+D800."}

    answer = horde.submit(owner.key, first, "once\x00upon\x00")
    assert answer.status_code == 200 and answer.json()["reward"] > 0
    assert Generation.objects.get(pk=first).text == "once\ufffdupon\ufffd"
    assert Generation.objects.get(pk=first).state == Generation.State.OK
