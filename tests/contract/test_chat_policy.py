import re
from pathlib import Path

import pytest

from contract.chat_declaration import ChatDeclaration, ChatLimits
from contract.chat_errors import ChatRefusal, param_from_native_message
from contract.chat_policy import (
    KUDOS_CAP_EXCESS_PATTERN,
    ChatConformance,
    ChatFeature,
    ChatGuarantee,
    ChatServiceGap,
    chat_request_requirements,
    chat_service_gap,
    chat_tools_temperature,
    check_tool_history,
    kudos_cap_message,
    merge_service_gaps,
    parse_kudos_cap_message,
    required_chat_features,
    schema_nesting_exceeds,
    strict_schema_violation,
    violated_chat_limit,
)

from .helpers import WEATHER_TOOL, body, tool_call

IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def test_vocabularies_have_the_spec_wire_strings():
    assert [f.value for f in ChatFeature] == [
        "seed",
        "reasoning_effort",
        "presence_penalty",
        "frequency_penalty",
        "vision",
        "tools",
        "json_object",
        "json_schema",
        "tools_with_response_format",
    ]
    assert [g.value for g in ChatGuarantee] == [
        "tool_choice_enforced",
        "single_tool_call_enforced",
        "structured_output_enforced",
        "prompt_overflow_refused",
    ]
    assert [c.value for c in ChatConformance] == ["strict", "best_effort"]


def features(**overrides):
    return {str(f) for f in chat_request_requirements(body(**overrides)).features}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, set()),
        ({"seed": 0}, {"seed"}),
        ({"reasoning_effort": "none"}, {"reasoning_effort"}),
        ({"presence_penalty": 0}, set()),
        ({"presence_penalty": 0.5}, {"presence_penalty"}),
        ({"frequency_penalty": -1}, {"frequency_penalty"}),
        ({"frequency_penalty": 0.0}, set()),
        ({"messages": [{"role": "user", "content": [IMAGE_PART]}]}, {"vision"}),
        ({"tools": [WEATHER_TOOL]}, {"tools"}),
        ({"tools": [WEATHER_TOOL], "tool_choice": "none"}, set()),
        ({"tools": []}, set()),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "tool_calls": [tool_call("a")]},
                    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
                ]
            },
            {"tools"},
        ),
        ({"response_format": {"type": "text"}}, set()),
        ({"response_format": {"type": "json_object"}}, {"json_object"}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {}}}},
            {"json_schema"},
        ),
        (
            {"tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}},
            {"tools", "json_object", "tools_with_response_format"},
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": "none", "response_format": {"type": "json_object"}},
            {"json_object"},
        ),
    ],
)
def test_required_features(overrides, expected):
    assert features(**overrides) == expected


def guarantees(**overrides):
    return {str(g) for g in chat_request_requirements(body(**overrides)).guarantees}


def test_required_guarantees_under_strict():
    assert guarantees() == {"prompt_overflow_refused"}
    assert guarantees(tools=[WEATHER_TOOL]) == {"prompt_overflow_refused"}
    assert guarantees(tools=[WEATHER_TOOL], tool_choice="required") == {
        "prompt_overflow_refused",
        "tool_choice_enforced",
    }
    forced = {"type": "function", "function": {"name": "get_weather"}}
    assert "tool_choice_enforced" in guarantees(tools=[WEATHER_TOOL], tool_choice=forced)
    # Tools are not forwarded under none, and without tools a choice forwards nothing.
    assert guarantees(tools=[WEATHER_TOOL], tool_choice="none") == {"prompt_overflow_refused"}
    strict_schema = {"type": "json_schema", "json_schema": {"name": "c", "schema": {}, "strict": True}}
    assert "structured_output_enforced" in guarantees(response_format=strict_schema)
    loose_schema = {"type": "json_schema", "json_schema": {"name": "c", "schema": {}}}
    assert "structured_output_enforced" not in guarantees(response_format=loose_schema)
    # single_tool_call_enforced is never required.
    assert "single_tool_call_enforced" not in guarantees(tools=[WEATHER_TOOL], parallel_tool_calls=False)


def test_best_effort_needs_no_guarantee_but_the_same_features():
    overrides = {"tools": [WEATHER_TOOL], "tool_choice": "required", "horde": {"conformance": "best_effort"}}
    requirements = chat_request_requirements(body(**overrides))
    assert requirements.guarantees == frozenset()
    assert requirements.conformance == ChatConformance.BEST_EFFORT
    assert {str(f) for f in requirements.features} == {"tools"}


def test_required_chat_features_is_sorted_features_and_guarantees():
    assert required_chat_features(body(seed=1, tools=[WEATHER_TOOL], tool_choice="required")) == [
        "prompt_overflow_refused",
        "seed",
        "tool_choice_enforced",
        "tools",
    ]


def test_tools_temperature_only_when_tools_are_forwarded():
    assert chat_tools_temperature(body()) is None
    assert chat_tools_temperature(body(temperature=0.3)) is None
    assert chat_tools_temperature(body(tools=[WEATHER_TOOL])) == 1.0  # the payload default
    assert chat_tools_temperature(body(tools=[WEATHER_TOOL], temperature=0.3)) == 0.3
    assert chat_tools_temperature(body(tools=[WEATHER_TOOL], tool_choice="none", temperature=2)) is None


def test_tool_temperature_limit():
    limits = ChatLimits(max_context_length=8192, max_length=1024, tools_max_temperature=0.7)
    assert violated_chat_limit(limits, tools_temperature=0.7) is None
    assert violated_chat_limit(limits, tools_temperature=0.8) == "tools_max_temperature"
    unlimited = ChatLimits(max_context_length=8192, max_length=1024)
    assert violated_chat_limit(unlimited, tools_temperature=2.0) is None
    assert violated_chat_limit(limits, max_length=2048) == "max_length"
    assert violated_chat_limit(limits, max_context_length=16384) == "max_context_length"


def declaration(features=(), transports=(), tools_max_temperature=None):
    return ChatDeclaration(
        chat_jobs=True,
        chat_features=frozenset(features),
        chat_limits=ChatLimits(4096, 1024, tools_max_temperature),
        model_id="llama-3",
        image_transports=frozenset(transports),
    )


def test_service_gap():
    request = body(tools=[WEATHER_TOOL], tool_choice="required", temperature=1.5)
    requirements = chat_request_requirements(request)
    full = declaration(["tools", "tool_choice_enforced", "prompt_overflow_refused"])
    assert chat_service_gap(requirements, full, max_context_length=4096, max_length=1024).empty
    gap = chat_service_gap(requirements, declaration(["tools"], tools_max_temperature=1.0), max_length=2048)
    assert gap == ChatServiceGap(
        ("prompt_overflow_refused", "tool_choice_enforced"), ("max_length", "tools_max_temperature")
    )
    assert gap.impossible_reason() == {
        "kind": "declaration_gap",
        "missing_declarations": ["prompt_overflow_refused", "tool_choice_enforced"],
        "exceeded_limits": ["max_length", "tools_max_temperature"],
    }


def test_vision_gap_names_image_transports_for_a_worker_without_one():
    requirements = chat_request_requirements(
        body(messages=[{"role": "user", "content": [IMAGE_PART]}], horde={"conformance": "best_effort"})
    )
    assert chat_service_gap(requirements, declaration(["vision"])).missing_declarations == (
        "image_transports",
    )
    assert chat_service_gap(requirements, declaration(["vision"], ["messages_url"])).missing_declarations == (
        "image_transports",
    )
    assert chat_service_gap(requirements, declaration(["vision"], ["base64"])).empty
    assert chat_service_gap(requirements, declaration()).missing_declarations == ("vision",)


def test_merge_service_gaps():
    merged = merge_service_gaps(
        [ChatServiceGap(("vision",), ("max_length",)), ChatServiceGap(("tools",), ("max_context_length",))]
    )
    assert merged == ChatServiceGap(("tools", "vision"), ("max_context_length", "max_length"))


# --- tool history -----------------------------------------------------------------------------

USER = {"role": "user", "content": "weather?"}


def history_refusal(messages) -> ChatRefusal:
    with pytest.raises(ChatRefusal) as info:
        check_tool_history(messages)
    assert info.value.status == 400
    assert info.value.rc == "UnsupportedChatParameter"
    return info.value


def test_valid_histories_pass():
    check_tool_history([USER])
    check_tool_history(
        [
            USER,
            {"role": "assistant", "tool_calls": [tool_call("a"), tool_call("b")]},
            {"role": "tool", "tool_call_id": "b", "content": "1"},
            {"role": "tool", "tool_call_id": "a", "content": "2"},
            {"role": "assistant", "tool_calls": [tool_call("a")]},  # an id may recur later
            {"role": "tool", "tool_call_id": "a", "content": "3"},
            {"role": "assistant", "content": "done"},
        ]
    )


def test_unanswered_calls_before_another_message():
    refusal = history_refusal(
        [
            USER,
            {"role": "assistant", "tool_calls": [tool_call("a"), tool_call("b")]},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            USER,
        ]
    )
    assert refusal.param == "messages[3].role"
    assert refusal.text == (
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        "'tool_call_id'. The following tool_call_ids did not have response messages: b"
    )
    assert refusal.message == f"'messages[3].role': {refusal.text}"


def test_history_ending_with_unanswered_calls():
    refusal = history_refusal([USER, {"role": "assistant", "tool_calls": [tool_call("a"), tool_call("b")]}])
    assert refusal.param == "messages"
    assert refusal.text.endswith("did not have response messages: a, b")


@pytest.mark.parametrize(
    "messages",
    [
        [USER, {"role": "tool", "tool_call_id": "a", "content": "1"}],
        [
            USER,
            {"role": "assistant", "tool_calls": [tool_call("a"), tool_call("b")]},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "tool", "tool_call_id": "a", "content": "again"},
        ],
        [
            USER,
            {"role": "assistant", "tool_calls": [tool_call("a")]},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "tool", "tool_call_id": "z", "content": "none open"},
        ],
    ],
)
def test_tool_message_without_open_call(messages):
    refusal = history_refusal(messages)
    assert refusal.param == f"messages[{len(messages) - 1}].role"
    assert refusal.text == (
        "Invalid parameter: messages with role 'tool' must be a response to a preceding message with "
        "'tool_calls'."
    )


def test_tool_message_answering_an_unknown_id():
    refusal = history_refusal(
        [
            USER,
            {"role": "assistant", "tool_calls": [tool_call("a")]},
            {"role": "tool", "tool_call_id": "zz", "content": "1"},
        ]
    )
    assert refusal.param == "messages[2].tool_call_id"
    assert (
        refusal.text
        == "Invalid parameter: 'tool_call_id' of 'zz' not found in 'tool_calls' of previous message."
    )
    assert param_from_native_message(refusal.message) == "messages[2].tool_call_id"


def test_repeated_id_within_one_assistant_message():
    refusal = history_refusal([USER, {"role": "assistant", "tool_calls": [tool_call("a"), tool_call("a")]}])
    assert refusal.param == "messages[1].tool_calls"
    assert "'a'" in refusal.text


# --- schemas ------------------------------------------------------------------------------------


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def test_schema_nesting():
    assert not schema_nesting_exceeds(nested(10))  # the root plus 10 levels below it
    assert schema_nesting_exceeds(nested(11))
    assert not schema_nesting_exceeds({"type": "array", "items": {"anyOf": [{"type": "string"}]}})
    assert not schema_nesting_exceeds("not a schema")


def test_strict_schema_rules_with_openai_messages():
    ok = {
        "type": "object",
        "additionalProperties": False,
        "required": ["shade"],
        "properties": {"shade": {"type": "string", "minimum": 1}},
    }
    assert strict_schema_violation(ok, kind="response_format", name="colour") is None
    nested_open = {
        "type": "object",
        "additionalProperties": False,
        "required": ["shade"],
        "properties": {"shade": {"type": "object", "properties": {}}},
    }
    assert strict_schema_violation(nested_open, kind="response_format", name="colour") == (
        "Invalid schema for response_format 'colour': In context=('properties', 'shade'), "
        "'additionalProperties' is required to be supplied and to be false."
    )
    assert strict_schema_violation({"type": "object"}, kind="function", name="get_weather") == (
        "Invalid schema for function 'get_weather': In context=(), 'additionalProperties' is required to be "
        "supplied and to be false."
    )
    missing_required = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"a": {}, "b": {}},
        "required": ["a"],
    }
    assert strict_schema_violation(missing_required, kind="function", name="f") == (
        "Invalid schema for function 'f': In context=(), 'required' is required to be supplied and to be an "
        "array including every key in properties. Missing 'b'."
    )
    in_defs = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "required": ["p"],
        "$defs": {"P": {"type": "object"}},
    }
    assert "In context=('$defs', 'P')" in strict_schema_violation(in_defs, kind="function", name="f")
    in_any_of = {"anyOf": [{"type": "string"}, {"type": "object"}]}
    assert "In context=('anyOf', '1')" in strict_schema_violation(in_any_of, kind="function", name="f")
    in_items = {"type": "array", "items": {"type": "object", "additionalProperties": True}}
    assert "In context=('items',)" in strict_schema_violation(in_items, kind="function", name="f")


# --- kudos cap ----------------------------------------------------------------------------------


def test_kudos_cap_message_round_trips_through_the_pattern():
    message = kudos_cap_message(42.5, 10)
    assert message == "The request's kudos estimate of 42.5 exceeds its max_kudos of 10 at current pricing."
    assert parse_kudos_cap_message(message) == (42.5, 10)
    assert parse_kudos_cap_message(kudos_cap_message(12.0, 3)) == (12.0, 3)
    assert KUDOS_CAP_EXCESS_PATTERN.search(message).group("max_kudos") == "10"
    assert parse_kudos_cap_message("something else") is None


# --- one derivation -----------------------------------------------------------------------------

PROJECT = Path(__file__).resolve().parents[2]
DERIVATION = re.compile(r"^def (required_chat_features|chat_request_requirements|_required_features)\b", re.M)


def test_exactly_one_derivation_of_required_features():
    """Every caller (native route, front, worker) uses chat_policy's derivation; none defines its own."""
    defining = sorted(
        str(path.relative_to(PROJECT))
        for path in PROJECT.rglob("*.py")
        if ".venv" not in path.parts and "tests" not in path.parts and DERIVATION.search(path.read_text())
    )
    assert defining == ["contract/chat_policy.py"]
    source = (PROJECT / "contract/chat_policy.py").read_text()
    assert len(DERIVATION.findall(source)) == 3  # the derivation and its two thin readers
