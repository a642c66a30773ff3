"""Bad bodies on the live daphne server (hordesite.asgi: body guard, hot route layer, Django, the
mounted front): every JSON route answers a clear 4xx in its own error shape, never a 500 or
daphne's HTML page, anonymous or keyed (issue 13, item 2; docs/adr/0018).

Live here, not in process, because the failures seen were daphne's: its HTML error page for an
exception the hot route layer raised, and Django's RequestDataTooBig behind its ASGI handler.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from django.conf import settings

from contract.chat_limits import MAX_CHAT_BODY_BYTES
from tests.oai.conftest import _restore_anonymous_user

pytestmark = pytest.mark.django_db(transaction=True)

# (method, path) of every native route that takes a JSON body
NATIVE_JSON_ROUTES = [
    ("POST", "/api/v2/generate/text/async"),
    ("POST", "/api/v2/generate/chat/async"),
    ("POST", "/api/v2/generate/text/pop"),
    ("POST", "/api/v2/generate/text/submit"),
    ("PUT", f"/api/v2/workers/{uuid.UUID(int=1)}"),
    ("PUT", "/api/v2/status/modes"),
]
FRONT_ROUTE = ("POST", "/v1/chat/completions")
CALLERS = ["anonymous", "keyed"]


def nested(depth: int) -> bytes:
    """A small JSON object whose prompt nests `depth` arrays deep (2 KB at 1,000)."""
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "models": ["m"]}'


@pytest.fixture
def headers(make_user):
    _restore_anonymous_user()  # a transactional test's flush removed the migration's row

    def build(caller: str, path: str) -> dict[str, str]:
        if caller == "anonymous":
            return {}
        key = make_user(f"bad-body-{uuid.uuid4().hex[:6]}", kudos=1000, moderator=True).key
        return {"Authorization": f"Bearer {key}"} if path.startswith("/v1/") else {"apikey": key}

    return build


def assert_native_error(response: httpx.Response, *statuses: int) -> dict:
    assert response.status_code in statuses, (response.status_code, response.text[:300])
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert isinstance(body["message"], str) and body["message"]
    assert isinstance(body["rc"], str) and body["rc"]
    return body


def assert_front_error(response: httpx.Response, *statuses: int) -> dict:
    assert response.status_code in statuses, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize(("method", "path"), NATIVE_JSON_ROUTES)
def test_a_body_nested_a_thousand_deep_is_400_in_the_native_shape(live_horde, headers, caller, method, path):
    for depth in (1_000, 50_000):
        response = httpx.request(
            method,
            live_horde.url + path,
            content=nested(depth),
            headers={"Content-Type": "application/json", **headers(caller, path)},
            timeout=20,
        )
        # 400 for the body; a refusal of the caller that comes first (401/403/404) is a 4xx too.
        body = assert_native_error(response, 400, 401, 403, 404)
        if response.status_code == 400:
            assert body == {"message": "The request body nests too deeply.", "rc": "BadRequest"}


@pytest.mark.parametrize("caller", CALLERS)
def test_a_thousand_deep_body_to_the_front_is_400_in_the_openai_shape(live_horde, front, headers, caller):
    response = httpx.post(
        live_horde.url + FRONT_ROUTE[1],
        content=nested(1_000),
        headers={"Content-Type": "application/json", **headers(caller, FRONT_ROUTE[1])},
        timeout=20,
    )
    assert_front_error(response, 400, 401)


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize(("method", "path"), [r for r in NATIVE_JSON_ROUTES if r[1] != "/api/v2/generate/chat/async"])
def test_a_body_over_djangos_bound_is_413_request_too_large(live_horde, headers, caller, method, path):
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    big = json.dumps({"prompt": "x" * (limit + 1)}).encode()
    sent = {"Content-Type": "application/json", **headers(caller, path)}
    declared = httpx.request(method, live_horde.url + path, content=big, headers=sent, timeout=20)
    assert assert_native_error(declared, 413)["rc"] == "RequestTooLarge"
    # The same body chunked (no Content-Length): read one byte past the bound, then refused.
    chunked = httpx.request(method, live_horde.url + path, content=iter([big[:limit], big[limit:]]), headers=sent, timeout=20)
    assert "content-length" not in chunked.request.headers
    assert assert_native_error(chunked, 413)["rc"] == "RequestTooLarge"


@pytest.mark.parametrize("caller", CALLERS)
def test_the_chat_route_keeps_its_own_bound(live_horde, headers, caller):
    path = "/api/v2/generate/chat/async"
    sent = {"Content-Type": "application/json", **headers(caller, path)}
    # 2.5 MiB and more is within the chat bound: validated, not refused for its size.
    within = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (3 * 1024 * 1024)}]}).encode()
    response = httpx.post(live_horde.url + path, content=within, headers=sent, timeout=30)
    assert response.status_code < 500 and response.status_code != 413, response.text[:300]
    # Past MAX_CHAT_BODY_BYTES, chunked: read one byte past the bound, then refused.
    chunk = b"x" * (4 * 1024 * 1024)
    over = httpx.post(
        live_horde.url + path, content=iter([chunk] * (MAX_CHAT_BODY_BYTES // len(chunk) + 1)), headers=sent, timeout=60
    )
    assert assert_native_error(over, 413)["rc"] == "RequestTooLarge"


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize(("method", "path"), NATIVE_JSON_ROUTES)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_json_body_not_sent_as_json_is_415_on_every_route(live_horde, headers, caller, method, path, content_type):
    sent = headers(caller, path) | ({"Content-Type": content_type} if content_type else {})
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}).encode()
    response = httpx.request(method, live_horde.url + path, content=raw, headers=sent, timeout=10)
    body = assert_native_error(response, 415)
    assert body["rc"] == "BadRequest" and "Unsupported media type" in body["message"]


@pytest.mark.parametrize(("method", "path"), NATIVE_JSON_ROUTES)
def test_json_with_a_charset_still_reaches_the_route(live_horde, headers, method, path):
    sent = {"Content-Type": "application/json; charset=utf-8", **headers("keyed", path)}
    response = httpx.request(method, live_horde.url + path, content=b'{"x": 1}', headers=sent, timeout=10)
    # The route's own answer for a wrong body: a refusal, never the media type or a 5xx.
    assert response.status_code not in (413, 415) and response.status_code < 500, response.text[:300]


def gzipped_chat_body() -> bytes:
    import gzip

    return gzip.compress(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode())


@pytest.mark.parametrize(("method", "path"), NATIVE_JSON_ROUTES)
@pytest.mark.parametrize("encoding", ["gzip", "deflate, gzip", "br"])
def test_a_compressed_body_is_415_naming_its_encoding_on_every_native_route(live_horde, headers, method, path, encoding):
    """Not the JSON parser's complaint about byte 0x8b: the body's encoding is named, with the one the
    horde takes (RFC 9110's Accept-Encoding on a 415)."""
    sent = {"Content-Type": "application/json", "Content-Encoding": encoding, **headers("keyed", path)}
    response = httpx.request(method, live_horde.url + path, content=gzipped_chat_body(), headers=sent, timeout=10)
    body = assert_native_error(response, 415)
    assert body == {
        "message": f"The request body's Content-Encoding {encoding!r} is not supported: send it uncompressed.",
        "rc": "BadRequest",
    }
    assert response.headers["accept-encoding"] == "identity"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_a_compressed_body_to_the_front_is_415_naming_its_encoding(live_horde, front, headers, path):
    sent = {"Content-Type": "application/json", "Content-Encoding": "gzip", **headers("keyed", path)}
    response = httpx.post(live_horde.url + path, content=gzipped_chat_body(), headers=sent, timeout=10)
    assert assert_front_error(response, 415) == {
        "message": "The request body's Content-Encoding 'gzip' is not supported: send it uncompressed.",
        "type": "invalid_request_error",
        "param": None,
        "code": "UnsupportedContentEncoding",
    }
    assert response.headers["accept-encoding"] == "identity"
    assert response.headers["x-should-retry"] == "false" and response.headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize("path", ["/api/v2/generate/text/pop", "/v1/chat/completions"])
def test_an_identity_content_encoding_is_a_body_as_any_other(live_horde, front, headers, path):
    sent = {"Content-Type": "application/json", "Content-Encoding": "identity", **headers("keyed", path)}
    response = httpx.post(live_horde.url + path, content=b'{"x": 1}', headers=sent, timeout=10)
    assert response.status_code == 400, response.text[:300]  # the route's own refusal of the body
