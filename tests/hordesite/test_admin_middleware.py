"""The admin keeps its whole middleware (sessions, login, messages, CSRF); the API routes skip it."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client


@pytest.fixture
def operator(db):
    return get_user_model().objects.create_superuser("operator", "op@example.org", "a-long-passphrase")


def test_an_operator_logs_in_and_reads_the_admin_pages(operator):
    browser = Client(enforce_csrf_checks=True)
    login_page = browser.get("/admin/login/")
    assert login_page.status_code == 200 and "csrftoken" in login_page.cookies
    token = login_page.cookies["csrftoken"].value
    logged_in = browser.post(
        "/admin/login/?next=/admin/",
        {"username": "operator", "password": "a-long-passphrase", "csrfmiddlewaretoken": token},
    )
    assert logged_in.status_code == 302 and logged_in["Location"] == "/admin/"
    assert "sessionid" in browser.cookies
    for page in ("/admin/", "/admin/chat/generationrequest/", "/admin/workers/worker/", "/admin/accounts/hordeuser/", "/admin/accounts/kudostransfer/"):
        answer = browser.get(page)
        assert answer.status_code == 200, page
        assert answer["X-Frame-Options"] == "DENY"


def test_the_admin_refuses_a_login_without_its_csrf_token(operator):
    browser = Client(enforce_csrf_checks=True)
    browser.get("/admin/login/")
    refused = browser.post("/admin/login/", {"username": "operator", "password": "a-long-passphrase"})
    assert refused.status_code == 403


def test_api_answers_carry_no_session_and_their_length(api, db):
    answer = api.get("/api/v2/status/heartbeat")
    assert answer.status_code == 200
    assert answer["Content-Length"] == str(len(answer.content))
    assert answer["X-Content-Type-Options"] == "nosniff"
    assert answer["Access-Control-Allow-Origin"] == "*"
    assert "Set-Cookie" not in answer and "Vary" not in answer
