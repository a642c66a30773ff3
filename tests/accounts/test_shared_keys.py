"""Shared keys (upstream's /v2/sharedkeys, and chat_requests.md's "shared keys ... apply"): a key a
user lends, whose requests are the owner's within the key's kudos, expiry and per-job limits."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import KudosTransaction, SharedKey
from chat.models import GenerationRequest
from chat.services.admission import SHARED_KEY_DOWNGRADED_PRIORITY
from tests.chat.chat_route_helpers import chat_async, chat_worker
from tests.chat.test_chat_submit import counter_points, metric_reader  # noqa: F401  (fixture)
from tests.conftest import Horde
from tests.races import race

MODEL = "Gryphe/MythoMax-L2-13b"  # 13B
SMALL = "koboldcpp/Marx-3B-V3"  # 3B
RFC_822 = re.compile(r"^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} -0000$")


def lend(api, key: str | None, **body):
    headers = {"HTTP_APIKEY": key} if key else {}
    return api.put("/api/v2/sharedkeys", body, format="json", **headers)


def key_route(api, method: str, key_id, key: str | None = None, body=None):
    headers = {"HTTP_APIKEY": key} if key else {}
    return getattr(api, method)(f"/api/v2/sharedkeys/{key_id}", body, format="json", **headers)


@pytest.fixture
def lender(make_user):
    return make_user("lender", kudos=1000)


@pytest.fixture
def shared(api, lender):
    """A key lent by `lender` with 100 kudos to spend."""
    answer = lend(api, lender.key, name="Mutual Aid", kudos=100)
    assert answer.status_code == 200, answer.json()
    return answer.json()["id"]


def _worker_online(horde, owner, **pop):
    assert horde.pop(owner.key, **pop).json()["id"] is None


# --- the routes ----------------------------------------------------------------------------------


def test_a_lent_key_reads_back_the_same_for_anyone_holding_its_id(api, lender):
    created = lend(api, lender.key, name="Mutual Aid", kudos=250, expiry=30, max_text_tokens=300)
    assert created.status_code == 200
    body = created.json()
    assert set(body) == {
        "id", "username", "name", "kudos", "expiry", "utilized", "max_image_pixels", "max_image_steps",
        "max_text_tokens",
    }
    assert body["username"] == lender.user.unique_alias
    assert (body["name"], body["kudos"], body["utilized"], body["max_text_tokens"]) == ("Mutual Aid", 250, 0, 300)
    assert (body["max_image_pixels"], body["max_image_steps"]) == (-1, -1)
    assert RFC_822.match(body["expiry"]), body["expiry"]
    stored = SharedKey.objects.get(pk=body["id"])
    assert timedelta(days=29, hours=23) < stored.expiry - timezone.now() <= timedelta(days=30)
    # The GET reads no key (a wrong one included), as upstream's.
    assert key_route(APIClient(), "get", body["id"]).json() == body
    assert key_route(APIClient(), "get", body["id"], key="not-a-key").json() == body


def test_a_key_lent_without_options_takes_upstreams_defaults(api, lender):
    body = lend(api, lender.key).json()
    assert (body["kudos"], body["max_image_pixels"], body["max_image_steps"], body["max_text_tokens"]) == (
        5000, -1, -1, -1
    )
    # No name and no expiry: left out, as upstream's skip_none.
    assert "name" not in body and "expiry" not in body


@pytest.mark.parametrize(
    ("field", "value"),
    [("kudos", -2), ("kudos", 50_000_001), ("name", "ab"), ("expiry", -2), ("expiry", 36_501),
     ("expiry", 10**12), ("max_text_tokens", 4097), ("max_image_steps", 501), ("kudos", "many")],
)
def test_an_out_of_range_option_is_a_validation_error(api, lender, field, value):
    refused = lend(api, lender.key, **{field: value})
    assert refused.status_code == 400
    assert field in refused.json()["errors"]
    assert not SharedKey.objects.exists()


def test_only_a_registered_user_lends_keys_and_a_shared_key_lends_none(api, lender, shared):
    anonymous = lend(api, None)
    assert anonymous.status_code == 403 and anonymous.json()["rc"] == "AnonForbidden"
    by_shared = lend(api, shared)
    assert by_shared.status_code == 401 and by_shared.json()["rc"] == "InvalidAPIKey"
    assert SharedKey.objects.count() == 1


def test_a_user_holds_three_keys_and_a_trusted_one_ten(api, make_user):
    plain, trusted = make_user("plain"), make_user("trusted", trusted=True)
    assert [lend(api, plain.key).status_code for _ in range(4)] == [200, 200, 200, 403]
    refused = lend(api, plain.key).json()
    assert refused == {"message": "You cannot have more than 3 shared keys.", "rc": "Forbidden"}
    assert [lend(api, trusted.key).status_code for _ in range(11)] == [200] * 10 + [403]


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_two_creations_racing_for_the_last_place_get_one_key(make_user):
    plain = make_user("plain")
    for _ in range(2):
        assert lend(APIClient(), plain.key).status_code == 200
    answers = race([lambda: lend(APIClient(), plain.key).status_code for _ in range(3)])
    assert sorted(answers) == [200, 403, 403]
    assert SharedKey.objects.filter(user=plain.user).count() == 3


def test_the_owner_changes_only_what_it_sends(api, lender, shared):
    changed = key_route(api, "patch", shared, lender.key, {"kudos": -1, "max_text_tokens": 64, "expiry": 7})
    assert changed.status_code == 200
    body = changed.json()
    assert (body["kudos"], body["max_text_tokens"], body["name"]) == (-1, 64, "Mutual Aid")
    assert RFC_822.match(body["expiry"])
    never = key_route(api, "patch", shared, lender.key, {"expiry": -1}).json()
    assert "expiry" not in never and never["kudos"] == -1


def test_a_change_with_nothing_to_change_is_refused(api, lender, shared):
    # null is as absent, as upstream's reqparse reads it.
    for body in ({}, {"name": None, "kudos": None}):
        refused = key_route(api, "patch", shared, lender.key, body)
        assert refused.status_code == 400
        assert refused.json() == {"message": "No shared key modification selected!", "rc": "NoSharedKeyModSelected"}
    assert lend(api, lender.key, name=None, kudos=None).json()["kudos"] == 5000


def test_a_change_out_of_range_is_a_validation_error(api, lender, shared):
    refused = key_route(api, "patch", shared, lender.key, {"expiry": 10**7})
    assert refused.status_code == 400 and "expiry" in refused.json()["errors"]


def test_another_user_neither_changes_nor_deletes_a_key(api, lender, shared, make_user):
    other = make_user("other")
    for method, body in (("patch", {"kudos": 1}), ("delete", None)):
        refused = key_route(api, method, shared, other.key, body)
        assert refused.status_code == 403
        assert refused.json() == {
            "message": f"Shared Key {shared} belongs to {lender.user.unique_alias} and not to {other.user.unique_alias}.",
            "rc": "Forbidden",
        }
    assert SharedKey.objects.get(pk=shared).kudos == 100


def test_a_deleted_key_is_gone_and_an_unknown_one_is_an_invalid_key(api, lender, shared):
    assert key_route(api, "delete", shared, lender.key).json() == {"message": "OK"}
    for method in ("get", "delete"):
        gone = key_route(api, method, shared, lender.key)
        assert gone.status_code == 401
        assert gone.json() == {"message": "No user matching sent Shared Key.", "rc": "InvalidAPIKey"}
    assert key_route(api, "get", "not-a-uuid").status_code == 401


def test_find_user_names_the_key_and_hides_the_owners_ids(api, lender, shared):
    as_key = api.get("/api/v2/find_user", HTTP_APIKEY=shared).json()
    assert as_key["username"] == f"{lender.user.unique_alias} (Shared Key: Mutual Aid)"
    assert as_key["id"] == lender.user.pk
    assert "worker_ids" not in as_key and "sharedkey_ids" not in as_key
    as_owner = api.get("/api/v2/find_user", HTTP_APIKEY=lender.key).json()
    assert as_owner["sharedkey_ids"] == [shared] and as_owner["worker_ids"] == []


def test_find_user_names_an_unnamed_key_plainly(api, lender):
    key_id = lend(api, lender.key).json()["id"]
    assert api.get("/api/v2/find_user", HTTP_APIKEY=key_id).json()["username"] == (
        f"{lender.user.unique_alias} (Shared Key)"
    )


def test_a_shared_key_acts_for_none_of_its_owners_own_routes(horde, api, lender, shared, make_user):
    """Its worker's pop and submit, and the management of the key itself."""
    popped = horde.pop(shared)
    assert popped.status_code == 401 and popped.json()["rc"] == "InvalidAPIKey"
    requester = make_user("r", kudos=100)
    _worker_online(horde, lender)
    horde.text_async(requester.key, models=[MODEL])
    job = horde.pop(lender.key).json()
    submitted = horde.submit(shared, job["id"])
    assert submitted.status_code == 401 and submitted.json()["rc"] == "InvalidAPIKey"
    for method, body in (("patch", {"kudos": 1}), ("delete", None)):
        answer = key_route(api, method, shared, shared, body)
        assert answer.status_code == 401 and answer.json()["rc"] == "InvalidAPIKey"
    assert SharedKey.objects.get(pk=shared).kudos == 100


# --- requests made with a key --------------------------------------------------------------------


def test_a_request_made_with_a_key_is_its_owners_and_draws_the_key_down(horde, api, lender, shared, make_user):
    worker_owner = make_user("owner")
    _worker_online(horde, worker_owner)
    created = horde.text_async(shared, models=[MODEL], prompt="a" * 4000, params={"max_length": 200})
    assert created.status_code == 202, created.json()
    request = GenerationRequest.objects.get(pk=created.json()["id"])
    assert request.user_id == lender.user.pk and str(request.shared_key_id) == shared
    # The horde tax is the owner's, spent through the key.
    assert lender.refresh().kudos == Decimal("999")
    key = SharedKey.objects.get(pk=shared)
    assert (key.kudos, key.utilized) == (Decimal("99"), Decimal("1"))

    job = horde.pop(worker_owner.key).json()
    assert horde.submit(worker_owner.key, job["id"], "b" * 400).json() == {"reward": 17.63}
    assert lender.refresh().kudos == Decimal("999") - Decimal("17.63")
    key.refresh_from_db()
    assert (key.kudos, key.utilized) == (Decimal("81.37"), Decimal("18.63"))
    # The wire shows whole kudos, as upstream's Integer fields.
    shown = key_route(api, "get", shared).json()
    assert (shown["kudos"], shown["utilized"]) == (81, 18)
    charges = KudosTransaction.objects.filter(user=lender.user, kind=KudosTransaction.Kind.GENERATION_CHARGE)
    assert [c.amount for c in charges] == [Decimal("-17.63")]


def test_an_unlimited_key_keeps_no_limit_and_counts_what_it_spent(horde, api, lender, make_user):
    key_id = lend(api, lender.key, kudos=-1).json()["id"]
    worker_owner = make_user("owner")
    _worker_online(horde, worker_owner)
    horde.text_async(key_id, models=[MODEL], prompt="a" * 4000, params={"max_length": 200})
    job = horde.pop(worker_owner.key).json()
    horde.submit(worker_owner.key, job["id"], "b" * 400)
    key = SharedKey.objects.get(pk=key_id)
    assert (key.kudos, key.utilized) == (Decimal("-1"), Decimal("18.63"))


def test_a_settlement_never_takes_a_key_below_zero(horde, api, lender, make_user):
    key_id = lend(api, lender.key, kudos=19).json()["id"]  # covers the quote, then the tax takes 1
    worker_owner = make_user("owner")
    _worker_online(horde, worker_owner)
    created = horde.text_async(key_id, models=[SMALL], prompt="a" * 4000, params={"max_length": 200})
    assert created.status_code == 202, created.json()
    SharedKey.objects.filter(pk=key_id).update(kudos=Decimal("2"))  # the owner lowered it meanwhile
    job = horde.pop(worker_owner.key, models=[SMALL]).json()
    reward = Decimal(str(horde.submit(worker_owner.key, job["id"], "b" * 400).json()["reward"]))
    assert reward > 2
    key = SharedKey.objects.get(pk=key_id)
    assert (key.kudos, key.utilized) == (Decimal("0"), Decimal("1") + reward)
    spent = horde.text_async(key_id, models=[SMALL])
    assert spent.status_code == 403
    assert spent.json() == {"message": "This shared key has run out of kudos.", "rc": "SharedKeyEmpty"}


def test_a_deleted_keys_queued_request_is_still_served_and_charged_to_the_owner(horde, api, lender, shared, make_user):
    worker_owner = make_user("owner")
    _worker_online(horde, worker_owner)
    horde.text_async(shared, models=[MODEL], prompt="a" * 4000, params={"max_length": 200})
    key_route(api, "delete", shared, lender.key)
    job = horde.pop(worker_owner.key).json()
    assert horde.submit(worker_owner.key, job["id"], "b" * 400).json() == {"reward": 17.63}
    assert lender.refresh().kudos == Decimal("999") - Decimal("17.63")


def test_a_spent_key_is_refused_or_with_allow_downgrade_asks_as_anonymous(horde, lender, shared):
    SharedKey.objects.filter(pk=shared).update(kudos=0)
    refused = horde.text_async(shared, models=[MODEL])
    assert refused.status_code == 403 and refused.json()["rc"] == "SharedKeyEmpty"
    downgraded = horde.text_async(shared, models=[MODEL], allow_downgrade=True)
    assert downgraded.status_code == 202, downgraded.json()
    request = GenerationRequest.objects.get(pk=downgraded.json()["id"])
    assert request.user.is_anonymous and request.shared_key_id is None
    assert request.priority == SHARED_KEY_DOWNGRADED_PRIORITY
    assert lender.refresh().kudos == Decimal("1000")


def test_a_spent_key_is_refused_on_the_chat_route_and_without_anonymous_requests(api, horde, lender, shared,
                                                                                 make_user, settings):
    chat_worker(make_user("owner"))
    SharedKey.objects.filter(pk=shared).update(kudos=0)
    chat = chat_async(api, shared)
    assert chat.status_code == 403 and chat.json()["rc"] == "SharedKeyEmpty"
    settings.HORDE_ALLOW_ANONYMOUS = False
    text = horde.text_async(shared, models=[MODEL], allow_downgrade=True)
    assert text.status_code == 403 and text.json()["rc"] == "SharedKeyEmpty"
    assert not GenerationRequest.objects.exists()


def test_a_spent_keys_anonymous_request_keeps_the_keys_token_limit(horde, lender, shared):
    SharedKey.objects.filter(pk=shared).update(kudos=0, max_text_tokens=50)
    refused = horde.text_async(shared, models=[MODEL], params={"max_length": 100}, allow_downgrade=True)
    assert refused.status_code == 400 and refused.json()["rc"] == "BadRequest"
    assert not GenerationRequest.objects.exists()


def test_the_keys_kudos_are_checked_before_its_token_limit(horde, lender, api, make_user):
    _worker_online(horde, make_user("owner"))
    key_id = lend(api, lender.key, kudos=5, max_text_tokens=100).json()["id"]
    refused = horde.text_async(key_id, models=[MODEL], params={"max_length": 200})
    assert refused.status_code == 403 and refused.json()["rc"] == "SharedKeyInsufficientKudos"


def test_a_listed_request_under_upfront_kudos_on_worker_lists_is_not_downgraded(horde, lender, api, make_user,
                                                                                   settings):
    settings.HORDE_UPFRONT_KUDOS_ON_WORKERLIST = True
    owner = make_user("owner")
    _worker_online(horde, owner)
    from workers.models import Worker

    worker_id = str(Worker.objects.get(owner=owner.user).pk)
    key_id = lend(api, lender.key, kudos=5).json()["id"]
    refused = horde.text_async(
        key_id, models=[MODEL], params={"max_length": 200}, workers=[worker_id], allow_downgrade=True
    )
    assert refused.status_code == 403 and refused.json()["rc"] == "SharedKeyInsufficientKudos"


def test_an_expired_key_is_refused_on_both_routes(api, horde, lender, shared, make_user):
    chat_worker(make_user("owner"))
    SharedKey.objects.filter(pk=shared).update(expiry=timezone.now() - timedelta(seconds=1))
    for answer in (horde.text_async(shared, models=[MODEL]), chat_async(api, shared)):
        assert answer.status_code == 403
        assert answer.json() == {"message": "This shared key has expired", "rc": "SharedKeyExpired"}
    assert not GenerationRequest.objects.exists()
    assert lender.refresh().kudos == Decimal("1000")


def test_a_job_over_the_keys_token_limit_is_refused(api, horde, lender, shared, make_user):
    chat_worker(make_user("owner"))
    SharedKey.objects.filter(pk=shared).update(max_text_tokens=100)
    text = horde.text_async(shared, models=[MODEL], params={"max_length": 101})
    assert text.status_code == 400
    assert text.json() == {
        "message": "This shared key is limited to 100 tokens per job. You requested 101 tokens.", "rc": "BadRequest"
    }
    chat = chat_async(api, shared, max_tokens=200)
    assert chat.status_code == 400
    assert chat.json()["message"] == (
        "'max_tokens': This shared key is limited to 100 tokens per job. You requested 200 tokens."
    )
    assert horde.text_async(shared, models=[MODEL], params={"max_length": 100}).status_code == 202
    assert chat_async(api, shared, max_tokens=100).status_code == 202


def test_a_key_short_of_the_dearest_models_kudos_refuses_with_its_own_code(horde, lender, make_user, api):
    """The 13B quote of 200 tokens is about 22 kudos with the tax, the 3B one about 7: a key of 10
    covers the small model alone, and listing both is priced at the dearest."""
    worker_owner = make_user("owner")
    _worker_online(horde, worker_owner, models=[MODEL, SMALL])
    key_id = lend(api, lender.key, kudos=10).json()["id"]
    refused = horde.text_async(key_id, models=[SMALL, MODEL], params={"max_length": 200})
    assert refused.status_code == 403
    body = refused.json()
    assert body["rc"] == "SharedKeyInsufficientKudos"
    assert re.fullmatch(
        r"This shared key does not have enough remaining kudos \(10\) to fulfill this request \(\d+(\.\d+)?\)\.",
        body["message"],
    ), body["message"]
    assert horde.text_async(key_id, models=[SMALL], params={"max_length": 200}).status_code == 202
    assert GenerationRequest.objects.count() == 1
    assert SharedKey.objects.get(pk=key_id).kudos == Decimal("9")


def test_with_allow_downgrade_a_short_key_queues_at_the_anonymous_priority(horde, lender, make_user, api):
    _worker_online(horde, make_user("owner"))
    key_id = lend(api, lender.key, kudos=5).json()["id"]
    created = horde.text_async(key_id, models=[MODEL], params={"max_length": 200}, allow_downgrade=True)
    assert created.status_code == 202, created.json()
    request = GenerationRequest.objects.get(pk=created.json()["id"])
    assert request.user_id == lender.user.pk and request.priority == SHARED_KEY_DOWNGRADED_PRIORITY
    assert request.max_length == 200


def test_a_short_key_with_no_online_worker_hears_no_eligible_worker(horde, lender, api):
    key_id = lend(api, lender.key, kudos=5).json()["id"]
    refused = horde.text_async(key_id, models=[MODEL], params={"max_length": 200})
    assert refused.status_code == 403 and refused.json()["rc"] == "NoEligibleWorker"
    assert not GenerationRequest.objects.exists()


def test_a_chat_request_on_a_short_key_is_refused_and_charges_nothing(api, lender, make_user):
    chat_worker(make_user("owner"))
    key_id = lend(api, lender.key, kudos=5).json()["id"]
    refused = chat_async(api, key_id, max_tokens=400)
    assert refused.status_code == 403 and refused.json()["rc"] == "SharedKeyInsufficientKudos"
    assert not GenerationRequest.objects.exists()
    assert lender.refresh().kudos == Decimal("1000")
    created = chat_async(api, key_id, max_tokens=16)
    assert created.status_code == 202, created.json()
    request = GenerationRequest.objects.get(pk=created.json()["id"])
    assert request.user_id == lender.user.pk and str(request.shared_key_id) == key_id
    assert SharedKey.objects.get(pk=key_id).kudos == Decimal("4")


def test_the_allowance_decision_names_a_shared_key_requester(horde, lender, shared, make_user, metric_reader):  # noqa: F811
    _worker_online(horde, make_user("owner"))
    horde.text_async(shared, models=[MODEL], params={"max_length": 64})
    points = counter_points(metric_reader, "horde.text.free_allowance.decisions")
    assert [dict(attrs)["horde.requester"] for attrs in points] == ["shared_key"]


def test_two_creations_on_one_key_each_draw_their_tax(make_user, lender, shared):
    horde = Horde(APIClient())
    _worker_online(horde, make_user("owner"))
    for _ in range(2):
        assert horde.text_async(shared, models=[MODEL], params={"max_length": 64}).status_code == 202
    key = SharedKey.objects.get(pk=shared)
    assert (key.kudos, key.utilized) == (Decimal("98"), Decimal("2"))


def test_lending_keys_is_rate_limited_per_address(api, make_user, settings):
    settings.HORDE_SHARED_KEY_CREATE_RATE_LIMITS = ["2/minute"]
    trusted = make_user("trusted", trusted=True)
    answers = [lend(api, trusted.key) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert answers[2].json()["rc"] == "RateLimited" and "Retry-After" in answers[2].headers
    assert SharedKey.objects.count() == 2


def _waiting_on_a_lock(count: int) -> bool:
    """Whether `count` other sessions wait on a lock (the API calls queued behind the test's)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0] >= count


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_change_to_a_key_deleted_meanwhile_is_the_unknown_key_not_a_500(make_user):
    """The owner's PATCH read the key, then its DELETE (from another tab) removed it before the
    PATCH wrote: the PATCH answers as for an unknown key, as it would a moment later."""
    import threading
    import time

    from django.db import connection, transaction

    lender = make_user("lender", kudos=1000)
    key_id = lend(APIClient(), lender.key, name="Mutual Aid").json()["id"]
    answers: dict = {}

    def call(name, method, body=None):
        try:
            answers[name] = key_route(APIClient(), method, key_id, lender.key, body)
        finally:
            connection.close()

    with transaction.atomic():
        # Held here, the key's row queues the DELETE, then the PATCH's write (its read is done).
        list(SharedKey.objects.select_for_update().filter(pk=key_id))
        threads = [threading.Thread(target=call, args=("delete", "delete"))]
        threads[0].start()
        for _ in range(200):
            if _waiting_on_a_lock(1):
                break
            time.sleep(0.025)
        threads.append(threading.Thread(target=call, args=("patch", "patch", {"name": "Renamed"})))
        threads[1].start()
        for _ in range(200):
            if _waiting_on_a_lock(2):
                break
            time.sleep(0.025)
    for thread in threads:
        thread.join()
    assert answers["delete"].status_code == 200
    assert answers["patch"].status_code == 401, answers["patch"].content
    assert answers["patch"].json() == {"message": "No user matching sent Shared Key.", "rc": "InvalidAPIKey"}
    assert not SharedKey.objects.filter(pk=key_id).exists()
