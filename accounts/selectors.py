from __future__ import annotations

import copy

from django.conf import settings

from accounts.models import HordeUser, hash_api_key
from contract.process_cache import ProcessCache

# Every authenticated route would otherwise read the caller's row once per request. A process keeps
# what it read for HORDE_API_KEY_CACHE_SECONDS: a changed role or a removed key takes that long to
# apply, and balances are never read from here (admission locks the row; find_user re-reads it).
# Callers may change the user they get: each gets its own copy.
_users_by_key: ProcessCache[str, HordeUser] = ProcessCache(
    "users by API key", ttl=lambda: settings.HORDE_API_KEY_CACHE_SECONDS, max_entries=50_000
)
_anonymous: ProcessCache[None, HordeUser] = ProcessCache(
    "the anonymous user", ttl=lambda: settings.HORDE_API_KEY_CACHE_SECONDS, max_entries=1
)


def user_get_by_api_key(api_key: str) -> HordeUser | None:
    """The key's user (a copy of the process's recent read; None for an unknown key)."""
    key_hash = hash_api_key(api_key)
    hit = _users_by_key.get(key_hash)
    if hit is not None:
        return copy.copy(hit)
    user = HordeUser.objects.filter(api_key_hash=key_hash).first()
    if user is not None:
        _users_by_key.set(key_hash, copy.copy(user))
    return user


def anonymous_user_get() -> HordeUser:
    hit = _anonymous.get(None)
    if hit is not None:
        return copy.copy(hit)
    user = HordeUser.objects.get(is_anonymous=True)
    _anonymous.set(None, copy.copy(user))
    return user


def user_get_fresh(user: HordeUser) -> HordeUser:
    """The user's row as stored now (balances included)."""
    return HordeUser.objects.get(pk=user.pk)


def user_details(user: HordeUser) -> dict:
    """The find_user body: the user's row read fresh (the balance never comes from the key cache)
    and the ids of its workers."""
    user = user_get_fresh(user)
    worker_ids = [str(w) for w in user.workers.values_list("id", flat=True)]
    return {
        "username": user.unique_alias,
        "id": user.pk,
        "kudos": float(user.kudos),
        "trusted": user.trusted,
        "moderator": user.moderator,
        "concurrency": user.concurrency,
        "worker_count": len(worker_ids),
        "worker_ids": worker_ids,
    }
