"""The request side of the chat route: the OpenAI request model, its screening and the native body
(spec: chat_front.md, Request keys and Message roles). Of the front it imports only the reply side's
error envelope (oai.errors).

A body goes through three screening steps before validation: `find_refused_parameter` refuses an
unknown top-level key, a no-op key holding another value than its default, an unserved role or
content part type, and tool_calls off an assistant message; `drop_default_no_ops` drops the no-op
keys at their default; `drop_unknown_nested_keys` drops the unserved keys inside messages, tools and
tool_choice (as OpenAI ignores them, e.g. the fields the SDK adds when it replays a streamed reply).
`screen_request` then applies the front's own bounds, builds the native body
(`build_native_chat_body`) and validates it with the contract.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, TypeGuard

from pydantic import BaseModel, ConfigDict

from contract.chat_errors import ChatRefusal
from contract.chat_limits import (
    MAX_CHAT_MODEL_COUNT,
    MAX_CHAT_STOP_SEQUENCES,
    MIN_CHAT_MAX_TOKENS,
    OPENAI_SAMPLING_RANGES,
)
from contract.chat_shapes import (
    CHAT_REQUEST_KEYS,
    CONTENT_PART_TYPES,
    SUPPORTED_MESSAGE_KEYS,
    ChatReasoningEffort,
    ChatRequest,
    lone_surrogate_path,
    validate_chat_request,
)
from contract.strict_json import loads_strict
from oai.errors import ChatFrontError
from oai.mapping import estimate_prompt_tokens

# Keys the front validates and forwards, or applies itself (stream, stream_options, user, metadata):
# the native route's keys, one list in the contract.
REQUEST_FIELDS = CHAT_REQUEST_KEYS
# Keys accepted only at their default, then dropped: key -> the default values. logit_bias {} is
# what SillyTavern's custom chat source always sends (as on /v1/completions, ADR 0014).
DEFAULT_NO_OP_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,),
    "top_logprobs": (0,),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "logit_bias": ({},),
}
# Applied or accepted by the front, never forwarded.
FRONT_ONLY_KEYS = ("stream", "stream_options", "user", "metadata")
# OpenRouter's reasoning object, translated into the native keys by map_reasoning (ADR 0087).
REASONING_KEYS = frozenset({"effort", "max_tokens", "exclude", "enabled"})

TOOL_CALL_KEYS = frozenset({"id", "type", "function"})
TOOL_CALL_FUNCTION_KEYS = frozenset({"name", "arguments"})
TEXT_PART_KEYS = frozenset({"type", "text"})
IMAGE_PART_KEYS = frozenset({"type", "image_url"})
IMAGE_URL_KEYS = frozenset({"url", "detail"})
TOOL_KEYS = frozenset({"type", "function"})
TOOL_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
TOOL_CHOICE_KEYS = frozenset({"type", "function"})
TOOL_CHOICE_FUNCTION_KEYS = frozenset({"name"})
# OpenAI's stream_options. include_obfuscation asks for OpenAI's random padding field on each chunk
# (on by default there); the front never pads, so it is typed and otherwise not applied.
STREAM_OPTIONS_KEYS = frozenset({"include_usage", "include_obfuscation"})


def _unsupported(param: str, message: str) -> ChatFrontError:
    return ChatFrontError(400, "UnsupportedChatParameter", message, param=param, should_retry=False)


def _bad(param: str | None, message: str) -> ChatFrontError:
    return ChatFrontError(400, "BadRequest", message, param=param, should_retry=False)


def parse_body(raw: bytes) -> Any:
    """JSON, with NaN, Infinity and -Infinity refused (Python's parser accepts them, and reads a
    number past a float's range as infinity), and a lone surrogate (JSON's "\\ud800" escape)
    refused wherever it is: no UTF-8 text, this front's own answers included, can carry one."""
    try:
        body = loads_strict(raw)
    except (ValueError, RecursionError) as error:
        raise _bad(None, f"We could not parse the JSON body of your request: {error}") from None
    # An escape makes one, or a UTF-16/32 body (json.loads decodes it with surrogatepass; it is
    # told by a BOM or a NUL in the first bytes); the UTF-8 decoder refuses an encoded one, so most
    # bodies skip the walk.
    if b"\\u" in raw or b"\x00" in raw[:4] or raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        surrogate_at = lone_surrogate_path(body)
        if surrogate_at is not None:
            raise _bad(
                surrogate_at or None,
                f"Invalid value for '{surrogate_at or 'body'}': the text holds a lone surrogate, which is not valid Unicode.",
            )
    return body


# --- step 1: refused parameters -------------------------------------------------------------------


def find_refused_parameter(body: Mapping[str, Any]) -> ChatFrontError | None:
    """The first refusal among the screened keys, or None."""
    for key, value in body.items():
        if key in REQUEST_FIELDS or key == "reasoning":
            continue
        if key in DEFAULT_NO_OP_PARAMETERS:
            if value is None or any(
                value == d and type(value) is type(d) for d in DEFAULT_NO_OP_PARAMETERS[key]
            ):
                continue
            return _unsupported(
                key,
                f"Unsupported value: '{key}' is not supported by the AI Horde; send it at its default "
                f"({', '.join(json.dumps(d) for d in DEFAULT_NO_OP_PARAMETERS[key])}) or leave it out.",
            )
        return _unsupported(str(key), f"Unrecognized request argument supplied: {key}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        if role is not None and (not isinstance(role, str) or role not in SUPPORTED_MESSAGE_KEYS):
            shown = role if isinstance(role, str) else json.dumps(role)
            return _unsupported(
                f"messages[{i}].role",
                f"Unsupported value: messages[{i}].role={shown}; the AI Horde serves the roles system, "
                "developer, user, assistant and tool.",
            )
        if role != "assistant" and message.get("tool_calls") is not None:
            return _unsupported(
                f"messages[{i}].tool_calls",
                f"Invalid parameter: 'tool_calls' is only allowed on messages with role 'assistant' "
                f"(messages[{i}] has role '{role}').",
            )
        content = message.get("content")
        if isinstance(content, list) and isinstance(role, str):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if isinstance(kind, str) and kind not in CONTENT_PART_TYPES[role]:
                    return _unsupported(
                        f"messages[{i}].content[{j}].type={kind}",
                        f"Unsupported value: messages[{i}].content[{j}].type={kind} is not supported on "
                        f"{'an' if role == 'assistant' else 'a'} {role} message.",  # "a user", not "an user"
                    )
    return None


# --- step 2: no-op parameters at their default ----------------------------------------------------


def drop_default_no_ops(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if key not in DEFAULT_NO_OP_PARAMETERS}


# --- step 3: unknown nested keys --------------------------------------------------------------------


def _keep(obj: Any, keys: frozenset[str]) -> Any:
    if not isinstance(obj, Mapping):
        return obj
    return {key: value for key, value in obj.items() if key in keys}


def _clean_tool_call(call: Any) -> Any:
    call = _keep(call, TOOL_CALL_KEYS)
    if isinstance(call, dict) and isinstance(call.get("function"), Mapping):
        call["function"] = _keep(call["function"], TOOL_CALL_FUNCTION_KEYS)
    return call


def _clean_part(part: Any) -> Any:
    if not isinstance(part, Mapping):
        return part
    if part.get("type") == "text":
        return _keep(part, TEXT_PART_KEYS)
    if part.get("type") == "image_url":
        part = _keep(part, IMAGE_PART_KEYS)
        if isinstance(part.get("image_url"), Mapping):
            part["image_url"] = _keep(part["image_url"], IMAGE_URL_KEYS)
    return part


def _clean_message(message: Any) -> Any:
    if not isinstance(message, Mapping) or message.get("role") not in SUPPORTED_MESSAGE_KEYS:
        return message
    kept = _keep(message, SUPPORTED_MESSAGE_KEYS[message["role"]])
    if isinstance(kept.get("tool_calls"), list):
        kept["tool_calls"] = [_clean_tool_call(call) for call in kept["tool_calls"]]
    if isinstance(kept.get("content"), list):
        kept["content"] = [_clean_part(part) for part in kept["content"]]
    return kept


def _clean_tool(tool: Any) -> Any:
    tool = _keep(tool, TOOL_KEYS)
    if isinstance(tool, dict) and isinstance(tool.get("function"), Mapping):
        tool["function"] = _keep(tool["function"], TOOL_FUNCTION_KEYS)  # parameters forwarded unchanged
    return tool


def drop_unknown_nested_keys(body: dict[str, Any]) -> dict[str, Any]:
    body = dict(body)
    if isinstance(body.get("messages"), list):
        body["messages"] = [_clean_message(message) for message in body["messages"]]
    if isinstance(body.get("tools"), list):
        body["tools"] = [_clean_tool(tool) for tool in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        choice = _keep(choice, TOOL_CHOICE_KEYS)
        if isinstance(choice.get("function"), Mapping):
            choice["function"] = _keep(choice["function"], TOOL_CHOICE_FUNCTION_KEYS)
        body["tool_choice"] = choice
    return body


# --- the front's bounds -----------------------------------------------------------------------------


def _is_number(value: Any) -> TypeGuard[int | float]:
    # An int is always finite: math.isfinite would overflow on one too large for a float.
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _shown(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, float) or not value.is_integer() else f"{value:g}"


def _check_models(body: Mapping[str, Any]) -> None:
    has_model, has_models = body.get("model") is not None, body.get("models") is not None
    if has_model and has_models:
        raise ChatFrontError(
            400,
            "ChatRequestConflict",
            "Send one of 'model' and 'models', not both.",
            param="models",
            should_retry=False,
        )
    if not has_model and not has_models:
        raise _bad("model", "you must provide a model parameter")
    if has_model:
        model = body["model"]
        if isinstance(model, str) and ":" in model:
            raise model_not_found(model, "model")
        return
    models = body["models"]
    if not isinstance(models, list):
        return  # the contract refuses the type
    if len(models) > MAX_CHAT_MODEL_COUNT:
        raise _unsupported(
            "models", f"'models' lists {len(models)} models; at most {MAX_CHAT_MODEL_COUNT} are supported."
        )
    seen: set[str] = set()
    for i, entry in enumerate(models):
        path = f"models[{i}]"
        if isinstance(entry, str) and not entry:
            raise _unsupported(path, f"Invalid value for '{path}': expected a non-empty string.")
        if isinstance(entry, str) and entry in seen:
            raise _bad(path, f"'models' lists '{entry}' twice.")
        if isinstance(entry, str):
            seen.add(entry)
            if ":" in entry:
                raise model_not_found(entry, path)


def model_not_found(model: str, param: str) -> ChatFrontError:
    return ChatFrontError(
        404,
        "model_not_found",
        f"The model `{model}` does not exist or you do not have access to it.",
        param=param,
        should_retry=False,
    )


def _check_ranges(body: Mapping[str, Any]) -> None:
    for key, (low, high) in OPENAI_SAMPLING_RANGES.items():
        value = body.get(key)
        if not _is_number(value):
            continue
        if value > high:
            raise _unsupported(
                key,
                f"Invalid '{key}': decimal above maximum value. Expected a value <= {high:g}, but got "
                f"{_shown(value)} instead.",
            )
        if value < low:
            raise _unsupported(
                key,
                f"Invalid '{key}': decimal below minimum value. Expected a value >= {low:g}, but got "
                f"{_shown(value)} instead.",
            )
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(key)
        if not _is_number(value):
            continue
        floor = 1 if key == "n" or value < 1 else MIN_CHAT_MAX_TOKENS
        if value < floor:
            raise _unsupported(
                key,
                f"Invalid '{key}': integer below minimum value. Expected a value >= {floor}, but got "
                f"{_shown(value)} instead.",
            )
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_CHAT_STOP_SEQUENCES:
        raise _unsupported(
            "stop",
            f"Invalid 'stop': array too long. Expected an array with maximum length {MAX_CHAT_STOP_SEQUENCES}, "
            f"but got an array with length {len(stop)} instead.",
        )
    if isinstance(body.get("messages"), list) and not body["messages"]:
        raise _bad(
            "messages",
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
        )
    # The front-only keys are not forwarded, so the contract never sees them: typed here, as OpenAI.
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise _bad("stream", "Invalid type for 'stream': expected a boolean.")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "Invalid type for 'user': expected a string.")
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, Mapping) and all(isinstance(value, str) for value in metadata.values())
    ):
        raise _bad("metadata", "Invalid type for 'metadata': expected an object of strings.")
    options = body.get("stream_options")
    if options is not None:
        _screen_object(options, "stream_options", STREAM_OPTIONS_KEYS, ("include_usage", "include_obfuscation"))


def _screen_object(value: Any, param: str, keys: frozenset[str], booleans: tuple[str, ...]) -> None:
    """An object parameter: an object, only `keys`, each of `booleans` a boolean or null."""
    if not isinstance(value, Mapping):
        raise _bad(param, f"Invalid type for '{param}': expected an object.")
    for key in value:
        if key not in keys:
            raise _unsupported(f"{param}.{key}", f"Unknown parameter: '{param}.{key}'.")
    for key in booleans:
        if value.get(key) is not None and not isinstance(value[key], bool):
            raise _bad(f"{param}.{key}", f"Invalid type for '{param}.{key}': expected a boolean.")


def _conflict(param: str, message: str) -> ChatFrontError:
    return ChatFrontError(400, "ChatRequestConflict", message, param=param, should_retry=False)


def map_reasoning(body: dict[str, Any]) -> dict[str, Any]:
    """OpenRouter's `reasoning` object as the native keys (ADR 0087): effort is reasoning_effort,
    enabled false is reasoning_effort none, exclude is horde.include_reasoning negated. A value the
    other keys contradict is 400 ChatRequestConflict at the object's key; max_tokens, a reasoning
    token budget no worker declares, is refused unless null."""
    reasoning = body.pop("reasoning", None)
    if reasoning is None:
        return body
    _screen_object(reasoning, "reasoning", REASONING_KEYS, ("exclude", "enabled"))
    if reasoning.get("max_tokens") is not None:
        raise _unsupported(
            "reasoning.max_tokens",
            "Unsupported parameter: 'reasoning.max_tokens'; the AI Horde's workers declare no reasoning "
            "token budget. Send 'reasoning.effort' (none, minimal, low, medium, high, xhigh) instead.",
        )
    effort, enabled = reasoning.get("effort"), reasoning.get("enabled")
    if effort is not None and effort not in ChatReasoningEffort.__members__.values():
        raise _bad(
            "reasoning.effort",
            "Invalid value for 'reasoning.effort': expected one of none, minimal, low, medium, high, xhigh.",
        )
    if enabled is False:
        if effort not in (None, "none"):
            raise _conflict(
                "reasoning.effort",
                f"'reasoning.enabled' is false and 'reasoning.effort' is '{effort}'; send one of them.",
            )
        effort = "none"
    elif enabled is True and effort == "none":
        raise _conflict(
            "reasoning.effort", "'reasoning.enabled' is true and 'reasoning.effort' is 'none'; send one of them."
        )
    if effort is not None:
        top = body.get("reasoning_effort")
        if top is not None and top != effort:
            raise _conflict(
                "reasoning.effort",
                f"'reasoning_effort' is {json.dumps(top)} and the reasoning object asks for '{effort}'; send one of them.",
            )
        body["reasoning_effort"] = effort
    exclude = reasoning.get("exclude")
    if exclude is not None:
        horde = body.get("horde")
        if horde is not None and not isinstance(horde, Mapping):
            return body  # the contract refuses the type
        shown = (horde or {}).get("include_reasoning")
        if shown is not None and not isinstance(shown, bool):
            return body  # the contract refuses the type, as without the object
        if shown is exclude:
            raise _conflict(
                "reasoning.exclude",
                f"'reasoning.exclude' is {json.dumps(exclude)} and 'horde.include_reasoning' is "
                f"{json.dumps(shown)}; send one of them.",
            )
        body["horde"] = {**(horde or {}), "include_reasoning": not exclude}
    return body


def refusal_error(refusal: ChatRefusal) -> ChatFrontError:
    """A contract refusal with OpenAI's message and param (the message is not prefixed with the path)."""
    status = refusal.status
    return ChatFrontError(status, refusal.rc, refusal.text, param=refusal.param, should_retry=False)


# --- request and response models -------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ChatCompletionRequest(BaseModel):
    """A screened and validated request: the contract's request plus the keys the front applies."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    chat: ChatRequest
    stream: bool = False
    stream_options: StreamOptions | None = None
    native_body: dict[str, Any]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def prompt_estimate(self) -> int:
        """The prompt's tokens as estimated when its worker reports none (oai.mapping.build_usage)."""
        return estimate_prompt_tokens(self.chat.stored_messages())

    @property
    def include_reasoning(self) -> bool:
        return self.chat.horde.include_reasoning

    @property
    def fail_fast(self) -> bool:
        return self.chat.horde.availability_mode == "fail_fast"

    @property
    def requested_models(self) -> list[str]:
        return self.chat.model_list

    @property
    def lists_models(self) -> bool:
        """Whether the client sent models (a list), not model."""
        return bool(self.chat.models)


# tool_choice values under which a reply may be text: its text is relayed when the front is set to
# relay requests with tools (HORDE_OAI_RELAY_WITH_TOOLS, ADR 0098).
RELAYED_TOOL_CHOICES = (None, "auto", "none")


def relays_deltas(request: ChatCompletionRequest, *, with_tools: bool = False) -> bool:
    """Whether the request's reply is relayed as deltas from worker progress: streamed, no tools and
    no response_format other than text (the horde verifies those only on the whole reply), and one
    choice (the stream holds every choice's deltas; the front streams one; ADR 0023). `with_tools`
    (the front's setting, off by default as the spec says): tools too, under a tool_choice that lets
    the model answer in text (ADR 0098: chat apps send tools with every chat)."""
    body = request.native_body
    response_format = body.get("response_format")
    tools_allow = not body.get("tools") or (with_tools and body.get("tool_choice") in RELAYED_TOOL_CHOICES)
    return (
        request.stream
        and tools_allow
        and (response_format is None or dict(response_format) == {"type": "text"})
        and (body.get("n") or 1) == 1
    )


def build_native_chat_body(
    body: Mapping[str, Any], *, operation_key: str | None = None, stream_progress: bool = False
) -> dict[str, Any]:
    """The screened OpenAI body as the native route takes it: the front-only keys are not forwarded,
    tools and response_format at their default are dropped, and horde.operation_key is added.
    `stream_progress` forwards stream: true (the stream hint) for a request whose deltas are relayed."""
    native: dict[str, Any] = {}
    for key, value in body.items():
        if value is None or key in FRONT_ONLY_KEYS:
            continue
        if key == "tools" and value == []:
            continue
        if key == "response_format" and isinstance(value, Mapping) and dict(value) == {"type": "text"}:
            continue
        native[key] = value
    if operation_key is not None:
        native["horde"] = {**(native.get("horde") or {}), "operation_key": operation_key}
    if stream_progress:
        native["stream"] = True
    return native


def screen_request(raw_body: Any) -> ChatCompletionRequest:
    """The three screening steps, the front's bounds, then the contract's validation; raises
    ChatFrontError with OpenAI's message and param."""
    if not isinstance(raw_body, Mapping):
        raise _bad(None, "The request body has to be a JSON object.")
    refused = find_refused_parameter(raw_body)
    if refused is not None:
        raise refused
    body = drop_unknown_nested_keys(drop_default_no_ops(dict(raw_body)))
    body = {key: value for key, value in body.items() if value is not None}  # null counts as omitted
    body = map_reasoning(body)
    _check_models(body)
    _check_ranges(body)
    native = build_native_chat_body(body)
    try:
        chat = validate_chat_request(native)
    except ChatRefusal as refusal:
        raise refusal_error(refusal) from None
    except RecursionError:
        raise _bad(None, "The request body nests too deeply.") from None
    stream = body.get("stream") is True
    return ChatCompletionRequest(
        chat=chat,
        stream=stream,
        stream_options=StreamOptions(**body["stream_options"]) if body.get("stream_options") else None,
        native_body=native,
    )
