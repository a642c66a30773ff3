"""POST /api/v2/kudos/transfer, as upstream's: kudos given to a user named by alias or to a shared
key, with both ledger rows and the log in one transaction, upstream's refusals, the Idempotency-Key
a retry may carry, and no balance spent twice by transfers racing on real connections."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from accounts.models import HordeUser, KudosTransaction, KudosTransfer, SharedKey
from tests.accounts.test_shared_keys import lend
from tests.races import race


def transfer(api, key: str | None, username: str, amount, **headers):
    sent = {"HTTP_APIKEY": key} if key else {}
    sent.update({f"HTTP_{name.upper().replace('-', '_')}": value for name, value in headers.items()})
    return api.post("/api/v2/kudos/transfer", {"username": username, "amount": amount}, format="json", **sent)


def kudos(account) -> Decimal:
    return HordeUser.objects.get(pk=account.user.pk).kudos


def refused(answer, rc: str, status: int = 400) -> None:
    assert (answer.status_code, answer.json()["rc"]) == (status, rc), answer.json()


def test_the_whole_available_balance_can_be_given_and_no_more(api, make_user):
    alice, bob = make_user("alice", kudos=100), make_user("bob")
    HordeUser.objects.filter(pk=alice.user.pk).update(kudos_held=Decimal("40"))
    refused(transfer(api, alice.key, f"bob#{bob.user.pk}", 61), "KudosTransferNotEnough")
    assert transfer(api, alice.key, f"bob#{bob.user.pk}", 60).json() == {"transferred": 60.0}
    assert (kudos(alice), kudos(bob)) == (Decimal("40"), Decimal("60"))


def test_upstreams_default_amount_and_a_blank_name(api, make_user):
    alice, bob = make_user("alice", kudos=500), make_user("bob")
    sent = api.post("/api/v2/kudos/transfer", {"username": f"bob#{bob.user.pk}"}, format="json", HTTP_APIKEY=alice.key)
    assert sent.json() == {"transferred": 100.0}
    refused(transfer(api, alice.key, "", 5), "InvalidTargetUsername")


def test_kudos_move_with_their_ledger_rows_and_log(api, make_user):
    alice, bob = make_user("alice", kudos=500), make_user("bob", kudos=10)
    answer = transfer(api, alice.key, f"bob#{bob.user.pk}", 120)
    assert (answer.status_code, answer.json()) == (200, {"transferred": 120.0})
    assert (kudos(alice), kudos(bob)) == (Decimal("380"), Decimal("130"))
    ledger = sorted(KudosTransaction.objects.filter(kind="transfer").values_list("user_id", "amount"))
    assert ledger == sorted([(alice.user.pk, Decimal("-120")), (bob.user.pk, Decimal("120"))])
    [log] = KudosTransfer.objects.all()
    assert (log.source_id, log.dest_id, log.amount, log.shared_key_id) == (alice.user.pk, bob.user.pk, 120, None)
    # The alias's last '#' decides, as upstream reads it: the name part may be anything.
    assert transfer(api, alice.key, f"some#name#{bob.user.pk}", 1).status_code == 200


def test_upstreams_refusals(api, make_user, settings):
    alice, bob = make_user("alice", kudos=100), make_user("bob", kudos=100)
    anonymous = HordeUser.objects.get(is_anonymous=True)
    for username, amount, rc in (
        (f"alice#{alice.user.pk}", 5, "KudosTransferToSelf"),
        (f"Anonymous#{anonymous.pk}", 5, "KudosTransferToAnon"),
        (f"bob#{bob.user.pk}", -5, "NegativeKudosTransfer"),
        (f"bob#{bob.user.pk}", 0, "InvalidKudosTransferAmount"),
        ("nobody#99999999", 5, "InvalidTargetUsername"),
        ("nobody", 5, "InvalidTargetUsername"),
        (f"bob#{bob.user.pk}", 101, "KudosTransferNotEnough"),
    ):
        refused(transfer(api, alice.key, username, amount), rc)
    refused(transfer(api, None, f"bob#{bob.user.pk}", 5), "KudosTransferFromAnon")
    refused(transfer(api, "not-a-key", f"bob#{bob.user.pk}", 5), "InvalidAPIKey", 401)
    assert transfer(api, alice.key, f"bob#{bob.user.pk}", 1.5).status_code == 400  # whole kudos, as upstream
    # What queued requests hold is not the payer's to give.
    HordeUser.objects.filter(pk=alice.user.pk).update(kudos_held=Decimal("60"))
    refused(transfer(api, alice.key, f"bob#{bob.user.pk}", 41), "KudosTransferNotEnough")
    assert (kudos(alice), kudos(bob)) == (Decimal("100"), Decimal("100"))
    assert not KudosTransfer.objects.exists() and not KudosTransaction.objects.filter(kind="transfer").exists()


def test_a_transfer_straight_back_waits_a_minute(api, make_user):
    alice, bob = make_user("alice", kudos=100), make_user("bob", kudos=100)
    assert transfer(api, alice.key, f"bob#{bob.user.pk}", 10).status_code == 200
    back = transfer(api, bob.key, f"alice#{alice.user.pk}", 10)
    assert back.json() == {
        "message": "This user transferred kudos to you very recently. Please wait at least 1 minute.",
        "rc": "TooFastKudosTransfers",
    }
    KudosTransfer.objects.update(created=KudosTransfer.objects.get().created - timedelta(seconds=61))
    assert transfer(api, bob.key, f"alice#{alice.user.pk}", 10).status_code == 200
    assert (kudos(alice), kudos(bob)) == (Decimal("100"), Decimal("100"))


def test_a_transfer_to_a_shared_key_pays_its_owner_and_fills_the_key(api, make_user):
    owner, giver = make_user("owner", kudos=1000), make_user("giver", kudos=100)
    limited = lend(api, owner.key, kudos=50).json()["id"]
    unlimited = lend(api, owner.key, kudos=-1).json()["id"]
    assert transfer(api, giver.key, limited, 30).json() == {"transferred": 30.0}
    assert transfer(api, giver.key, unlimited, 20).status_code == 200
    assert kudos(owner) == Decimal("1050") and kudos(giver) == Decimal("50")
    assert SharedKey.objects.get(pk=limited).kudos == Decimal("80")
    assert SharedKey.objects.get(pk=unlimited).kudos == Decimal("-1")  # still no limit
    refused(transfer(api, owner.key, limited, 5), "KudosTransferToSelf")  # your own key is you
    # A shared key spends; it does not give.
    refused(transfer(api, limited, f"giver#{giver.user.pk}", 5), "InvalidAPIKey", 401)
    expired = lend(api, owner.key, kudos=50, expiry=1).json()["id"]
    from django.utils import timezone

    SharedKey.objects.filter(pk=expired).update(expiry=timezone.now() - timedelta(seconds=1))
    refused(transfer(api, giver.key, expired, 5), "SharedKeyExpired")


def test_an_idempotency_key_makes_a_retry_safe(api, make_user):
    alice, bob, carol = make_user("alice", kudos=100), make_user("bob"), make_user("carol")
    first = transfer(api, alice.key, f"bob#{bob.user.pk}", 40, **{"Idempotency-Key": "tip-1"})
    again = transfer(api, alice.key, f"bob#{bob.user.pk}", 40, **{"Idempotency-Key": "tip-1"})
    assert first.json() == again.json() == {"transferred": 40.0}
    assert (kudos(alice), kudos(bob)) == (Decimal("60"), Decimal("40"))
    refused(transfer(api, alice.key, f"carol#{carol.user.pk}", 40, **{"Idempotency-Key": "tip-1"}), "IdempotencyKeyConflict")
    refused(transfer(api, alice.key, f"bob#{bob.user.pk}", 41, **{"Idempotency-Key": "tip-1"}), "IdempotencyKeyConflict")
    # A retry answers as the first attempt did, whatever changed since: the balance spent, the
    # target key gone.
    HordeUser.objects.filter(pk=alice.user.pk).update(kudos=Decimal("0"))
    assert transfer(api, alice.key, f"bob#{bob.user.pk}", 40, **{"Idempotency-Key": "tip-1"}).json() == {
        "transferred": 40.0
    }
    assert (kudos(alice), kudos(bob)) == (Decimal("0"), Decimal("40"))
    # A refused attempt claims nothing: once there is enough, the same key moves the kudos.
    refused(transfer(api, alice.key, f"carol#{carol.user.pk}", 10, **{"Idempotency-Key": "tip-2"}), "KudosTransferNotEnough")
    HordeUser.objects.filter(pk=alice.user.pk).update(kudos=Decimal("10"))
    assert transfer(api, alice.key, f"carol#{carol.user.pk}", 10, **{"Idempotency-Key": "tip-2"}).status_code == 200
    assert kudos(carol) == Decimal("10")
    # Another sender's key of the same text is its own.
    assert transfer(api, bob.key, f"carol#{carol.user.pk}", 5, **{"Idempotency-Key": "tip-1"}).status_code == 200
    refused(transfer(api, alice.key, f"bob#{bob.user.pk}", 1, **{"Idempotency-Key": "k" * 256}), "BadRequest")


@pytest.mark.django_db(transaction=True)
def test_racing_transfers_never_spend_a_balance_twice(make_user):
    alice = make_user("alice", kudos=100)
    friends = [make_user(f"friend{i}") for i in range(5)]
    answers = race(
        [
            lambda friend=friend: transfer(APIClient(), alice.key, f"f#{friend.user.pk}", 30).status_code
            for friend in friends
        ]
    )
    assert sorted(answers) == [200, 200, 200, 400, 400]
    assert kudos(alice) == Decimal("10") and sum(kudos(f) for f in friends) == Decimal("90")
    assert KudosTransfer.objects.count() == 3


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_transfer_never_waits_on_a_held_balance_it_could_deadlock_on(make_user):
    """A settlement holding a balance: the transfer tries again without waiting (so it can never be
    one end of a deadlock), goes through once the balance is free, and answers 503 while it is not."""
    import threading

    from django.db import connection, transaction

    alice, bob = make_user("alice", kudos=100), make_user("bob")
    held, release = threading.Event(), threading.Event()

    def hold_bob(seconds: float) -> None:
        try:
            with transaction.atomic():
                HordeUser.objects.select_for_update().get(pk=bob.user.pk)
                held.set()
                release.wait(seconds)
        finally:
            connection.close()

    def transfer_while_held(seconds: float):
        held.clear()
        release.clear()
        holder = threading.Thread(target=hold_bob, args=(seconds,))
        holder.start()
        assert held.wait(5)
        try:
            return transfer(APIClient(), alice.key, f"bob#{bob.user.pk}", 10)
        finally:
            release.set()
            holder.join()

    assert transfer_while_held(0.2).json() == {"transferred": 10.0}  # freed within the retries
    busy = transfer_while_held(5.0)
    assert (busy.status_code, busy.json()["rc"]) == (503, "KudosTransferBusy")
    assert (kudos(alice), kudos(bob)) == (Decimal("90"), Decimal("10"))


@pytest.mark.django_db(transaction=True)
def test_a_retry_racing_its_first_attempt_moves_the_kudos_once(make_user):
    alice, bob = make_user("alice", kudos=100), make_user("bob")
    answers = race(
        [
            lambda: transfer(APIClient(), alice.key, f"bob#{bob.user.pk}", 30, **{"Idempotency-Key": "once"}).json()
            for _ in range(3)
        ]
    )
    assert answers == [{"transferred": 30.0}] * 3
    assert (kudos(alice), kudos(bob)) == (Decimal("70"), Decimal("30"))
    assert KudosTransaction.objects.filter(kind="transfer").count() == 2


def test_renaming_a_shared_key_keeps_what_a_transfer_added_meanwhile(api, make_user):
    from accounts.services import shared_key_update

    owner, giver = make_user("owner", kudos=10), make_user("giver", kudos=100)
    key_id = lend(api, owner.key, kudos=50).json()["id"]
    read_before = SharedKey.objects.get(pk=key_id)  # as the PATCH's view read it
    assert transfer(api, giver.key, key_id, 25).status_code == 200
    renamed = shared_key_update(key=read_before, changes={"name": "Mutual Aid"})
    assert (renamed.name, renamed.kudos) == ("Mutual Aid", Decimal("75"))
    assert SharedKey.objects.get(pk=key_id).kudos == Decimal("75")


def test_a_settlement_moves_both_balances_and_nets_a_self_served_request(make_user):
    """kudos_settle moves both balances and releases the hold; a requester served by their own
    worker pays and earns on one row."""
    import uuid

    from accounts.services import kudos_settle

    owner, requester = make_user("owner", kudos=10), make_user("requester", kudos=100)
    HordeUser.objects.filter(pk=requester.user.pk).update(kudos_held=Decimal("30"))
    settle = dict(request_id=uuid.uuid4(), generation_id=uuid.uuid4())
    kudos_settle(payee_id=owner.user.pk, payer_id=requester.user.pk, reward=Decimal("4.5"),
                 charge=Decimal("5.25"), release_held=Decimal("30"), **settle)
    assert (kudos(owner), kudos(requester)) == (Decimal("14.50"), Decimal("94.75"))
    assert HordeUser.objects.get(pk=requester.user.pk).kudos_held == 0
    assert HordeUser.objects.get(pk=owner.user.pk).kudos_held == 0
    kudos_settle(payee_id=owner.user.pk, payer_id=owner.user.pk, reward=Decimal("2"),
                 charge=Decimal("3"), release_held=Decimal("0"), **settle)
    assert kudos(owner) == Decimal("13.50")
