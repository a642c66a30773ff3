"""Chat features, guarantees and the request rules the native route, front and workers share.

`chat_request_requirements` is the only derivation of what a request needs from a worker: the
server stores its `declarations` in waiting_prompts.chat_required_features, the front and the
reference worker call the same function.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from contract.chat_errors import ChatRefusal
from contract.chat_limits import CHAT_SAMPLING_DEFAULTS, MAX_CHAT_SCHEMA_NESTING


class ChatFeature(StrEnum):
    """Optional capabilities. The vocabulary grows by adding values; a value never changes meaning."""

    SEED = "seed"
    REASONING_EFFORT = "reasoning_effort"
    PRESENCE_PENALTY = "presence_penalty"
    FREQUENCY_PENALTY = "frequency_penalty"
    VISION = "vision"
    TOOLS = "tools"
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    TOOLS_WITH_RESPONSE_FORMAT = "tools_with_response_format"


class ChatGuarantee(StrEnum):
    """The backend follows one part of the OpenAI contract exactly (ADR 0036)."""

    TOOL_CHOICE_ENFORCED = "tool_choice_enforced"
    SINGLE_TOOL_CALL_ENFORCED = "single_tool_call_enforced"
    STRUCTURED_OUTPUT_ENFORCED = "structured_output_enforced"
    PROMPT_OVERFLOW_REFUSED = "prompt_overflow_refused"


class ChatConformance(StrEnum):
    STRICT = "strict"
    BEST_EFFORT = "best_effort"


# Features and guarantees share one namespace, the worker's chat_features list.
KNOWN_CHAT_DECLARATIONS: frozenset[str] = frozenset(
    [f.value for f in ChatFeature] + [g.value for g in ChatGuarantee]
)

# The limit names a service gap reports in exceeded_limits.
CHAT_LIMIT_NAMES = ("max_context_length", "max_length", "tools_max_temperature")
# Reported among missing declarations for a worker declaring vision without an image transport.
MISSING_IMAGE_TRANSPORTS = "image_transports"


# --- reading a request body -------------------------------------------------------------------
# These read the wire shape (the native body, or the front's mapped body) and tolerate any
# value, so the derivation never raises on what validation would refuse.


def chat_tools(body: Mapping[str, Any]) -> list[Any]:
    """The request's tool definitions; an empty list or null is the same as none."""
    tools = body.get("tools")
    return tools if isinstance(tools, list) else []


def chat_tool_choice(body: Mapping[str, Any]) -> str | None:
    """none, auto, required or function (a forced function); None without tools.

    A null or absent tool_choice beside tools is auto, OpenAI's default.
    """
    if not chat_tools(body):
        return None
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, Mapping):
        return "function"
    return choice if choice in ("none", "auto", "required") else "auto"


def forced_tool_name(body: Mapping[str, Any]) -> str | None:
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        return name if isinstance(name, str) else None
    return None


def forwards_tools(body: Mapping[str, Any]) -> bool:
    """Tool definitions reach the worker: tools under a tool_choice other than none."""
    return chat_tool_choice(body) not in (None, "none")


def response_format_type(body: Mapping[str, Any]) -> str | None:
    """json_object or json_schema; None for text, null or absent."""
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        if kind in ("json_object", "json_schema"):
            return kind
    return None


def is_strict_json_schema(body: Mapping[str, Any]) -> bool:
    if response_format_type(body) != "json_schema":
        return False
    json_schema = body["response_format"].get("json_schema")
    return isinstance(json_schema, Mapping) and json_schema.get("strict") is True


def iter_chat_messages(body: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, Mapping):
                yield message


def iter_content_parts(message: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    content = message.get("content")
    if isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping):
                yield part


def count_image_parts(body: Mapping[str, Any]) -> int:
    return sum(
        1
        for message in iter_chat_messages(body)
        for part in iter_content_parts(message)
        if part.get("type") == "image_url"
    )


def uses_tool_history(body: Mapping[str, Any]) -> bool:
    return any(
        message.get("role") == "tool" or message.get("tool_calls") for message in iter_chat_messages(body)
    )


def _conformance(body: Mapping[str, Any]) -> ChatConformance:
    horde = body.get("horde")
    if isinstance(horde, Mapping) and horde.get("conformance") == ChatConformance.BEST_EFFORT:
        return ChatConformance.BEST_EFFORT
    return ChatConformance.STRICT


def _is_nonzero(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value != 0


# --- requirements -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRequirements:
    """What a request needs from a worker, derived once when it is created."""

    features: frozenset[ChatFeature]
    guarantees: frozenset[ChatGuarantee]
    conformance: ChatConformance
    has_images: bool
    tools_temperature: float | None

    @property
    def declarations(self) -> list[str]:
        """Sorted feature and guarantee values, as stored in chat_required_features."""
        return sorted(str(v) for v in (*self.features, *self.guarantees))


def required_chat_guarantees(
    body: Mapping[str, Any], conformance: ChatConformance | str | None = None
) -> frozenset[ChatGuarantee]:
    """The guarantees a request needs; a best_effort request needs none."""
    if conformance is None:
        conformance = _conformance(body)
    if conformance != ChatConformance.STRICT:
        return frozenset()
    needed = {ChatGuarantee.PROMPT_OVERFLOW_REFUSED}
    # Tools are not forwarded under tool_choice none, so none needs no tool guarantee.
    if chat_tool_choice(body) in ("required", "function"):
        needed.add(ChatGuarantee.TOOL_CHOICE_ENFORCED)
    if is_strict_json_schema(body):
        needed.add(ChatGuarantee.STRUCTURED_OUTPUT_ENFORCED)
    # single_tool_call_enforced is never required: the Horde reduces the reply itself.
    return frozenset(needed)


def _required_features(body: Mapping[str, Any]) -> frozenset[ChatFeature]:
    needed: set[ChatFeature] = set()
    # seed and reasoning_effort: whatever the value (a backend ignoring the key reasons anyway).
    if body.get("seed") is not None:
        needed.add(ChatFeature.SEED)
    if body.get("reasoning_effort") is not None:
        needed.add(ChatFeature.REASONING_EFFORT)
    if _is_nonzero(body.get("presence_penalty")):
        needed.add(ChatFeature.PRESENCE_PENALTY)
    if _is_nonzero(body.get("frequency_penalty")):
        needed.add(ChatFeature.FREQUENCY_PENALTY)
    if count_image_parts(body):
        needed.add(ChatFeature.VISION)
    if forwards_tools(body) or uses_tool_history(body):
        needed.add(ChatFeature.TOOLS)
    kind = response_format_type(body)
    if kind == "json_object":
        needed.add(ChatFeature.JSON_OBJECT)
    elif kind == "json_schema":
        needed.add(ChatFeature.JSON_SCHEMA)
    if kind is not None and forwards_tools(body):
        needed.add(ChatFeature.TOOLS_WITH_RESPONSE_FORMAT)
    return frozenset(needed)


def chat_tools_temperature(body: Mapping[str, Any]) -> float | None:
    """The temperature the job carries when the request forwards tools; None otherwise."""
    if not forwards_tools(body):
        return None
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        return float(temperature)
    return float(CHAT_SAMPLING_DEFAULTS["temperature"])


def chat_request_requirements(body: Mapping[str, Any]) -> ChatRequirements:
    """The one derivation of a request's features, guarantees and worker-side limits.

    `body` is the chat request in wire shape (native body; the front's mapped body). Any
    mapping is read without raising.
    """
    conformance = _conformance(body)
    return ChatRequirements(
        features=_required_features(body),
        guarantees=required_chat_guarantees(body, conformance),
        conformance=conformance,
        has_images=count_image_parts(body) > 0,
        tools_temperature=chat_tools_temperature(body),
    )


def required_chat_features(body: Mapping[str, Any]) -> list[str]:
    """The stored chat_required_features: sorted features and guarantees."""
    return chat_request_requirements(body).declarations


# --- declarations against requirements ----------------------------------------------------------


# Read-only members, so frozen dataclasses (contract.chat_declaration's) satisfy them.
class ChatLimitsLike(Protocol):
    @property
    def max_context_length(self) -> int: ...
    @property
    def max_length(self) -> int: ...
    @property
    def tools_max_temperature(self) -> float | None: ...


class ChatDeclarationLike(Protocol):
    @property
    def chat_features(self) -> frozenset[str]: ...
    @property
    def chat_limits(self) -> ChatLimitsLike | None: ...
    @property
    def receives_images(self) -> bool: ...


def exceeded_chat_limits(
    limits: ChatLimitsLike | None,
    *,
    max_context_length: int | None = None,
    max_length: int | None = None,
    tools_temperature: float | None = None,
) -> list[str]:
    """The chat limits a request exceeds, in CHAT_LIMIT_NAMES order.

    A worker whose tools_max_temperature is below the job's tool temperature is refused under
    both conformance modes, since a clamped value changes the request; without the limit it
    applies every temperature as sent.
    """
    if limits is None:
        return []
    exceeded = []
    if max_context_length is not None and max_context_length > limits.max_context_length:
        exceeded.append("max_context_length")
    if max_length is not None and max_length > limits.max_length:
        exceeded.append("max_length")
    ceiling = limits.tools_max_temperature
    if tools_temperature is not None and ceiling is not None and tools_temperature > ceiling:
        exceeded.append("tools_max_temperature")
    return exceeded


def violated_chat_limit(
    limits: ChatLimitsLike | None,
    *,
    max_context_length: int | None = None,
    max_length: int | None = None,
    tools_temperature: float | None = None,
) -> str | None:
    """The first chat limit a request exceeds, or None."""
    exceeded = exceeded_chat_limits(
        limits,
        max_context_length=max_context_length,
        max_length=max_length,
        tools_temperature=tools_temperature,
    )
    return exceeded[0] if exceeded else None


@dataclass(frozen=True)
class ChatServiceGap:
    missing_declarations: tuple[str, ...] = ()
    exceeded_limits: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.missing_declarations and not self.exceeded_limits

    def impossible_reason(self) -> dict[str, Any]:
        """The status route's impossible_reason for this gap."""
        return {
            "kind": "declaration_gap",
            "missing_declarations": list(self.missing_declarations),
            "exceeded_limits": list(self.exceeded_limits),
        }


def chat_service_gap(
    requirements: ChatRequirements,
    declaration: ChatDeclarationLike,
    *,
    max_context_length: int | None = None,
    max_length: int | None = None,
) -> ChatServiceGap:
    """What a worker's declaration lacks for a request (eligibility rules 2 and 3).

    Rule 1 (chat_jobs and the model) and rule 4 (only/ignore, trust...) are not declaration
    gaps. Empty means the declaration can serve the request.
    """
    declared = declaration.chat_features
    missing = {v for v in requirements.declarations if v not in declared}
    if requirements.has_images and ChatFeature.VISION in declared and not declaration.receives_images:
        missing.add(MISSING_IMAGE_TRANSPORTS)
    exceeded = exceeded_chat_limits(
        declaration.chat_limits,
        max_context_length=max_context_length,
        max_length=max_length,
        tools_temperature=requirements.tools_temperature,
    )
    return ChatServiceGap(tuple(sorted(missing)), tuple(exceeded))


def merge_service_gaps(gaps: Iterable[ChatServiceGap]) -> ChatServiceGap:
    """The union of the refused workers' gaps, as impossible_reason lists them."""
    missing: set[str] = set()
    exceeded: set[str] = set()
    for gap in gaps:
        missing.update(gap.missing_declarations)
        exceeded.update(gap.exceeded_limits)
    return ChatServiceGap(
        tuple(sorted(missing)), tuple(name for name in CHAT_LIMIT_NAMES if name in exceeded)
    )


# --- tool history (OpenAI's rule) ----------------------------------------------------------------

UNANSWERED_TOOL_CALLS_MESSAGE = (
    "An assistant message with 'tool_calls' must be followed by tool messages responding to "
    "each 'tool_call_id'. The following tool_call_ids did not have response messages: {ids}"
)
UNEXPECTED_TOOL_MESSAGE = (
    "Invalid parameter: messages with role 'tool' must be a response to a preceding message "
    "with 'tool_calls'."
)
UNKNOWN_TOOL_CALL_ID_MESSAGE = (
    "Invalid parameter: 'tool_call_id' of '{id}' not found in 'tool_calls' of previous message."
)
REPEATED_TOOL_CALL_ID_MESSAGE = "Invalid parameter: the tool call id '{id}' is repeated in 'tool_calls'."


def _unanswered(issued: list[str | None], answered: set[str | None]) -> str:
    return ", ".join(str(call_id) for call_id in issued if call_id not in answered)


def check_tool_history(messages: Sequence[Mapping[str, Any]]) -> None:
    """Refuse a history breaking OpenAI's rule: an assistant message with tool_calls is followed
    at once by tool messages answering each of its ids exactly once, in any order, and the ids
    within one assistant message are unique. An id may recur in a later round.
    """
    issued: list[str | None] = []  # ids of the latest assistant message with tool_calls (None: not a string)
    answered: set[str | None] = set()
    for i, message in enumerate(messages):
        if message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            call_id = call_id if isinstance(call_id, str) else None
            if not issued or len(answered) == len(issued) or call_id in answered:
                raise ChatRefusal(
                    "UnsupportedChatParameter", UNEXPECTED_TOOL_MESSAGE, param=f"messages[{i}].role"
                )
            if call_id not in issued:
                raise ChatRefusal(
                    "UnsupportedChatParameter",
                    UNKNOWN_TOOL_CALL_ID_MESSAGE.format(id=call_id),
                    param=f"messages[{i}].tool_call_id",
                )
            answered.add(call_id)
            continue
        if len(answered) < len(issued):
            raise ChatRefusal(
                "UnsupportedChatParameter",
                UNANSWERED_TOOL_CALLS_MESSAGE.format(ids=_unanswered(issued, answered)),
                param=f"messages[{i}].role",
            )
        issued, answered = [], set()
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        for call in calls or ():
            call_id = call.get("id") if isinstance(call, Mapping) else None
            call_id = call_id if isinstance(call_id, str) else None
            if call_id in issued:
                raise ChatRefusal(
                    "UnsupportedChatParameter",
                    REPEATED_TOOL_CALL_ID_MESSAGE.format(id=call_id),
                    param=f"messages[{i}].tool_calls",
                )
            issued.append(call_id)
    if len(answered) < len(issued):
        raise ChatRefusal(
            "UnsupportedChatParameter",
            UNANSWERED_TOOL_CALLS_MESSAGE.format(ids=_unanswered(issued, answered)),
            param="messages",
        )


# --- schemas: nesting and OpenAI's strict structural rules --------------------------------------

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "allOf", "oneOf")
_SCHEMA_SINGLES = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
)


def iter_subschemas(schema: Mapping[str, Any]) -> Iterator[tuple[tuple[str, ...], Mapping[str, Any]]]:
    """(relative context, subschema) for each direct subschema, in document keyword order."""
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            for name, sub in value.items():
                if isinstance(sub, Mapping):
                    yield (key, str(name)), sub
        elif (key == "items" or key in _SCHEMA_LISTS) and isinstance(value, list):
            for index, sub in enumerate(value):
                if isinstance(sub, Mapping):
                    yield (key, str(index)), sub
        elif (key == "items" or key in _SCHEMA_SINGLES) and isinstance(value, Mapping):
            yield (key,), value


def schema_nesting_exceeds(schema: Any, limit: int = MAX_CHAT_SCHEMA_NESTING) -> bool:
    """Whether a schema nests more than `limit` subschema levels below its root."""
    if not isinstance(schema, Mapping):
        return False
    stack: list[tuple[Mapping[str, Any], int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        for _, sub in iter_subschemas(node):
            if depth + 1 > limit:
                return True
            stack.append((sub, depth + 1))
    return False


def schema_nesting_message(kind: str, name: str, limit: int = MAX_CHAT_SCHEMA_NESTING) -> str:
    return f"Invalid schema for {kind} '{name}': the schema nests more than {limit} levels below its root."


def _is_object_schema(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return kind is None and isinstance(schema.get("properties"), Mapping)


def strict_schema_violation(schema: Any, *, kind: str, name: str) -> str | None:
    """OpenAI's message for the first break of the strict structural rules, or None.

    Every object schema, at the root and in every subschema, sets additionalProperties: false
    and lists each of its properties in required. `kind` is "response_format" or "function".
    """
    if not isinstance(schema, Mapping):
        return None
    prefix = f"Invalid schema for {kind} '{name}': In context="
    stack: list[tuple[tuple[str, ...], Mapping[str, Any]]] = [((), schema)]
    while stack:
        context, node = stack.pop()
        if _is_object_schema(node):
            if node.get("additionalProperties") is not False:
                return (
                    f"{prefix}{context!r}, 'additionalProperties' is required to be supplied and to be false."
                )
            properties = node.get("properties")
            required = node.get("required")
            required = required if isinstance(required, list) else []
            for key in properties if isinstance(properties, Mapping) else ():
                if key not in required:
                    return (
                        f"{prefix}{context!r}, 'required' is required to be supplied and to be "
                        f"an array including every key in properties. Missing '{key}'."
                    )
        children = [(context + rel, sub) for rel, sub in iter_subschemas(node)]
        stack.extend(reversed(children))  # depth first, in document order
    return None


# --- openai_guards: json_object needs the word json ------------------------------------------------

JSON_OBJECT_WITHOUT_JSON_MESSAGE = (
    "'messages' must contain the word 'json' in some form, to use 'response_format' of type 'json_object'."
)


def messages_mention_json(messages: Iterable[Mapping[str, Any]]) -> bool:
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and "json" in content.lower():
            return True
        for part in iter_content_parts(message):
            text = part.get("text")
            if part.get("type") == "text" and isinstance(text, str) and "json" in text.lower():
                return True
    return False


# --- kudos cap message ------------------------------------------------------------------------------

KUDOS_CAP_EXCESS_PATTERN = re.compile(
    r"kudos estimate of (?P<kudos_estimate>\d+(?:\.\d+)?) exceeds its max_kudos of "
    r"(?P<max_kudos>\d+)"
)


def _format_kudos(value: float) -> str:
    text = f"{round(float(value), 2):.2f}".rstrip("0").rstrip(".")
    return text or "0"


def kudos_cap_message(kudos_estimate: float, max_kudos: int) -> str:
    """ChatKudosCapExceeded's message, stating the estimate and the cap."""
    return (
        f"The request's kudos estimate of {_format_kudos(kudos_estimate)} exceeds its "
        f"max_kudos of {max_kudos} at current pricing."
    )


def parse_kudos_cap_message(message: str) -> tuple[float, int] | None:
    """(kudos_estimate, max_kudos) read back from a ChatKudosCapExceeded message, or None."""
    match = KUDOS_CAP_EXCESS_PATTERN.search(message or "")
    if not match:
        return None
    estimate = float(match.group("kudos_estimate"))
    return (estimate if math.isfinite(estimate) else 0.0), int(match.group("max_kudos"))
