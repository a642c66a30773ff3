"""`manage.py worker_owner_key NAME`: the owner of a worker gets a new key, printed on the last line;
the old key stops authenticating, and nothing else of the owner changes."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings
from django.utils import timezone

from accounts.models import HordeUser, hash_api_key
from accounts.selectors import user_get_by_api_key
from accounts.services import user_create
from workers.models import Worker

pytestmark = pytest.mark.django_db


def _owner_with_worker(name: str, username: str = "volunteer") -> tuple[HordeUser, str]:
    owner, key = user_create(username=username, trusted=True)
    Worker.objects.create(name=name, owner=owner, last_check_in=timezone.now())
    return owner, key


@override_settings(HORDE_API_KEY_CACHE_SECONDS=0)
def test_the_owner_gets_a_new_key_and_the_old_one_stops_working() -> None:
    owner, old_key = _owner_with_worker("lost-key-worker")
    out = StringIO()
    call_command("worker_owner_key", "lost-key-worker", stdout=out)
    new_key = out.getvalue().splitlines()[-1]
    assert new_key != old_key and " " not in new_key and len(new_key) >= 16
    assert user_get_by_api_key(new_key).pk == owner.pk
    assert user_get_by_api_key(old_key) is None
    stored = HordeUser.objects.get(pk=owner.pk)
    assert stored.api_key_hash == hash_api_key(new_key)
    assert (stored.username, stored.trusted, stored.kudos) == (owner.username, owner.trusted, owner.kudos)
    assert HordeUser.objects.filter(username=owner.username).count() == 1


def test_no_worker_of_that_name_exits_3_and_changes_no_key() -> None:
    owner, key = _owner_with_worker("someone-else")
    with pytest.raises(CommandError, match="no worker is named 'nobody'") as refused:
        call_command("worker_owner_key", "nobody", stdout=StringIO())
    assert refused.value.returncode == 3
    assert HordeUser.objects.get(pk=owner.pk).api_key_hash == hash_api_key(key)


def test_an_owner_of_another_username_is_refused_and_keeps_its_key() -> None:
    owner, key = _owner_with_worker("demo-worker", username="a-real-volunteer")
    with pytest.raises(CommandError, match="belongs to a-real-volunteer#") as refused:
        call_command("worker_owner_key", "demo-worker", "--owner-username", "demo-worker", stdout=StringIO())
    assert refused.value.returncode == 1
    assert HordeUser.objects.get(pk=owner.pk).api_key_hash == hash_api_key(key)
