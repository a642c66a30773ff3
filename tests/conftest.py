"""Shared fixtures. No fixture here stands in for the database or Redis: tests run on real ones.

scripts/test.sh runs the suite twice: on PostgreSQL and Redis (REDIS_URL on a dedicated database,
flushed before every test), and on the embedded default (SQLite, REDIS_URL empty) without the tests
marked `postgres_only` or `redis_only`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.conf import settings

from contract.chat_signal import CHAT_SIGNAL_DB


def pytest_configure(config) -> None:
    """On SQLite, a file test database instead of the shared in-memory one: the live servers'
    threads (tests/oai/conftest.py, the bridge's and the web process's live tests) write
    concurrently, which SQLite's shared cache refuses ("database table is locked", "no such
    savepoint") where a file database in WAL mode waits for its busy timeout. pytest-django adds
    the xdist worker suffix to the name. Here, not beside one of those tests: any subset of the
    suite gets it. Named after the database's own file, so that runs given different files never
    share a test database."""
    database = settings.DATABASES["default"]
    if database["ENGINE"] == "django.db.backends.sqlite3" and not database.get("TEST", {}).get("NAME"):
        folder = Path(settings.BASE_DIR) / "var"
        folder.mkdir(exist_ok=True)
        database.setdefault("TEST", {})["NAME"] = str(folder / f"test-{Path(database['NAME']).stem}.sqlite3")


@pytest.fixture
def redis_url() -> str | None:
    """The Redis URL the code under test uses (settings.REDIS_URL); None on the embedded default."""
    return settings.REDIS_URL


@pytest.fixture(autouse=True)
def _flush_test_redis() -> None:
    """Start every test on an empty Redis database when REDIS_URL is set.

    The test command points REDIS_URL at a database of its own (/15, and /14... per xdist worker);
    database 0 is refused so that a stray REDIS_URL cannot wipe real data.
    """
    url = settings.REDIS_URL
    if not url:
        return
    import redis

    client = redis.Redis.from_url(url)
    try:
        db = client.connection_pool.connection_kwargs.get("db", 0)
        if int(db) == 0:
            pytest.exit(f"REDIS_URL {url!r} is database 0: run the suite on a test database (e.g. /15)", 2)
        if int(db) == CHAT_SIGNAL_DB:
            pytest.exit(
                f"REDIS_URL {url!r} is database {CHAT_SIGNAL_DB}, where every process keeps the completion "
                "signal and the progress streams (contract.chat_signal.CHAT_SIGNAL_DB): flushing it per test "
                "would wipe another worker's; run the suite on another (e.g. /15)",
                2,
            )
        client.flushdb()
    finally:
        client.close()


# --- API fixtures (lead) ---

import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from rest_framework.test import APIClient  # noqa: E402

# The text model reference the project ships (the default of HORDE_TEXT_MODEL_REFERENCE): every
# model the suite prices against is in it (tests/chat/test_model_reference.py).
SHIPPED_MODEL_REFERENCE = Path(__file__).resolve().parents[1] / "hordesite" / "data" / "text_model_reference.json"


@pytest.fixture(autouse=True)
def _shipped_model_reference(settings):
    from chat.model_reference import reload_reference

    settings.HORDE_TEXT_MODEL_REFERENCE = str(SHIPPED_MODEL_REFERENCE)
    reload_reference()
    yield
    reload_reference()


@pytest.fixture(autouse=True)
def _fresh_cache():
    from django.core.cache import cache

    from contract.process_cache import reset_process_caches

    cache.clear()
    reset_process_caches()


@pytest.fixture
def api() -> APIClient:
    return APIClient()


@dataclass
class Account:
    user: object
    key: str

    def refresh(self):
        self.user.refresh_from_db()
        return self.user


@pytest.fixture
def make_user(db):
    from accounts.services import user_create

    def make(name: str = "", *, kudos: float = 0, trusted: bool = False, moderator: bool = False) -> Account:
        user, key = user_create(
            username=name or f"user-{uuid.uuid4().hex[:6]}", kudos=kudos, trusted=trusted, moderator=moderator
        )
        return Account(user=user, key=key)

    return make


class Horde:
    """A small client over the native routes, as a worker or requester program uses them."""

    def __init__(self, client: APIClient):
        self.client = client

    def _call(self, method: str, path: str, key: str | None, body=None):
        headers = {"HTTP_APIKEY": key} if key else {}
        return getattr(self.client, method)(f"/api/v2/{path}", body, format="json", **headers)

    def text_async(self, key: str | None, **body):
        body.setdefault("prompt", "Once upon a time")
        return self._call("post", "generate/text/async", key, body)

    def status(self, request_id, key: str | None = None):
        return self._call("get", f"generate/text/status/{request_id}", key)

    def cancel(self, request_id, key: str | None = None):
        return self._call("delete", f"generate/text/status/{request_id}", key)

    def pop(self, key: str, **body):
        body.setdefault("name", "worker-1")
        body.setdefault("models", ["Gryphe/MythoMax-L2-13b"])
        body.setdefault("max_length", 512)
        body.setdefault("max_context_length", 4096)
        body.setdefault("bridge_agent", "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp")
        return self._call("post", "generate/text/pop", key, body)

    def submit(self, key: str, job_id, generation: str = "A reply.", **body):
        return self._call("post", "generate/text/submit", key, {"id": str(job_id), "generation": generation, **body})

    def chat_submit(self, key: str, job_id, **body):
        """A chat job's structured submit: message, finish_reason, model_id... and no generation."""
        return self._call("post", "generate/text/submit", key, {"id": str(job_id), **body})


@pytest.fixture
def horde(api, db) -> Horde:
    return Horde(api)


@pytest.fixture(autouse=True)
def _chat_image_store(settings, tmp_path_factory):
    """Each test's chat images and messages objects in a folder of its own (made by its first
    save), never under var/."""
    folder = tmp_path_factory.getbasetemp() / f"chat-objects-{uuid.uuid4().hex}"
    local = {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(folder)}}
    settings.STORAGES = {**settings.STORAGES, "chat_images": local, "chat_messages": local}


@pytest.fixture
def allowance_at_the_floor(settings):
    """The free output allowance held at its floor whatever the queue (a ceiling at the floor):
    for tests of the upfront kudos rules themselves."""
    settings.HORDE_TEXT_FREE_OUTPUT_CEILING = settings.HORDE_TEXT_FREE_OUTPUT_FLOOR


@pytest.fixture(autouse=True)
def _generous_rate_limits(settings):
    """Most tests submit many requests from one address; the rate limit tests set their own."""
    from accounts.ratelimit import reset_local_counts

    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["10000/second"]
    settings.HORDE_SHARED_KEY_CREATE_RATE_LIMITS = ["10000/second"]
    settings.HORDE_KUDOS_TRANSFER_RATE_LIMITS = ["10000/second"]
    settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP = "10000/second"
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = "100000/minute"
    settings.HORDE_API_KEY_RATE_LIMITS = ["10000/second"]
    settings.HORDE_ANONYMOUS_KEY_RATE_LIMITS = ["10000/second"]
    reset_local_counts()
