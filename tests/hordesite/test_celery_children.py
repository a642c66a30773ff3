"""The Celery worker's prefork children are replaced once their memory passes a bound
(CELERY_WORKER_MAX_MEMORY_PER_CHILD, default 256 MiB) or after a number of tasks
(CELERY_WORKER_MAX_TASKS_PER_CHILD): a safety net against whatever makes a child grow (a leak of
ours kept every database connection a child opened: docs/adr/0088), since a fresh child starts small.

Runs the real `celery -A hordesite worker -B` on the embedded broker and database.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hordesite.clone import clean_env

ROOT = Path(__file__).resolve().parents[2]
# The pool process a sweep succeeded in (its name in the worker's log line).
SUCCEEDED_IN = re.compile(r"INFO/(ForkPoolWorker-\d+)\] Task chat\.tasks\.\w+\[[^]]+\] succeeded")
SHOW_BOUNDS = (
    "from hordesite.celery import app; import json; "
    "print(json.dumps([app.conf.worker_max_memory_per_child, app.conf.worker_max_tasks_per_child]))"
)


def _bounds(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SHOW_BOUNDS], cwd=ROOT, env=clean_env(**env), capture_output=True, text=True, timeout=60
    )


def test_the_worker_reads_its_childrens_bounds_from_the_environment():
    default = _bounds()
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout.splitlines()[-1]) == [262_144, None]
    set_ = _bounds(CELERY_WORKER_MAX_MEMORY_PER_CHILD="400000", CELERY_WORKER_MAX_TASKS_PER_CHILD="1000")
    assert json.loads(set_.stdout.splitlines()[-1]) == [400_000, 1000]
    never = _bounds(CELERY_WORKER_MAX_MEMORY_PER_CHILD="0")
    assert json.loads(never.stdout.splitlines()[-1]) == [None, None]
    negative = _bounds(CELERY_WORKER_MAX_TASKS_PER_CHILD="-1")
    assert negative.returncode != 0 and "0 (never) or more" in negative.stderr


@pytest.mark.slow
def test_a_child_past_its_memory_bound_is_replaced_after_its_task_and_the_sweeps_go_on(tmp_path):
    """What the variable does. Celery's command line reads it too (click's CELERY_ prefix, as
    `--max-memory-per-child`), so this passed before the settings read it; what the settings add,
    the default and the refusal of a negative bound, is the test above's."""
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'celery.sqlite3'}",
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
        "CELERY_BEAT_SCHEDULE_FILENAME": str(tmp_path / "celerybeat-schedule"),
        "HORDE_SWEEP_INTERVAL_SECONDS": "1",
        "CELERY_WORKER_MAX_MEMORY_PER_CHILD": "1",  # KiB: every child is past it after its first task
        "PYTHONUNBUFFERED": "1",
    }
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
    log = tmp_path / "celery.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "hordesite", "worker", "-B", "--concurrency=1", "--loglevel=INFO"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0,
        )
    try:
        deadline = time.monotonic() + 90
        # Concurrency 1, and each sweep ran by another child: each child was replaced after its task.
        while len(set(SUCCEEDED_IN.findall(log.read_text()))) < 4:
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, log.read_text()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
