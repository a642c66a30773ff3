from __future__ import annotations

import copy
from email.utils import formatdate

from django.conf import settings
from django.core.cache import cache
from django.db.models import Count
from django.utils import timezone

from accounts.models import HordeUser, SharedKey, hash_api_key, shared_key_id_of
from contract.errors import HordeError
from contract.process_cache import ProcessCache
from contract.text import USER_ID_DIGITS

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


def user_get_by_id(user_id: int) -> HordeUser | None:
    return HordeUser.objects.filter(pk=user_id).first()


def kudos_transfer_target(username: str) -> tuple[HordeUser, SharedKey | None]:
    """Who a kudos transfer names: a user by the id after the alias's last '#' (a name may hold
    '#'), else a shared key by its id (its owner, and the key); refused as upstream refuses."""
    user_id = username.rsplit("#", 1)[-1].strip()
    if USER_ID_DIGITS.fullmatch(user_id):
        user = user_get_by_id(int(user_id))
        if user is not None:
            return user, None
    key = shared_key_get(username)
    if key is None:
        raise HordeError("InvalidTargetUsername", "Invalid target username.")
    if key.is_expired(timezone.now()):
        # 400 as every refusal of a transfer upstream (its KudosValidationError), not the 403 of a use.
        raise HordeError("SharedKeyExpired", "This shared key has expired", status=400)
    return key.user, key


USERS_PAGE_SIZE = 25
USERS_LAST_PAGE = 10_000  # upstream's: a later page is empty without a query
USERS_PAGE_CACHE_SECONDS = 10


def users_page(*, sort: str, page: int) -> list[dict]:
    """GET /api/v2/users: a page of every user's public details, the richest first (`kudos`) or the
    oldest (`age`), as upstream's; one query, cached USERS_PAGE_CACHE_SECONDS."""
    if page > USERS_LAST_PAGE:
        return []
    key = f"horde:users-page:{sort}:{page}"
    body = cache.get(key)
    if body is None:
        order = ("created", "pk") if sort == "age" else ("-kudos", "pk")
        users = HordeUser.objects.annotate(worker_count=Count("workers")).order_by(*order)
        offset = (page - 1) * USERS_PAGE_SIZE
        body = [_public_details(user, worker_count=user.worker_count) for user in users[offset : offset + USERS_PAGE_SIZE]]
        cache.set(key, body, USERS_PAGE_CACHE_SECONDS)
    return body


def _public_details(user: HordeUser, *, worker_count: int) -> dict:
    return {
        "username": user.unique_alias,
        "id": user.pk,
        "kudos": float(user.kudos),
        "trusted": user.trusted,
        "moderator": user.moderator,
        "concurrency": user.concurrency,
        "worker_count": worker_count,
        # Whole seconds since the account was made, as upstream's (KoboldAI Lite's KudoRank shows it).
        "account_age": int((timezone.now() - user.created).total_seconds()),
    }


def user_get_fresh(user: HordeUser) -> HordeUser:
    """The user's row as stored now (balances included)."""
    return HordeUser.objects.get(pk=user.pk)


def user_details(user: HordeUser, *, shared_key: SharedKey | None = None, private: bool = True) -> dict:
    """The find_user body: the user's row read fresh (the balance never comes from the key cache).
    The owner's own key (`private`: the user or a moderator asking) also sees its workers' and
    shared keys' ids; a shared key sees neither and is named after its owner, as upstream's
    "alias#1 (Shared Key: name)"."""
    user = user_get_fresh(user)
    worker_ids = [str(w) for w in user.workers.values_list("id", flat=True)]
    details = _public_details(user, worker_count=len(worker_ids))
    if shared_key is not None:
        name = f": {shared_key.name}" if shared_key.name is not None else ""
        details["username"] = f"{user.unique_alias} (Shared Key{name})"
        return details
    if not private:
        return details
    details["worker_ids"] = worker_ids
    details["sharedkey_ids"] = [str(k) for k in user.shared_keys.order_by("created").values_list("id", flat=True)]
    return details


def shared_key_get(key: str) -> SharedKey | None:
    """The shared key an `apikey` names (its id), with its owner; None when it names none. Never
    cached: its balance and expiry decide each request."""
    key_id = shared_key_id_of(key)
    if key_id is None:
        return None
    return SharedKey.objects.select_related("user").filter(pk=key_id).first()


def _whole(value) -> int:
    """Kudos on upstream's wire are integers (fields.Integer truncates)."""
    return int(value)


def shared_key_details(key: SharedKey) -> dict:
    """Upstream's SharedKeyDetails: name and expiry left out when unset (skip_none), expiry in
    RFC 822 as flask-restx writes it."""
    details: dict = {
        "id": str(key.pk),
        "username": key.user.unique_alias,
        "name": key.name,
        "kudos": _whole(key.kudos),
        "expiry": formatdate(key.expiry.timestamp()) if key.expiry else None,
        "utilized": _whole(key.utilized),
        "max_image_pixels": key.max_image_pixels,
        "max_image_steps": key.max_image_steps,
        "max_text_tokens": key.max_text_tokens,
    }
    return {name: value for name, value in details.items() if value is not None}
