"""The reference worker run as an operator runs it, `python -m workers.bridge`, for the tests that
stop it with a signal: against any horde, or named sigterm-bridge on the live horde once it checked in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.bridge.conftest import MODEL, LiveHorde
from workers.models import Worker

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def bridge_process(horde_url: str, api_key: str, backend: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """The bridge started with these arguments, its output (stderr too) read as text from stdout;
    killed when the block ends if it is still running."""
    env = {**os.environ, "BRIDGE_API_KEY": api_key, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.bridge", "--horde-url", horde_url, "--backend", backend, *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


@contextmanager
def checked_in_bridge_process(horde: LiveHorde, backend: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A bridge named sigterm-bridge serving MODEL on the live horde (pop interval 0.1 s), once its
    worker exists (within 20 s); killed when the block ends if it is still running."""
    with bridge_process(horde.url, horde.worker_key, backend, "--horde-model", MODEL, "--name", "sigterm-bridge",
                        "--pop-interval", "0.1", *args) as proc:
        deadline = time.monotonic() + 20
        while not Worker.objects.filter(name="sigterm-bridge").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(proc.communicate()[0])
            time.sleep(0.1)
        yield proc


def signal_and_wait(proc: subprocess.Popen[str], signum: signal.Signals, *, timeout: float) -> tuple[str, float]:
    """Sends `signum` and waits up to `timeout` s for the process to end: its output, and the
    seconds from the signal to its end."""
    started = time.monotonic()
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=timeout)
    return output, time.monotonic() - started
