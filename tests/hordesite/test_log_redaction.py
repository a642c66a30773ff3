"""A secret a client puts in a URL path stays out of the web process's logs.

`GET /api/v2/sharedkeys/<id>` carries a shared key's id, a credential (whoever holds it spends its
owner's kudos), and SillyTavern 1.19.0 sends the user's own API key there: its "show kudos" asks
getSharedKey(the API key) before findUser (docs/adr/0108). The horde keeps only keys' hashes; a log
line holding the key whole would be the one place it is stored readable. Both of the web process's
lines about such a request, daphne's access line and django.request's warning on the 401, name the
path with the id replaced.
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from tests.hordesite.test_web_restart import LaunchedWeb, web_env
from tests.ports import free_port

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_request_warning_names_a_shared_key_path_without_its_id(client, make_user, caplog):
    user = make_user("kudos-checker")
    with caplog.at_level(logging.WARNING, logger="django.request"):
        response = client.get(f"/api/v2/sharedkeys/{user.key}")
        assert response.status_code == 401  # not a shared key: SillyTavern reads it as none
    assert user.key not in caplog.text
    assert "Unauthorized: /api/v2/sharedkeys/<redacted>" in caplog.text


def test_a_shared_key_path_in_other_case_is_logged_without_its_id(client, make_user, caplog):
    """A client that spells the route in another case gets a 404, whose warning names the path."""
    user = make_user("kudos-checker-case")
    with caplog.at_level(logging.WARNING, logger="django.request"):
        response = client.get(f"/api/v2/SharedKeys/{user.key}")
        assert response.status_code == 404
    assert user.key not in caplog.text
    assert "/api/v2/SharedKeys/<redacted>" in caplog.text


@pytest.mark.slow
def test_the_access_log_names_a_shared_key_path_without_its_id(tmp_path: Path, make_user):
    user = make_user("kudos-checker")
    web = LaunchedWeb(web_env(tmp_path), free_port(), tmp_path / "web.log")
    web.start()
    try:
        answer = httpx.get(f"{web.url}sharedkeys/{user.key}?fields=kudos", headers={"Client-Agent": "x:1:y"})
        assert answer.status_code == 401
        assert httpx.get(web.url + "status/heartbeat").status_code == 200  # a line after it
    finally:
        web.kill()
    log = web.log.read_text()
    assert user.key not in log
    assert '"GET /api/v2/sharedkeys/<redacted>?fields=kudos" 401' in log
