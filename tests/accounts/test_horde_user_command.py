"""`manage.py horde_user create`: the key on the last line authenticates as the new user."""

from __future__ import annotations

from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from accounts.models import HordeUser, hash_api_key

pytestmark = pytest.mark.django_db


def _create(*args: str) -> tuple[list[str], HordeUser]:
    out = StringIO()
    call_command("horde_user", "create", *args, stdout=out)
    lines = out.getvalue().splitlines()
    return lines, HordeUser.objects.get(api_key_hash=hash_api_key(lines[-1]))


def test_create_prints_the_key_alone_on_the_last_line() -> None:
    lines, user = _create("alice")
    key = lines[-1]
    assert key == key.strip() and " " not in key and len(key) >= 16
    assert user.username == "alice"
    assert user.kudos == Decimal("0")
    assert not user.trusted and not user.moderator
    assert user.api_key_hash != key


def test_create_with_kudos_and_roles() -> None:
    _, user = _create("bob", "--kudos", "1500.5", "--trusted", "--moderator")
    assert user.kudos == Decimal("1500.50")
    assert user.trusted and user.moderator


def test_each_user_gets_a_fresh_key() -> None:
    first, _ = _create("carol")
    second, _ = _create("carol")
    assert first[-1] != second[-1]


@pytest.mark.parametrize("kudos", ["-1", "lots", "NaN"])
def test_bad_kudos_is_refused(kudos: str) -> None:
    with pytest.raises(CommandError):
        call_command("horde_user", "create", "dave", "--kudos", kudos, stdout=StringIO())
    assert not HordeUser.objects.filter(username="dave").exists()
