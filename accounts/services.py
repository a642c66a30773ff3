"""Writes on accounts: creation and every kudos movement (always with its ledger row)."""

from __future__ import annotations

import secrets
from datetime import timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

from django.conf import settings
from django.db import transaction
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


def kudos_transfer_to(
    *, source: HordeUser, dest: HordeUser, shared_key: SharedKey | None, amount: int, idempotency_key: str | None
) -> Decimal:
    """Move `amount` kudos from `source` to `dest` (a shared key's owner, whose key then holds that
    much more), with upstream's refusals (rc and status), both ledger rows and the transfer's log,
    in one transaction. Both balances are locked first, so concurrent transfers cannot spend one
    balance twice; a repeated Idempotency-Key with the same transfer moves nothing again and answers
    as the first did. Returns the kudos transferred."""
    if dest.is_anonymous:
        raise HordeError(
            "KudosTransferToAnon", "Kudos sent to Anonymous would be lost: the transfer was not made."
        )
    if dest.pk == source.pk:
        raise HordeError("KudosTransferToSelf", "You cannot send kudos to yourself.")
    if amount < 0:
        raise HordeError("NegativeKudosTransfer", "A transfer's amount cannot be negative.")
    if amount == 0:
        raise HordeError("InvalidKudosTransferAmount", "Transfer amount must be positive.")
    value = Decimal(amount)
    with transaction.atomic():
        locked = {u.pk: u for u in HordeUser.objects.select_for_update().filter(pk__in=[source.pk, dest.pk]).order_by("pk")}
        payer = locked[source.pk]
        # Under the payer's lock: a retry racing its first attempt sees the first's log row.
        if idempotency_key is not None:
            prior = KudosTransfer.objects.filter(source_id=source.pk, idempotency_key=idempotency_key).first()
            if prior is not None:
                if (prior.dest_id, prior.amount, prior.shared_key_id) != (
                    dest.pk, value, shared_key.pk if shared_key else None
                ):
                    raise HordeError(
                        "IdempotencyKeyConflict",
                        "Idempotency key was already used with different transfer parameters.",
                    )
                return prior.amount
        cooldown = timezone.now() - timedelta(seconds=KUDOS_TRANSFER_REVERSE_COOLDOWN_SECONDS)
        if KudosTransfer.objects.filter(source_id=dest.pk, dest_id=source.pk, created__gte=cooldown).exists():
            raise HordeError(
                "TooFastKudosTransfers",
                "This user transferred kudos to you very recently. Please wait at least 1 minute.",
            )
        if payer.kudos_available < value:
            raise HordeError("KudosTransferNotEnough", "Not enough kudos.")
        HordeUser.objects.filter(pk=source.pk).update(kudos=F("kudos") - value)
        HordeUser.objects.filter(pk=dest.pk).update(kudos=F("kudos") + value)
        KudosTransaction.objects.bulk_create(
            [
                KudosTransaction(user_id=source.pk, amount=-value, kind=KudosTransaction.Kind.TRANSFER),
                KudosTransaction(user_id=dest.pk, amount=value, kind=KudosTransaction.Kind.TRANSFER),
            ]
        )
        KudosTransfer.objects.create(
            source_id=source.pk,
            dest_id=dest.pk,
            shared_key_id=shared_key.pk if shared_key else None,
            amount=value,
            idempotency_key=idempotency_key,
        )
        if shared_key is not None:
            SharedKey.objects.filter(pk=shared_key.pk).exclude(kudos=SHARED_KEY_UNLIMITED).update(
                kudos=F("kudos") + value
            )
    return value


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
    HordeUser.objects.filter(pk=payee_id).update(kudos=F("kudos") + reward)
    payer_updates: dict = {"kudos": F("kudos") - charge}
    if release_held:
        payer_updates["kudos_held"] = F("kudos_held") - release_held
    HordeUser.objects.filter(pk=payer_id).update(**payer_updates)
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
    """Apply the PATCH's fields that were sent (`expiry` in days, as at creation)."""
    if "expiry" in changes:
        key.expiry = _expiry_from_days(changes.pop("expiry"))
    if "kudos" in changes:
        key.kudos = Decimal(changes.pop("kudos"))
    for name, value in changes.items():
        setattr(key, name, value)
    key.save()
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
