"""Bodies reach the application as sent: daphne's requests skip Twisted's form parsing
(hordesite/daphne_requests.py), so a form-typed body gets the route's own answer, not Twisted's."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_multipart_body_twisted_cannot_parse_gets_the_routes_json_answer(live_horde, make_user):
    owner = make_user("multipart-poster")
    response = httpx.post(
        f"{live_horde.url}/api/v2/generate/text/pop",
        content=b"not a multipart body",
        headers={"Content-Type": "multipart/form-data; boundary=xyz", "apikey": owner.key},
        timeout=10,
    )
    # Twisted alone would answer a bare 400 with no body before the application saw the request;
    # the route refuses a body type it does not take, in its own JSON.
    assert response.status_code == 415
    assert response.headers["content-type"] == "application/json"
    assert "multipart/form-data" in response.json()["message"]

