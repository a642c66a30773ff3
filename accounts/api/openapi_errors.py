"""OpenAPI: the native API's refusals (docs/adr/0085-the-schema-documents-every-refusal.md).

Every native route refuses with `{"message", "rc"}`, or with the schema failure's
`{"errors": {...}, "message": "Input payload validation failed"}` (hordesite/errors.py). A view
names its own refusals and their rcs with `refusals()`; `document_native_refusals`, a
drf-spectacular postprocessing hook, adds the answers every native route can give whatever it does
(a Host not allowed, a body or query refused, an unknown key or id, a body too large or not JSON, a
lost database), so that a client generated from the schema knows every status it may read.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse

NATIVE_ROOT = "/api/v2/"
VALIDATION_MESSAGE = "Input payload validation failed"
# A list answer of free-form objects (a raw schema: drf-spectacular takes no bare field as a response).
OBJECT_LIST = {"type": "array", "items": {"type": "object", "additionalProperties": {}}}

# The two refusal bodies, as components the hook adds to the document.
COMPONENTS = {
    "NativeError": {
        "type": "object",
        "properties": {
            "message": {"type": "string"},
            "rc": {"type": "string", "description": "the refusal's return code, e.g. BadRequest"},
        },
        "required": ["message", "rc"],
    },
    "NativeValidationError": {
        "type": "object",
        "properties": {
            "errors": {
                "type": "object",
                "additionalProperties": {"type": "string"},
                "description": 'each refused field\'s path and why, e.g. {"params.max_length": "..."}',
            },
            "message": {"type": "string", "description": f'"{VALIDATION_MESSAGE}"'},
        },
        "required": ["errors", "message"],
    },
}
ERROR = {"$ref": "#/components/schemas/NativeError"}
# A 400 is either: an rc's refusal, or the schema failure's list of fields.
BAD_REQUEST = {"oneOf": [ERROR, {"$ref": "#/components/schemas/NativeValidationError"}]}


def refusals(**rcs_by_status: list[str]) -> dict[int, OpenApiResponse]:
    """A view's refusals for `extend_schema(responses=...)`, keyed `s400=[...]`, `s403=[...]`: each
    status with the rcs the route answers it with (the 400 also in the schema failure's shape)."""
    return {
        int(key.removeprefix("s")): OpenApiResponse(
            BAD_REQUEST if key == "s400" else ERROR, description="rc: " + ", ".join(rcs)
        )
        for key, rcs in rcs_by_status.items()
    }


def _to(operation_id: str, **parameters: str) -> dict:
    return {"operationId": operation_id, "parameters": parameters}


_REQUEST_ID = "$response.body#/id"
# OpenAPI links from an answer to the routes that take what it names (a request's id, a shared
# key's, a user's, a popped job's), so that clients and stateful fuzzers follow them.
LINKS: dict[tuple[str, str, str], dict[str, dict]] = {
    ("/api/v2/generate/text/async", "post", "202"): {
        "TextStatus": _to("api_v2_generate_text_status_retrieve", request_id=_REQUEST_ID),
        "TextCancel": _to("api_v2_generate_text_status_destroy", request_id=_REQUEST_ID),
    },
    ("/api/v2/generate/chat/async", "post", "202"): {
        "ChatStatus": _to("api_v2_generate_chat_status_retrieve", request_id=_REQUEST_ID),
        "ChatCancel": _to("api_v2_generate_chat_status_destroy", request_id=_REQUEST_ID),
    },
    ("/api/v2/sharedkeys", "put", "200"): {
        "SharedKey": _to("api_v2_sharedkeys_retrieve", key_id=_REQUEST_ID),
        "SharedKeyChange": _to("api_v2_sharedkeys_partial_update", key_id=_REQUEST_ID),
        "SharedKeyDelete": _to("api_v2_sharedkeys_destroy", key_id=_REQUEST_ID),
    },
    ("/api/v2/find_user", "get", "200"): {"User": _to("api_v2_users_retrieve", user_id=_REQUEST_ID)},
    ("/api/v2/generate/text/pop", "post", "200"): {
        "Submit": {
            "operationId": "api_v2_generate_text_submit_create",
            "requestBody": {"id": _REQUEST_ID, "generation": "A reply.", "state": "ok"},
        },
    },
}


def _json(schema: dict, description: str) -> dict:
    return {"content": {"application/json": {"schema": schema}}, "description": description}


def document_native_refusals(result, generator, request, public):
    """Adds to each native operation the statuses any route of its kind answers, unless its view
    named them: 400 (a Host not allowed, a body or query it refuses), 401 (a key no one holds, where
    a key is read), 404 (an id in the path), 413 and 415 (a body too large, not JSON), 503 (the
    database lost); and the LINKS of its answers."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in COMPONENTS.items():
        schemas.setdefault(name, schema)
    for path, operations in result.get("paths", {}).items():
        if not path.startswith(NATIVE_ROOT):
            continue
        for method, operation in operations.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            defaults = {"400": _json(BAD_REQUEST, "rc: BadRequest")}
            if any("ApiKey" in scheme for scheme in operation.get("security") or []):
                defaults["401"] = _json(ERROR, "rc: InvalidAPIKey")
            if "{" in path:
                defaults["404"] = _json(ERROR, "rc: the NotFound rc of the thing the path names")
            if "requestBody" in operation:
                defaults["413"] = _json(ERROR, "rc: RequestTooLarge")
                defaults["415"] = _json(ERROR, "rc: BadRequest (a body not sent as JSON)")
            defaults["503"] = _json(ERROR, "rc: DatabaseUnavailable")
            responses = operation.setdefault("responses", {})
            for status, response in defaults.items():
                responses.setdefault(status, response)
            for status, response in responses.items():
                if (links := LINKS.get((path, method, status))) is not None:
                    response["links"] = links
    return result
