"""Writes on accounts: creation and every kudos movement (always with its ledger row)."""

from __future__ import annotations

import secrets
import time
from datetime import timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

from django.conf import settings
from django.db import OperationalError, transaction
from django.db.models import Case, F, Value, When
from django.db.models.functions import Greatest
from django.utils import timezone

from accounts.models import (
    KUDOS_TRANSFER_REVERSE_COOLDOWN_SECONDS,
    MAX_SHARED_KEYS,
    MAX_SHARED_KEYS_TRUSTED,
    SHARED_KEY_UNLIMITED,
    HordeUser,
    KudosTransaction,
    KudosTransfer,
    SharedKey,
    hash_api_key,
)
from accounts.selectors import kudos_transfer_target
from contract.errors import HordeError


def new_api_key() -> str:
    return secrets.token_urlsafe(16)


@transaction.atomic
def user_create(
    *, username: str, kudos: float | Decimal = 0, trusted: bool = False, moderator: bool = False
) -> tuple[HordeUser, str]:
    """Create a user; returns it with its plain API key, which is not stored."""
    api_key = new_api_key()
    user = HordeUser.objects.create(
        username=username,
        api_key_hash=hash_api_key(api_key),
        trusted=trusted,
        moderator=moderator,
        concurrency=settings.HORDE_DEFAULT_CONCURRENCY,
    )
    if kudos:
        kudos_transfer(user_id=user.pk, amount=Decimal(str(kudos)), kind=KudosTransaction.Kind.GRANT)
        user.refresh_from_db(fields=["kudos"])
    return user, api_key


def user_api_key_replace(*, user_id: int) -> str:
    """A new API key for the user, returned plain (only its hash is stored); the old one stops
    authenticating, after at most HORDE_API_KEY_CACHE_SECONDS in a process that read it."""
    api_key = new_api_key()
    if not HordeUser.objects.filter(pk=user_id).update(api_key_hash=hash_api_key(api_key)):
        raise HordeUser.DoesNotExist(f"no user {user_id}")
    return api_key


def kudos_transfer(
    *,
    user_id: int,
    amount: Decimal,
    kind: str,
    request_id: UUID | None = None,
    generation_id: UUID | None = None,
    release_held: Decimal = Decimal("0"),
) -> None:
    """Move `amount` (signed) into a user's balance and record it; optionally release a hold.

    Callers run inside the transaction that stores what the kudos pay for.
    """
    updates: dict = {"kudos": F("kudos") + amount}
    if release_held:
        updates["kudos_held"] = F("kudos_held") - release_held
    HordeUser.objects.filter(pk=user_id).update(**updates)
    if amount:
        KudosTransaction.objects.create(
            user_id=user_id, amount=amount, kind=kind, request_id=request_id, generation_id=generation_id
        )


# Tries at the transfer's locks, each after a longer pause (about 1.4 s in all): settlements hold
# a balance for one statement's time.
KUDOS_TRANSFER_LOCK_ATTEMPTS = 10
KUDOS_TRANSFER_LOCK_RETRY_SECONDS = 0.025


def kudos_transfer_to(*, source: HordeUser, username: str, amount: int, idempotency_key: str | None) -> Decimal:
    """Move `amount` kudos from `source` to the user or shared key `username` names (a key's owner
    is paid and the key holds that much more), with upstream's refusals (rc and status), both
    ledger rows and the transfer's log, in one transaction. Both balances are locked first (never
    waited on: _transfer_locks), so concurrent transfers cannot spend one balance twice. A
    repeated Idempotency-Key of the same transfer moves nothing again and answers as the first did,
    whatever became of its target since. Returns the kudos transferred."""
    if amount < 0:
        raise HordeError("NegativeKudosTransfer", "A transfer's amount cannot be negative.")
    if amount == 0:
        raise HordeError("InvalidKudosTransferAmount", "Transfer amount must be positive.")
    value = Decimal(amount)
    if idempotency_key is not None and (replayed := _transfer_replayed(source, idempotency_key, username, value)):
        return replayed
    dest, shared_key = kudos_transfer_target(username)
    if dest.is_anonymous:
        raise HordeError(
            "KudosTransferToAnon", "Kudos sent to Anonymous would be lost: the transfer was not made."
        )
    if dest.pk == source.pk:
        raise HordeError("KudosTransferToSelf", "You cannot send kudos to yourself.")
    with transaction.atomic():
        locked = _transfer_locks(user_ids=[source.pk, dest.pk], shared_key_id=shared_key.pk if shared_key else None)
        if len(locked) < 2:  # one of them was deleted since it was read
            raise HordeError("InvalidTargetUsername", "Invalid target username.")
        # Again under the payer's lock: a retry racing its first attempt sees the first's log row.
        if idempotency_key is not None and (replayed := _transfer_replayed(source, idempotency_key, username, value)):
            return replayed
        cooldown = timezone.now() - timedelta(seconds=KUDOS_TRANSFER_REVERSE_COOLDOWN_SECONDS)
        if KudosTransfer.objects.filter(source_id=dest.pk, dest_id=source.pk, created__gte=cooldown).exists():
            raise HordeError(
                "TooFastKudosTransfers",
                "This user transferred kudos to you very recently. Please wait at least 1 minute.",
            )
        if locked[source.pk].kudos_available < value:
            raise HordeError("KudosTransferNotEnough", "Not enough kudos.")
        for user_id in sorted(locked):  # id order, as the lock above
            HordeUser.objects.filter(pk=user_id).update(
                kudos=F("kudos") + (value if user_id == dest.pk else -value)
            )
        KudosTransaction.objects.bulk_create(
            [
                KudosTransaction(user_id=source.pk, amount=-value, kind=KudosTransaction.Kind.TRANSFER),
                KudosTransaction(user_id=dest.pk, amount=value, kind=KudosTransaction.Kind.TRANSFER),
            ]
        )
        KudosTransfer.objects.create(
            source_id=source.pk,
            dest_id=dest.pk,
            target=username,
            shared_key_id=shared_key.pk if shared_key else None,
            amount=value,
            idempotency_key=idempotency_key,
        )
        if shared_key is not None:
            SharedKey.objects.filter(pk=shared_key.pk).exclude(kudos=SHARED_KEY_UNLIMITED).update(
                kudos=F("kudos") + value
            )
    return value


def _transfer_locks(*, user_ids: list[int], shared_key_id: UUID | None) -> dict[int, HordeUser]:
    """Both users' rows (and the shared key's) locked for a transfer, by id, in the order every
    settlement takes them (docs/adr/0068-one-lock-order.md). The locks are taken without waiting,
    and tried again while a settlement holds one: a transfer queued for a balance would queue the
    submits' foreign key checks on that balance behind it."""
    for attempt in range(KUDOS_TRANSFER_LOCK_ATTEMPTS):
        try:
            with transaction.atomic():  # a savepoint: a refused lock leaves the transaction usable
                users = HordeUser.objects.select_for_update(nowait=True).filter(pk__in=user_ids).order_by("pk")
                locked = {user.pk: user for user in users}
                if shared_key_id is not None:
                    list(SharedKey.objects.select_for_update(nowait=True).filter(pk=shared_key_id))
                return locked
        except OperationalError:  # a lock held elsewhere (LockNotAvailable)
            time.sleep(KUDOS_TRANSFER_LOCK_RETRY_SECONDS * (attempt + 1))
    raise HordeError(
        "KudosTransferBusy", "The accounts are busy settling jobs: send the transfer again.", status=503
    )


def _transfer_replayed(source: HordeUser, idempotency_key: str, username: str, value: Decimal) -> Decimal | None:
    """The amount of the sender's transfer that claimed this key, when it was this same transfer
    (the same target as sent and amount); IdempotencyKeyConflict when it was another."""
    prior = KudosTransfer.objects.filter(source_id=source.pk, idempotency_key=idempotency_key).first()
    if prior is None:
        return None
    if (prior.target, prior.amount) != (username, value):
        raise HordeError(
            "IdempotencyKeyConflict", "Idempotency key was already used with different transfer parameters."
        )
    return prior.amount


def kudos_settle(
    *,
    payee_id: int,
    payer_id: int,
    reward: Decimal,
    charge: Decimal,
    release_held: Decimal,
    request_id: UUID,
    generation_id: UUID,
    shared_key_id: UUID | None = None,
) -> None:
    """A settled generation: the worker's owner earns `reward`, the requester pays `charge` (drawn
    from the shared key the request was made with, if any) and has `release_held` of its hold
    released; both ledger rows in one insert."""
    # One UPDATE per user, in id order, so two of these settling at once cannot deadlock.
    for user_id in sorted({payee_id, payer_id}):
        change = (reward if user_id == payee_id else 0) - (charge if user_id == payer_id else 0)
        updates: dict = {"kudos": F("kudos") + change}
        if user_id == payer_id and release_held:
            updates["kudos_held"] = F("kudos_held") - release_held
        HordeUser.objects.filter(pk=user_id).update(**updates)
    rows = [(payee_id, reward, KudosTransaction.Kind.GENERATION_REWARD)]
    if charge:
        rows.append((payer_id, -charge, KudosTransaction.Kind.GENERATION_CHARGE))
    KudosTransaction.objects.bulk_create(
        [
            KudosTransaction(user_id=user, amount=amount, kind=kind, request_id=request_id, generation_id=generation_id)
            for user, amount, kind in rows
            if amount
        ]
    )
    shared_key_consume(shared_key_id=shared_key_id, amount=charge)


def kudos_settle_ctes(*, source: str, now) -> list[tuple[str, str, list]]:
    """kudos_settle as PostgreSQL CTEs (name, SQL, params) for a caller's single statement.
    `source` is a FROM item of at most one row with the columns payee_id, payer_id, reward,
    charge, release (of the hold), request_id, generation_id and shared_key_id; nothing is written
    without its row. One UPDATE moves both balances, so a payee who is also the payer is right."""
    balances = (
        "UPDATE horde_users AS u SET"
        " kudos = u.kudos + CASE WHEN u.id = s.payee_id THEN s.reward ELSE 0 END"
        " - CASE WHEN u.id = s.payer_id THEN s.charge ELSE 0 END,"
        " kudos_held = u.kudos_held - CASE WHEN u.id = s.payer_id THEN s.release ELSE 0 END"
        f" FROM {source} WHERE u.id IN (s.payee_id, s.payer_id)"
    )
    # kudos_settle's rows: the reward, then the charge; a zero amount writes no row.
    ledger = (
        "INSERT INTO horde_kudos_transactions (user_id, amount, kind, request_id, generation_id, created)"
        f" SELECT v.user_id, v.amount, v.kind, s.request_id, s.generation_id, %s::timestamptz FROM {source},"
        " LATERAL (VALUES (s.payee_id, s.reward, %s::varchar, 1), (s.payer_id, -s.charge, %s::varchar, 2))"
        " AS v(user_id, amount, kind, position) WHERE v.amount <> 0 ORDER BY v.position"
    )
    return [
        ("kudos_balances", balances, []),
        (
            "kudos_ledger",
            ledger,
            [now, KudosTransaction.Kind.GENERATION_REWARD, KudosTransaction.Kind.GENERATION_CHARGE],
        ),
        shared_key_consume_cte(source=source),
    ]


def kudos_hold(*, user_id: int, amount: Decimal) -> None:
    HordeUser.objects.filter(pk=user_id).update(kudos_held=F("kudos_held") + amount)


def kudos_release(*, user_id: int, amount: Decimal) -> None:
    if amount:
        HordeUser.objects.filter(pk=user_id).update(kudos_held=F("kudos_held") - amount)


# --- shared keys ----------------------------------------------------------------------------------


# Upstream answers an unknown shared key as an invalid key.
SHARED_KEY_UNKNOWN_MESSAGE = "No user matching sent Shared Key."


def _expiry_from_days(days: int) -> Any:
    """The wire's `expiry` (days from now; SHARED_KEY_UNLIMITED: never) as the stored instant."""
    return None if days == SHARED_KEY_UNLIMITED else timezone.now() + timedelta(days=days)


@transaction.atomic
def shared_key_create(
    *,
    user: HordeUser,
    kudos: int,
    expiry_days: int,
    name: str | None,
    max_image_pixels: int,
    max_image_steps: int,
    max_text_tokens: int,
) -> SharedKey:
    """A new key lent by `user`, within the per-user count (upstream's: 10 for a trusted user, 3
    otherwise). The user's row is locked so that two creations cannot both take the last place."""
    locked = HordeUser.objects.select_for_update().get(pk=user.pk)
    allowed = MAX_SHARED_KEYS_TRUSTED if locked.trusted else MAX_SHARED_KEYS
    if SharedKey.objects.filter(user=locked).count() >= allowed:
        raise HordeError("Forbidden", f"You cannot have more than {allowed} shared keys.", status=403)
    return SharedKey.objects.create(
        user=locked,
        kudos=Decimal(kudos),
        expiry=_expiry_from_days(expiry_days),
        name=name,
        max_image_pixels=max_image_pixels,
        max_image_steps=max_image_steps,
        max_text_tokens=max_text_tokens,
    )


def shared_key_update(*, key: SharedKey, changes: dict[str, Any]) -> SharedKey:
    """Apply the PATCH's fields that were sent (`expiry` in days, as at creation). Only those are
    written: a settlement or a transfer changing the key's kudos meanwhile is kept."""
    sent = list(changes)
    if "expiry" in changes:
        key.expiry = _expiry_from_days(changes.pop("expiry"))
    if "kudos" in changes:
        key.kudos = Decimal(changes.pop("kudos"))
    for name, value in changes.items():
        setattr(key, name, value)
    with transaction.atomic():
        # Written by id, then read back under the write's row lock: a key its owner deleted since
        # the view read it is the unknown key (a save would fail on the missing row).
        if sent and not SharedKey.objects.filter(pk=key.pk).update(**{name: getattr(key, name) for name in sent}):
            raise HordeError("InvalidAPIKey", SHARED_KEY_UNKNOWN_MESSAGE)
        key.refresh_from_db()  # the answer shows the key as it is now
    return key


def shared_key_delete(*, key: SharedKey) -> None:
    """Requests made with it stay the owner's; their settlements no longer draw on a key."""
    key.delete()


def shared_key_consume(*, shared_key_id: UUID | None, amount: Decimal) -> None:
    """Draw `amount` from a key's kudos (to 0 at least; an unlimited key keeps its -1) and add it to
    what the key utilized. A spent key draws nothing, as upstream's."""
    if shared_key_id is None or amount <= 0:
        return
    SharedKey.objects.filter(pk=shared_key_id).exclude(kudos=0).update(
        kudos=Case(
            When(kudos=SHARED_KEY_UNLIMITED, then=Value(Decimal(SHARED_KEY_UNLIMITED))),
            default=Greatest(F("kudos") - amount, Value(Decimal("0"))),
        ),
        utilized=F("utilized") + amount,
    )


def shared_key_consume_cte(*, source: str) -> tuple[str, str, list]:
    """shared_key_consume as a PostgreSQL CTE over `source` (columns shared_key_id and charge)."""
    return (
        "shared_key_drawn",
        "UPDATE horde_shared_keys AS k SET"
        " kudos = CASE WHEN k.kudos = %s THEN k.kudos ELSE GREATEST(k.kudos - s.charge, 0) END,"
        " utilized = k.utilized + s.charge"
        f" FROM {source} WHERE k.id = s.shared_key_id AND k.kudos <> 0 AND s.charge > 0",
        [SHARED_KEY_UNLIMITED],
    )
