"""The process's API key cache: identities are reused for HORDE_API_KEY_CACHE_SECONDS, balances never."""

from __future__ import annotations

import time

from accounts.models import HordeUser


def find_user(api, key: str):
    return api.get("/api/v2/find_user", HTTP_APIKEY=key)


def test_find_user_reads_the_balance_fresh_while_the_key_is_cached(api, make_user, settings):
    settings.HORDE_API_KEY_CACHE_SECONDS = 60
    account = make_user("rich", kudos=10)
    assert find_user(api, account.key).json()["kudos"] == 10
    HordeUser.objects.filter(pk=account.user.pk).update(kudos=25)
    assert find_user(api, account.key).json()["kudos"] == 25


def test_a_role_change_applies_once_the_cached_read_is_older_than_the_setting(api, make_user, settings):
    settings.HORDE_API_KEY_CACHE_SECONDS = 0.3
    account = make_user("soon-trusted")
    assert find_user(api, account.key).json()["trusted"] is False
    HordeUser.objects.filter(pk=account.user.pk).update(trusted=True)
    # Within the window the process may still answer from its read; after it, never.
    time.sleep(0.35)
    assert find_user(api, account.key).json()["trusted"] is True


def test_zero_reads_the_user_on_every_request(api, make_user, settings):
    settings.HORDE_API_KEY_CACHE_SECONDS = 0
    account = make_user("moderated")
    assert find_user(api, account.key).json()["moderator"] is False
    HordeUser.objects.filter(pk=account.user.pk).update(moderator=True)
    assert find_user(api, account.key).json()["moderator"] is True


def test_an_unknown_key_is_refused_every_time_and_not_remembered(api, make_user, settings):
    settings.HORDE_API_KEY_CACHE_SECONDS = 60
    refused = find_user(api, "not-a-key-of-anyone")
    assert refused.status_code == 401 and refused.json()["rc"] == "InvalidAPIKey"
    assert find_user(api, "not-a-key-of-anyone").status_code == 401
    account = make_user("late")
    assert find_user(api, account.key).status_code == 200
