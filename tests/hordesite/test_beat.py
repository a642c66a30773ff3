"""A real `celery -A hordesite worker -B`, started where var/ does not exist (a fresh clone): beat
creates what it needs, the sweeps run and record it, and /healthz reports them.

Before, beat took the missing var/ for a corrupted schedule file and died while the worker
reported ready, so no lease or expiry sweep ever ran.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from chat.models import SweepRun
from hordesite.sweep_health import scheduled_sweeps
from tests.hordesite.clone import clean_env, clone_like_copy, run_python

SWEEPS = set(scheduled_sweeps())

pytestmark = pytest.mark.slow


def _start_worker_with_beat(clone: Path, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "hordesite", "worker", "-B", "--concurrency=1", "--loglevel=INFO"],
        cwd=clone, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT, process_group=0,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for(found, proc: subprocess.Popen, log_path: Path, seconds: float = 90):
    deadline = time.monotonic() + seconds
    while not (value := found()):
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.5)
    return value


def _assert_beat_kept_its_schedule(clone: Path, log_path: Path) -> None:
    log = log_path.read_text()
    assert "corrupted schedule" not in log and "FileNotFoundError" not in log, log
    assert list((clone / "var").glob("celerybeat-schedule*")), log


def _database_url() -> str:
    db = connection.settings_dict
    auth = quote(db["USER"] or "") + (f":{quote(db['PASSWORD'])}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_worker_with_beat_on_postgres_sweeps_from_a_clone_without_var(tmp_path, api):
    clone = clone_like_copy(tmp_path / "clone")
    env = clean_env(
        DATABASE_URL=_database_url(),  # this test's database: the sweeps' records are read here
        REDIS_URL=settings.REDIS_URL or "",
        SECRET_KEY=os.environ["SECRET_KEY"],
        ALLOWED_HOSTS="localhost",
        HORDE_SWEEP_INTERVAL_SECONDS="1",
        HORDE_CHAT_ORPHAN_SWEEP_SECONDS="1",
    )
    started = timezone.now()
    log_path = tmp_path / "celery.log"
    proc = _start_worker_with_beat(clone, env, log_path)
    try:
        runs = _wait_for(
            lambda: (found := {r.task: r for r in SweepRun.objects.filter(finished_at__gt=started)}).keys() == SWEEPS
            and found,
            proc,
            log_path,
        )
    finally:
        _stop(proc)
    _assert_beat_kept_its_schedule(clone, log_path)

    response = api.get("/healthz")
    assert response.status_code == 200, response.content
    reported = response.json()["sweeps"]
    for task in SWEEPS:
        last = SweepRun.objects.get(task=task).finished_at
        assert last >= runs[task].finished_at
        assert reported[task] == {"last_finished_at": last.isoformat(), "late": False}


def test_worker_with_beat_on_the_embedded_default_from_a_clone_without_var(tmp_path):
    """The README's by-hand path with no environment at all: migrate, then the worker with beat."""
    clone = clone_like_copy(tmp_path / "clone")
    env = clean_env(HORDE_SWEEP_INTERVAL_SECONDS="1", HORDE_CHAT_ORPHAN_SWEEP_SECONDS="1")
    migrate = run_python(clone, env, "manage.py", "migrate", "--noinput", "-v0")
    assert migrate.returncode == 0, migrate.stderr
    database = clone / "var" / "horde.sqlite3"

    def finished_sweeps() -> dict[str, str]:
        with sqlite3.connect(database) as db:
            return dict(db.execute("SELECT task, finished_at FROM horde_sweep_runs").fetchall())

    log_path = tmp_path / "celery.log"
    proc = _start_worker_with_beat(clone, env, log_path)
    try:
        _wait_for(lambda: finished_sweeps().keys() == SWEEPS, proc, log_path)
    finally:
        _stop(proc)
    _assert_beat_kept_its_schedule(clone, log_path)
    assert (clone / "var" / "celery-broker").is_dir()  # the filesystem broker's folders, made at start

    health = run_python(
        clone, {**env, "HORDE_SWEEP_LATE_SECONDS": "600"}, "manage.py", "shell", "-c",
        "import json; from django.test import Client; r = Client().get('/healthz'); "
        "print(json.dumps({'code': r.status_code, 'body': r.json()}))",
    )
    assert health.returncode == 0, health.stderr
    answer = json.loads(health.stdout.strip().splitlines()[-1])
    assert answer["code"] == 200 and answer["body"]["status"] == "ok", answer
    assert set(answer["body"]["sweeps"]) == SWEEPS
    assert all(sweep["last_finished_at"] and not sweep["late"] for sweep in answer["body"]["sweeps"].values())


def test_sweeps_beat_sent_while_no_worker_ran_are_not_all_run_when_one_starts(tmp_path):
    """Beat keeps sending while the worker is down (a restart, a crash): each sweep message expires
    after its own interval, so a worker that comes back discards the stale ones instead of running
    the backlog (one message per interval per sweep: thousands after a night); beat's next ones run."""
    clone = clone_like_copy(tmp_path / "clone")
    env = clean_env(HORDE_SWEEP_INTERVAL_SECONDS="1")
    migrate = run_python(clone, env, "manage.py", "migrate", "--noinput", "-v0")
    assert migrate.returncode == 0, migrate.stderr

    beat_log = tmp_path / "beat.log"
    beat = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "hordesite", "beat", "--loglevel=INFO"],
        cwd=clone, env=env, stdout=beat_log.open("w"), stderr=subprocess.STDOUT, process_group=0,
    )
    try:
        _wait_for(lambda: beat_log.read_text().count("Sending due task abort-stale-generations") >= 6, beat, beat_log)
    finally:
        _stop(beat)

    worker_log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "hordesite", "worker", "--concurrency=1", "--loglevel=INFO"],
        cwd=clone, env=env, stdout=worker_log.open("w"), stderr=subprocess.STDOUT, process_group=0,
    )
    try:
        # The worker has read the backlog: each message run, or discarded as expired.
        _wait_for(lambda: "chat.tasks.abort_stale_generations[" in worker_log.read_text(), worker, worker_log)
        time.sleep(3)  # the rest of the backlog, were it run
    finally:
        _stop(worker)
    log = worker_log.read_text()
    ran = [line for line in log.splitlines() if "chat.tasks.abort_stale_generations[" in line and "succeeded" in line]
    assert len(ran) <= 1, log  # at most one, sent within an interval of the start: not the six
    assert "Discarding revoked task: chat.tasks.abort_stale_generations[" in log, log
