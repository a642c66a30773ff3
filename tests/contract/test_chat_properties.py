"""Property tests: the validators raise nothing but their documented refusal, and valid requests pass."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.chat_declaration import parse_chat_declaration
from contract.chat_errors import ChatDeclarationInvalid, ChatRefusal
from contract.chat_limits import CHAT_SEED_MAX, CHAT_SEED_MIN
from contract.chat_policy import (
    chat_request_requirements,
    check_tool_history,
    schema_nesting_exceeds,
    strict_schema_violation,
)
from contract.chat_shapes import validate_chat_request
from contract.chat_verify import parse_chat_submit, verify_chat_reply

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

text = st.text(max_size=12) | st.sampled_from(["\ud800", "json", "", "none", "auto", "required"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4),
    max_leaves=20,
)

KEYS = [
    "model", "models", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "frequency_penalty", "presence_penalty", "seed", "reasoning_effort", "stop", "n", "stream",
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "horde",
]  # fmt: skip

names = st.from_regex(r"[A-Za-z0-9_-]{1,10}", fullmatch=True)
ids = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8)
contents = st.text(max_size=30) | st.lists(
    st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=10)), max_size=3
)
image_parts = st.builds(
    lambda url, detail: {
        "type": "image_url",
        "image_url": {"url": url, **({"detail": detail} if detail else {})},
    },
    st.sampled_from(["https://example.com/a.png", "data:image/png;base64,AAAA"]),
    st.sampled_from([None, "auto", "low", "high"]),
)


@st.composite
def tool_rounds(draw, tool_names):
    """An assistant message with calls and the tool messages answering each id once, in any order."""
    call_ids = draw(st.lists(ids, min_size=1, max_size=3, unique=True))
    calls = [
        {
            "id": i,
            "type": "function",
            "function": {"name": draw(st.sampled_from(tool_names)), "arguments": "{}"},
        }
        for i in call_ids
    ]
    answers = [
        {"role": "tool", "tool_call_id": i, "content": draw(contents)}
        for i in draw(st.permutations(call_ids))
    ]
    assistant = {"role": "assistant", "tool_calls": calls}
    if draw(st.booleans()):
        assistant["content"] = None
    return [assistant, *answers]


@st.composite
def valid_bodies(draw):
    tool_names = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    with_tools = draw(st.booleans())
    messages = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(contents)})
    for _ in range(draw(st.integers(1, 3))):
        user_content = draw(contents | st.lists(image_parts, min_size=1, max_size=2))
        messages.append({"role": "user", "content": user_content})
        if draw(st.booleans()):
            messages.extend(draw(tool_rounds(tool_names)))
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(contents)})
    data: dict = {"messages": messages}
    if draw(st.booleans()):
        data["model"] = draw(names)
    else:
        data["models"] = draw(st.lists(names, min_size=1, max_size=5, unique=True))
    optional = {
        "max_tokens": st.integers(16, 16384),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "frequency_penalty": st.floats(-2, 2),
        "presence_penalty": st.floats(-2, 2),
        "seed": st.integers(CHAT_SEED_MIN, CHAT_SEED_MAX),
        "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh"]),
        "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=4),
        "n": st.just(1),
        "stream": st.booleans(),
        "response_format": st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "object"}}},
                {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "c",
                        "strict": True,
                        "schema": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["a"],
                            "properties": {"a": {"type": "string"}},
                        },
                    },
                },
            ]
        ),
        "horde": st.fixed_dictionaries(
            {},
            optional={
                "context_fit": st.sampled_from(["grow", "reject", "truncate_oldest"]),
                "conformance": st.sampled_from(["strict", "best_effort"]),
                "slow_workers": st.booleans(),
                "max_kudos": st.integers(1, 1000),
                "dry_run": st.booleans(),
                "operation_key": st.uuids().map(str),
                "only": st.lists(st.uuids().map(str), min_size=1, max_size=2),
            },
        ),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            data[key] = draw(strategy)
    if with_tools:
        data["tools"] = [
            {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
            for n in tool_names
        ]
        if draw(st.booleans()):
            data["tool_choice"] = draw(
                st.sampled_from(["none", "auto", "required"])
                | st.sampled_from(tool_names).map(lambda n: {"type": "function", "function": {"name": n}})
            )
        if draw(st.booleans()):
            data["parallel_tool_calls"] = draw(st.booleans())
    return data


@PROPERTY_SETTINGS
@given(valid_bodies())
def test_valid_requests_always_pass(data):
    original = copy.deepcopy(data)
    request = validate_chat_request(data)
    assert data == original  # the body is not modified
    # One derivation: the validated request and its raw body need the same workers.
    assert request.requirements() == chat_request_requirements(data)
    check_tool_history(request.stored_messages())


@PROPERTY_SETTINGS
@given(json_values)
def test_any_json_body_is_refused_only_by_chat_refusal(data):
    try:
        validate_chat_request(data)
    except ChatRefusal as refusal:
        assert refusal.status in (400, 413) and refusal.rc and refusal.message


@st.composite
def mutated_bodies(draw):
    """A valid body with one value somewhere replaced by arbitrary JSON."""
    data = draw(valid_bodies())
    node = data
    path = []
    while True:
        keys = list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = draw(st.sampled_from(keys))
        path.append(key)
        if not isinstance(node[key], dict | list) or draw(st.booleans()):
            node[key] = draw(json_values)
            break
        node = node[key]
    if draw(st.booleans()):
        data[draw(st.sampled_from(KEYS))] = draw(json_values)
    return data


@PROPERTY_SETTINGS
@given(mutated_bodies())
def test_mutated_bodies_are_refused_only_by_chat_refusal(data):
    try:
        request = validate_chat_request(data)
    except ChatRefusal as refusal:
        assert refusal.rc and refusal.message
    else:
        assert request.requirements() == chat_request_requirements(data)


@PROPERTY_SETTINGS
@given(st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6))
def test_requirements_never_raise(data):
    requirements = chat_request_requirements(data)
    assert requirements.declarations == sorted(requirements.declarations)


@PROPERTY_SETTINGS
@given(json_values)
def test_schema_rules_never_raise(schema):
    schema_nesting_exceeds(schema)
    strict_schema_violation(schema, kind="function", name="f")


@PROPERTY_SETTINGS
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "chat_jobs": st.booleans() | json_values,
            "prompt_jobs": st.booleans() | json_values,
            "chat_features": st.lists(st.sampled_from(["tools", "vision", "x"])) | json_values,
            "chat_limits": st.fixed_dictionaries(
                {},
                optional={
                    "max_context_length": st.integers(-5, 10000) | json_values,
                    "max_length": st.integers(-5, 10000) | json_values,
                    "tools_max_temperature": st.floats(-1, 3) | json_values,
                },
            )
            | json_values,
            "model_id": st.sampled_from(["m", ""]) | json_values,
            "image_transports": st.lists(st.sampled_from(["url", "base64", "messages_url", "x"]))
            | json_values,
        },
    )
)
def test_declarations_are_refused_only_by_chat_declaration_invalid(pop):
    try:
        declaration = parse_chat_declaration(pop, models=["m"])
    except ChatDeclarationInvalid as refusal:
        assert refusal.rc == "ChatDeclarationInvalid"
    else:
        assert declaration.prompt_jobs or declaration.chat_jobs


extras_strategy = st.fixed_dictionaries(
    {},
    optional={
        "tools": st.just([{"type": "function", "function": {"name": "f"}}]) | json_values,
        "tool_choice": st.sampled_from(
            ["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]
        )
        | json_values,
        "parallel_tool_calls": st.booleans() | json_values,
        "response_format": st.sampled_from(
            [
                {"type": "json_object"},
                {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "strict": True, "schema": {"type": "object"}},
                },
            ]
        )
        | st.builds(
            lambda s: {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": s}},
            json_values,
        ),
    },
)


@PROPERTY_SETTINGS
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "message": json_values
            | st.fixed_dictionaries(
                {"role": st.just("assistant"), "content": st.none() | text | st.just('{"a": 1}')},
                optional={
                    "tool_calls": st.lists(
                        st.builds(
                            lambda i, n: {
                                "id": i,
                                "type": "function",
                                "function": {"name": n, "arguments": "{}"},
                            },
                            st.sampled_from(["a", "b"]),
                            st.sampled_from(["f", "g"]),
                        ),
                        max_size=3,
                    )
                },
            ),
            "finish_reason": st.sampled_from(["stop", "length", "tool_calls", "content_filter"])
            | json_values,
            "model_id": st.just("m") | json_values,
            "state": st.sampled_from(["ok", "faulted"]) | json_values,
            "prompt_tokens": st.integers() | json_values,
            "native_finish_reason": json_values,
        },
    ),
    extras_strategy,
    st.sampled_from(["strict", "best_effort"]),
)
def test_submits_are_refused_only_by_chat_refusal(body, extras, conformance):
    try:
        submit = parse_chat_submit(body)
        if submit.message is not None:
            verify_chat_reply(submit.message, submit.finish_reason, extras=extras, conformance=conformance)
    except ChatRefusal as refusal:
        assert refusal.rc in ("ChatSubmitInvalid", "ChatSubmitNonconformant")


def test_a_lone_surrogate_anywhere_is_refused_with_its_path():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    for body, path in (
        ({**base, "model": "\ud800"}, "model"),
        ({**base, "messages": [{"role": "user", "content": "a\udfffb"}]}, "messages[0].content"),
        ({**base, "stop": ["ok", "\ud83d"]}, "stop[1]"),
    ):
        try:
            validate_chat_request(body)
        except ChatRefusal as refusal:
            assert (refusal.rc, refusal.param) == ("BadRequest", path)
        else:
            raise AssertionError(f"accepted {body!r}")
