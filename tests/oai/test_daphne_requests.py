"""Form-typed bodies on daphne: the route refuses a body type it does not take in its own JSON.

daphne's requests are Twisted's, which would parse a POST declared as a form before the application
sees it; the web process's server (hordesite/web_server.py, the live horde's here) makes them
without that parse (docs/adr/0043), so even a multipart body Twisted could not parse reaches the
route and gets its JSON 415."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-www-form-urlencoded", b"name=worker&models=m"),
        ("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--xyz--\r\n"),
    ],
)
def test_a_form_body_gets_the_routes_json_answer(live_horde, make_user, content_type, body):
    owner = make_user("form-poster")
    response = httpx.post(
        f"{live_horde.url}/api/v2/generate/text/pop",
        content=body,
        headers={"Content-Type": content_type, "apikey": owner.key},
        timeout=10,
    )
    assert response.status_code == 415
    assert response.headers["content-type"] == "application/json"
    assert content_type.split(";")[0] in response.json()["message"]


def test_a_multipart_body_twisted_could_not_parse_gets_the_routes_json_answer(live_horde, make_user):
    owner = make_user("multipart-poster")
    response = httpx.post(
        f"{live_horde.url}/api/v2/generate/text/pop",
        content=b"not a multipart body",
        headers={"Content-Type": "multipart/form-data; boundary=xyz", "apikey": owner.key},
        timeout=10,
    )
    assert response.status_code == 415
    assert response.headers["content-type"] == "application/json"
    assert response.json()["rc"] == "BadRequest"


def test_a_multipart_body_to_the_front_gets_an_openai_error(live_horde, make_user):
    owner = make_user("multipart-front")
    response = httpx.post(
        f"{live_horde.url}/v1/chat/completions",
        content=b"not a multipart body",
        headers={"Content-Type": "multipart/form-data; boundary=xyz", "Authorization": f"Bearer {owner.key}"},
        timeout=10,
    )
    assert 400 <= response.status_code < 500
    assert response.json()["error"]["type"] == "invalid_request_error"
