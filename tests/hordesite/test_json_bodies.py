"""One body rule for every native JSON route, in process on both of Django's handlers (the suite's
WSGI client and the ASGI stack's Django): 415 for a body not sent as JSON, 413 for a body past the
route's bound, 400 {"message", "rc"} for one nested too deeply (docs/adr/0018)."""

from __future__ import annotations

import json

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db

ROUTES = [
    ("post", "/api/v2/generate/text/async"),
    ("post", "/api/v2/generate/chat/async"),
    ("post", "/api/v2/generate/text/pop"),
    ("post", "/api/v2/generate/text/submit"),
    ("put", "/api/v2/status/modes"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_wsgi_refuses_a_text_plain_body_with_415(method, path, make_user):
    key = make_user("plain-poster", kudos=100).key
    response = getattr(Client(), method)(path, data='{"prompt": "hi"}', content_type="text/plain", HTTP_APIKEY=key)
    assert response.status_code == 415
    assert response.json() == {"message": 'Unsupported media type "text/plain" in request.', "rc": "BadRequest"}


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_wsgi_refuses_a_deep_body_with_400(method, path, make_user):
    key = make_user("deep-poster", kudos=100, moderator=True).key
    deep = '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"
    response = getattr(Client(), method)(path, data=deep, content_type="application/json", HTTP_APIKEY=key)
    assert response.status_code == 400
    assert response.json() == {"message": "The request body nests too deeply.", "rc": "BadRequest"}


@pytest.mark.parametrize(("method", "path"), [r for r in ROUTES if r[1] != "/api/v2/generate/chat/async"])
def test_wsgi_refuses_a_body_over_the_bound_with_413(method, path, make_user, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    key = make_user("big-poster", kudos=100).key
    big = json.dumps({"prompt": "x" * 2000})
    response = getattr(Client(), method)(path, data=big, content_type="application/json", HTTP_APIKEY=key)
    assert response.status_code == 413
    assert response.json() == {"message": "The request body is over 1000 bytes.", "rc": "RequestTooLarge"}


def test_a_body_less_request_is_left_to_the_route(make_user):
    key = make_user("empty-poster", kudos=100).key
    response = Client().generic("POST", "/api/v2/generate/text/async", HTTP_APIKEY=key)
    # No body and no type: the route's own validation answers, not the media type rule.
    assert response.status_code == 400 and response.json()["message"] == "Input payload validation failed"



@pytest.mark.parametrize(
    ("path", "body", "echo"),
    [
        (
            "/api/v2/generate/text/submit",
            {"id": "8a7b2a3c-1f47-4a8e-9a53-3bd0a8f2e0c1", "generation": "x", "state": "\ud800"},
            {"errors": {"state": '"\ud800" is not a valid choice.'}, "message": "Input payload validation failed"},
        ),
        (
            "/api/v2/generate/text/pop",
            {"name": "w", "models": ["m"], "chat_jobs": True, "model_id": "\ud800",
             "chat_limits": {"max_context_length": 4096, "max_length": 512}},
            {"message": "'model_id': model_id '\ud800' is not one of the worker's models.", "rc": "ChatDeclarationInvalid"},
        ),
    ],
)
def test_a_refusal_echoing_a_lone_surrogate_is_still_400(path, body, echo, make_user):
    """JSON's \\ud800 escape parses to text UTF-8 cannot encode: a refusal that echoes it failed to
    render (a 500). It is answered with the echo escaped, as the client sent it."""
    key = make_user("surrogate-worker", kudos=100).key
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as its escape
    response = Client().post(path, data=raw, content_type="application/json", HTTP_APIKEY=key)
    assert response.status_code == 400
    assert response.content.isascii() and json.loads(response.content) == echo
