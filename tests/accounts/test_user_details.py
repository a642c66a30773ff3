"""The user details routes carry what the programs written against upstream read of them
(docs/adr/0077-pop-and-user-parity-audit.md): KoboldAI Lite's KudoRank page shows `account_age`
from find_user or /users/{id}, as upstream's whole seconds since the account was made."""

from __future__ import annotations

from datetime import timedelta

from django.core.cache import cache
from django.utils import timezone

from accounts.models import HordeUser


def test_account_age_is_the_whole_seconds_since_the_account_was_made(horde, make_user):
    alice = make_user("alice", kudos=5)
    HordeUser.objects.filter(pk=alice.user.pk).update(created=timezone.now() - timedelta(days=3, seconds=7))
    cache.clear()
    day3 = 3 * 86_400 + 7
    answers = {
        "find_user": horde.client.get("/api/v2/find_user", HTTP_APIKEY=alice.key).json(),
        "public": horde.client.get(f"/api/v2/users/{alice.user.pk}").json(),
        "private": horde.client.get(f"/api/v2/users/{alice.user.pk}", HTTP_APIKEY=alice.key).json(),
        "list": next(u for u in horde.client.get("/api/v2/users").json() if u["id"] == alice.user.pk),
    }
    for where, body in answers.items():
        assert isinstance(body["account_age"], int), where
        assert day3 <= body["account_age"] <= day3 + 5, (where, body)
