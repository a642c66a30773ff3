"""schemathesis over the native OpenAPI schema (GET /api/v2/openapi.json), in process through the
WSGI application: no generated request, valid or not, may yield a 500, and every answer is one the
schema documents, its status and its body (docs/adr/0085).

Bounded to stay well under a minute: a few examples per operation, no stateful links.
"""

from __future__ import annotations

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase
from hypothesis import settings as hypothesis_settings
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

FUZZ_EXAMPLES_PER_OPERATION = 25


@pytest.fixture
def fuzz_key(make_user):
    """A registered requester with kudos, and a chat worker, so requests reach past the first checks."""
    from tests.chat.chat_route_helpers import chat_worker

    requester = make_user("fuzz", kudos=100_000)
    chat_worker(make_user("fuzz-owner"))
    return requester.key


@pytest.fixture
def keep_test_connection(db):
    """As Django's test client does: the handler must not close the test transaction's connection."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


# Loaded at collection: the schema view reads no database.
schema = schemathesis.openapi.from_wsgi("/api/v2/openapi.json?format=json", get_wsgi_application())


@schema.parametrize()
@hypothesis_settings(
    max_examples=FUZZ_EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_request_yields_a_500(case, keep_test_connection, fuzz_key):
    response = case.call(headers={"apikey": fuzz_key})
    assert response.status_code != 500, f"{case.method} {case.formatted_path}: {response.text[:500]}"
    case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])
