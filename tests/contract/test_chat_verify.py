import pytest

from contract.chat_errors import ChatRefusal
from contract.chat_verify import (
    SCHEMA_CANNOT_COMPILE_MESSAGE,
    chat_output_tokens,
    chat_reply_characters,
    is_chat_submit,
    parse_chat_submit,
    verify_chat_reply,
)

from .helpers import tool_call

TOOLS = [
    {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "get_time"}},
]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
COLOUR_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["shade"],
    "properties": {"shade": {"type": "string"}},
}


def reply(content="", calls=None):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def outcome(message, extras, conformance="strict", finish="stop"):
    """(rc or None) under the conformance mode."""
    try:
        verify_chat_reply(message, finish, extras=extras, conformance=conformance)
    except ChatRefusal as refusal:
        assert refusal.status == 400
        return refusal.rc
    return None


def schema_format(schema, strict=True):
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": schema, "strict": strict},
        }
    }


@pytest.mark.parametrize(
    ("message", "extras", "strict_rc", "best_effort_rc"),
    [
        (reply(None, [tool_call("a", "launch")]), {"tools": TOOLS}, "ChatSubmitInvalid", "ChatSubmitInvalid"),
        (reply(None, [tool_call("a")]), None, "ChatSubmitInvalid", "ChatSubmitInvalid"),
        (
            reply(None, [tool_call("a"), tool_call("a", "get_time")]),
            {"tools": TOOLS},
            "ChatSubmitInvalid",
            "ChatSubmitInvalid",
        ),
        (
            reply(None, [tool_call("a")]),
            {"tools": TOOLS, "tool_choice": "none"},
            "ChatSubmitNonconformant",
            None,
        ),
        (reply("text"), {"tools": TOOLS, "tool_choice": "required"}, "ChatSubmitNonconformant", None),
        (reply("text"), {"tools": TOOLS, "tool_choice": FORCED}, "ChatSubmitNonconformant", None),
        (
            reply(None, [tool_call("a", "get_time")]),
            {"tools": TOOLS, "tool_choice": FORCED},
            "ChatSubmitNonconformant",
            None,
        ),
        (reply(None, [tool_call("a")]), {"tools": TOOLS, "tool_choice": FORCED}, None, None),
        (reply("text"), {"tools": TOOLS}, None, None),
        (reply("[1, 2]"), {"response_format": {"type": "json_object"}}, "ChatSubmitNonconformant", None),
        (reply("not json"), {"response_format": {"type": "json_object"}}, "ChatSubmitNonconformant", None),
        (reply('{"a": NaN}'), {"response_format": {"type": "json_object"}}, "ChatSubmitNonconformant", None),
        (reply('{"a": 1}'), {"response_format": {"type": "json_object"}}, None, None),
        (reply('{"shade": 3}'), schema_format(COLOUR_SCHEMA, strict=False), None, None),
        (reply("[]"), schema_format(COLOUR_SCHEMA, strict=False), "ChatSubmitNonconformant", None),
        (reply('{"shade": 3}'), schema_format(COLOUR_SCHEMA), "ChatSubmitNonconformant", None),
        (reply('{"shade": "teal"}'), schema_format(COLOUR_SCHEMA), None, None),
        # A tool call reply with empty content is exempt from the response format.
        (
            reply("", [tool_call("a")]),
            {"tools": TOOLS, "response_format": {"type": "json_object"}},
            None,
            None,
        ),
        (reply(None, [tool_call("a")]), {"tools": TOOLS, **schema_format(COLOUR_SCHEMA)}, None, None),
    ],
)
def test_verification_table(message, extras, strict_rc, best_effort_rc):
    assert outcome(message, extras, "strict") == strict_rc
    assert outcome(message, extras, "best_effort") == best_effort_rc


def test_single_call_reduction_under_strict_only():
    message = reply(None, [tool_call("a"), tool_call("b", "get_time"), tool_call("a", "launch")])
    extras = {"tools": TOOLS, "parallel_tool_calls": False}
    verified = verify_chat_reply(message, "tool_calls", extras=extras, conformance="strict")
    # The reduction runs first, so the dropped calls (a duplicate id, an unknown function) are not checked.
    assert verified.message["tool_calls"] == [tool_call("a")]
    assert verified.dropped_tool_calls == 2
    assert verified.finish_reason == "tool_calls"
    both = reply(None, [tool_call("a"), tool_call("b", "get_time")])
    kept = verify_chat_reply(both, "tool_calls", extras=extras, conformance="best_effort")
    assert len(kept.message["tool_calls"]) == 2 and kept.dropped_tool_calls == 0


def test_forced_function_finishes_with_stop():
    extras = {"tools": TOOLS, "tool_choice": FORCED}
    for conformance in ("strict", "best_effort"):
        verified = verify_chat_reply(
            reply(None, [tool_call("a")]), "tool_calls", extras=extras, conformance=conformance
        )
        assert verified.finish_reason == "stop"
    assert (
        verify_chat_reply(reply(None, [tool_call("a")]), "tool_calls", extras={"tools": TOOLS}).finish_reason
        == "tool_calls"
    )


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]},
        {"$ref": "https://json-schema.org/draft/2020-12/schema"},
        {"$ref": "https://example.com/remote.json"},
        {"type": 12},
        # The reply never reaches the broken reference; the schema is refused all the same.
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}, "b": {"type": "integer"}}},
        {"$id": "https://ex.com/root.json", "properties": {"a": {"$ref": "other.json#/$defs/n"}}},
    ],
)
def test_uncompilable_schema_refuses_the_reply(schema):
    with pytest.raises(ChatRefusal) as info:
        verify_chat_reply(reply('{"b": 1}'), "stop", extras=schema_format(schema))
    assert (info.value.rc, info.value.text) == ("ChatSubmitNonconformant", SCHEMA_CANNOT_COMPILE_MESSAGE)


def test_schema_draft_follows_its_dollar_schema():
    # Draft 4's exclusiveMaximum is a boolean; under 2020-12 it would not compile.
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "number",
        "maximum": 5,
        "exclusiveMaximum": True,
    }
    assert outcome(reply("4"), schema_format(draft4)) is None
    assert outcome(reply("5"), schema_format(draft4)) == "ChatSubmitNonconformant"
    local_ref = {
        "$defs": {"s": {"type": "string"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/s"}},
    }
    assert outcome(reply('{"a": "x"}'), schema_format(local_ref)) is None
    assert outcome(reply('{"a": 1}'), schema_format(local_ref)) == "ChatSubmitNonconformant"
    # A reference through the schema's own $id, or a nested $id's base, stays inside the schema.
    by_id = {
        "$id": "https://ex.com/root.json",
        "$defs": {"n": {"type": "number"}},
        "properties": {
            "a": {"$ref": "root.json#/$defs/n"},
            "b": {"$id": "sub/b.json", "$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s"},
        },
    }
    assert outcome(reply('{"a": 1, "b": "x"}'), schema_format(by_id)) is None
    assert outcome(reply('{"a": "x"}'), schema_format(by_id)) == "ChatSubmitNonconformant"
    assert outcome(reply('{"b": 2}'), schema_format(by_id)) == "ChatSubmitNonconformant"


# --- structured submit ----------------------------------------------------------------------------


def submit(**fields):
    data = {"id": "g1", "model_id": "llama-3", "message": reply("hello"), "finish_reason": "stop"}
    data.update(fields)
    return {k: v for k, v in data.items() if v is not ...}


def test_chat_submit_detection():
    assert is_chat_submit({"id": "g", "model_id": "m"})
    assert is_chat_submit({"id": "g", "fault_reason": "x"})
    assert not is_chat_submit({"id": "g", "generation": "text"})


def test_parse_submit():
    parsed = parse_chat_submit(
        submit(
            message={
                "role": "assistant",
                "content": None,
                "tool_calls": [tool_call("a")],
                "reasoning_content": "hmm",
            },
            finish_reason="tool_calls",
            native_finish_reason="eos",
            prompt_tokens=10,
            completion_tokens=0,
        )
    )
    assert parsed.message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [tool_call("a")],
        "reasoning_content": "hmm",
    }
    assert parsed.finish_reason == "tool_calls"
    assert (parsed.prompt_tokens, parsed.completion_tokens, parsed.reasoning_tokens) == (10, 0, None)
    assert parse_chat_submit(submit(message=reply(""))).message == {"role": "assistant", "content": ""}


def test_faulted_submit_needs_no_message():
    parsed = parse_chat_submit(
        {"id": "g", "state": "faulted", "model_id": "llama-3", "fault_reason": "prompt_overflow"}
    )
    assert (parsed.state, parsed.message, parsed.fault_reason) == ("faulted", None, "prompt_overflow")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"message": ...}, "message"),
        ({"finish_reason": ...}, "finish_reason"),
        ({"finish_reason": "eos"}, "finish_reason"),
        ({"finish_reason": "tool_calls"}, "finish_reason"),
        ({"message": {"role": "assistant", "content": None}}, "message.content"),
        ({"message": {"role": "user", "content": "x"}}, "message.role"),
        ({"message": {"role": "assistant", "content": "x", "tool_calls": []}}, "message.tool_calls"),
        ({"message": {"role": "assistant", "content": "x", "extra": 1}}, "message.extra"),
        (
            {"message": {"role": "assistant", "content": "x", "reasoning_content": "r" * (1024 * 1024 + 1)}},
            "message.reasoning_content",
        ),
        ({"generation": "text"}, "generation"),
        ({"model_id": ...}, "model_id"),
        ({"native_finish_reason": "x" * 33}, "native_finish_reason"),
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"completion_tokens": 10_000_001}, "completion_tokens"),
        ({"state": "great"}, "state"),
    ],
)
def test_invalid_submits(fields, param):
    with pytest.raises(ChatRefusal) as info:
        parse_chat_submit(submit(**fields))
    assert (info.value.status, info.value.rc, info.value.param) == (400, "ChatSubmitInvalid", param)


def test_reply_characters_and_output_tokens():
    message = {
        "role": "assistant",
        "content": "abcd",
        "reasoning_content": "ef",
        "tool_calls": [tool_call("x", "fn", "{}")],
    }
    assert chat_reply_characters(message) == 4 + 2 + 2 + 2
    assert chat_output_tokens(0, 512) == 20  # the text kudos minimum
    assert chat_output_tokens(401, 512) == 101  # rounded up
    assert chat_output_tokens(10_000, 512) == 512  # at most the requested max_length
