"""daphne as the web process runs it (scripts/run.py serve_web; the tests' live horde).

Two differences from stock daphne, through Twisted's and daphne's public classes. Requests are made
with Twisted's `parsePOSTFormSubmission=False`. Twisted otherwise reads every POST's Content-Type
with the email package, to fill `request.args` from a form body; daphne never reads `request.args`
(the ASGI application gets the body whole), so that parse was pure cost: about 0.1 ms of the
interpreter a POST (a tenth of a progress post's), and a malformed multipart body got Twisted's
bare 400 page instead of the API's JSON answer (docs/adr/0043-daphne-without-form-parsing.md).

And a stop (SIGTERM) drains before daphne cancels what is left (oai.server.FrontServer): the
process stops listening (under the launcher's several processes the kernel keeps queueing on the
launcher's socket for the process started in its place), lets the native requests being served end
with their answers sent, for at most STOP_DRAIN_SECONDS, and answers a held pop its empty pop
(hordesite.wsgi_pool.drain_layers); the mounted front's requests end answered by the same deadline
(oai.asgi.drain_fronts, docs/adr/0076). Stock daphne cancelled them at once: a submit whose view was
running committed on its serving thread and its client got a closed connection, so a text request
was queued, and charged, under an id its client never learnt.

Its access log names `/api/v2/sharedkeys/<id>` without the id, a credential (docs/adr/0108).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from daphne.cli import CommandLineInterface
from daphne.http_protocol import HTTPFactory, WebRequest

from hordesite.log_redaction import redacting_action_logger
from hordesite.wsgi_pool import drain_layers
from oai.asgi import drain_fronts
from oai.server import FrontServer


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


class HordeServer(FrontServer):
    """daphne's Server with JsonHTTPFactory (daphne's CommandLineInterface takes it as
    `server_class`), draining the native API and the front at a stop. `Server.run` assigns
    `self.http_factory` before it listens; this class keeps a JsonHTTPFactory in its place, since
    daphne offers no other way to choose the factory. Its access log names a shared key's path
    without the id (hordesite.log_redaction)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("action_logger") is not None:
            kwargs["action_logger"] = redacting_action_logger(kwargs["action_logger"])
        super().__init__(*args, **kwargs)

    @property
    def http_factory(self) -> HTTPFactory:
        return self._json_http_factory

    @http_factory.setter
    def http_factory(self, factory: HTTPFactory) -> None:
        self._json_http_factory = factory if isinstance(factory, JsonHTTPFactory) else JsonHTTPFactory(self)

    async def drain(self, deadline: float) -> None:
        """The native requests and the front's, both by `deadline`."""
        await asyncio.gather(drain_layers(max(0.0, deadline - time.monotonic())), drain_fronts(deadline))


class HordeCommandLine(CommandLineInterface):
    """daphne's command line (`daphne --help`), serving with HordeServer."""

    server_class = HordeServer
