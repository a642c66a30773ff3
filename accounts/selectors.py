from __future__ import annotations

import copy
import threading
import time

from django.conf import settings
from django.db.models import Sum

from accounts.models import HordeUser, hash_api_key

# Every authenticated route would otherwise read the caller's row once per request. A process keeps
# what it read for HORDE_API_KEY_CACHE_SECONDS: a changed role or a removed key takes that long to
# apply, and balances are never read from here (admission locks the row; find_user re-reads it).
_API_KEY_CACHE_MAX_ENTRIES = 50_000
_api_key_cache: dict[str, tuple[float, HordeUser]] = {}
_anonymous: list[tuple[float, HordeUser]] = []
_lock = threading.Lock()


def _fresh(read_at: float) -> bool:
    return time.monotonic() - read_at < settings.HORDE_API_KEY_CACHE_SECONDS


def user_get_by_api_key(api_key: str) -> HordeUser | None:
    """The key's user (a copy of the process's recent read; None for an unknown key)."""
    key_hash = hash_api_key(api_key)
    hit = _api_key_cache.get(key_hash)
    if hit is not None and _fresh(hit[0]):
        return copy.copy(hit[1])
    user = HordeUser.objects.filter(api_key_hash=key_hash).first()
    if user is not None and settings.HORDE_API_KEY_CACHE_SECONDS > 0:
        with _lock:
            if len(_api_key_cache) >= _API_KEY_CACHE_MAX_ENTRIES:
                _api_key_cache.clear()
            _api_key_cache[key_hash] = (time.monotonic(), copy.copy(user))
    return user


def anonymous_user_get() -> HordeUser:
    if _anonymous and _fresh(_anonymous[0][0]):
        return copy.copy(_anonymous[0][1])
    user = HordeUser.objects.get(is_anonymous=True)
    _anonymous[:] = [(time.monotonic(), copy.copy(user))]
    return user


def user_get_fresh(user: HordeUser) -> HordeUser:
    """The user's row as stored now (balances included)."""
    return HordeUser.objects.get(pk=user.pk)


def reset_user_caches() -> None:
    """Forget every cached read (tests; a key or role change that must apply at once)."""
    with _lock:
        _api_key_cache.clear()
        _anonymous.clear()


def user_ledger_total(user: HordeUser) -> float:
    return float(user.kudos_transactions.aggregate(total=Sum("amount"))["total"] or 0)
