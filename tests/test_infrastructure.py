"""The test machinery itself: each pass runs on the backends it claims, and Redis starts empty."""

from __future__ import annotations

import pytest
from django.db import connection


@pytest.mark.django_db
def test_database_answers() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)


@pytest.mark.postgres_only
@pytest.mark.django_db
def test_postgres_pass_runs_on_postgres() -> None:
    assert connection.vendor == "postgresql"
    assert connection.features.has_select_for_update_skip_locked


@pytest.mark.redis_only
@pytest.mark.parametrize("key", ["first", "second"])
def test_redis_starts_every_test_empty(redis_url: str | None, key: str) -> None:
    import redis

    assert redis_url, "redis_only tests run only with REDIS_URL set"
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.dbsize() == 0
        client.set(f"test-infrastructure:{key}", "1")
    finally:
        client.close()
