"""daphne as the web process runs it (scripts/run.py serve_web; the tests' live horde).

One difference from stock daphne, through Twisted's and daphne's public classes: requests are made
with Twisted's `parsePOSTFormSubmission=False`. Twisted otherwise reads every POST's Content-Type
with the email package, to fill `request.args` from a form body; daphne never reads `request.args`
(the ASGI application gets the body whole), so that parse was pure cost: about 0.1 ms of the
interpreter a POST (a tenth of a progress post's), and a malformed multipart body got Twisted's
bare 400 page instead of the API's JSON answer (docs/adr/0043-daphne-without-form-parsing.md).
"""

from __future__ import annotations

from typing import Any

from daphne.cli import CommandLineInterface
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.server import Server


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


class HordeCommandLine(CommandLineInterface):
    """daphne's command line (`daphne --help`), serving with HordeServer."""

    server_class = HordeServer
