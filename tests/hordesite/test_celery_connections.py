"""A Celery worker keeps its PostgreSQL sessions from one sweep to the next (docs/adr/0093).

Celery's Django fixup closed the connections, and under the prefork pool Django's connection pool
with them, before and after every task: each sweep opened a new pool, about three new sessions
(TLS and authentication in production), at beat's pace. Runs the real `celery -A hordesite worker
-B` on this test's PostgreSQL database and Redis, and counts the sessions PostgreSQL saw opened on
the database (pg_stat_database.sessions) while the worker ran sweeps. The test process opens none
meanwhile: it reads the counter on the connection it already holds.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings
from django.db import connection

from tests.hordesite.clone import clean_env

pytestmark = [pytest.mark.postgres_only, pytest.mark.redis_only, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SUCCEEDED = re.compile(rb"Task chat\.tasks\.\w+\[[^]]+\] succeeded")
SWEEPS_MEASURED = 30


def _sessions_opened() -> int:
    with connection.cursor() as cursor:  # autocommit: each read is a fresh statistics snapshot
        cursor.execute("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
        return cursor.fetchone()[0]


def _database_url() -> str:
    db = connection.settings_dict
    user = quote(db["USER"] or "", safe="") + (f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else "")
    return f"postgres://{user}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def _wait_for_sweeps(log: Path, worker: subprocess.Popen, count: int) -> int:
    deadline = time.monotonic() + 90
    while (done := len(SUCCEEDED.findall(log.read_bytes()))) < count:
        assert worker.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)
    return done


def test_sweeps_reuse_the_workers_sessions(transactional_db, tmp_path):
    env = clean_env(
        DATABASE_URL=_database_url(),
        REDIS_URL=settings.REDIS_URL,
        SECRET_KEY="test-celery-connections-" + "k" * 40,
        ALLOWED_HOSTS="127.0.0.1",
        CELERY_BEAT_SCHEDULE_FILENAME=str(tmp_path / "celerybeat-schedule"),
        HORDE_SWEEP_INTERVAL_SECONDS="1",  # four sweeps a second
    )
    log = tmp_path / "celery.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "hordesite", "worker", "-B", "--concurrency=1", "--loglevel=INFO"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0,
        )
    try:
        # The child's first sweeps open its pool; PostgreSQL counts a session within a second or so.
        before_sweeps = _wait_for_sweeps(log, worker, 4)
        time.sleep(1.5)
        before = _sessions_opened()
        after_sweeps = _wait_for_sweeps(log, worker, before_sweeps + SWEEPS_MEASURED)
        time.sleep(1.5)
        opened = _sessions_opened() - before
        # Before the fix: about three per sweep (90 or more). A bound, not 0: a pool connection
        # made at the start and counted late, or replaced at its max_lifetime.
        assert opened <= 4, f"{opened} sessions opened for {after_sweeps - before_sweeps} sweeps"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, log.read_text()[-4000:]
        assert b"raised unexpected" not in log.read_bytes(), log.read_text()[-4000:]
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)  # the worker's group: its children and beat too
            worker.wait()
