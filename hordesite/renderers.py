"""The native routes' JSON renderer: DRF's, with lone surrogates escaped rather than a 500.

JSON's "\\ud800" escape parses to a lone surrogate, which UTF-8 cannot encode. A refusal that
echoes the value it refuses (a ChoiceField's '"\\ud800" is not a valid choice.', a chat
declaration's model_id) then failed to render, and the client got a 500 for its own bad input.
Such a body is rendered again with every non-ASCII character escaped, as the client sent it; every
other body renders exactly as DRF renders it.
"""

from __future__ import annotations

from rest_framework import renderers


class _AsciiJSONRenderer(renderers.JSONRenderer):
    ensure_ascii = True


_ASCII = _AsciiJSONRenderer()


class JSONRenderer(renderers.JSONRenderer):
    def render(self, data, accepted_media_type=None, renderer_context=None):
        try:
            return super().render(data, accepted_media_type, renderer_context)
        except UnicodeEncodeError:
            return _ASCII.render(data, accepted_media_type, renderer_context)
