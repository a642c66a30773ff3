"""Writes on accounts: creation and every kudos movement (always with its ledger row)."""

from __future__ import annotations

import secrets
from decimal import Decimal
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.db.models import F

from accounts.models import HordeUser, KudosTransaction, hash_api_key


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


def kudos_settle(
    *,
    payee_id: int,
    payer_id: int,
    reward: Decimal,
    charge: Decimal,
    release_held: Decimal,
    request_id: UUID,
    generation_id: UUID,
) -> None:
    """A settled generation: the worker's owner earns `reward`, the requester pays `charge` and has
    `release_held` of its hold released; both ledger rows in one insert."""
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


def kudos_settle_ctes(
    *,
    gate: str,
    release_held: str,
    payee_id: int,
    payer_id: int,
    reward: Decimal,
    charge: Decimal,
    request_id: UUID,
    generation_id: UUID,
    now,
) -> list[tuple[str, str, list]]:
    """kudos_settle as PostgreSQL CTEs (name, SQL, params) for a caller's single statement: they
    write only when the CTE `gate` holds a row, and `release_held` is an SQL expression of the
    hold released. One UPDATE moves both balances, so a payee who is also the payer is right."""
    balances = (
        "UPDATE horde_users AS u SET"
        " kudos = u.kudos + CASE WHEN u.id = %s THEN %s ELSE 0 END - CASE WHEN u.id = %s THEN %s ELSE 0 END,"
        f" kudos_held = u.kudos_held - CASE WHEN u.id = %s THEN {release_held} ELSE 0 END"
        f" WHERE u.id IN (%s, %s) AND EXISTS (SELECT 1 FROM {gate})"
    )
    rows = [(payee_id, reward, KudosTransaction.Kind.GENERATION_REWARD)]
    if charge:
        rows.append((payer_id, -charge, KudosTransaction.Kind.GENERATION_CHARGE))
    rows = [row for row in rows if row[1]]
    ctes = [
        ("kudos_balances", balances, [payee_id, reward, payer_id, charge, payer_id, payee_id, payer_id]),
    ]
    if rows:
        values = ", ".join("(%s::bigint, %s::numeric, %s::varchar)" for _ in rows)
        ledger = (
            "INSERT INTO horde_kudos_transactions (user_id, amount, kind, request_id, generation_id, created)"
            f" SELECT v.user_id, v.amount, v.kind, %s::uuid, %s::uuid, %s::timestamptz FROM {gate},"
            f" (VALUES {values}) AS v(user_id, amount, kind)"
        )
        ctes.append(("kudos_ledger", ledger, [request_id, generation_id, now, *(x for row in rows for x in row)]))
    return ctes


def kudos_hold(*, user_id: int, amount: Decimal) -> None:
    HordeUser.objects.filter(pk=user_id).update(kudos_held=F("kudos_held") + amount)


def kudos_release(*, user_id: int, amount: Decimal) -> None:
    if amount:
        HordeUser.objects.filter(pk=user_id).update(kudos_held=F("kudos_held") - amount)
