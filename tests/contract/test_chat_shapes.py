import base64
import uuid

import pytest

from contract.chat_limits import (
    MAX_CHAT_IMAGE_COUNT,
    MAX_CHAT_MESSAGE_COUNT,
    MAX_CHAT_TEXT_BYTES,
    MAX_CHAT_TOOL_COUNT,
    MAX_CHAT_TOOL_SPEC_BYTES,
)
from contract.chat_shapes import (
    ChatContextFit,
    ChatHordeOptions,
    ChatReasoningEffort,
    data_url_decoded_size,
    validate_chat_request,
)

from .helpers import WEATHER_TOOL, body, refuse, tool_call

USER = {"role": "user", "content": "hi"}


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def data_url(decoded_bytes: int) -> str:
    return "data:image/png;base64," + base64.b64encode(b"\0" * decoded_bytes).decode()


def image_message(*urls: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]}


def test_valid_request_and_its_mapping():
    request = validate_chat_request(
        body(
            models=None,
            model="llama-3",
            max_completion_tokens=300,
            stop="END",
            messages=[{"role": "developer", "content": "be brief"}, USER],
            horde={"operation_key": str(uuid.uuid4()), "context_fit": "grow"},
        )
    )
    assert request.model_list == ["llama-3"]
    assert request.max_length == 300
    assert request.stop_sequence == ["END"]
    assert request.horde.context_fit is ChatContextFit.GROW
    assert request.stored_messages()[0] == {"role": "system", "content": "be brief"}


def test_defaults():
    request = validate_chat_request(body())
    assert request.max_length == 512
    assert request.horde == ChatHordeOptions()
    assert request.horde.context_fit == "truncate_oldest"
    assert request.horde.conformance == "strict"
    assert request.horde.slow_workers is True and request.horde.include_reasoning is True
    assert request.horde.availability_mode == "wait"


def test_worker_lists_hold_worker_ids():
    worker_id = uuid.uuid4()
    request = validate_chat_request(body(horde={"ignore": [str(worker_id).upper()]}))
    assert request.horde.ignore == [worker_id]
    assert request.horde.model_dump(mode="json")["ignore"] == [str(worker_id)]


def test_assistant_content_absent_is_stored_as_null():
    request = validate_chat_request(
        body(
            messages=[
                USER,
                {"role": "assistant", "tool_calls": [tool_call("a")]},
                {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "sunny"}]},
            ],
            tools=[WEATHER_TOOL],
        )
    )
    assert request.stored_messages()[1] == {
        "role": "assistant",
        "tool_calls": [tool_call("a")],
        "content": None,
    }


def test_nulls_count_as_omitted():
    request = validate_chat_request(
        body(tools=None, tool_choice=None, parallel_tool_calls=None, response_format=None, seed=None)
    )
    assert request.tools is None


def test_reasoning_effort_values():
    assert [e.value for e in ChatReasoningEffort] == ["none", "minimal", "low", "medium", "high", "xhigh"]
    for effort in ChatReasoningEffort:
        validate_chat_request(body(reasoning_effort=effort.value))


def test_every_model_entry_and_tools_at_their_caps_pass():
    validate_chat_request(body(model=None, models=["a", "b", "c", "d", "e"]))
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(MAX_CHAT_TOOL_COUNT)]
    validate_chat_request(body(tools=tools))
    validate_chat_request(body(tools=[{"type": "function", "function": {"name": "x" * 64}}]))
    validate_chat_request(
        body(tools=[{"type": "function", "function": {"name": "f", "parameters": nested(10)}}])
    )


TOOL_CHOICE_WITHOUT_TOOLS = (
    "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified."
)
PARALLEL_WITHOUT_TOOLS = "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when 'tools' are specified."
STRICT_COLOUR = {
    "type": "json_schema",
    "json_schema": {
        "name": "colour",
        "strict": True,
        "schema": {
            "type": "object",
            "additionalProperties": False,
            "required": ["shade"],
            "properties": {"shade": {"type": "object", "properties": {}}},
        },
    },
}

REFUSALS = [
    # (overrides, status, rc, param, exact text or None)
    (
        {"logprobs": True},
        400,
        "UnsupportedChatParameter",
        "logprobs",
        "Unrecognized request argument supplied: logprobs",
    ),
    ({"logit_bias": {}}, 400, "UnsupportedChatParameter", "logit_bias", None),
    ({"modalities": ["text"]}, 400, "UnsupportedChatParameter", "modalities", None),
    ({"top_k": 40}, 400, "UnsupportedChatParameter", "top_k", None),
    (
        {"horde": {"models": ["x"]}},
        400,
        "UnsupportedChatParameter",
        "horde.models",
        "Unknown parameter: 'horde.models'.",
    ),
    ({"horde": {"only": ["w1"], "ignore": ["w2"]}}, 400, "ChatRequestConflict", "horde.ignore", None),
    ({"horde": {"context_fit": "ignore"}}, 400, "BadRequest", "horde.context_fit", None),
    ({"horde": {"operation_key": "not-a-uuid"}}, 400, "BadRequest", "horde.operation_key", None),
    ({"horde": {"dry_run": "yes"}}, 400, "BadRequest", "horde.dry_run", None),
    ({"horde": {"only": []}}, 400, "BadRequest", "horde.only", None),
    # only and ignore hold worker ids: a worker's name is refused, never dropped
    (
        {"horde": {"ignore": ["alice-worker"]}},
        400,
        "BadRequest",
        "horde.ignore[0]",
        "Invalid value for 'horde.ignore[0]': 'alice-worker' is not a worker id: workers are named by their id (a UUID).",
    ),
    ({"horde": {"only": [str(uuid.uuid4()), "bob"]}}, 400, "BadRequest", "horde.only[1]", None),
    ({"horde": {"only": [5]}}, 400, "BadRequest", "horde.only[0]", None),
    ({"horde": {"ignore": [""]}}, 400, "BadRequest", "horde.ignore[0]", None),
    ({"horde": {"max_kudos": 0}}, 400, "BadRequest", "horde.max_kudos", None),
    ({"horde": "strict"}, 400, "BadRequest", "horde", None),
    ({"models": ["a"]}, 400, "ChatRequestConflict", "models", None),
    ({"model": None}, 400, "BadRequest", "model", None),
    ({"model": None, "models": []}, 400, "BadRequest", "models", None),
    ({"model": None, "models": ["a", ""]}, 400, "BadRequest", "models[1]", None),
    ({"model": None, "models": ["a", "b", "a"]}, 400, "BadRequest", "models[2]", "'models' lists 'a' twice."),
    ({"model": None, "models": ["a", "b", "c", "d", "e", "f"]}, 400, "BadRequest", "models", None),
    ({"model": 3}, 400, "BadRequest", "model", None),
    ({"messages": []}, 400, "BadRequest", "messages", None),
    ({"messages": None}, 400, "BadRequest", "messages", None),
    ({"messages": [USER] * (MAX_CHAT_MESSAGE_COUNT + 1)}, 400, "UnsupportedChatParameter", "messages", None),
    (
        {"messages": [{"role": "user", "content": "x" * (MAX_CHAT_TEXT_BYTES + 1)}]},
        400,
        "UnsupportedChatParameter",
        "messages",
        None,
    ),
    (
        {"messages": [{"role": "function", "content": "x"}]},
        400,
        "UnsupportedChatParameter",
        "messages[0].role",
        None,
    ),
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": [tool_call("a")]}]},
        400,
        "UnsupportedChatParameter",
        "messages[0].tool_calls",
        None,
    ),
    (
        {
            "messages": [
                USER,
                {"role": "assistant", "tool_calls": [tool_call("a")]},
                {"role": "tool", "tool_call_id": "a", "content": "x", "name": "n"},
            ]
        },
        400,
        "UnsupportedChatParameter",
        "messages[2].name",
        None,
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]},
        400,
        "UnsupportedChatParameter",
        "messages[0].content[1].type",
        None,
    ),
    (
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
                },
            ]
        },
        400,
        "UnsupportedChatParameter",
        "messages[1].content[0].type",
        None,
    ),
    ({"messages": [{"role": "user"}]}, 400, "BadRequest", "messages[0].content", None),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "BadRequest", "messages[0].content", None),
    ({"messages": [USER, {"role": "assistant"}]}, 400, "BadRequest", "messages[1].content", None),
    (
        {"messages": [USER, {"role": "tool", "content": "x"}]},
        400,
        "BadRequest",
        "messages[1].tool_call_id",
        None,
    ),
    (
        {
            "messages": [
                USER,
                {"role": "assistant", "tool_calls": [tool_call("a")]},
                {"role": "tool", "content": "x", "tool_call_id": "a" * 257},
            ]
        },
        400,
        "UnsupportedChatParameter",
        "messages[2].tool_call_id",
        None,
    ),
    (
        {"messages": [USER, {"role": "assistant", "tool_calls": [tool_call(str(i)) for i in range(129)]}]},
        400,
        "UnsupportedChatParameter",
        "messages[1].tool_calls",
        None,
    ),
    ({"n": 2}, 400, "UnsupportedChatParameter", "n", None),
    ({"n": "1"}, 400, "BadRequest", "n", None),
    (
        {"max_tokens": 100, "max_completion_tokens": 200},
        400,
        "ChatRequestConflict",
        "max_completion_tokens",
        None,
    ),
    ({"max_tokens": 15}, 400, "BadRequest", "max_tokens", None),
    ({"max_tokens": 16385}, 400, "BadRequest", "max_tokens", None),
    ({"max_tokens": "512"}, 400, "BadRequest", "max_tokens", None),
    ({"temperature": "hot"}, 400, "BadRequest", "temperature", None),
    ({"presence_penalty": 2.5}, 400, "BadRequest", "presence_penalty", None),
    ({"reasoning_effort": "extreme"}, 400, "BadRequest", "reasoning_effort", None),
    ({"reasoning_effort": 1}, 400, "BadRequest", "reasoning_effort", None),
    ({"stop": ["a", 1]}, 400, "BadRequest", "stop", None),
    ({"tool_choice": "auto"}, 400, "ChatRequestConflict", "tool_choice", TOOL_CHOICE_WITHOUT_TOOLS),
    (
        {"tool_choice": "none", "tools": []},
        400,
        "ChatRequestConflict",
        "tool_choice",
        TOOL_CHOICE_WITHOUT_TOOLS,
    ),
    (
        {"parallel_tool_calls": False},
        400,
        "ChatRequestConflict",
        "parallel_tool_calls",
        PARALLEL_WITHOUT_TOOLS,
    ),
    (
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
        400,
        "ChatRequestConflict",
        "tool_choice",
        None,
    ),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, 400, "BadRequest", "tool_choice", None),
    ({"tools": [WEATHER_TOOL] * (MAX_CHAT_TOOL_COUNT + 1)}, 400, "UnsupportedChatParameter", "tools", None),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "description": "x" * MAX_CHAT_TOOL_SPEC_BYTES}}
            ]
        },
        400,
        "UnsupportedChatParameter",
        "tools",
        None,
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
        400,
        "BadRequest",
        "tools[0].function.name",
        None,
    ),
    # `$` alone would let a name end in a newline through; the whole name has to match.
    ({"tools": [{"type": "function", "function": {"name": "get_weather\n"}}]}, 400, "BadRequest", "tools[0].function.name", None),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, 400, "BadRequest", "tools[0].function.name", None),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "reply\n", "schema": {"type": "object"}}}},
        400,
        "BadRequest",
        "response_format.json_schema.name",
        None,
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(11)}}]},
        400,
        "UnsupportedChatParameter",
        "tools[0].function.parameters",
        None,
    ),
    ({"tools": [{"type": "custom", "custom": {}}]}, 400, "UnsupportedChatParameter", "tools[0].custom", None),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "strict": True, "parameters": {"type": "object"}},
                }
            ]
        },
        400,
        "UnsupportedChatParameter",
        "tools[0].function.parameters",
        "Invalid schema for function 'get_weather': In context=(), 'additionalProperties' is required to be supplied and to be false.",
    ),
    (
        {"response_format": STRICT_COLOUR},
        400,
        "UnsupportedChatParameter",
        "response_format.json_schema.schema",
        "Invalid schema for response_format 'colour': In context=('properties', 'shade'), 'additionalProperties' is required to be supplied and to be false.",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": nested(11)}}},
        400,
        "UnsupportedChatParameter",
        "response_format.json_schema.schema",
        None,
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "c"}}},
        400,
        "BadRequest",
        "response_format.json_schema.schema",
        None,
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema_": {}}}},
        400,
        "UnsupportedChatParameter",
        "response_format.json_schema.schema_",
        None,
    ),
    ({"response_format": {"type": "grammar"}}, 400, "UnsupportedChatParameter", "response_format.type", None),
    (
        {"response_format": {"type": "json_object"}, "horde": {"openai_guards": True}},
        400,
        "ChatRequestConflict",
        "messages",
        "'messages' must contain the word 'json' in some form, to use 'response_format' of type 'json_object'.",
    ),
    (
        {"messages": [image_message(*["https://example.com/a.png"] * (MAX_CHAT_IMAGE_COUNT + 1))]},
        400,
        "TooManyExtraSourceImages",
        "messages",
        None,
    ),
    (
        {"messages": [image_message(data_url(5 * 1024 * 1024 + 3))]},
        400,
        "SourceImageSizeExceeded",
        "messages[0].content[0].image_url.url",
        None,
    ),
    (
        {"messages": [image_message(*[data_url(5 * 1024 * 1024)] * 5 + [data_url(3)])]},
        400,
        "SourceImageSizeExceeded",
        "messages",
        None,
    ),
    (
        {"messages": [image_message("ftp://example.com/a.png")]},
        400,
        "BadRequest",
        "messages[0].content[0].image_url.url",
        None,
    ),
]


@pytest.mark.parametrize(("overrides", "status", "rc", "param", "text"), REFUSALS)
def test_refusals(overrides, status, rc, param, text):
    refusal = refuse(body(**overrides))
    assert (refusal.status, refusal.rc, refusal.param) == (status, rc, param)
    if text is not None:
        assert refusal.text == text
    # The native message starts with the quoted path, so a caller recovers the param from it.
    assert refusal.message == f"'{param}': {refusal.text}"
    assert refusal.body() == {"message": refusal.message, "rc": rc}


def test_unsupported_key_messages_hold_the_key():
    assert "prediction" in refuse(body(prediction={})).message
    assert "messages[0].role=function" in refuse(body(messages=[{"role": "function", "content": "x"}])).text
    refusal = refuse(body(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]))
    assert "messages[0].content[0].type=input_audio" in refusal.text


def test_history_is_checked_on_the_body():
    refusal = refuse(
        body(
            tools=[WEATHER_TOOL],
            messages=[
                USER,
                {"role": "assistant", "tool_calls": [tool_call("a")]},
                {"role": "tool", "tool_call_id": "b", "content": "x"},
            ],
        )
    )
    assert (refusal.rc, refusal.param) == ("UnsupportedChatParameter", "messages[2].tool_call_id")
    assert refusal.message == (
        "'messages[2].tool_call_id': Invalid parameter: 'tool_call_id' of 'b' not found in 'tool_calls' "
        "of previous message."
    )


def test_image_totals_at_parse():
    at_cap = [data_url(5 * 1024 * 1024)] * 5  # 25 MiB, the total cap
    request = validate_chat_request(body(messages=[image_message(*at_cap)]))
    assert request.requirements().has_images
    refusal = refuse(body(messages=[image_message(*at_cap, data_url(3))]))
    assert str(25 * 1024 * 1024 + 3) in refusal.text and str(25 * 1024 * 1024) in refusal.text


def test_data_url_size_estimate():
    for size in (0, 1, 2, 3, 100, 1001):
        assert data_url_decoded_size(data_url(size)) == size


def test_openai_guards_pass_with_json_mentioned():
    validate_chat_request(
        body(
            response_format={"type": "json_object"},
            horde={"openai_guards": True},
            messages=[{"role": "user", "content": [{"type": "text", "text": "Answer in JSON"}]}],
        )
    )
    # Without the guard the Horde serves it.
    validate_chat_request(body(response_format={"type": "json_object"}))


def test_body_that_is_not_an_object():
    refusal = refuse(["not", "an", "object"])
    assert (refusal.status, refusal.rc, refusal.param) == (400, "BadRequest", None)
