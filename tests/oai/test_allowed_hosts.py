"""ALLOWED_HOSTS holds on every API route, not only on the admin: a Host it does not list is 400 in
the route's own error shape, native or OpenAI's, over the real serving stack (daphne, the native
routes' threads, the front's handler). /healthz answers any Host, as probes dial an address."""

from __future__ import annotations

import httpx
import pytest

from oai.errors import HOST_NOT_SERVED_MESSAGE


@pytest.fixture
def served_host(settings):
    settings.ALLOWED_HOSTS = ["horde.example"]
    return "horde.example"


def _get(live_horde, path: str, host: str, **kwargs) -> httpx.Response:
    return httpx.request(kwargs.pop("method", "GET"), f"{live_horde.url}{path}", headers={"Host": host}, timeout=10, **kwargs)


def test_a_host_not_served_is_refused_on_the_native_routes(live_horde, transactional_db, served_host):
    assert _get(live_horde, "/api/v2/status/heartbeat", served_host).status_code == 200
    refused = _get(live_horde, "/api/v2/status/heartbeat", "evil.example")
    assert refused.status_code == 400
    assert refused.json() == {"message": HOST_NOT_SERVED_MESSAGE, "rc": "BadRequest"}
    assert refused.headers["Access-Control-Allow-Origin"] == "*"  # a browser client can read it
    posted = _get(live_horde, "/api/v2/generate/text/async", "evil.example", method="POST", json={"prompt": "x"})
    assert (posted.status_code, posted.json()["rc"]) == (400, "BadRequest")


def test_a_host_not_served_is_refused_on_the_front_in_openai_shape(live_horde, front, served_host):
    assert _get(live_horde, "/v1/models", served_host).status_code == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        refused = _get(live_horde, path, "evil.example", method=method, json={"model": "m", "messages": []})
        assert refused.status_code == 400, (path, refused.text)
        assert refused.json() == {
            "error": {"message": HOST_NOT_SERVED_MESSAGE, "type": "invalid_request_error", "param": None,
                      "code": "invalid_host"}
        }
        assert refused.headers["x-should-retry"] == "false"


def test_healthz_answers_any_host(live_horde, transactional_db, served_host):
    assert _get(live_horde, "/healthz", "10.0.0.7:8000").status_code in (200, 503)  # its own verdict, not 400
