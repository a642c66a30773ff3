from __future__ import annotations

from django.db.models import Sum

from accounts.models import HordeUser, hash_api_key


def user_get_by_api_key(api_key: str) -> HordeUser | None:
    return HordeUser.objects.filter(api_key_hash=hash_api_key(api_key)).first()


def anonymous_user_get() -> HordeUser:
    return HordeUser.objects.get(is_anonymous=True)


def user_ledger_total(user: HordeUser) -> float:
    return float(user.kudos_transactions.aggregate(total=Sum("amount"))["total"] or 0)
