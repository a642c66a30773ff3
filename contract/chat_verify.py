"""A chat job's structured submit, and reply verification against the request (the spec's ADR 0036, layer 3).

verify_chat_reply checks a reply against the client's stored chat_extras, never against a
worker's declaration or the narrowed copy the worker received.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Annotated, Any, Literal

import regex
from jsonschema import Draft202012Validator, ValidationError
from jsonschema.validators import extend, validator_for
from pydantic import Field, StrictStr
from referencing import Registry
from referencing.jsonschema import DRAFT202012, specification_with

from contract.chat_declaration import ChatFinishReason
from contract.chat_errors import ChatRefusal
from contract.chat_limits import (
    MAX_CHAT_NATIVE_FINISH_REASON_LENGTH,
    MAX_CHAT_REPORTED_TOKENS,
    MAX_CHAT_TEXT_BYTES,
    MAX_CHAT_TOOL_CALL_COUNT,
)
from contract.chat_policy import ChatConformance, chat_tool_choice, chat_tools, forced_tool_name
from contract.chat_shapes import ChatShape, ChatToolCall, utf8_size
from contract.text import TEXT_KUDOS_MIN_TOKENS

# A body carrying any of these is a chat submit; any other is a text submit.
CHAT_SUBMIT_KEYS = frozenset({"message", "model_id", "finish_reason", "fault_reason"})
CHAT_SUBMIT_STATES = ("ok", "censored", "csam", "faulted")
CHARACTERS_PER_TOKEN = 4


class ChatReplyMessage(ChatShape):
    role: Literal["assistant"]
    content: StrictStr | None = None
    tool_calls: (
        Annotated[list[ChatToolCall], Field(min_length=1, max_length=MAX_CHAT_TOOL_CALL_COUNT)] | None
    ) = None
    reasoning_content: StrictStr | None = None


@dataclass(frozen=True)
class ChatSubmit:
    """The chat fields of a submit. A faulted job carries no message or finish_reason."""

    model_id: str
    state: str
    message: dict[str, Any] | None = None
    finish_reason: ChatFinishReason | None = None
    native_finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    fault_reason: str | None = None  # as sent; only a chat job's fault reads it


def is_chat_submit(body: Mapping[str, Any]) -> bool:
    return any(key in body for key in CHAT_SUBMIT_KEYS)


def _invalid(text: str, param: str | None = None) -> ChatRefusal:
    return ChatRefusal("ChatSubmitInvalid", text, param=param)


def _count(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None  # the backend did not report it
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CHAT_REPORTED_TOKENS:
        raise _invalid(f"{key} has to be an integer from 0 to {MAX_CHAT_REPORTED_TOKENS}.", key)
    return value


# A lone surrogate: JSON's \ud800 escapes parse to one, and UTF-8 (hence PostgreSQL) cannot hold it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _unencodable_path(value: Any, path: str) -> str | None:
    """The path of the first string in `value` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _unencodable_path(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
        if found:
            return found
    return None


def _reply_message(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _invalid("A chat submit needs message, an assistant reply object.", "message")
    try:
        reply = ChatReplyMessage.model_validate(value)
    except Exception as exc:  # pydantic's ValidationError, or anything odd in the input
        errors = getattr(exc, "errors", None)
        first = errors()[0] if callable(errors) else {"loc": (), "msg": str(exc)}
        path = ".".join(["message", *(str(item) for item in first["loc"])])
        raise _invalid(f"Invalid '{path}': {first['msg']}.", path) from None
    if reply.content is None and not reply.tool_calls:
        raise _invalid("message.content may be null only with tool_calls.", "message.content")
    dumped = reply.model_dump(mode="json", exclude_none=True) | {"content": reply.content}
    unencodable = _unencodable_path(dumped, "message")
    if unencodable:
        raise _invalid("The text holds a lone surrogate, which is not valid Unicode.", unencodable)
    if reply.reasoning_content is not None and utf8_size(reply.reasoning_content) > MAX_CHAT_TEXT_BYTES:
        raise _invalid(
            f"message.reasoning_content is over {MAX_CHAT_TEXT_BYTES} bytes.", "message.reasoning_content"
        )
    return dumped


def parse_chat_submit(body: Mapping[str, Any]) -> ChatSubmit:
    """Read a chat job's submit (a body for which is_chat_submit holds); raise ChatSubmitInvalid.

    ChatModelMismatch needs the generation's assigned model and is the route's check.
    """
    if "generation" in body and "message" in body:
        raise _invalid("A chat submit sends message, not generation.", "generation")
    model_id = body.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        raise _invalid("A chat submit needs model_id, the model that served the job.", "model_id")
    state = body.get("state", "ok")
    if state not in CHAT_SUBMIT_STATES:
        raise _invalid("state is ok, censored, csam or faulted.", "state")
    if state == "faulted":
        fault_reason = body.get("fault_reason")
        return ChatSubmit(
            model_id=model_id,
            state=state,
            fault_reason=fault_reason if isinstance(fault_reason, str) else None,
        )
    message = _reply_message(body.get("message"))
    finish_reason = body.get("finish_reason")
    if finish_reason not in ChatFinishReason.__members__.values():
        raise _invalid(
            "A chat submit needs finish_reason: stop, length, content_filter or tool_calls.", "finish_reason"
        )
    assert finish_reason is not None  # one of the members, all strings
    if finish_reason == ChatFinishReason.TOOL_CALLS and not message.get("tool_calls"):
        raise _invalid("finish_reason tool_calls needs a non-empty message.tool_calls.", "finish_reason")
    native = body.get("native_finish_reason")
    if native is not None and (
        not isinstance(native, str) or len(native) > MAX_CHAT_NATIVE_FINISH_REASON_LENGTH
    ):
        raise _invalid(
            f"native_finish_reason is a string of at most {MAX_CHAT_NATIVE_FINISH_REASON_LENGTH} characters.",
            "native_finish_reason",
        )
    return ChatSubmit(
        model_id=model_id,
        state=state,
        message=message,
        finish_reason=ChatFinishReason(finish_reason),
        native_finish_reason=native,
        prompt_tokens=_count(body, "prompt_tokens"),
        completion_tokens=_count(body, "completion_tokens"),
        reasoning_tokens=_count(body, "reasoning_tokens"),
    )


# --- verification --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatVerifiedReply:
    message: dict[str, Any]  # tool calls reduced to the first under strict single-call
    finish_reason: str  # as stored (chat_reply_finish_reason)
    dropped_tool_calls: int = 0


def _nonconformant(text: str) -> ChatRefusal:
    return ChatRefusal("ChatSubmitNonconformant", text, param="message")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_json(content: str) -> Any:
    """Python's json with NaN and Infinity refused; raises ValueError."""
    return json.loads(content, parse_constant=_refuse_constant)


SCHEMA_CANNOT_COMPILE_MESSAGE = (
    "The request's response format schema cannot be compiled, so the reply cannot be shown to match it."
)


def _check_references(schema: Any, cls: Any) -> None:
    """Resolve every $ref of the schema now, inside the schema only (its own $id and embedded
    ones count as inside; nothing is retrieved); raises referencing's Unresolvable. Validation
    resolves a reference only when an instance reaches it, so a broken one could otherwise pass."""
    meta = cls.META_SCHEMA
    specification = specification_with(meta.get("$id") or meta.get("id") or "", default=DRAFT202012)
    root = specification.create_resource(schema)
    uri = root.id() or ""
    resolver = Registry().with_resource(uri, root).crawl().resolver(base_uri=uri)
    stack = [(resolver, root)]
    while stack:
        resolver, resource = stack.pop()
        resolver = resolver.in_subresource(resource)  # a subschema's $id moves the base
        ref = resource.contents.get("$ref") if isinstance(resource.contents, Mapping) else None
        if isinstance(ref, str):
            resolver.lookup(ref)
        stack.extend((resolver, sub) for sub in resource.subresources())


def schema_validator(schema: Any) -> Any:
    """A jsonschema validator for the draft the schema's $schema declares (2020-12 otherwise),
    resolving references only inside the schema; raises ValueError when it cannot compile.

    Compiled validators are kept by the schema's canonical JSON: a request's n replies, and the
    many requests of one client, share a schema, and compiling is most of a verification."""
    if not isinstance(schema, Mapping | bool):
        raise ValueError("not a schema")
    try:
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return _compile_validator(schema)
    return _cached_validator(key)


@lru_cache(maxsize=256)
def _cached_validator(key: str) -> Any:
    return _compile_validator(json.loads(key))


# --- the schema's regular expressions ----------------------------------------------------------
# A strict schema's pattern and patternProperties are the requester's, matched against the worker's
# reply. Python's re backtracks without bound and holds the interpreter lock while it does, so a
# pattern such as ^(a|aa)+$ against a few dozen characters would stop the whole web process. The
# schema's patterns are matched with the regex module instead, under one time budget for a reply
# (docs/adr/0069-bounded-work-for-what-clients-choose.md).
CHAT_SCHEMA_PATTERN_SECONDS = 0.5
SCHEMA_PATTERN_TIMEOUT_MESSAGE = (
    f"The reply could not be matched against the response format schema's patterns within "
    f"{CHAT_SCHEMA_PATTERN_SECONDS} seconds."
)
# jsonschema matches the patternProperties of every subschema with re while it collects the keys
# unevaluatedProperties has to check; a schema holding both is not checked (SCHEMA_CANNOT_COMPILE).
_UNBOUNDED_COMBINATION = ("patternProperties", "unevaluatedProperties")

_pattern_deadline: ContextVar[float | None] = ContextVar("schema_pattern_deadline", default=None)


class SchemaPatternTimeout(Exception):
    """The schema's patterns took more than CHAT_SCHEMA_PATTERN_SECONDS against one reply."""


def _pattern_search(pattern: str, text: str) -> bool:
    deadline = _pattern_deadline.get()
    remaining = CHAT_SCHEMA_PATTERN_SECONDS if deadline is None else deadline - time.monotonic()
    if remaining <= 0:
        raise SchemaPatternTimeout
    try:
        return regex.search(pattern, text, timeout=remaining) is not None
    except TimeoutError:
        raise SchemaPatternTimeout from None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _pattern_search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _pattern_search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(keyword: Callable[..., Iterator[ValidationError]]) -> Callable[..., Iterator[ValidationError]]:
    """The draft's own additionalProperties, but with patternProperties matched under the budget."""

    def check(validator: Any, additional: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
        patterns = schema.get("patternProperties") if isinstance(schema, Mapping) else None
        if not patterns or not validator.is_type(instance, "object"):
            yield from keyword(validator, additional, instance, schema)
            return
        properties = schema.get("properties", {})
        extras = sorted(
            (key for key in instance if key not in properties and not any(_pattern_search(p, key) for p in patterns)),
            key=str,
        )
        if validator.is_type(additional, "object"):
            for key in extras:
                yield from validator.descend(instance[key], additional, path=key)
        elif additional is False and extras:
            verb = "does" if len(extras) == 1 else "do"
            listed = ", ".join(repr(key) for key in extras)
            yield ValidationError(f"{listed} {verb} not match any of the regexes: {', '.join(map(repr, sorted(patterns)))}")

    return check


@cache
def _bounded(cls: Any) -> Any:
    """The draft's validator class with its regular expressions matched under the budget."""
    keywords = cls.VALIDATORS
    bounded: dict[str, Any] = {"pattern": _pattern, "patternProperties": _pattern_properties}
    if "additionalProperties" in keywords:
        bounded["additionalProperties"] = _additional_properties(keywords["additionalProperties"])
    return extend(cls, validators={name: check for name, check in bounded.items() if name in keywords})


def _schema_objects(schema: Any, cls: Any) -> Iterator[tuple[Mapping[str, Any], bool]]:
    """Each schema object of `schema` as the draft reads it (not property names, defaults or
    enums), with whether it is the root."""
    meta = cls.META_SCHEMA
    specification = specification_with(meta.get("$id") or meta.get("id") or "", default=DRAFT202012)
    stack = [(specification.create_resource(schema), True)]
    while stack:
        resource, root = stack.pop()
        if isinstance(resource.contents, Mapping):
            yield resource.contents, root
        stack.extend((sub, False) for sub in resource.subresources())


def _read_alike(pattern: str) -> bool:
    """Whether the regex module reads `pattern` as re and ECMA-262 do: it also reads a POSIX class
    inside a set ([[:alpha:]]) and a fuzzy constraint ({e<=1}), which re reads as literals."""
    escaped = in_set = False
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_set:
            if char == "[" and pattern[index + 1 : index + 2] == ":":
                return False
            in_set = char != "]"
        elif char == "[":
            in_set = True
            if pattern[index + 1 : index + 2] == "]":  # a leading ] is a member
                index += 1
        elif char == "{":
            end = pattern.find("}", index)
            body = pattern[index + 1 : end] if end != -1 else ""
            if not re.fullmatch(r"[0-9]*,?[0-9]*", body) and re.search(r"[eisd]", body):
                return False
        index += 1
    return True


def _check_bounded(schema: Any, cls: Any) -> None:
    """Refuse (ValueError) a schema whose patterns could escape the budget or be read otherwise:
    a $schema below the root (jsonschema would check that subschema with the draft's own class,
    matching with re), patternProperties with unevaluatedProperties, or a pattern the regex module
    reads differently from re."""
    keywords: set[str] = set()
    for node, root in _schema_objects(schema, cls):
        if "$schema" in node and not root:
            raise ValueError("a $schema below the root cannot be checked in bounded time")
        keywords.update(node)
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), Mapping):
            patterns.extend(str(key) for key in node["patternProperties"])
        if not all(_read_alike(pattern) for pattern in patterns):
            raise ValueError("a pattern uses a POSIX class or a fuzzy constraint, which re reads as literals")
    if set(_UNBOUNDED_COMBINATION) <= keywords:
        raise ValueError("patternProperties with unevaluatedProperties cannot be checked in bounded time")


def _compile_validator(schema: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unknown $schema falls back to 2020-12
        cls = validator_for(schema, default=Draft202012Validator)
    try:
        cls.check_schema(schema)
    except Exception as exc:
        raise ValueError(str(exc)) from None
    try:
        _check_references(schema, cls)
    except Exception as exc:  # Unresolvable: outside the schema or pointing nowhere
        raise ValueError(f"unresolvable reference: {exc!r}") from None
    try:
        _check_bounded(schema, cls)
    except ValueError:
        raise
    except Exception as exc:  # a subschema the draft's specification cannot read
        raise ValueError(str(exc)) from None
    # An empty registry: nothing is retrieved, so references resolve inside the schema only.
    return _bounded(cls)(schema, registry=Registry())


def schema_mismatch(schema: Any, instance: Any) -> str | None:
    """The first way `instance` fails `schema`, or None; raises ValueError when the schema
    cannot be compiled or its references do not resolve, and SchemaPatternTimeout when its
    patterns take more than CHAT_SCHEMA_PATTERN_SECONDS in all."""
    validator = schema_validator(schema)
    token = _pattern_deadline.set(time.monotonic() + CHAT_SCHEMA_PATTERN_SECONDS)
    try:
        error = next(iter(validator.iter_errors(instance)), None)
    except SchemaPatternTimeout:
        raise
    except Exception as exc:  # unresolvable reference, bad pattern, recursion...
        raise ValueError(str(exc)) from None
    finally:
        _pattern_deadline.reset(token)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"at {where}: {error.message[:200]}"


def chat_reply_finish_reason(
    finish_reason: str, message: Mapping[str, Any], extras: Mapping[str, Any] | None
) -> str:
    """The stored finish reason: tool_calls becomes stop under a function tool_choice, since
    OpenAI finishes such a choice with stop and the worker received it as required."""
    if (
        finish_reason == ChatFinishReason.TOOL_CALLS
        and message.get("tool_calls")
        and chat_tool_choice(extras or {}) == "function"
    ):
        return ChatFinishReason.STOP.value
    return str(finish_reason)


def verify_chat_reply(
    message: Mapping[str, Any],
    finish_reason: str,
    *,
    extras: Mapping[str, Any] | None,
    conformance: ChatConformance | str = ChatConformance.STRICT,
) -> ChatVerifiedReply:
    """Check a parsed reply (parse_chat_submit's message) against the stored chat_extras.

    Raises ChatSubmitInvalid (both modes) or ChatSubmitNonconformant (strict only).
    """
    extras = extras or {}
    strict = conformance == ChatConformance.STRICT
    reply = dict(message)
    calls = list(reply.get("tool_calls") or ())
    dropped = 0
    # The single-call reduction runs first, so a call it drops is not checked.
    if strict and extras.get("parallel_tool_calls") is False and len(calls) > 1:
        dropped = len(calls) - 1
        calls = calls[:1]
        reply["tool_calls"] = calls

    names = {
        tool["function"].get("name")
        for tool in chat_tools(extras)
        if isinstance(tool, Mapping)
        and isinstance(tool.get("function"), Mapping)
        and isinstance(tool["function"].get("name"), str)
    }
    seen: set[str] = set()
    for call in calls:
        name = call["function"]["name"]
        if not names:
            raise _invalid(
                "The reply carries tool calls, but the request has no tools.", "message.tool_calls"
            )
        if name not in names:
            raise _invalid(
                f"The reply calls the function '{name}', which the request's tools do not define.",
                "message.tool_calls",
            )
        if call["id"] in seen:
            raise _invalid(
                f"The reply carries two tool calls with the id '{call['id']}'.", "message.tool_calls"
            )
        seen.add(call["id"])

    if strict:
        choice = chat_tool_choice(extras)
        if choice == "none" and calls:
            raise _nonconformant("The reply calls a tool under tool_choice none.")
        if choice == "required" and not calls:
            raise _nonconformant("The reply does not call a tool under tool_choice required.")
        if choice == "function":
            forced = forced_tool_name(extras)
            if not calls or any(call["function"]["name"] != forced for call in calls):
                raise _nonconformant(
                    f"The reply does not call only the function '{forced}' the tool_choice forces."
                )
        _verify_response_format(reply, calls, extras)

    return ChatVerifiedReply(
        message=reply,
        finish_reason=chat_reply_finish_reason(finish_reason, reply, extras),
        dropped_tool_calls=dropped,
    )


def _verify_response_format(reply: Mapping[str, Any], calls: list[Any], extras: Mapping[str, Any]) -> None:
    response_format = extras.get("response_format")
    if not isinstance(response_format, Mapping):
        return
    kind = response_format.get("type")
    if kind not in ("json_object", "json_schema"):
        return
    content = reply.get("content")
    if not content and calls:
        return  # a tool call reply is exempt from the response format
    json_schema = response_format.get("json_schema") if kind == "json_schema" else None
    strict_schema = isinstance(json_schema, Mapping) and json_schema.get("strict") is True
    try:
        document = _parse_json(content or "")
    except (ValueError, RecursionError):
        raise _nonconformant("The reply's content is not JSON, as the response format requires.") from None
    if not strict_schema:
        if not isinstance(document, dict):
            raise _nonconformant("The reply's content is not a JSON object, as the response format requires.")
        return
    assert isinstance(json_schema, Mapping)  # strict_schema holds only for one
    try:
        mismatch = schema_mismatch(json_schema.get("schema"), document)
    except SchemaPatternTimeout:
        raise _nonconformant(SCHEMA_PATTERN_TIMEOUT_MESSAGE) from None
    except ValueError:
        raise _nonconformant(SCHEMA_CANNOT_COMPILE_MESSAGE) from None
    if mismatch:
        raise _nonconformant(f"The reply does not match the response format schema {mismatch}")


# --- pricing inputs --------------------------------------------------------------------------------


def chat_reply_characters(message: Mapping[str, Any]) -> int:
    """Characters charged and rewarded: content, reasoning, and each call's name and arguments."""
    total = len(message.get("content") or "") + len(message.get("reasoning_content") or "")
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        total += len(function.get("name") or "") + len(function.get("arguments") or "")
    return total


def chat_output_tokens(characters: int, max_length: int) -> int:
    """The output estimate's token count: characters / 4 rounded up, at least the text kudos
    minimum and at most the requested max_length."""
    return min(max(math.ceil(characters / CHARACTERS_PER_TOKEN), TEXT_KUDOS_MIN_TOKENS), max_length)
