"""A submit whose answer was lost: the horde stored it, and the answer never came (the connection
dropped, which the bridge's client sends again on a new one at once) or was a proxy's 504, and the
submit sent again is answered DuplicateGen (a reply) or AbortedGen (a fault: the generation is
faulted already). The job ended as the first submit said, so the bridge counts it so, not as a
dropped job. The horde is a local server answering as this horde does."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from tests.http_fakes import QuietHandler, close_server, serve
from workers.bridge.config import BridgeConfig
from workers.bridge.scripted import ScriptedBackend
from workers.bridge.worker import Bridge

JOB_ID = "00000000-0000-4000-8000-000000000001"


class LosingHorde:
    """Hands out one text job; stores its first submit and loses its answer (`lose`: "close" the
    connection without one, or a proxy's "504"), then answers a submit of the same job as the horde
    answers one it already holds."""

    def __init__(self, lose: str) -> None:
        self.submits: list[dict[str, Any]] = []
        self.popped = False
        horde = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802
                self.send_json(200, {"username": "losing#1", "id": 1})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.endswith("/pop"):
                    if horde.popped:
                        self.send_json(200, {"id": None, "ids": [], "payload": {}, "skipped": {}})
                        return
                    horde.popped = True
                    self.send_json(200, {"id": JOB_ID, "ids": [JOB_ID], "model": "scripted", "ttl": 150,
                                         "payload": {"prompt": "Once upon a time", "max_length": 16}, "skipped": {}})
                    return
                horde.submits.append(body)
                if len(horde.submits) == 1:  # stored; the answer is lost
                    if lose == "close":
                        self.close_connection = True
                    else:
                        self.send_json(504, {"message": "Gateway Timeout"})
                    return
                faulted = body.get("state") == "faulted"
                self.send_json(400, {"rc": "AbortedGen" if faulted else "DuplicateGen",
                                     "message": f"Processing Generation with ID {JOB_ID} already submitted."})

        self.server = serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        close_server(self.server)


class FailingBackend(ScriptedBackend):
    def complete(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        from workers.bridge.backends import BackendError

        raise BackendError("backend answered 500: out of memory")


@pytest.mark.parametrize(("backend", "lose"), [(ScriptedBackend, "close"), (ScriptedBackend, "504"), (FailingBackend, "504")])
def test_a_submit_stored_whose_answer_was_lost_is_counted_as_it_ended(backend, lose):
    horde = LosingHorde(lose)
    config = BridgeConfig(horde_url=horde.url, api_key="k" * 22, worker_name="losing-bridge", backend="scripted",
                          horde_model="scripted", pop_interval=0.1, pop_wait=0, max_jobs=1)
    bridge = Bridge(config, backend(), out=open("/dev/null", "w"))  # noqa: SIM115
    thread = threading.Thread(target=lambda: bridge.run(install_signals=False), daemon=True)
    thread.start()
    thread.join(20)
    horde.close()
    assert not thread.is_alive()
    assert len(horde.submits) == 2  # the lost one, then the one sent again
    stats = bridge.stats
    if backend is ScriptedBackend:
        assert (stats.ok, stats.faulted, stats.dropped) == (1, 0, 0)
    else:
        assert (stats.ok, stats.faulted, stats.dropped) == (0, 1, 0)
