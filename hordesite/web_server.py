"""daphne as the web process runs it (scripts/run.py serve_web; the tests' live horde).

Two differences from stock daphne, through Twisted's and daphne's public classes. Requests are made
with Twisted's `parsePOSTFormSubmission=False`. Twisted otherwise reads every POST's Content-Type
with the email package, to fill `request.args` from a form body; daphne never reads `request.args`
(the ASGI application gets the body whole), so that parse was pure cost: about 0.1 ms of the
interpreter a POST (a tenth of a progress post's), and a malformed multipart body got Twisted's
bare 400 page instead of the API's JSON answer (docs/adr/0043-daphne-without-form-parsing.md).

And a stop (SIGTERM) drains before daphne cancels what is left: the process stops listening (under
the launcher's several processes the kernel keeps queueing on the launcher's socket for the process
started in its place), lets the native requests being served end with their answers sent, for at
most SHUTDOWN_DRAIN_SECONDS, and answers a held pop its empty pop (hordesite.wsgi_pool.drain_layers).
Stock daphne cancelled them at once: a submit whose view was running committed on its serving
thread and its client got a closed connection, so a text request was queued, and charged, under an
id its client never learnt.
"""

from __future__ import annotations

import asyncio
from typing import Any

from daphne.cli import CommandLineInterface
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.server import Server
from twisted.internet import defer

from hordesite.wsgi_pool import drain_layers

# The longest a stop waits for the requests in flight: a native view's own bounds (the database
# pool's 10 s wait) fit, and the launcher's 20 s stop (scripts/run.py) and systemd's 30 s are longer.
SHUTDOWN_DRAIN_SECONDS = 10.0


class JsonWebRequest(WebRequest):
    """daphne's request, without Twisted's parse of form bodies (the API takes JSON)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["parsePOSTFormSubmission"] = False
        super().__init__(*args, **kwargs)


class JsonHTTPFactory(HTTPFactory):
    """daphne's factory, whose connections make JsonWebRequests."""

    def buildProtocol(self, addr: Any) -> Any:  # noqa: N802  (Twisted's name)
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = JsonWebRequest
        return protocol


class HordeServer(Server):
    """daphne's Server with JsonHTTPFactory (daphne's CommandLineInterface takes it as
    `server_class`). `Server.run` assigns `self.http_factory` before it listens; this class keeps a
    JsonHTTPFactory in its place, since daphne offers no other way to choose the factory."""

    @property
    def http_factory(self) -> HTTPFactory:
        return self._json_http_factory

    @http_factory.setter
    def http_factory(self, factory: HTTPFactory) -> None:
        self._json_http_factory = factory if isinstance(factory, JsonHTTPFactory) else JsonHTTPFactory(self)

    def listen_success(self, port: Any) -> None:
        self._listening_ports = [*getattr(self, "_listening_ports", []), port]
        super().listen_success(port)

    def kill_all_applications(self) -> Any:
        """daphne's stop (a "before shutdown" trigger), after the drain: no new connection is taken,
        and the requests being served end with their answers for at most SHUTDOWN_DRAIN_SECONDS."""
        for port in getattr(self, "_listening_ports", []):
            port.stopListening()
        drained = defer.Deferred.fromFuture(asyncio.ensure_future(drain_layers(SHUTDOWN_DRAIN_SECONDS)))
        drained.addBoth(lambda _: super(HordeServer, self).kill_all_applications())
        return drained


class HordeCommandLine(CommandLineInterface):
    """daphne's command line (`daphne --help`), serving with HordeServer."""

    server_class = HordeServer
