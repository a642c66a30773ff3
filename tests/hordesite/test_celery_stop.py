"""A Celery worker with beat stops cleanly on SIGTERM to its main process (deploy/systemd's KillMode=mixed).

Runs the real `celery -A hordesite worker -B` on the embedded broker (no server needed) in a
process group of its own, waits until it is ready, sends SIGTERM to the main process only, and
checks that every process of the group is gone within the unit's stop timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_SECONDS = 60  # horde-celery-worker.service's TimeoutStopSec


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_sigterm_to_main_process_stops_worker_with_beat(tmp_path):
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'celery.sqlite3'}",
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
        "PYTHONUNBUFFERED": "1",
    }
    celery = Path(sys.executable).parent / "celery"
    log = tmp_path / "celery.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(celery), "-A", "hordesite", "worker", "-B", "--loglevel=INFO", "--concurrency=2"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0,
        )
    try:
        deadline = time.monotonic() + 60
        while b" ready." not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the worker did not get ready:\n" + log.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            proc.poll()
            time.sleep(0.2)
        assert not _group_alive(proc.pid), "still running after SIGTERM:\n" + log.read_text()
        assert proc.wait(timeout=1) == 0
        assert b"Warm shutdown" in log.read_bytes()
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
