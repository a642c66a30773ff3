"""Wire shapes of a chat request and the native route's body validation.

`validate_chat_request` refuses a body with the spec's status, `rc`, message and path, and
returns a `ChatRequest`. The checks are explicit (not pydantic's error translation) so every
refusal has a stable path and rc; the pydantic models document the accepted shapes, type the
result and are what the OpenAI front validates tools and formats with.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal, overload
from uuid import UUID

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from contract.chat_errors import ChatRefusal
from contract.chat_limits import (
    CHAT_MAX_TOKENS_DEFAULT,
    CHAT_PENALTY_RANGE,
    CHAT_SEED_MAX,
    CHAT_SEED_MIN,
    MAX_CHAT_IMAGE_BYTES,
    MAX_CHAT_IMAGE_COUNT,
    MAX_CHAT_IMAGE_TOTAL_BYTES,
    MAX_CHAT_MAX_TOKENS,
    MAX_CHAT_MESSAGE_COUNT,
    MAX_CHAT_MODEL_COUNT,
    MAX_CHAT_SCHEMA_NESTING,
    MAX_CHAT_TEXT_BYTES,
    MAX_CHAT_TOOL_CALL_COUNT,
    MAX_CHAT_TOOL_CALL_ID_LENGTH,
    MAX_CHAT_TOOL_COUNT,
    MAX_CHAT_TOOL_NAME_LENGTH,
    MAX_CHAT_TOOL_SPEC_BYTES,
    MIN_CHAT_MAX_TOKENS,
    MIN_CHAT_TOOL_CALL_ID_LENGTH,
    TOOL_NAME_PATTERN,
)
from contract.chat_policy import (
    JSON_OBJECT_WITHOUT_JSON_MESSAGE,
    ChatConformance,
    ChatRequirements,
    chat_request_requirements,
    check_tool_history,
    messages_mention_json,
    schema_nesting_exceeds,
    schema_nesting_message,
    strict_schema_violation,
)


class ChatReasoningEffort(StrEnum):
    NONE = "none"
    MINIMAL = "minimal"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    XHIGH = "xhigh"


class ChatContextFit(StrEnum):
    GROW = "grow"
    REJECT = "reject"
    TRUNCATE_OLDEST = "truncate_oldest"


class ChatAvailabilityMode(StrEnum):
    WAIT = "wait"
    FAIL_FAST = "fail_fast"


class ChatContextAdjustmentReason(StrEnum):
    GROW = "grow"
    TRUNCATE_OLDEST = "truncate_oldest"
    WORKER_MAX_LENGTH = "worker_max_length"


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# A message key outside its role's set is refused here (the front drops it instead).
SUPPORTED_MESSAGE_KEYS: dict[str, frozenset[str]] = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset({"role", "content", "name", "tool_calls"}),
    "tool": frozenset({"role", "content", "tool_call_id"}),
}
CONTENT_PART_TYPES: dict[str, frozenset[str]] = {
    role: frozenset({"text", "image_url"}) if role == "user" else frozenset({"text"}) for role in CHAT_ROLES
}

# The native body's top-level keys.
CHAT_REQUEST_KEYS = frozenset(
    {
        "model",
        "models",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "frequency_penalty",
        "presence_penalty",
        "seed",
        "reasoning_effort",
        "stop",
        "n",
        "stream",
        "stream_options",
        "user",
        "metadata",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "horde",
    }
)

_TOOL_NAME = re.compile(TOOL_NAME_PATTERN)
_DATA_IMAGE_URL = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,", re.IGNORECASE)
_HTTP_URL = re.compile(r"^https?://[^\s/]+", re.IGNORECASE)


# --- pydantic shapes -----------------------------------------------------------------------------


class ChatShape(BaseModel):
    model_config = ConfigDict(extra="forbid")


ToolName = Annotated[StrictStr, Field(pattern=TOOL_NAME_PATTERN)]
ToolCallId = Annotated[
    StrictStr, Field(min_length=MIN_CHAT_TOOL_CALL_ID_LENGTH, max_length=MAX_CHAT_TOOL_CALL_ID_LENGTH)
]
PositiveInt = Annotated[StrictInt, Field(gt=0)]


def _worker_id(value: Any) -> Any:
    """A string that is not a UUID (a worker's name, say) gets a message saying what is wanted;
    anything else is left to UUID's own check."""
    if isinstance(value, str):
        try:
            return UUID(value)
        except ValueError:
            raise PydanticCustomError(
                "worker_id", "'{value}' is not a worker id: workers are named by their id (a UUID)", {"value": value}
            ) from None
    return value


WorkerId = Annotated[UUID, BeforeValidator(_worker_id)]


class ChatHordeOptions(ChatShape):
    """The `horde` object: request options OpenAI has no key for."""

    # Worker ids, as the spec types them: a worker's name is refused, never ignored.
    only: Annotated[list[WorkerId], Field(min_length=1)] | None = None
    ignore: Annotated[list[WorkerId], Field(min_length=1)] | None = None
    trusted_workers: StrictBool = False
    validated_backends: StrictBool = False
    slow_workers: StrictBool = True
    max_context_length: PositiveInt | None = None
    context_fit: ChatContextFit = ChatContextFit.TRUNCATE_OLDEST
    conformance: ChatConformance = ChatConformance.STRICT
    openai_guards: StrictBool = False
    include_reasoning: StrictBool = True
    availability_mode: ChatAvailabilityMode = ChatAvailabilityMode.WAIT
    max_kudos: PositiveInt | None = None
    dry_run: StrictBool = False
    operation_key: UUID | None = None


CHAT_HORDE_KEYS = frozenset(ChatHordeOptions.model_fields)


class ChatToolFunction(ChatShape):
    name: ToolName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(ChatShape):
    type: Literal["function"]
    function: ChatToolFunction


class ChatToolChoiceName(ChatShape):
    name: StrictStr


class ChatToolChoiceFunction(ChatShape):
    type: Literal["function"]
    function: ChatToolChoiceName


ChatToolChoice = Literal["none", "auto", "required"] | ChatToolChoiceFunction


class ChatJsonSchema(ChatShape):
    name: ToolName
    # `schema` on the wire; schema_ is the Python name only (an unknown key on the wire).
    schema_: dict[str, Any] = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class ChatResponseFormatText(ChatShape):
    type: Literal["text"]


class ChatResponseFormatJsonObject(ChatShape):
    type: Literal["json_object"]


class ChatResponseFormatJsonSchema(ChatShape):
    type: Literal["json_schema"]
    json_schema: ChatJsonSchema


ChatResponseFormat = Annotated[
    ChatResponseFormatText | ChatResponseFormatJsonObject | ChatResponseFormatJsonSchema,
    Field(discriminator="type"),
]


class ChatToolCallFunction(ChatShape):
    name: StrictStr
    arguments: StrictStr


class ChatToolCall(ChatShape):
    id: ToolCallId
    type: Literal["function"]
    function: ChatToolCallFunction


class ChatTextPart(ChatShape):
    type: Literal["text"]
    text: StrictStr


class ChatImageUrl(ChatShape):
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None


class ChatImagePart(ChatShape):
    type: Literal["image_url"]
    image_url: ChatImageUrl


ChatUserPart = Annotated[ChatTextPart | ChatImagePart, Field(discriminator="type")]


class ChatSystemMessage(ChatShape):
    role: Literal["system", "developer"]
    content: StrictStr | list[ChatTextPart]
    name: StrictStr | None = None


class ChatUserMessage(ChatShape):
    role: Literal["user"]
    content: StrictStr | list[ChatUserPart]
    name: StrictStr | None = None


class ChatAssistantMessage(ChatShape):
    role: Literal["assistant"]
    content: StrictStr | list[ChatTextPart] | None = None
    name: StrictStr | None = None
    tool_calls: (
        Annotated[list[ChatToolCall], Field(min_length=1, max_length=MAX_CHAT_TOOL_CALL_COUNT)] | None
    ) = None


class ChatToolMessage(ChatShape):
    role: Literal["tool"]
    content: StrictStr | list[ChatTextPart]
    tool_call_id: ToolCallId


ChatMessage = Annotated[
    ChatSystemMessage | ChatUserMessage | ChatAssistantMessage | ChatToolMessage,
    Field(discriminator="role"),
]


def _documented(**schema: Any) -> Any:
    """An optional key's bounds, for the OpenAPI schema only: validate_chat_request's checks
    enforce them first, each with the spec's rc and message."""
    return Field(default=None, json_schema_extra=schema)


class ChatRequest(ChatShape):
    """A validated native chat request body: an OpenAI chat completion body, plus `models` and the
    `horde` object."""

    model: StrictStr | None = _documented(minLength=1, description="Exactly one of model and models")
    models: list[StrictStr] | None = _documented(minItems=1, maxItems=MAX_CHAT_MODEL_COUNT)
    messages: Annotated[list[ChatMessage], Field(json_schema_extra={"minItems": 1, "maxItems": MAX_CHAT_MESSAGE_COUNT})]
    # Lax numbers: the checks above have already refused strings and booleans.
    max_tokens: int | None = _documented(
        minimum=MIN_CHAT_MAX_TOKENS, maximum=MAX_CHAT_MAX_TOKENS, description=f"default {CHAT_MAX_TOKENS_DEFAULT}"
    )
    max_completion_tokens: int | None = _documented(minimum=MIN_CHAT_MAX_TOKENS, maximum=MAX_CHAT_MAX_TOKENS)
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = _documented(minimum=CHAT_PENALTY_RANGE[0], maximum=CHAT_PENALTY_RANGE[1])
    presence_penalty: float | None = _documented(minimum=CHAT_PENALTY_RANGE[0], maximum=CHAT_PENALTY_RANGE[1])
    seed: int | None = _documented(minimum=CHAT_SEED_MIN, maximum=CHAT_SEED_MAX)
    reasoning_effort: ChatReasoningEffort | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: int | None = _documented(minimum=1, maximum=1)
    stream: StrictBool | None = None
    stream_options: dict[str, Any] | None = None
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    tools: list[ChatTool] | None = _documented(maxItems=MAX_CHAT_TOOL_COUNT)
    tool_choice: ChatToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ChatResponseFormat | None = None
    horde: ChatHordeOptions = Field(default_factory=ChatHordeOptions)

    @property
    def model_list(self) -> list[str]:
        """The accepted models; model: "a" is models: ["a"]."""
        return list(self.models) if self.models else [self.model or ""]

    @property
    def max_length(self) -> int:
        value = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        return value if value is not None else CHAT_MAX_TOKENS_DEFAULT

    @property
    def stop_sequence(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop

    def wire(self) -> dict[str, Any]:
        """The body as sent (keys the client set), in wire names."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def stored_messages(self) -> list[dict[str, Any]]:
        """Messages as stored and sent to workers: developer becomes system, a key sent as null is
        left out as one not sent (so both give one fingerprint), and an assistant message's absent
        content is stored as null."""
        stored = []
        for message in self.messages:
            data = message.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)
            if data["role"] == "developer":
                data["role"] = "system"
            if data["role"] == "assistant":
                data.setdefault("content", None)
            stored.append(data)
        return stored

    def requirements(self) -> ChatRequirements:
        return chat_request_requirements(self.wire())


# --- helpers ------------------------------------------------------------------------------------


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _bad(path: str | None, text: str) -> ChatRefusal:
    return ChatRefusal("BadRequest", text, param=path)


def _unsupported(path: str | None, text: str) -> ChatRefusal:
    return ChatRefusal("UnsupportedChatParameter", text, param=path)


def _conflict(path: str | None, text: str) -> ChatRefusal:
    return ChatRefusal("ChatRequestConflict", text, param=path)


def _wrong_type(path: str, expected: str) -> ChatRefusal:
    return _bad(path, f"Invalid type for '{path}': expected {expected}.")


def _check_keys(obj: Mapping[str, Any], allowed: frozenset[str] | set[str], path: str) -> None:
    for key in obj:
        if key not in allowed:
            raise _unsupported(_join(path, str(key)), f"Unknown parameter: '{_join(path, str(key))}'.")


def _object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _wrong_type(path, "an object")
    return value


@overload
def _string(obj: Mapping[str, Any], key: str, path: str, *, required: Literal[True] = True) -> str: ...
@overload
def _string(obj: Mapping[str, Any], key: str, path: str, *, required: bool) -> str | None: ...
def _string(obj: Mapping[str, Any], key: str, path: str, *, required: bool = True) -> str | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise _wrong_type(_join(path, key), "a string")
    return value


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and (isinstance(value, int) or math.isfinite(value))
    )


def _as_int(value: Any) -> int | None:
    """An integer, or a float with no fractional part; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def utf8_size(text: str) -> int:
    # surrogatepass: a JSON body may carry lone surrogates, which plain UTF-8 cannot encode.
    return len(text.encode("utf-8", "surrogatepass"))


def compact_json_size(value: Any) -> int:
    return utf8_size(json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str))


def data_url_decoded_size(url: str) -> int:
    """A base64 data URL's decoded size, estimated from its payload length."""
    payload = url.partition(",")[2].strip()
    padding = len(payload) - len(payload.rstrip("="))
    return max(0, len(payload) * 3 // 4 - padding)


def message_text_bytes(messages: Sequence[Mapping[str, Any]]) -> int:
    """UTF-8 bytes of every string content and text part and every history tool call's
    function name and arguments (what MAX_CHAT_TEXT_BYTES bounds)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += utf8_size(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    total += utf8_size(part["text"])
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping):
                for key in ("name", "arguments"):
                    if isinstance(function.get(key), str):
                        total += utf8_size(function[key])
    return total


# --- image caps ------------------------------------------------------------------------------------


def too_many_images(count: int) -> ChatRefusal:
    return ChatRefusal(
        "TooManyExtraSourceImages",
        f"A chat request may carry at most {MAX_CHAT_IMAGE_COUNT} images; this one carries {count}.",
        param="messages",
    )


def image_too_large(path: str, size: int) -> ChatRefusal:
    return ChatRefusal(
        "SourceImageSizeExceeded",
        f"The image is {size} bytes; each image may be at most {MAX_CHAT_IMAGE_BYTES} bytes.",
        param=path,
    )


def images_total_exceeded(total: int, cap: int, *, encoded: bool = False) -> ChatRefusal:
    """The total cap's refusal, stating the total reached and the cap."""
    what = "The request's images as stored (JPEG) total" if encoded else "The request's images total"
    return ChatRefusal(
        "SourceImageSizeExceeded",
        f"{what} {total} bytes, over the {cap} byte cap for this request.",
        param="messages",
    )


# --- body validation ----------------------------------------------------------------------------


def _check_horde(value: Any) -> None:
    horde = _object(value, "horde")
    _check_keys(horde, CHAT_HORDE_KEYS, "horde")
    if horde.get("only") is not None and horde.get("ignore") is not None:
        raise _conflict("horde.ignore", "'horde.only' and 'horde.ignore' cannot be combined.")
    try:
        ChatHordeOptions.model_validate({k: v for k, v in horde.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        path = "horde"
        for item in error["loc"]:
            path = _join(path, item if isinstance(item, int) else str(item))
        raise _bad(path, f"Invalid value for '{path}': {error['msg']}.") from None


def _check_models(body: Mapping[str, Any]) -> None:
    has_model = body.get("model") is not None
    has_models = body.get("models") is not None
    if has_model and has_models:
        raise _conflict("models", "Send one of 'model' and 'models', not both.")
    if not has_model and not has_models:
        raise _bad("model", "A chat request needs 'model' or 'models'.")
    if has_model:
        model = body["model"]
        if not isinstance(model, str) or not model:
            raise _bad("model", "Invalid value for 'model': expected a non-empty string.")
        return
    models = body["models"]
    if not isinstance(models, list):
        raise _wrong_type("models", "an array of strings")
    if not models:
        raise _bad("models", "'models' needs at least one model.")
    if len(models) > MAX_CHAT_MODEL_COUNT:
        raise _bad("models", f"'models' may list at most {MAX_CHAT_MODEL_COUNT} models.")
    seen: set[str] = set()
    for i, entry in enumerate(models):
        path = _join("models", i)
        if not isinstance(entry, str) or not entry:
            raise _bad(path, f"Invalid value for '{path}': expected a non-empty string.")
        if entry in seen:
            raise _bad(path, f"'models' lists '{entry}' twice.")
        seen.add(entry)


def _check_content(message: Mapping[str, Any], role: str, path: str) -> int:
    """Check a message's content; returns the number of image parts."""
    content_path = _join(path, "content")
    content = message.get("content")
    if content is None:
        if role == "assistant":
            if not message.get("tool_calls"):
                raise _bad(content_path, "An assistant message needs content or tool_calls.")
            return 0
        raise _bad(content_path, f"Missing required parameter: '{content_path}'.")
    if isinstance(content, str):
        return 0
    if not isinstance(content, list):
        raise _wrong_type(content_path, "a string or an array of content parts")
    images = 0
    for j, part in enumerate(content):
        part_path = _join(content_path, j)
        part = _object(part, part_path)
        kind = part.get("type")
        if not isinstance(kind, str) or kind not in CONTENT_PART_TYPES[role]:
            shown = kind if isinstance(kind, str) else json.dumps(kind, default=str)
            raise _unsupported(
                _join(part_path, "type"),
                f"Unsupported value: {_join(part_path, 'type')}={shown} is not supported on "
                f"{'an' if role == 'assistant' else 'a'} {role} message.",  # "a user", not "an user"
            )
        if kind == "text":
            _check_keys(part, {"type", "text"}, part_path)
            _string(part, "text", part_path)
            continue
        images += 1
        _check_keys(part, {"type", "image_url"}, part_path)
        image_path = _join(part_path, "image_url")
        image = _object(part.get("image_url"), image_path)
        _check_keys(image, {"url", "detail"}, image_path)
        url = _string(image, "url", image_path)
        if not (_DATA_IMAGE_URL.match(url) or _HTTP_URL.match(url)):
            raise _bad(
                _join(image_path, "url"),
                "Invalid image URL: expected a data:image/...;base64, URL or an http(s) URL.",
            )
        if image.get("detail") is not None and image["detail"] not in ("auto", "low", "high"):
            raise _bad(_join(image_path, "detail"), "Invalid value: detail is auto, low or high.")
    return images


def _check_tool_call_id(value: Any, path: str) -> None:
    if not isinstance(value, str):
        raise _wrong_type(path, "a string")
    if not MIN_CHAT_TOOL_CALL_ID_LENGTH <= len(value) <= MAX_CHAT_TOOL_CALL_ID_LENGTH:
        raise _unsupported(
            path,
            f"Invalid '{path}': a tool call id has {MIN_CHAT_TOOL_CALL_ID_LENGTH} to "
            f"{MAX_CHAT_TOOL_CALL_ID_LENGTH} characters.",
        )


def _check_tool_calls(value: Any, path: str) -> None:
    if not isinstance(value, list):
        raise _wrong_type(path, "an array of tool calls")
    if not 1 <= len(value) <= MAX_CHAT_TOOL_CALL_COUNT:
        raise _unsupported(
            path, f"'{path}' holds {len(value)} tool calls; 1 to {MAX_CHAT_TOOL_CALL_COUNT} are supported."
        )
    for k, call in enumerate(value):
        call_path = _join(path, k)
        call = _object(call, call_path)
        _check_keys(call, {"id", "type", "function"}, call_path)
        _check_tool_call_id(call.get("id"), _join(call_path, "id"))
        if call.get("type") != "function":
            raise _unsupported(
                _join(call_path, "type"),
                f"Unsupported value: '{_join(call_path, 'type')}' is 'function' only.",
            )
        function_path = _join(call_path, "function")
        function = _object(call.get("function"), function_path)
        _check_keys(function, {"name", "arguments"}, function_path)
        _string(function, "name", function_path)
        _string(function, "arguments", function_path)


def _check_messages(body: Mapping[str, Any]) -> int:
    """Check the messages; returns the number of image parts."""
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "Missing required parameter: 'messages'.")
    if not isinstance(messages, list):
        raise _wrong_type("messages", "an array of messages")
    if not messages:
        raise _bad("messages", "Invalid 'messages': empty array. Expected an array with minimum length 1.")
    if len(messages) > MAX_CHAT_MESSAGE_COUNT:
        raise _unsupported(
            "messages",
            f"'messages' holds {len(messages)} messages; at most {MAX_CHAT_MESSAGE_COUNT} are supported.",
        )
    images = 0
    for i, message in enumerate(messages):
        path = _join("messages", i)
        message = _object(message, path)
        role = message.get("role")
        if not isinstance(role, str) or role not in SUPPORTED_MESSAGE_KEYS:
            if role is None:
                raise _bad(_join(path, "role"), f"Missing required parameter: '{_join(path, 'role')}'.")
            shown = role if isinstance(role, str) else json.dumps(role, default=str)
            raise _unsupported(
                _join(path, "role"),
                f"Unsupported value: {_join(path, 'role')}={shown}; roles are system, developer, "
                "user, assistant and tool.",
            )
        _check_keys(message, SUPPORTED_MESSAGE_KEYS[role], path)
        if message.get("name") is not None:
            _string(message, "name", path)
        if role == "assistant" and message.get("tool_calls") is not None:
            _check_tool_calls(message["tool_calls"], _join(path, "tool_calls"))
        if role == "tool":
            if message.get("tool_call_id") is None:
                raise _bad(
                    _join(path, "tool_call_id"),
                    f"Missing required parameter: '{_join(path, 'tool_call_id')}'.",
                )
            _check_tool_call_id(message["tool_call_id"], _join(path, "tool_call_id"))
        images += _check_content(message, role, path)
    text_bytes = message_text_bytes(messages)
    if text_bytes > MAX_CHAT_TEXT_BYTES:
        raise _unsupported(
            "messages",
            f"The messages hold {text_bytes} bytes of text; at most {MAX_CHAT_TEXT_BYTES} are supported.",
        )
    return images


def _check_number(body: Mapping[str, Any], key: str, bounds: tuple[float, float] | None = None) -> None:
    value = body.get(key)
    if value is None:
        return
    if not _is_number(value):
        raise _wrong_type(key, "a number")
    if bounds and not bounds[0] <= value <= bounds[1]:
        raise _bad(key, f"Invalid value for '{key}': expected a number from {bounds[0]:g} to {bounds[1]:g}.")


def _check_scalars(body: Mapping[str, Any]) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None:
            continue
        number = _as_int(value)
        if number is None:
            raise _wrong_type(key, "an integer")
        if not MIN_CHAT_MAX_TOKENS <= number <= MAX_CHAT_MAX_TOKENS:
            raise _bad(
                key,
                f"Invalid value for '{key}': expected an integer from {MIN_CHAT_MAX_TOKENS} to "
                f"{MAX_CHAT_MAX_TOKENS}.",
            )
    max_tokens, max_completion = body.get("max_tokens"), body.get("max_completion_tokens")
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _conflict(
            "max_completion_tokens", "'max_tokens' and 'max_completion_tokens' differ; send one of them."
        )
    _check_number(body, "temperature")  # ranges: the text params'
    _check_number(body, "top_p")
    _check_number(body, "frequency_penalty", CHAT_PENALTY_RANGE)
    _check_number(body, "presence_penalty", CHAT_PENALTY_RANGE)
    if body.get("seed") is not None:
        seed = _as_int(body["seed"])
        if seed is None:
            raise _wrong_type("seed", "an integer")
        if not CHAT_SEED_MIN <= seed <= CHAT_SEED_MAX:
            raise _bad("seed", f"Invalid value for 'seed': expected an integer from {CHAT_SEED_MIN} to {CHAT_SEED_MAX}.")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in ChatReasoningEffort.__members__.values():
        raise _bad(
            "reasoning_effort",
            "Invalid value for 'reasoning_effort': expected one of none, minimal, low, medium, high, xhigh.",
        )
    n = body.get("n")
    if n is not None:
        if _as_int(n) is None:
            raise _wrong_type("n", "an integer")
        if _as_int(n) != 1:
            raise _unsupported("n", f"Unsupported value: 'n' is {n}; only n=1 is supported.")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise _wrong_type("stop", "a string or an array of strings")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise _wrong_type("stop", "a string or an array of strings")
    for key, expected, kind in (
        ("stream", "a boolean", bool),
        ("parallel_tool_calls", "a boolean", bool),
        ("user", "a string", str),
        ("stream_options", "an object", Mapping),
        ("metadata", "an object", Mapping),
    ):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise _wrong_type(key, expected)


def _check_schema(schema: Any, path: str, *, kind: str, name: str, strict: bool) -> None:
    if schema_nesting_exceeds(schema, MAX_CHAT_SCHEMA_NESTING):
        raise _unsupported(path, schema_nesting_message(kind, name))
    if strict:
        violation = strict_schema_violation(schema, kind=kind, name=name)
        if violation:
            raise _unsupported(path, violation)


def _check_tools(body: Mapping[str, Any]) -> list[str]:
    """Check the tool definitions; returns their names."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _wrong_type("tools", "an array of tools")
    if len(tools) > MAX_CHAT_TOOL_COUNT:
        raise _unsupported(
            "tools", f"'tools' holds {len(tools)} tools; at most {MAX_CHAT_TOOL_COUNT} are supported."
        )
    names = []
    for i, tool in enumerate(tools):
        path = _join("tools", i)
        tool = _object(tool, path)
        _check_keys(tool, {"type", "function"}, path)
        if tool.get("type") != "function":
            raise _unsupported(
                _join(path, "type"), f"Unsupported value: '{_join(path, 'type')}' is 'function' only."
            )
        function_path = _join(path, "function")
        function = _object(tool.get("function"), function_path)
        _check_keys(function, {"name", "description", "parameters", "strict"}, function_path)
        name = _string(function, "name", function_path)
        if not _TOOL_NAME.fullmatch(name):
            raise _bad(
                _join(function_path, "name"),
                f"Invalid '{_join(function_path, 'name')}': a function name has 1 to {MAX_CHAT_TOOL_NAME_LENGTH} characters "
                "of a-z, A-Z, 0-9, underscores and dashes.",
            )
        _string(function, "description", function_path, required=False)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise _wrong_type(_join(function_path, "parameters"), "an object")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _wrong_type(_join(function_path, "strict"), "a boolean")
        _check_schema(
            parameters, _join(function_path, "parameters"), kind="function", name=name, strict=strict is True
        )
        names.append(name)
    return names


def _check_tool_choice(body: Mapping[str, Any], tool_names: list[str]) -> None:
    choice = body.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, Mapping):
        _check_keys(choice, {"type", "function"}, "tool_choice")
        if choice.get("type") != "function":
            raise _bad("tool_choice.type", "Invalid value for 'tool_choice.type': expected 'function'.")
        function = _object(choice.get("function"), "tool_choice.function")
        _check_keys(function, {"name"}, "tool_choice.function")
        _string(function, "name", "tool_choice.function")
    elif choice not in ("none", "auto", "required"):
        raise _bad(
            "tool_choice",
            "Invalid value for 'tool_choice': expected none, auto, required or a function choice.",
        )
    if not tool_names:
        raise _conflict(
            "tool_choice",
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
        )
    if isinstance(choice, Mapping) and choice["function"]["name"] not in tool_names:
        raise _conflict(
            "tool_choice",
            f"Invalid value for 'tool_choice': the function '{choice['function']['name']}' is not "
            "defined in 'tools'.",
        )


def _check_response_format(body: Mapping[str, Any]) -> None:
    value = body.get("response_format")
    if value is None:
        return
    response_format = _object(value, "response_format")
    kind = response_format.get("type")
    if kind in ("text", "json_object"):
        _check_keys(response_format, {"type"}, "response_format")
        return
    if kind != "json_schema":
        shown = kind if isinstance(kind, str) else json.dumps(kind, default=str)
        raise _unsupported(
            "response_format.type",
            f"Unsupported value: response_format.type={shown}; types are text, json_object and json_schema.",
        )
    _check_keys(response_format, {"type", "json_schema"}, "response_format")
    path = "response_format.json_schema"
    if response_format.get("json_schema") is None:
        raise _bad(path, f"Missing required parameter: '{path}'.")
    json_schema = _object(response_format["json_schema"], path)
    _check_keys(json_schema, {"name", "schema", "description", "strict"}, path)
    name = _string(json_schema, "name", path)
    if not _TOOL_NAME.fullmatch(name):
        raise _bad(
            _join(path, "name"),
            f"Invalid '{path}.name': a name has 1 to {MAX_CHAT_TOOL_NAME_LENGTH} characters of a-z, A-Z, 0-9, "
            "underscores and dashes.",
        )
    if json_schema.get("schema") is None:
        raise _bad(_join(path, "schema"), f"Missing required parameter: '{path}.schema'.")
    schema = _object(json_schema["schema"], _join(path, "schema"))
    _string(json_schema, "description", path, required=False)
    strict = json_schema.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _wrong_type(_join(path, "strict"), "a boolean")
    _check_schema(schema, _join(path, "schema"), kind="response_format", name=name, strict=strict is True)


def _check_tool_spec_size(body: Mapping[str, Any]) -> None:
    size = sum(
        compact_json_size(body[key])
        for key in ("tools", "tool_choice", "response_format")
        if body.get(key) is not None
    )
    if size > MAX_CHAT_TOOL_SPEC_BYTES:
        raise _unsupported(
            "tools",
            f"'tools', 'tool_choice' and 'response_format' hold {size} bytes of JSON; at most "
            f"{MAX_CHAT_TOOL_SPEC_BYTES} are supported.",
        )


def _check_images(body: Mapping[str, Any], count: int) -> None:
    """The caps every request is held to at parse, before the user is known."""
    if count > MAX_CHAT_IMAGE_COUNT:
        raise too_many_images(count)
    total = 0
    for i, message in enumerate(body["messages"]):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part.get("type") != "image_url":
                continue
            url = part["image_url"]["url"]
            if not _DATA_IMAGE_URL.match(url):
                continue
            size = data_url_decoded_size(url)
            if size > MAX_CHAT_IMAGE_BYTES:
                raise image_too_large(f"messages[{i}].content[{j}].image_url.url", size)
            total += size
    if total > MAX_CHAT_IMAGE_TOTAL_BYTES:
        raise images_total_exceeded(total, MAX_CHAT_IMAGE_TOTAL_BYTES)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(text: str) -> bool:
    # isascii() reads a flag CPython keeps on the string: an ASCII string (a data URL's megabytes of
    # base64, most keys and texts) is never scanned.
    return not text.isascii() and _LONE_SURROGATE.search(text) is not None


def _shown_key(key: str) -> str:
    """A key as a path shows it: its lone surrogates escaped, so the message stays valid UTF-8."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8") if _has_lone_surrogate(key) else key


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) holding a lone surrogate: JSON's "\\ud800"
    escape parses to one, and no UTF-8 text (the database, the worker, the reply) can carry it.
    A key in the path shows its surrogates escaped; "" is the body itself."""
    if isinstance(value, str):
        return path if _has_lone_surrogate(value) else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            shown = _shown_key(key) if isinstance(key, str) else str(key)
            child = f"{path}.{shown}" if path else shown
            if isinstance(key, str) and _has_lone_surrogate(key):
                return child
            found = lone_surrogate_path(item, child)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def validate_chat_request(body: Any) -> ChatRequest:
    """Validate a native chat request body (parsed JSON); raise ChatRefusal.

    Top-level nulls count as omitted. A body over MAX_CHAT_BODY_BYTES is refused before
    parsing, by the route (RequestTooLarge).
    """
    if not isinstance(body, Mapping):
        raise _bad(None, "The request body has to be a JSON object.")
    surrogate_at = lone_surrogate_path(body)
    if surrogate_at is not None:
        raise _bad(surrogate_at, f"Invalid value for '{surrogate_at}': the text holds a lone surrogate, which is not valid Unicode.")
    body = {key: value for key, value in body.items() if value is not None}
    for key in body:
        if key not in CHAT_REQUEST_KEYS:
            raise _unsupported(str(key), f"Unrecognized request argument supplied: {key}")
    if "horde" in body:
        _check_horde(body["horde"])
    _check_models(body)
    image_count = _check_messages(body)
    _check_scalars(body)
    tool_names = _check_tools(body)
    _check_tool_choice(body, tool_names)
    if body.get("parallel_tool_calls") is not None and not tool_names:
        raise _conflict(
            "parallel_tool_calls",
            "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when "
            "'tools' are specified.",
        )
    _check_response_format(body)
    _check_tool_spec_size(body)
    check_tool_history(body["messages"])
    _check_images(body, image_count)
    horde = body.get("horde") or {}
    if (
        horde.get("openai_guards") is True
        and isinstance(body.get("response_format"), Mapping)
        and body["response_format"].get("type") == "json_object"
        and not messages_mention_json(body["messages"])
    ):
        raise _conflict("messages", JSON_OBJECT_WITHOUT_JSON_MESSAGE)
    if isinstance(body.get("horde"), Mapping):
        body["horde"] = {k: v for k, v in body["horde"].items() if v is not None}
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:  # a shape the checks above let through: still a 400
        error = exc.errors()[0]
        path = ".".join(str(item) for item in error["loc"])
        raise _bad(path or None, f"Invalid request: {error['msg']}.") from None
