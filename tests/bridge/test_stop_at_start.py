"""Stopping the bridge while it starts: its probe of the backend may wait minutes on one call (Ollama
loading a large model answers the load request when it is done, up to --backend-timeout), and a
signal is handled only between calls. A second SIGINT/SIGTERM stops it at once, as the README says
of a second signal; no job is held yet. The backend is a local server that does not answer its
model list, as a backend busy loading a model would not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.bridge.test_pop_wait import OtherHorde

ROOT = Path(__file__).resolve().parents[2]


class SilentBackend:
    """Reads every request and answers none until closed."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.released = threading.Event()
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                backend.asked.set()
                backend.released.wait(60)

            do_POST = do_GET  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def silent_backend() -> Iterator[SilentBackend]:
    backend = SilentBackend()
    yield backend
    backend.close()


def test_a_second_signal_stops_a_bridge_waiting_on_its_backend_at_start(silent_backend):
    horde = OtherHorde(strict=False)
    env = {**os.environ, "BRIDGE_API_KEY": "k" * 22, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.bridge", "--horde-url", horde.url, "--backend", silent_backend.url,
         "--name", "starting-bridge", "--backend-timeout", "60"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert silent_backend.asked.wait(20), "the bridge never probed the backend"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=20)
        stopped_after = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
        horde.close()
    assert stopped_after < 3, output  # not when the probe's call times out (10 s here, minutes for a load)
    assert proc.returncode == 0, output
    assert "SIGINT again" in output and "Traceback" not in output, output
