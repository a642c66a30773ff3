"""The migrations match the models and every one of them reverses.

An operator who rolls a release back runs `manage.py migrate <app> <earlier>`: each migration must
undo, data migrations included, with rows in the tables. Each case migrates a scratch database of
its own forward, puts a user, a served text request and a queued one in it through the native routes,
unapplies every project app to zero and migrates forward again, in one `manage.py shell` process.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.core.management import call_command

from tests.hordesite.clone import ROOT, clean_env, run_python

pytestmark = pytest.mark.slow

# Runs in the scratch database's own process; prints one line per step for the assertions.
ROUND_TRIP = """
import json
from io import StringIO

from django.core.management import call_command
from django.db.migrations.executor import MigrationExecutor
from django.db import connection
from django.test import Client

call_command("migrate", verbosity=0)
out = StringIO()
call_command("horde_user", "create", "migration-owner", stdout=out)
key = out.getvalue().split()[-1]
client = Client()

def post(path, body):
    answer = client.post(path, data=json.dumps(body), content_type="application/json", headers={"apikey": key})
    print("seed", path, answer.status_code, *([answer.content] if answer.status_code >= 300 else []))
    return answer.json()

post("/api/v2/generate/text/async", {"prompt": "served", "params": {"max_length": 16}})
job = post("/api/v2/generate/text/pop", {"name": "migration-worker", "models": ["koboldcpp/scripted"],
                                          "max_length": 16, "max_context_length": 4096})
post("/api/v2/generate/text/submit", {"id": job["id"], "generation": "done", "state": "ok"})
post("/api/v2/generate/text/async", {"prompt": "queued", "params": {"max_length": 16}})

for app in ("chat", "workers", "accounts"):
    call_command("migrate", app, "zero", verbosity=0)
    print("zero", app)
call_command("migrate", verbosity=0)
plan = MigrationExecutor(connection).migration_plan(MigrationExecutor(connection).loader.graph.leaf_nodes())
print("unapplied after the round trip", len(plan))
"""


@pytest.mark.django_db
def test_every_model_change_has_its_migration() -> None:
    # `--check` exits 1 when makemigrations would write a migration.
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def _round_trip(database_url: str) -> list[str]:
    env = clean_env(DATABASE_URL=database_url, REDIS_URL="", CELERY_BROKER_URL="", DEBUG="true")
    done = run_python(ROOT, env, "manage.py", "shell", "--no-imports", "-c", ROUND_TRIP, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith(("seed", "zero", "unapplied"))]


EXPECTED = [
    "seed /api/v2/generate/text/async 202",
    "seed /api/v2/generate/text/pop 200",
    "seed /api/v2/generate/text/submit 200",
    "seed /api/v2/generate/text/async 202",
    "zero chat",
    "zero workers",
    "zero accounts",
    "unapplied after the round trip 0",
]


def test_every_migration_reverses_on_sqlite(tmp_path: Path) -> None:
    assert _round_trip(f"sqlite:///{tmp_path / 'rollback.sqlite3'}") == EXPECTED


@pytest.fixture
def scratch_postgres() -> Iterator[str]:
    """A PostgreSQL database of the test's own on the suite's server, dropped afterwards."""
    db = settings.DATABASES["default"]
    name = f"rollback_{uuid.uuid4().hex[:12]}"
    server = dict(host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432, user=db["USER"],
                  password=db["PASSWORD"] or None, dbname="postgres", autocommit=True)
    with psycopg.connect(**server) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    password = f":{db['PASSWORD']}" if db["PASSWORD"] else ""
    try:
        yield f"postgres://{db['USER']}{password}@{server['host']}:{server['port']}/{name}"
    finally:
        with psycopg.connect(**server) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.postgres_only
def test_every_migration_reverses_on_postgres(scratch_postgres: str) -> None:
    assert _round_trip(scratch_postgres) == EXPECTED
