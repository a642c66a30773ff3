"""DRF's content negotiation with its common answers decided without parsing.

Every native request runs DRF's negotiation, which parses the Accept header and each renderer's
media type into objects and orders them by precedence: tens of microseconds a request, for an
answer that is nearly always the same. A request with no Accept header, `*/*` or exactly the first
renderer's media type, and no format suffix or `format` query parameter, gets that renderer with
the media type DRF would give it; every other request goes through DRF's own negotiation.
"""

from __future__ import annotations

from rest_framework.negotiation import DefaultContentNegotiation


class CommonAcceptNegotiation(DefaultContentNegotiation):
    def select_renderer(self, request, renderers, format_suffix=None):
        if format_suffix is None and renderers and not request.META.get("QUERY_STRING"):
            first = renderers[0].media_type
            accept = request.META.get("HTTP_ACCEPT")
            # DRF answers these with (the first renderer, its media type) when it names one type.
            if "*" not in first and ";" not in first and accept in (None, "*/*", first):
                return renderers[0], first
        return super().select_renderer(request, renderers, format_suffix)
