"""schemathesis over the front's own OpenAPI schema (the one `python -m oai` serves at
/v1/openapi.json, generated from its views), against a real front: the live horde's mounted /v1
front over the real native routes, with a chat worker and a text worker answering. No generated
request, valid or not, may yield a 5xx, but the front's documented 503 `no_eligible_worker` for a
request no online worker can take.

Bounded to stay well under a minute: a few examples per operation, no stateful links, and short
front timeouts (a request the workers cannot serve ends 408 in seconds, not minutes).
"""

from __future__ import annotations

import pytest
import schemathesis
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, Phase
from hypothesis import settings as hypothesis_settings

pytestmark = pytest.mark.slow

FRONT_FUZZ_EXAMPLES_PER_OPERATION = 6


def _front_schema() -> dict:
    """The standalone front's schema (oai.standalone_urls), as its /v1/openapi.json serves it."""
    generator = SchemaGenerator(urlconf="oai.standalone_urls", title="AI Horde OpenAI-compatible front")
    schema = generator.get_schema(request=None, public=True)
    schema["paths"].pop("/v1/openapi.json", None)  # the schema itself: not an operation of the front
    return schema


schema = schemathesis.openapi.from_dict(_front_schema())


@pytest.fixture
def fuzz_front(front, requester, start_worker, start_text_worker):
    front.configure(nonstream_timeout_seconds=3.0, stream_timeout_seconds=3.0, fail_fast_grace_seconds=1.0)
    start_worker()
    start_text_worker()
    return front, requester.key


def test_the_front_schema_lists_the_front_routes():
    assert set(_front_schema()["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id}"}


@schema.parametrize()
@hypothesis_settings(
    max_examples=FRONT_FUZZ_EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_request_to_the_front_yields_a_5xx(case, fuzz_front):
    front, key = fuzz_front
    response = case.call(base_url=front.live.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    if response.status_code >= 500:
        # The one 5xx the front answers by design with a live horde: a request no online worker can
        # take (a model nobody serves, a budget over every worker's), after the grace period.
        code = (response.json().get("error") or {}).get("code")
        assert (response.status_code, code) == (503, "no_eligible_worker"), (
            f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:500]}"
        )
