"""The whole text loop over HTTP: async -> pop -> submit -> status, with its kudos."""

from __future__ import annotations

from decimal import Decimal

import pytest

from accounts.models import KudosTransaction
from chat.models import Generation, GenerationRequest

MODEL = "Gryphe/MythoMax-L2-13b"  # 13B in the public reference
STATUS_KEYS = {
    "generations", "finished", "processing", "restarted", "waiting", "done", "faulted",
    "wait_time", "queue_position", "kudos", "is_possible",
}
GENERATION_KEYS = {"text", "seed", "gen_metadata", "worker_id", "worker_name", "model", "state"}


@pytest.fixture
def people(make_user):
    return make_user("requester", kudos=1000), make_user("owner")


def test_whole_loop_charges_and_rewards_the_upstream_formula(horde, people):
    requester, owner = people
    prompt = "a" * 4000
    assert horde.pop(owner.key, max_length=512, max_context_length=4096).json()["id"] is None  # online, idle
    created = horde.text_async(
        requester.key, prompt=prompt, models=[MODEL], params={"max_length": 200, "temperature": 0.7, "top_k": 40}
    )
    assert created.status_code == 202
    request_id = created.json()["id"]
    assert set(created.json()) == {"id", "kudos"}

    status = horde.status(request_id).json()
    assert set(status) == STATUS_KEYS
    assert (status["waiting"], status["processing"], status["finished"], status["done"]) == (1, 0, 0, False)

    job = horde.pop(owner.key, max_length=512, max_context_length=4096).json()
    assert job["payload"]["prompt"] == prompt
    assert job["payload"]["max_length"] == 200
    assert job["payload"]["max_context_length"] == 2048
    assert job["payload"]["temperature"] == 0.7
    assert job["payload"]["n"] == 1
    assert not {"width", "length", "steps"} & set(job["payload"])
    assert job["model"] == MODEL and job["ttl"] == 150 and job["ids"] == [job["id"]]
    assert set(job) == {"payload", "id", "ids", "messages", "ttl", "extra_source_images", "skipped", "softprompt", "model"}
    assert horde.status(request_id).json()["processing"] == 1

    submitted = horde.submit(owner.key, job["id"], "b" * 400, seed=0)
    assert submitted.status_code == 200
    # 100 tokens (400 chars / 4) * 13B / 100, times the context multiplier 1.2 + 2.2^log2(200/1024).
    assert submitted.json() == {"reward": 17.63}

    status = horde.status(request_id).json()
    assert status["done"] is True and status["finished"] == 1 and status["processing"] == 0
    assert status["kudos"] == pytest.approx(17.63 + 1)  # the generation plus the horde tax
    [generation] = status["generations"]
    assert set(generation) == GENERATION_KEYS
    assert generation["text"] == "b" * 400 and generation["model"] == MODEL and generation["state"] == "ok"
    assert generation["worker_name"] == "worker-1"

    assert requester.refresh().kudos == Decimal("1000") - Decimal("17.63") - Decimal("1")
    assert owner.refresh().kudos == Decimal("17.63")
    ledger = sorted(KudosTransaction.objects.values_list("user_id", "kind", "amount"))
    assert ledger == sorted(
        [
            (requester.user.pk, "grant", Decimal("1000")),
            (requester.user.pk, "horde_tax", Decimal("-1")),
            (requester.user.pk, "generation_charge", Decimal("-17.63")),
            (owner.user.pk, "generation_reward", Decimal("17.63")),
        ]
    )


def test_reward_scales_with_parameters_and_short_replies_count_twenty_tokens(horde, people):
    requester, owner = people
    big = "meta-llama/Meta-Llama-3-70B-Instruct"
    request_id = horde.text_async(requester.key, prompt="a" * 4000, models=[big], params={"max_length": 200}).json()["id"]
    job = horde.pop(owner.key, models=[big]).json()
    # 70B: parameter bonus (70/13)^0.2; 100 tokens; context multiplier as above.
    assert horde.submit(owner.key, job["id"], "b" * 400).json() == {"reward": 132.92}

    request_id = horde.text_async(requester.key, prompt="a" * 4000, models=[MODEL], params={"max_length": 200}).json()["id"]
    job = horde.pop(owner.key).json()
    # A 3-character reply is counted as the 20-token floor: 20 * 13 / 100 * 1.356.
    assert horde.submit(owner.key, job["id"], "abc").json() == {"reward": 3.53}
    assert horde.status(request_id).json()["done"] is True


def test_unknown_model_pays_the_context_multiplier_to_untrusted_owners(horde, people):
    requester, owner = people
    horde.text_async(requester.key, prompt="a" * 4000, models=["my/private-model"], params={"max_length": 200})
    job = horde.pop(owner.key, models=["my/private-model"]).json()
    assert horde.submit(owner.key, job["id"], "b" * 400).json() == {"reward": 1.36}


@pytest.mark.parametrize("state", ["censored", "csam"])
def test_a_withheld_reply_is_neither_charged_nor_paid(horde, people, state):
    requester, owner = people
    horde.text_async(requester.key, prompt="a" * 4000, models=[MODEL], params={"max_length": 200})
    job = horde.pop(owner.key).json()
    assert horde.submit(owner.key, job["id"], "b" * 400, state=state).json() == {"reward": 0}
    assert requester.refresh().kudos == Decimal("999")  # only the horde tax
    assert requester.user.kudos_held == 0
    assert owner.refresh().kudos == 0
    assert not KudosTransaction.objects.filter(generation_id=job["id"]).exists()
    assert Generation.objects.get(pk=job["id"]).state == state


def test_censored_replies_to_ones_own_requests_make_no_kudos(horde, make_user):
    """A worker's owner serving their own requests and calling each reply censored: when the
    worker was paid and the requester not charged, each round made kudos from nothing."""
    account = make_user("self-dealer", kudos=100)
    for _ in range(3):
        horde.text_async(account.key, prompt="a" * 4000, models=[MODEL], params={"max_length": 200})
        job = horde.pop(account.key).json()
        assert horde.submit(account.key, job["id"], "word " * 600, state="censored").status_code == 200
    assert account.refresh().kudos == Decimal("97")  # three horde taxes, nothing made


def test_dry_run_quotes_without_creating(horde, people):
    requester, _ = people
    response = horde.text_async(requester.key, prompt="a" * 4000, models=[MODEL], params={"max_length": 200}, dry_run=True)
    assert response.status_code == 200
    # Full-length quote: 200 tokens * 13 / 100 * 1.356, plus the horde tax.
    assert response.json() == {"kudos": 36.26}
    assert not GenerationRequest.objects.exists()
    assert requester.refresh().kudos == Decimal("1000")


def test_batched_pop_hands_out_several_jobs_of_one_request(horde, people):
    requester, owner = people
    request_id = horde.text_async(requester.key, models=[MODEL], params={"n": 3}).json()["id"]
    job = horde.pop(owner.key, amount=2).json()
    assert len(job["ids"]) == 2 and job["id"] == job["ids"][0]
    status = horde.status(request_id).json()
    assert (status["processing"], status["waiting"]) == (2, 1)
    for job_id in job["ids"]:
        assert horde.submit(owner.key, job_id, "done").status_code == 200
    assert horde.pop(owner.key, amount=2).json()["ids"] != []
    assert horde.status(request_id).json()["finished"] == 2


def test_disable_batching_hands_out_one_job(horde, people):
    requester, owner = people
    horde.text_async(requester.key, models=[MODEL], params={"n": 3}, disable_batching=True)
    assert len(horde.pop(owner.key, amount=3).json()["ids"]) == 1


def test_submit_errors(horde, people, make_user):
    requester, owner = people
    horde.text_async(requester.key, models=[MODEL])
    job = horde.pop(owner.key).json()
    stranger = make_user("stranger")

    wrong = horde.submit(stranger.key, job["id"])
    assert wrong.status_code == 403 and wrong.json()["rc"] == "WrongCredentials"
    unknown = horde.submit(owner.key, "00000000-0000-0000-0000-000000000000")
    assert unknown.status_code == 404 and unknown.json()["rc"] == "InvalidJobID"
    anonymous = horde.submit("0000000000", job["id"])
    assert anonymous.status_code == 403 and anonymous.json()["rc"] == "AnonForbiddenWorker"

    # The parser refuses a text submit without generation: the job stays pending, nothing is paid.
    bare = horde.chat_submit(owner.key, job["id"], seed=0)
    assert bare.status_code == 400 and "generation" in bare.json()["errors"] and bare.json()["message"]
    assert Generation.objects.get(pk=job["id"]).state == "processing" and owner.refresh().kudos == 0

    assert horde.submit(owner.key, job["id"]).status_code == 200
    again = horde.submit(owner.key, job["id"])
    assert again.status_code == 400 and again.json()["rc"] == "DuplicateGen"
    assert Generation.objects.get(pk=job["id"]).text == "A reply."


def test_cancel_stops_the_queue_and_keeps_finished_work(horde, people):
    requester, owner = people
    request_id = horde.text_async(requester.key, models=[MODEL], params={"n": 3}).json()["id"]
    job = horde.pop(owner.key).json()
    assert horde.submit(owner.key, job["id"], "first").status_code == 200

    cancelled = horde.cancel(request_id)
    assert cancelled.status_code == 200
    body = cancelled.json()
    assert set(body) == set(STATUS_KEYS)
    assert body["finished"] == 1 and body["waiting"] == 0 and body["done"] is True
    assert [g["text"] for g in body["generations"]] == ["first"]
    assert horde.pop(owner.key).json()["id"] is None


def test_a_cancel_of_a_request_that_expired_since_it_was_read_claims_nothing(horde, people):
    """The route reads the request, then cancels it: an expiry in between is RequestNotFound on the
    re-read, never a 500 from the cancel's lock."""
    from chat.services.cancel import request_cancel

    requester, _ = people
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    read = GenerationRequest.objects.get(pk=request_id)
    GenerationRequest.objects.filter(pk=request_id).delete()  # as the expiry sweep does
    assert request_cancel(request=read) is False
    gone = horde.cancel(request_id)
    assert gone.status_code == 404 and gone.json()["rc"] == "RequestNotFound"


def test_cancel_lets_a_job_in_flight_submit_and_be_paid(horde, people):
    requester, owner = people
    request_id = horde.text_async(requester.key, models=[MODEL]).json()["id"]
    job = horde.pop(owner.key).json()
    horde.cancel(request_id)
    assert horde.status(request_id).json()["done"] is False  # the job in flight is still coming
    assert horde.submit(owner.key, job["id"], "late").status_code == 200
    assert horde.status(request_id).json()["done"] is True


def test_unknown_request_is_404(horde):
    missing = horde.status("00000000-0000-0000-0000-000000000000")
    assert missing.status_code == 404 and missing.json()["rc"] == "RequestNotFound"
    assert horde.cancel("00000000-0000-0000-0000-000000000000").json()["rc"] == "RequestNotFound"
