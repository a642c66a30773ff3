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

from tests.oai.conftest import MODEL

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
    assert set(_front_schema()["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/responses/{response_id}/input_items",
    }


def test_the_front_schema_documents_a_request_without_a_key():
    # The front serves a keyless request as the anonymous user (HORDE_OAI_ALLOW_ANONYMOUS, on by
    # default; off, it is the documented 401): the key is optional (ADR 0114).
    for path, operations in _front_schema()["paths"].items():
        for method, operation in operations.items():
            assert operation["security"] == [{"HordeBearerKey": []}, {}], (method, path)


def test_the_front_schema_documents_a_blank_prompt_as_refused():
    # schemathesis sent {"prompt": ""} to /v1/completions, valid by the schema; the horde refuses a
    # blank prompt (400 "This field may not be blank."), so the schema says minLength 1 (ADR 0114).
    body = _front_schema()["components"]["schemas"]["TextCompletionRequest"]
    assert body["properties"]["prompt"]["minLength"] == 1


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


# --- POST /v1/responses: more examples of its richer body, and its answers documented ---------------

RESPONSES_FUZZ_EXAMPLES = 40


@schema.include(path="/v1/responses").parametrize()
@hypothesis_settings(
    max_examples=RESPONSES_FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_responses_request_yields_an_undocumented_answer(case, fuzz_front):
    """Fuzzed Responses bodies (input, tools, tool_choice, text, reasoning, truncation, include...)
    never answer 5xx but the documented no_eligible_worker, and every status is one the schema lists."""
    front, key = fuzz_front
    response = case.call(base_url=front.live.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    if case.method.upper() != "POST":
        assert response.status_code < 500, (case.method, response.status_code)  # 405, or OPTIONS' 200
        return
    documented = set(_front_schema()["paths"]["/v1/responses"]["post"]["responses"])
    assert str(response.status_code) in documented, (response.status_code, response.text[:500])
    if response.status_code >= 500:
        code = (response.json().get("error") or {}).get("code")
        assert (response.status_code, code) == (503, "no_eligible_worker"), response.text[:500]


def _documented(status: int, code: str | None = None) -> None:
    responses = _front_schema()["paths"]["/v1/responses"]["post"]["responses"]
    assert str(status) in responses, (status, sorted(responses))
    if code is not None and status >= 500:
        assert code in responses[str(status)]["description"], (code, responses[str(status)]["description"])


def test_every_answer_of_the_responses_route_is_documented(front, requester, start_worker):
    """Real answers of the live front, refusals included: each status (and a 5xx's code) is one the
    schema lists for POST /v1/responses."""
    import httpx

    start_worker()
    url = f"{front.live.v1}/responses"
    auth = {"Authorization": f"Bearer {requester.key}"}
    answers = {
        "whole": httpx.post(url, json={"model": MODEL, "input": "Hi"}, headers=auth, timeout=30),
        "bad input": httpx.post(url, json={"model": MODEL, "input": 3}, headers=auth, timeout=30),
        "unknown key": httpx.post(url, json={"model": MODEL, "input": "Hi"}, headers={"Authorization": "Bearer 00000000000000000000"}, timeout=30),
        "unknown model": httpx.post(url, json={"model": "no/such-model", "input": "Hi"}, headers=auth, timeout=30),
        "not json": httpx.post(url, content=b"{", headers={**auth, "Content-Type": "application/json"}, timeout=30),
    }
    assert {name: a.status_code for name, a in answers.items()} == {
        "whole": 200,
        "bad input": 400,
        "unknown key": 401,
        "unknown model": 404,
        "not json": 400,
    }
    for answer in answers.values():
        _documented(answer.status_code)

    front.configure(max_body_bytes=1000)
    answer = httpx.post(url, json={"model": MODEL, "input": "x" * 2000}, headers=auth, timeout=30)
    assert answer.status_code == 413, answer.text
    _documented(413)

    # Redis gone: an item_reference cannot be told kept or not, 503 ResponseItemsUnavailable.
    front.configure(redis_url="redis://127.0.0.1:1/0")
    reference = {"model": MODEL, "input": [{"type": "item_reference", "id": "msg_0"}]}
    answer = httpx.post(url, json=reference, headers=auth, timeout=30)
    assert answer.status_code == 503, answer.text
    code = answer.json()["error"]["code"]
    assert code == "ResponseItemsUnavailable"
    _documented(503, code)
