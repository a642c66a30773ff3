"""The native routes' answers are the ones the OpenAPI schema they serve describes (ADR 0085): each
real answer, refusals included, validates against the schema of its route and status, and a
refusal's rc is among those its status documents."""

from __future__ import annotations

import json
import uuid

import jsonschema
import pytest

from accounts.api.openapi_errors import LINKS

SCHEMA_URL = "/api/v2/openapi.json?format=json"


@pytest.fixture
def served(horde):
    response = horde.client.get(SCHEMA_URL)
    assert response.status_code == 200
    return json.loads(response.content)


def _inline(schema: dict, node):
    """The node with every $ref replaced by its component, and OpenAPI 3.0's nullable read as JSON Schema's."""
    if isinstance(node, list):
        return [_inline(schema, item) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _inline(schema, schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]])
    out = {key: _inline(schema, value) for key, value in node.items()}
    if out.pop("nullable", False):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def assert_documented(served: dict, method: str, path: str, response) -> None:
    """The answer's status is documented for the route, its body validates against that status's
    schema, and a refusal's rc is named in that status's description."""
    responses = served["paths"][path][method.lower()]["responses"]
    status = str(response.status_code)
    assert status in responses, f"{method} {path} answered {status}, documented: {sorted(responses)}"
    body = json.loads(response.content)
    schema = responses[status]["content"]["application/json"]["schema"]
    jsonschema.validate(body, _inline(served, schema))
    if response.status_code >= 400 and isinstance(body, dict) and "rc" in body:
        assert body["rc"] in responses[status]["description"], (body["rc"], responses[status]["description"])


@pytest.fixture
def owner(make_user):
    return make_user("schema-owner", kudos=1000, trusted=True)


def _worker_id(horde, owner, name="schema-worker") -> str:
    response = horde.pop(owner.key, name=name)
    assert response.status_code == 200
    return horde.client.get(f"/api/v2/workers/name/{name}").json()["id"]


def test_the_pops_refusals_are_the_documented_ones(horde, owner, served):
    pop = "/api/v2/generate/text/pop"
    worker_id = _worker_id(horde, owner)
    refused = horde.pop(owner.key, name="schema-worker", priority_usernames=["db0"])
    assert json.loads(refused.content)["rc"] == "InvalidPriorityUsername"
    assert_documented(served, "POST", pop, refused)
    refused = horde.pop(owner.key, name="schema-worker", models=["model::someone#99"])
    assert refused.status_code == 400
    assert_documented(served, "POST", pop, refused)
    refused = horde.pop(owner.key, name="schema-worker", threads=51)
    assert "threads" in json.loads(refused.content)["errors"]
    assert_documented(served, "POST", pop, refused)

    put = horde.client.put(f"/api/v2/workers/{worker_id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key)
    assert put.status_code == 200
    assert_documented(served, "PUT", "/api/v2/workers/{worker_id}", put)
    in_maintenance = horde.pop(owner.key, name="schema-worker")
    assert in_maintenance.status_code == 403 and json.loads(in_maintenance.content)["rc"] == "WorkerMaintenance"
    assert_documented(served, "POST", pop, in_maintenance)


def test_the_list_routes_are_documented_as_lists(horde, owner, served):
    _worker_id(horde, owner)
    for path, url in (
        ("/api/v2/workers", "/api/v2/workers"),
        ("/api/v2/status/models", "/api/v2/status/models?type=text"),
        ("/api/v2/status/models/{model_name}", "/api/v2/status/models/Gryphe/MythoMax-L2-13b"),
        ("/api/v2/status/models/{model_name}", "/api/v2/status/models/nobody-serves-this"),
    ):
        response = horde.client.get(url)
        assert response.status_code == 200 and isinstance(json.loads(response.content), list)
        assert_documented(served, "GET", path, response)


def test_a_cancel_answers_its_documented_200(horde, make_user, served):
    requester = make_user("schema-requester", kudos=100)
    created = horde.text_async(requester.key, params={"max_length": 16})
    assert created.status_code == 202
    cancelled = horde.cancel(created.json()["id"])
    assert cancelled.status_code == 200
    assert_documented(served, "DELETE", "/api/v2/generate/text/status/{request_id}", cancelled)
    assert_documented(served, "DELETE", "/api/v2/generate/text/status/{request_id}", horde.cancel(uuid.uuid4()))

    key = horde.client.put("/api/v2/sharedkeys", {"kudos": 10}, format="json", HTTP_APIKEY=requester.key)
    assert_documented(served, "PUT", "/api/v2/sharedkeys", key)
    deleted = horde.client.delete(f"/api/v2/sharedkeys/{key.json()['id']}", HTTP_APIKEY=requester.key)
    assert deleted.status_code == 200
    assert_documented(served, "DELETE", "/api/v2/sharedkeys/{key_id}", deleted)


def test_an_unparseable_chat_body_is_the_documented_400(horde, served):
    response = horde.client.post("/api/v2/generate/chat/async", "{nope", content_type="application/json")
    assert response.status_code == 400
    assert_documented(served, "POST", "/api/v2/generate/chat/async", response)


def test_the_user_details_and_their_refusals_are_documented(horde, make_user, served):
    user = make_user("schema-user")
    found = horde.client.get("/api/v2/find_user", HTTP_APIKEY=user.key)
    assert "account_age" in found.json()
    assert_documented(served, "GET", "/api/v2/find_user", found)
    assert_documented(served, "GET", "/api/v2/users/{user_id}", horde.client.get(f"/api/v2/users/{user.user.pk}"))
    assert_documented(served, "GET", "/api/v2/users/{user_id}", horde.client.get("/api/v2/users/99999999"))
    assert_documented(served, "GET", "/api/v2/users", horde.client.get("/api/v2/users?page=x"))
    assert_documented(served, "GET", "/api/v2/find_user", horde.client.get("/api/v2/find_user", HTTP_APIKEY="nobody"))
    transfer = horde.client.post("/api/v2/kudos/transfer", {"username": "#", "amount": 1}, format="json", HTTP_APIKEY=user.key)
    assert_documented(served, "POST", "/api/v2/kudos/transfer", transfer)


def test_every_native_route_documents_the_refusals_any_route_answers(served):
    """A Host not allowed is 400 on every route, a lost database 503; a key no one holds is 401
    wherever a key is read; a body route may be refused as too large or not JSON."""
    for path, operations in served["paths"].items():
        if not path.startswith("/api/v2/"):
            continue
        for method, operation in operations.items():
            documented = set(operation["responses"])
            assert {"400", "503"} <= documented, (method, path)
            if operation.get("security") and any("ApiKey" in scheme for scheme in operation["security"]):
                assert "401" in documented, (method, path)
            if "requestBody" in operation:
                assert {"413", "415"} <= documented, (method, path)


def test_the_links_lead_to_operations_that_take_what_the_answer_names(served, horde, make_user):
    """Each link names an operation of the document and a parameter of its path; following the
    text request's link with a real answer reaches that request's status."""
    operations = {
        operation["operationId"]: (path, method)
        for path, methods in served["paths"].items()
        for method, operation in methods.items()
    }
    links = [
        link
        for methods in served["paths"].values()
        for operation in methods.values()
        for response in operation["responses"].values()
        for link in response.get("links", {}).values()
    ]
    assert len(links) == sum(len(by_name) for by_name in LINKS.values())
    for link in links:
        path, _ = operations[link["operationId"]]
        for name in link.get("parameters", {}):
            assert "{" + name + "}" in path, (link, path)

    requester = make_user("schema-links", kudos=100)
    created = horde.text_async(requester.key, params={"max_length": 16})
    link = served["paths"]["/api/v2/generate/text/async"]["post"]["responses"]["202"]["links"]["TextStatus"]
    assert link["parameters"] == {"request_id": "$response.body#/id"}
    status = horde.status(created.json()["id"])
    assert status.status_code == 200
    assert_documented(served, "GET", "/api/v2/generate/text/status/{request_id}", status)


@pytest.mark.parametrize(
    ("path", "name"),
    [("/api/v2/status/models", "min_count"), ("/api/v2/status/models", "max_count"), ("/api/v2/users", "page")],
)
def test_a_whole_number_query_parameter_takes_every_value_its_schema_allows(horde, served, path, name):
    """schemathesis (ADR 0114) sent `max_count=-610416108`, an integer as the schema documented it:
    the route refused it as "not a whole number", its sign counted as a tenth digit. The schema now
    bounds the parameter, and the route takes every value within the bounds."""
    (parameter,) = [p for p in served["paths"][path]["get"]["parameters"] if p["name"] == name]
    lowest, highest = parameter["schema"]["minimum"], parameter["schema"]["maximum"]
    for value in (-610416108, lowest, highest, 0):
        response = horde.client.get(f"{path}?type=text&{name}={value}")
        assert response.status_code == 200, (name, value, response.content)
        assert_documented(served, "GET", path, response)
    for value in (lowest - 1, highest + 1, "1.5"):
        response = horde.client.get(f"{path}?type=text&{name}={value}")
        assert response.status_code == 400 and response.json()["rc"] == "BadRequest", (name, value)
        assert f"from {lowest} to {highest}" in response.json()["message"]
        assert_documented(served, "GET", path, response)


def test_a_request_without_a_key_is_documented_as_the_anonymous_users(horde, served):
    """Every native route takes a request without a key as the anonymous user's (the route may then
    refuse the anonymous user, with its rc): the schema said a key was required, and schemathesis
    flagged each answer to a keyless request (`ignored_auth`, `missing_required_header`; ADR 0114)."""
    for path, operations in served["paths"].items():
        for method, operation in operations.items():
            if any("ApiKey" in scheme or "HordeBearerKey" in scheme for scheme in operation.get("security") or []):
                assert {} in operation["security"], (method, path)
    anonymous = horde.client.get("/api/v2/find_user")
    assert anonymous.status_code == 200 and anonymous.json()["username"].startswith("Anonymous#")
    assert_documented(served, "GET", "/api/v2/find_user", anonymous)
    refused = horde.client.post("/api/v2/generate/text/pop", {"name": "anon-worker"}, format="json")
    assert (refused.status_code, refused.json()["rc"]) == (403, "AnonForbiddenWorker")
    assert_documented(served, "POST", "/api/v2/generate/text/pop", refused)


def test_the_modes_body_is_documented_as_the_route_reads_it(horde, served, make_user):
    """schemathesis sent `PUT /api/v2/status/modes` `{}`, valid by a schema that said "any object":
    the route refuses any body without a boolean `maintenance_mode` (upstream's key; ADR 0114)."""
    operation = served["paths"]["/api/v2/status/modes"]["put"]
    body = _inline(served, operation["requestBody"]["content"]["application/json"]["schema"])
    assert body["required"] == ["maintenance_mode"] and body["properties"]["maintenance_mode"]["type"] == "boolean"
    moderator = make_user("schema-moderator", moderator=True)
    for sent in ({}, {"maintenance_mode": "yes"}):
        refused = horde.client.put("/api/v2/status/modes", sent, format="json", HTTP_APIKEY=moderator.key)
        assert (refused.status_code, refused.json()["rc"]) == (400, "BadRequest")
        assert_documented(served, "PUT", "/api/v2/status/modes", refused)
    switched = horde.client.put(
        "/api/v2/status/modes", {"maintenance_mode": False}, format="json", HTTP_APIKEY=moderator.key
    )
    assert switched.status_code == 200 and switched.json() == {"maintenance_mode": False}
    assert_documented(served, "PUT", "/api/v2/status/modes", switched)
    read = horde.client.get("/api/v2/status/modes")
    assert read.json() == {"maintenance_mode": False, "invite_only_mode": False}
    assert_documented(served, "GET", "/api/v2/status/modes", read)
