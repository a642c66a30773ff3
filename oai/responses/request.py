"""A Responses API body as the chat route's request (docs/adr/0101-responses-api.md).

`instructions` and `input` become `messages`: a string input is one user message; a message item
keeps its role, its `input_text`/`output_text` parts become text and `input_image` an image part;
`function_call` items become the assistant's tool calls (consecutive calls share one message) and a
`function_call_output` item a tool message; reasoning items are dropped, as chat messages carry no
reasoning. The flat function tools (and the functions of a namespace tool, each named
`<namespace>__<name>`), `tool_choice`, `text.format`, `reasoning`, `max_output_tokens`
and `truncation` take their chat form. The chat route's screening and the contract then check the
result; a refusal names the path the client sent (`input[2].content`, not `messages[3].content`).
`previous_response_id` and `item_reference` items are resolved before (oai.responses.references)
from the responses the front keeps; what needs more stored state (`conversation`, `prompt`) and
every built-in tool is refused with 400. `background: true` is answered at once and read later
(oai.responses.background, docs/adr/0102-responses-background.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import PrivateAttr

from oai.errors import ChatFrontError
from oai.responses.references import PreparedBody
from oai.schema import ChatCompletionRequest, screen_request

# Top-level keys a Responses body may hold. The ones in STATEFUL_KEYS are refused unless null (or
# false); the rest are translated, checked here, or accepted and echoed.
RESPONSES_KEYS = frozenset(
    {
        "model",
        "models",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "reasoning",
        "stream",
        "stream_options",
        "store",
        "background",
        "metadata",
        "client_metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "truncation",
        "include",
        "top_logprobs",
        "horde",
        "previous_response_id",
    }
)
STATEFUL_KEYS = ("conversation", "prompt", "max_tool_calls", "context_management")
STATELESS_HINT = (
    "This AI Horde front keeps no conversations: send the whole conversation in 'input', or continue "
    "a response with 'previous_response_id'."
)
# `include` values the front accepts: they ask for data on items it never outputs (built-in tools'
# results, encrypted reasoning it does not have), so they change nothing. Log probabilities are not
# served, so `message.output_text.logprobs` is refused.
ACCEPTED_INCLUDES = frozenset(
    {
        "reasoning.encrypted_content",
        "message.input_image.image_url",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
    }
)
SERVICE_TIERS = ("auto", "default")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
TEXT_VERBOSITY = ("medium",)
TRUNCATION_CONTEXT_FIT = {"auto": "truncate_oldest", "disabled": "reject"}
FUNCTION_TOOL_KEYS = ("name", "description", "parameters", "strict")
# A function `f` of a namespace tool `ns` is the chat function `ns__f`; its calls come back as `f`
# with `namespace: "ns"` (ADR 0101, "Namespace tools").
NAMESPACE_SEPARATOR = "__"
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# Content part types of a message item -> what the chat message holds.
TEXT_PART_TYPES = ("input_text", "output_text", "text", "refusal")


def _unsupported(param: str, message: str) -> ChatFrontError:
    return ChatFrontError(400, "UnsupportedChatParameter", message, param=param, should_retry=False)


def _bad(param: str | None, message: str) -> ChatFrontError:
    return ChatFrontError(400, "BadRequest", message, param=param, should_retry=False)


def _conflict(param: str, message: str) -> ChatFrontError:
    return ChatFrontError(400, "ChatRequestConflict", message, param=param, should_retry=False)


def _object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(path, f"Invalid type for '{path}': expected an object, but got {_type_name(value)} instead.")
    return value


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if value is None:
        return "null"
    return "an object"


class ResponsesRequest(ChatCompletionRequest):
    """The screened chat request, what the `response` object echoes of the Responses body, and what
    its response keeps (oai.response_items): this request's own input and the response it continues."""

    echo: dict[str, Any]
    turn_input: list[dict[str, Any]]
    previous_response_id: str | None = None
    # The chat name of each function of a namespace tool -> (its namespace, its own name).
    namespaced: dict[str, tuple[str, str]] = {}
    # Answered at once as queued, and read later (oai.responses.background).
    background: bool = False
    # The Responses path of each chat message and tool: the horde's refusals at submit (an unreadable
    # image, an input no context holds) name the chat body's paths.
    _translation: _Translation | None = PrivateAttr(default=None)

    def responses_error(self, error: ChatFrontError) -> ChatFrontError:
        """`error` of the chat route (its submit or its wait) naming what the client sent."""
        if self._translation is not None:
            _name_responses_paths(error, self._translation)
        return error


class _Translation:
    """The chat body being built, with the Responses path of each message and tool call."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.message_paths: list[str] = []
        self.call_paths: dict[tuple[int, int], str] = {}
        # The chat name of each function of a namespace tool -> (its namespace, its own name).
        self.namespaced: dict[str, tuple[str, str]] = {}
        self.tool_paths: list[str] = []  # the Responses path of each chat tool

    def add(self, message: dict[str, Any], path: str) -> None:
        self.messages.append(message)
        self.message_paths.append(path)

    def add_call(self, call: dict[str, Any], path: str) -> None:
        """A function_call item: joins the assistant message just before it (its text, or the calls
        before it), else starts an assistant message."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            self.add({"role": "assistant", "content": None, "tool_calls": []}, path)
            last = self.messages[-1]
        last.setdefault("tool_calls", [])
        self.call_paths[(len(self.messages) - 1, len(last["tool_calls"]))] = path
        last["tool_calls"].append(call)

    def responses_param(self, param: str | None) -> str | None:
        """The Responses path of a chat route's error param."""
        if not param:
            return param
        if param == "messages":
            return "input"
        match = re.match(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\])?(.*)$", param)
        if match:
            index, call, rest = int(match[1]), match[2], match[3]
            if index >= len(self.message_paths):
                return "input"
            if call is not None:
                path = self.call_paths.get((index, int(call)), self.message_paths[index])
                rest = {".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id"}.get(
                    rest, rest
                )
                return path + rest
            path = self.message_paths[index]
            if path in ("instructions", "previous_response_id"):
                return path
            if rest == ".tool_call_id":
                rest = ".call_id"
            image = re.match(r"(\.content\[\d+\])\.image_url\.(url|detail)$", rest)
            if image:  # an input_image part holds its URL as image_url, and its detail itself
                rest = image[1] + (".image_url" if image[2] == "url" else ".detail")
            elif rest.startswith(".content") and self.messages[index]["role"] == "tool":
                rest = ".output" + rest[len(".content") :]
            elif rest == ".role" and self.messages[index]["role"] == "tool":
                rest = ".call_id"  # a function_call_output without its call: it has no role
            elif rest == ".tool_calls":
                rest = ""  # the function_call items that make this assistant message
            return path + rest
        for chat, responses in (
            ("max_completion_tokens", "max_output_tokens"),
            ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"),
            ("reasoning_effort", "reasoning.effort"),
            ("tool_choice.function.name", "tool_choice.name"),
            ("tool_choice.function", "tool_choice"),
        ):
            if param == chat or param.startswith((chat + ".", chat + "[")):
                return responses + param[len(chat) :]
        tool = re.match(r"tools\[(\d+)\]\.function(.*)$", param)
        if tool:
            index = int(tool[1])
            path = self.tool_paths[index] if index < len(self.tool_paths) else f"tools[{index}]"
            return path + tool[2]
        return param


def _text_of_parts(parts: list[Any], path: str, *, images: bool) -> str | list[dict[str, Any]]:
    """A message item's content parts in the chat form: text only -> one string; with images (a
    user message) -> chat content parts."""
    chat_parts: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        part_path = f"{path}[{j}]"
        part = _object(part, part_path)
        kind = part.get("type")
        if kind in TEXT_PART_TYPES:
            key = "refusal" if kind == "refusal" else "text"
            text = part.get(key)
            if not isinstance(text, str):
                raise _bad(f"{part_path}.{key}", f"Invalid type for '{part_path}.{key}': expected a string.")
            chat_parts.append({"type": "text", "text": text})
        elif kind == "input_image" and images:
            if part.get("file_id") is not None:
                raise _unsupported(
                    f"{part_path}.file_id",
                    f"Unsupported parameter: '{part_path}.file_id'; this AI Horde front has no file store: send "
                    "the image as 'image_url' (an https URL or a data URL).",
                )
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _bad(f"{part_path}.image_url", f"Missing required parameter: '{part_path}.image_url'.")
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            chat_parts.append({"type": "image_url", "image_url": image})
        else:
            shown = kind if isinstance(kind, str) else json.dumps(kind)
            raise _unsupported(
                f"{part_path}.type",
                f"Unsupported value: {part_path}.type={shown}; the AI Horde serves input_text"
                + (", input_image" if images else "")
                + " and output_text parts here.",
            )
    if all(part["type"] == "text" for part in chat_parts):
        return "".join(part["text"] for part in chat_parts)
    return chat_parts


def _message_item(item: Mapping[str, Any], path: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        shown = role if isinstance(role, str) else json.dumps(role)
        raise _unsupported(
            f"{path}.role",
            f"Unsupported value: {path}.role={shown}; the AI Horde serves the roles user, system, developer "
            "and assistant.",
        )
    content = item.get("content")
    if isinstance(content, list):
        content = _text_of_parts(content, f"{path}.content", images=role == "user")
    elif not isinstance(content, str):
        raise _bad(f"{path}.content", f"Invalid type for '{path}.content': expected a string or an array of parts.")
    return {"role": role, "content": content}


def _output_text(output: Any, path: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        text = _text_of_parts(output, path, images=False)
        if isinstance(text, str):
            return text
    raise _bad(path, f"Invalid type for '{path}': expected a string or an array of input_text parts.")


def _string(item: Mapping[str, Any], key: str, path: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        if value is None:
            raise _bad(f"{path}.{key}", f"Missing required parameter: '{path}.{key}'.")
        raise _bad(f"{path}.{key}", f"Invalid type for '{path}.{key}': expected a string.")
    return value


def _translate_item(raw: Any, path: str, translation: _Translation) -> None:
    item = _object(raw, path)
    kind = item.get("type", "message")
    if kind == "message":
        translation.add(_message_item(item, path), path)
    elif kind == "function_call":
        name = _string(item, "name", path)
        if item.get("namespace") is not None:
            name = namespaced_name(_string(item, "namespace", path), name)
        call = {
            "id": _string(item, "call_id", path),
            "type": "function",
            "function": {"name": name, "arguments": _string(item, "arguments", path)},
        }
        translation.add_call(call, path)
    elif kind == "function_call_output":
        message = {
            "role": "tool",
            "tool_call_id": _string(item, "call_id", path),
            "content": _output_text(item.get("output"), f"{path}.output"),
        }
        translation.add(message, path)
    elif kind == "reasoning":
        return  # chat messages carry no reasoning; a model is not shown its past reasoning
    elif kind == "item_reference":  # resolved before screening (oai.responses.references)
        raise _unsupported(f"{path}.type", f"Unsupported value: {path}.type=item_reference. {STATELESS_HINT}")
    else:
        shown = kind if isinstance(kind, str) else json.dumps(kind)
        raise _unsupported(
            f"{path}.type",
            f"Unsupported value: {path}.type={shown}; the AI Horde serves message, function_call, "
            "function_call_output and reasoning items.",
        )


# What a kept turn holds of each input item and content part: the keys the translation reads. The
# others (what clients echo, or anything else) were never screened, and reasoning items are never
# sent again: kept, they would let one request park up to its whole body in the store for hours.
KEPT_ITEM_KEYS = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "namespace", "arguments"),
    "function_call_output": ("call_id", "output"),
}
KEPT_PART_KEYS = ("type", "text", "refusal", "image_url", "detail")


def _kept_item(item: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = item.get("type", "message")
    keys = KEPT_ITEM_KEYS.get(kind)
    if keys is None:
        return None
    kept = {"type": kind, **{key: item[key] for key in keys if key in item}}
    for key in ("content", "output"):
        if isinstance(kept.get(key), list):
            kept[key] = [{k: part[k] for k in KEPT_PART_KEYS if k in part} for part in kept[key]]
    return kept


def turn_input(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """This request's own input as items (a string is one user message), screened: what its
    response keeps for a later previous_response_id."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    kept = (_kept_item(item) for item in value or () if isinstance(item, Mapping))
    return [item for item in kept if item is not None]


def _translate_input(body: Mapping[str, Any], history: list[dict[str, Any]], translation: _Translation) -> None:
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "Invalid type for 'instructions': expected a string.")
        translation.add({"role": "system", "content": instructions}, "instructions")
    for item in history:  # the kept conversation of previous_response_id
        _translate_item(item, "previous_response_id", translation)
    value = body.get("input")
    if value is None:
        raise _bad("input", "Missing required parameter: 'input'.")
    if isinstance(value, str):
        translation.add({"role": "user", "content": value}, "input")
        return
    if not isinstance(value, list):
        raise _bad("input", "Invalid type for 'input': expected a string or an array of input items.")
    for i, raw in enumerate(value):
        _translate_item(raw, f"input[{i}]", translation)
    if not translation.messages:
        raise _bad("input", "Invalid 'input': no message to answer. Expected at least one message item.")


def namespaced_name(namespace: str, name: str) -> str:
    """The chat function name of a function in a namespace tool (ADR 0101, "Namespace tools")."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _function_tool(tool: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    function = {k: tool[k] for k in FUNCTION_TOOL_KEYS if k in tool}
    if name is not None:
        function["name"] = name
    return {"type": "function", "function": function}


def _unsupported_tool(tool: Mapping[str, Any], path: str) -> ChatFrontError:
    kind = tool.get("type")
    shown = kind if isinstance(kind, str) else json.dumps(kind)
    return _unsupported(
        f"{path}.type",
        f"Unsupported value: {path}.type={shown}; the AI Horde serves function tools only "
        "(and namespaces of function tools).",
    )


def _translate_tools(body: Mapping[str, Any], chat: dict[str, Any], translation: _Translation) -> None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools", "Invalid type for 'tools': expected an array of tools.")
    chat_tools = []
    flat_paths: dict[str, str] = {}  # the name of each function tool outside a namespace -> its path
    for i, raw in enumerate(tools or ()):
        path = f"tools[{i}]"
        tool = _object(raw, path)
        if tool.get("type") == "namespace":
            namespace = _string(tool, "name", path)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise _bad(f"{path}.tools", f"Invalid type for '{path}.tools': expected an array of tools.")
            for j, raw_inner in enumerate(inner):
                inner_path = f"{path}.tools[{j}]"
                function = _object(raw_inner, inner_path)
                if function.get("type") != "function":
                    raise _unsupported_tool(function, inner_path)
                name = namespaced_name(namespace, _string(function, "name", inner_path))
                translation.namespaced[name] = (namespace, function["name"])
                translation.tool_paths.append(inner_path)
                chat_tools.append(_function_tool(function, name))
            continue
        if tool.get("type") != "function":
            raise _unsupported_tool(tool, path)
        if isinstance(tool.get("name"), str):
            flat_paths.setdefault(tool["name"], path)
        translation.tool_paths.append(path)
        chat_tools.append(_function_tool(tool))
    for name, (namespace, inner_name) in translation.namespaced.items():
        if name in flat_paths:
            raise _conflict(
                f"{flat_paths[name]}.name",
                f"The function '{name}' has the name the AI Horde gives the function '{inner_name}' of "
                f"namespace '{namespace}'; rename one of them.",
            )
    if chat_tools:
        chat["tools"] = chat_tools
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        if choice.get("type") != "function":
            kind = choice.get("type")
            shown = kind if isinstance(kind, str) else json.dumps(kind)
            raise _unsupported(
                "tool_choice.type",
                f"Unsupported value: tool_choice.type={shown}; the AI Horde serves 'auto', 'none', 'required' "
                "and a function by name.",
            )
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None and (chat_tools or choice not in ("auto", "none")):
        # Without tools, "auto" and "none" ask for nothing (OpenAI takes them); "required" or a
        # function is refused by the chat route's check, at tool_choice.
        chat["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None and chat_tools:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]


def _translate_text(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    text = body.get("text")
    if text is None:
        return
    text = _object(text, "text")
    for key in text:
        if key not in ("format", "verbosity"):
            raise _unsupported(f"text.{key}", f"Unknown parameter: 'text.{key}'.")
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity not in TEXT_VERBOSITY:
        raise _unsupported(
            "text.verbosity",
            f"Unsupported value: 'text.verbosity' is not supported by the AI Horde; send it at its default "
            f"({', '.join(json.dumps(v) for v in TEXT_VERBOSITY)}) or leave it out.",
        )
    fmt = text.get("format")
    if fmt is None:
        return
    fmt = _object(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {key: value for key, value in fmt.items() if key != "type"},
        }
    else:
        chat["response_format"] = dict(fmt)


def _translate_reasoning(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return
    reasoning = _object(reasoning, "reasoning")
    for key in reasoning:
        if key not in ("effort", "summary", "generate_summary"):
            raise _unsupported(f"reasoning.{key}", f"Unknown parameter: 'reasoning.{key}'.")
    for key in ("summary", "generate_summary"):
        value = reasoning.get(key)
        if value is not None and value not in REASONING_SUMMARIES:
            raise _bad(
                f"reasoning.{key}",
                f"Invalid value for 'reasoning.{key}': expected one of {', '.join(REASONING_SUMMARIES)}.",
            )
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]


def _check_accepted(body: Mapping[str, Any]) -> None:
    """The keys accepted without a chat form: typed, and at a value the front can honour."""
    for key in ("store", "parallel_tool_calls", "background"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise _bad(key, f"Invalid type for '{key}': expected a boolean.")
    for key in ("safety_identifier", "prompt_cache_key", "prompt_cache_retention"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise _bad(key, f"Invalid type for '{key}': expected a string.")
    client_metadata = body.get("client_metadata")
    if client_metadata is not None and not (
        isinstance(client_metadata, Mapping) and all(isinstance(v, str) for v in client_metadata.values())
    ):
        raise _bad("client_metadata", "Invalid type for 'client_metadata': expected an object of strings.")
    options = body.get("stream_options")
    if options is not None:
        options = _object(options, "stream_options")
        for key, value in options.items():
            if key != "include_obfuscation":
                raise _unsupported(f"stream_options.{key}", f"Unknown parameter: 'stream_options.{key}'.")
            if not isinstance(value, bool):
                raise _bad(
                    "stream_options.include_obfuscation",
                    "Invalid type for 'stream_options.include_obfuscation': expected a boolean.",
                )
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise _unsupported(
            "service_tier",
            "Unsupported value: 'service_tier' is not supported by the AI Horde; send it at its default "
            '("auto", "default") or leave it out.',
        )
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or top != 0):
        raise _unsupported(
            "top_logprobs",
            "Unsupported value: 'top_logprobs' is not supported by the AI Horde; send 0 or leave it out.",
        )
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise _bad("include", "Invalid type for 'include': expected an array of strings.")
        for i, value in enumerate(include):
            if not isinstance(value, str) or value not in ACCEPTED_INCLUDES:
                shown = value if isinstance(value, str) else json.dumps(value)
                raise _unsupported(
                    f"include[{i}]",
                    f"Unsupported value: include[{i}]={shown} is not supported by the AI Horde.",
                )
    truncation = body.get("truncation")
    if truncation is not None and (not isinstance(truncation, str) or truncation not in TRUNCATION_CONTEXT_FIT):
        raise _bad("truncation", "Invalid value for 'truncation': expected 'auto' or 'disabled'.")


def _refuse_stateful(body: Mapping[str, Any]) -> None:
    for key in STATEFUL_KEYS:
        value = body.get(key)
        if value is None or value is False:
            continue
        raise _unsupported(key, f"Unsupported parameter: '{key}'. {STATELESS_HINT}")


def _check_background(body: Mapping[str, Any], *, keeps_items: bool) -> None:
    """`background: true` (docs/adr/0102-responses-background.md): kept, so never with store false. With
    `stream: true` it is streamed as oai.responses.background_stream builds it (ADR 0106)."""
    if body.get("background") is not True:
        return
    if body.get("store") is False:
        raise _bad("store", "Background mode requires 'store' to be true; this request sent store: false.")
    if not keeps_items:
        raise _unsupported(
            "background",
            "Unsupported parameter: 'background'. This AI Horde front keeps no responses "
            "(HORDE_OAI_RESPONSE_ITEMS_SECONDS is 0), and a background response is read from what it keeps.",
        )


def chat_body_from_responses(
    body: Mapping[str, Any], history: list[dict[str, Any]] | None = None
) -> tuple[dict[str, Any], _Translation]:
    """The chat completions body of a Responses body continuing `history` (the kept conversation of
    its previous_response_id), and the paths to name its errors by."""
    _refuse_stateful(body)
    for key in body:
        if key not in RESPONSES_KEYS and key not in STATEFUL_KEYS:
            raise _unsupported(str(key), f"Unrecognized request argument supplied: {key}")
    _check_accepted(body)
    translation = _Translation()
    _translate_input(body, history or [], translation)
    chat: dict[str, Any] = {"messages": translation.messages}
    for key in ("model", "models", "temperature", "top_p", "stream", "metadata", "user", "horde"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    _translate_tools(body, chat, translation)
    _translate_text(body, chat)
    _translate_reasoning(body, chat)
    truncation = body.get("truncation")
    if truncation is not None:
        horde = chat.get("horde")
        fit = TRUNCATION_CONTEXT_FIT[truncation]
        if isinstance(horde, Mapping) and horde.get("context_fit") not in (None, fit):
            raise _conflict(
                "truncation",
                f"'truncation' is '{truncation}' and 'horde.context_fit' is {json.dumps(horde['context_fit'])}; "
                "send one of them.",
            )
        if horde is None or isinstance(horde, Mapping):
            chat["horde"] = {**(horde or {}), "context_fit": fit}
    return chat, translation


# The chat route's names a refusal's message may still hold (past its param), as the client sent them.
MESSAGE_NAMES = (
    ("'messages'", "'input'"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("reasoning_effort", "reasoning.effort"),
)


# The chat route's tool history rules (contract.chat_policy), in the Responses API's items. A call id
# is the client's string, line breaks included (DOTALL).
TOOL_HISTORY_MESSAGES = (
    (
        re.compile(
            r"An assistant message with 'tool_calls' must be followed by tool \w+ responding to each "
            r"'tool_call_id'\. The following tool_call_ids did not have response \w+: "
        ),
        "Each function_call item must be followed by a function_call_output item with its call_id. The "
        "following call_ids have none: ",
    ),
    (
        re.compile(r"messages with role 'tool' must be a response to a preceding message with 'tool_calls'\."),
        "a function_call_output item must follow the function_call item with its call_id.",
    ),
    (
        re.compile(r"'tool_call_id' of '(.*)' not found in 'tool_calls' of previous message\.", re.DOTALL),
        r"'call_id' of '\1' not found in the function_call items before it.",
    ),
    (
        re.compile(r"the tool call id '(.*)' is repeated in 'tool_calls'\.", re.DOTALL),
        r"the call_id '\1' is repeated in the function_call items.",
    ),
)


def _responses_names(message: str) -> str:
    for chat, responses in MESSAGE_NAMES:
        message = message.replace(chat, responses)
    for pattern, responses in TOOL_HISTORY_MESSAGES:
        message = pattern.sub(responses, message)
    return message


def _echo_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    if tool.get("type") == "namespace":
        return {
            "type": "namespace",
            "name": tool["name"],
            "description": tool.get("description") or "",
            "tools": [_echo_tool(inner) for inner in tool["tools"]],
        }
    return {"type": "function", "strict": None, **{k: tool[k] for k in FUNCTION_TOOL_KEYS if k in tool}}


def _echo(body: Mapping[str, Any], request: ChatCompletionRequest, *, keeps_items: bool) -> dict[str, Any]:
    """What the `response` object echoes: the client's own values, in the Responses shape; `store`
    says whether its output items are kept for item_reference (the client's store, default true,
    on a front that keeps items)."""
    tools = [_echo_tool(tool) for tool in body.get("tools") or ()]
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    reasoning = body.get("reasoning") or {}
    horde = request.chat.horde
    return {
        "background": body.get("background") is True,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": body.get("previous_response_id"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        # `generate_summary` is the deprecated name of `summary`: the response echoes it as `summary`.
        "reasoning": {
            "effort": reasoning.get("effort"),
            "summary": reasoning.get("summary") or reasoning.get("generate_summary"),
        },
        "safety_identifier": body.get("safety_identifier"),
        "store": keeps_items and body.get("store") is not False,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": fmt, "verbosity": "medium"},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": tools,
        "top_p": body.get("top_p", 1.0),
        "truncation": "auto" if horde.context_fit == "truncate_oldest" else "disabled",
        "user": body.get("user"),
    }


def screen_responses_request(prepared: PreparedBody, *, keeps_items: bool = False) -> ResponsesRequest:
    """A Responses body (its references resolved) screened as the chat route screens its own; raises
    ChatFrontError naming the Responses path of what it refuses."""
    raw_body = prepared.body
    if not isinstance(raw_body, Mapping):
        raise _bad(None, "The request body has to be a JSON object.")
    chat, translation = chat_body_from_responses(raw_body, prepared.history)
    _check_background(raw_body, keeps_items=keeps_items)
    try:
        request = screen_request(chat)
    except ChatFrontError as error:
        _name_responses_paths(error, translation)
        raise
    screened = ResponsesRequest(
        **dict(request),
        echo=_echo(raw_body, request, keeps_items=keeps_items),
        turn_input=turn_input(raw_body),
        previous_response_id=prepared.previous_response_id,
        namespaced=translation.namespaced,
        background=raw_body.get("background") is True,
    )
    screened._translation = translation
    return screened


def _name_responses_paths(error: ChatFrontError, translation: _Translation) -> None:
    """The chat route's param and names in `error` as the Responses body's."""
    param = translation.responses_param(error.param)
    if param != error.param and error.param:
        error.message = error.message.replace(error.param, param or "")
        error.param = param
    error.message = _responses_names(error.message)
