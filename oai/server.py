"""daphne's Server with the front's stop (docs/adr/0076): the standalone front's (`python -m oai`),
and the base of the web process's (hordesite/web_server.py, which drains the native API too).

Stock daphne cancels every request at once at a stop (SIGTERM): a streamed /v1 reply ended without
an error event or `data: [DONE]`, and a whole one got a closed connection, which the OpenAI SDKs
retry as a connection error, and whose horde request's cancel often never left the process. Here
the process stops listening, then drains for at most STOP_DRAIN_SECONDS: a waiting request is
delivered, or waits on while a worker generates it, or has its horde request cancelled (as
undelivered: the horde ends it unpaid, docs/adr/0086) and answers 503 FrontStopping (Retry-After, x-should-retry: true) or, after a stream's headers, that error as
an SSE event and [DONE] (oai.asgi.drain_fronts). daphne then cancels what is left, and the front's
shutdown sends its open and failed cancels, within STOP_CLOSE_SECONDS.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from daphne.server import Server
from twisted.internet import defer

from oai.asgi import drain_fronts
from oai.state import close_fronts

# The longest a stop waits for the requests in flight: a native view's own bounds (the database
# pool's 10 s wait) fit, and the launcher's 20 s stop (scripts/run.py) and systemd's 30 s are longer.
STOP_DRAIN_SECONDS = 10.0
# Then the front's shutdown (its cancels still to send), at most this long: drain and shutdown
# together stay under the launcher's 20 s.
STOP_CLOSE_SECONDS = 5.0
# The chunks daphne hands a received body to the application in, all at once on the event loop:
# its default of 8 KiB made a 33 MiB body 4,000 reads and messages, ~0.1 s of the loop in one go;
# at 1 MiB it is 33 (docs/adr/0127). Each layer joins the chunks of a body whole anyway.
REQUEST_BUFFER_BYTES = 1024 * 1024


class FrontServer(Server):
    """daphne's Server, which drains at a stop (a "before shutdown" trigger) before it cancels, and
    hands a body on in REQUEST_BUFFER_BYTES chunks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("request_buffer_size", REQUEST_BUFFER_BYTES)
        super().__init__(*args, **kwargs)

    def listen_success(self, port: Any) -> None:
        self._listening_ports = [*getattr(self, "_listening_ports", []), port]
        super().listen_success(port)

    async def drain(self, deadline: float) -> None:
        """Until `deadline` (monotonic): the requests being served end with their answers sent."""
        await drain_fronts(deadline)

    def kill_all_applications(self) -> Any:
        """daphne's stop, after the drain: no new connection is taken, and the requests being served
        end with their answers for at most STOP_DRAIN_SECONDS; then the front's shutdown."""
        for port in getattr(self, "_listening_ports", []):
            port.stopListening()
        drained = defer.Deferred.fromFuture(asyncio.ensure_future(self.drain(time.monotonic() + STOP_DRAIN_SECONDS)))
        drained.addBoth(lambda _: Server.kill_all_applications(self))
        drained.addBoth(lambda _: defer.Deferred.fromFuture(asyncio.ensure_future(close_fronts(STOP_CLOSE_SECONDS))))
        return drained
