"""hordesite.negotiation: every request gets the renderer and media type DRF's own negotiation gives
it (or the same 406 / 404), and a JSON route answers each Accept header as before."""

from __future__ import annotations

import pytest
from django.test import RequestFactory
from rest_framework.exceptions import NotAcceptable
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BrowsableAPIRenderer, JSONRenderer, StaticHTMLRenderer
from rest_framework.request import Request

from hordesite.negotiation import CommonAcceptNegotiation

ACCEPTS = [
    None,
    "",
    "*/*",
    "application/json",
    "application/json; indent=4",
    "application/*",
    "text/html",
    "text/html, */*",
    "application/json, text/plain",
    "*/*; q=0.1",
]
RENDERER_SETS = [
    [JSONRenderer()],
    [JSONRenderer(), BrowsableAPIRenderer()],
    [StaticHTMLRenderer(), JSONRenderer()],
]


def _choice(negotiation, request, renderers, suffix):
    try:
        renderer, media_type = negotiation.select_renderer(request, renderers, suffix)
    except NotAcceptable:
        return "406"
    except Exception as error:  # the 404 of an unknown format suffix
        return type(error).__name__
    return type(renderer).__name__, media_type


@pytest.mark.parametrize("accept", ACCEPTS)
@pytest.mark.parametrize("renderers", RENDERER_SETS, ids=["json", "json+browsable", "html+json"])
@pytest.mark.parametrize(("query", "suffix"), [("", None), ("format=json", None), ("", "json"), ("", "api")])
def test_the_same_choice_as_drfs_negotiation(accept, renderers, query, suffix):
    headers = {} if accept is None else {"HTTP_ACCEPT": accept}
    path = f"/api/v2/status/heartbeat?{query}" if query else "/api/v2/status/heartbeat"
    request = Request(RequestFactory().get(path, **headers))
    assert _choice(CommonAcceptNegotiation(), request, renderers, suffix) == _choice(
        DefaultContentNegotiation(), request, renderers, suffix
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("accept", "status", "content_type"),
    [
        (None, 200, "application/json"),
        ("*/*", 200, "application/json"),
        ("application/json", 200, "application/json"),
        ("application/json; indent=4", 200, "application/json"),
        ("text/html", 406, "application/json"),
    ],
)
def test_a_json_route_answers_each_accept_header(client, accept, status, content_type):
    headers = {} if accept is None else {"HTTP_ACCEPT": accept}
    answer = client.get("/api/v2/status/heartbeat", **headers)
    assert answer.status_code == status
    assert answer["Content-Type"] == content_type
    if accept == "application/json; indent=4":
        assert answer.content.startswith(b"{\n    ")
