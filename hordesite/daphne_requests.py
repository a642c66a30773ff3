"""daphne's HTTP requests without Twisted's form parsing.

Twisted's http.Request parses every POST body that declares a form type (urlencoded or
multipart/form-data) into `request.args`, and to tell, parses every POST's Content-Type through the
email package. daphne never reads `args`: it hands the raw body to the ASGI application, which parses
it itself. So the parse is pure cost: 3.8% of daphne's interpreter time under the benchmark's pop
load (py-spy), a second copy in memory of a large form upload, and a bare 400 with no body from
Twisted, before the application sees it, for a multipart body Twisted cannot parse. Twisted's own switch for this is the request's `parsePOSTFormSubmission`;
daphne makes its requests without it, so its request class is replaced by one that passes it.
"""

from __future__ import annotations

from typing import Any


def use_requests_without_form_parsing() -> None:
    """Make daphne build its HTTP requests with parsePOSTFormSubmission=False (idempotent; a no-op
    outside daphne's server, where nothing imports daphne.http_protocol's request class)."""
    from daphne import http_protocol

    if getattr(http_protocol.WebRequest, "parses_forms", True) is False:
        return

    class WebRequestWithoutFormParsing(http_protocol.WebRequest):  # type: ignore[misc, valid-type]
        parses_forms = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["parsePOSTFormSubmission"] = False
            super().__init__(*args, **kwargs)

    # HTTPFactory.buildProtocol reads the module's name for each new connection.
    http_protocol.WebRequest = WebRequestWithoutFormParsing
