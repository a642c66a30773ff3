"""Stopping the bridge while it starts: its probe of the backend may wait minutes on one call (Ollama
loading a large model answers the load request when it is done, up to --backend-timeout), and a
signal is handled only between calls. A second SIGINT/SIGTERM stops it at once, as the README says
of a second signal; no job is held yet. The backend is a local server that does not answer its
model list, as a backend busy loading a model would not."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import closing

import pytest

from tests.bridge.processes import bridge_process, signal_and_wait
from tests.bridge.test_pop_wait import OtherHorde
from tests.http_fakes import QuietHandler, close_server, serve


class SilentBackend:
    """Reads every request and answers none until closed."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.released = threading.Event()
        backend = self

        class Handler(QuietHandler):
            def do_GET(self):  # noqa: N802
                backend.asked.set()
                backend.released.wait(60)

            do_POST = do_GET  # noqa: N815

        self.server = serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.released.set()
        close_server(self.server)


@pytest.fixture
def silent_backend() -> Iterator[SilentBackend]:
    backend = SilentBackend()
    yield backend
    backend.close()


def test_a_second_signal_stops_a_bridge_waiting_on_its_backend_at_start(silent_backend):
    with (
        closing(OtherHorde(strict=False)) as horde,
        bridge_process(horde.url, "k" * 22, silent_backend.url, "--name", "starting-bridge",
                       "--backend-timeout", "60") as proc,
    ):
        assert silent_backend.asked.wait(20), "the bridge never probed the backend"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        output, stopped_after = signal_and_wait(proc, signal.SIGINT, timeout=20)
    assert stopped_after < 3, output  # not when the probe's call times out (10 s here, minutes for a load)
    assert proc.returncode == 0, output
    assert "SIGINT again" in output and "Traceback" not in output, output
