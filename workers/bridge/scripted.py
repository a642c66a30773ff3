"""The scripted backend: no LLM, answers deterministically from the request (demo and tests).

It takes the same OpenAI-shaped bodies as a real backend and answers in the same shape, so the
bridge's job code runs unchanged. The same request always gets the same answer:

- tools forwarded (tool_choice auto or required) and the last message is not a tool result: one
  call to the first tool, with arguments that are a minimal valid instance of its parameters
  schema; finish_reason tool_calls. After a tool result (or under auto, when the last user message
  says "no tools"), a text answer.
- response_format json_schema: the minimal valid instance of the schema, as JSON; json_object:
  {"reply": "<text>"}.
- otherwise text: "Scripted reply to: <the last user text>", cut at max_tokens (4 characters a
  token; finish_reason length then).
- reasoning: with reasoning_effort other than none, the reply starts with a <think> block (as a
  reasoning model on a backend without a reasoning parser answers), which the bridge splits off;
  for a streamed job (`progress` given) it comes as reasoning_content, as a streamed reply reaches
  the bridge already split.
- text jobs (/v1/completions): the prompt's last line continued with a fixed sentence.

Directives in the last user message, for demos and tests: `[scripted:sleep=SECONDS]` waits first,
`[scripted:error]` fails as a backend error (generation_error), `[scripted:grammar-error]` as an
unbuildable grammar, `[scripted:overflow]` as a prompt over the context. A prompt whose estimate
(4 characters a token) plus max_tokens exceeds the context is refused as a real server refuses it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from typing import Any

from contract.chat_declaration import ChatFaultReason, ChatImageTransport
from contract.chat_policy import KNOWN_CHAT_DECLARATIONS
from workers.bridge.backends import BackendDown, BackendError, Capabilities, ProgressSink

CHARS_PER_TOKEN = 4
SCRIPTED_MODEL = "scripted"
SCRIPTED_CONTEXT = 32768
_DIRECTIVE = re.compile(r"\[scripted:(?P<name>[a-z-]+)(?:=(?P<value>[0-9.]+))?\]")


# --- a minimal valid instance of a JSON schema -----------------------------------------------------

_FORMAT_EXAMPLES = {
    "date-time": "2024-01-01T00:00:00Z",
    "date": "2024-01-01",
    "time": "00:00:00Z",
    "email": "user@example.org",
    "uri": "https://example.org/",
    "url": "https://example.org/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "hostname": "example.org",
}


def _resolve(ref: str, root: dict[str, Any]) -> Any:
    if not ref.startswith("#"):
        return {}
    node: Any = root
    for part in ref.lstrip("#").strip("/").split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part, {}) if isinstance(node, dict) else {}
    return node


def minimal_instance(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """The smallest value a schema accepts, for the common keywords (type, properties, required,
    items/minItems, enum/const, anyOf/oneOf/allOf, $ref, string/number bounds and formats)."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > 32:
        return None if schema is False else {}
    if "$ref" in schema:
        return minimal_instance(_resolve(schema["$ref"], root), root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return minimal_instance(schema[key][0], root, depth + 1)
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            part = _resolve(part["$ref"], root) if isinstance(part, dict) and "$ref" in part else part
            if isinstance(part, dict):
                for key, value in part.items():
                    if key == "properties":
                        merged.setdefault("properties", {}).update(value)
                    elif key == "required":
                        merged["required"] = [*merged.get("required", []), *value]
                    else:
                        merged.setdefault(key, value)
        return minimal_instance(merged, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind is None:
        if "properties" in schema or "required" in schema:
            kind = "object"
        elif "items" in schema or "prefixItems" in schema:
            kind = "array"
        else:
            return {}
    if kind == "object":
        properties = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        value = {name: minimal_instance(properties.get(name, {}), root, depth + 1) for name in required}
        for _ in range(max(0, int(schema.get("minProperties", 0)) - len(value))):
            name = next((p for p in properties if p not in value), None)
            if name is None:
                break
            value[name] = minimal_instance(properties[name], root, depth + 1)
        return value
    if kind == "array":
        prefix = schema["prefixItems"] if isinstance(schema.get("prefixItems"), list) else []
        items = schema["items"] if isinstance(schema.get("items"), dict) else {}
        count = max(int(schema.get("minItems", 0)), len(prefix))
        out = [minimal_instance(prefix[i], root, depth + 1) if i < len(prefix) else None for i in range(count)]
        for i in range(len(prefix), count):
            item = minimal_instance(items, root, depth + 1)
            if schema.get("uniqueItems") and isinstance(item, int | float) and not isinstance(item, bool):
                item = item + i
            out[i] = item
        return out
    if kind == "string":
        fmt = schema.get("format")
        text = _FORMAT_EXAMPLES.get(fmt, "") if isinstance(fmt, str) else ""
        min_length = int(schema.get("minLength", 0))
        if len(text) < min_length:
            text = text + "a" * (min_length - len(text))
        return text
    if kind in ("integer", "number"):
        return _minimal_number(schema, integer=kind == "integer")
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    return {}


def _minimal_number(schema: dict[str, Any], *, integer: bool) -> int | float:
    def num(key: str) -> float | None:
        value = schema.get(key)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    step = 1 if integer else 0.5
    value: float = 0
    minimum, exclusive_minimum = num("minimum"), num("exclusiveMinimum")
    maximum, exclusive_maximum = num("maximum"), num("exclusiveMaximum")
    if minimum is not None and value < minimum:
        value = minimum
    if exclusive_minimum is not None and value <= exclusive_minimum:
        value = exclusive_minimum + step
    if maximum is not None and value > maximum:
        value = maximum
    if exclusive_maximum is not None and value >= exclusive_maximum:
        value = exclusive_maximum - step
    multiple = num("multipleOf")
    if multiple and value % multiple:
        value = (value // multiple + 1) * multiple
    if integer:
        return int(math.ceil(value))
    return value


# --- the backend -----------------------------------------------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part.get("text", "") if part.get("type") == "text" else "[image]"
            for part in content
            if isinstance(part, dict)
        )
    return ""


def _estimate_tokens(text: str) -> int:
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


class ScriptedBackend:
    name = "scripted"

    def __init__(self, *, context: int = SCRIPTED_CONTEXT, model: str = SCRIPTED_MODEL):
        self.context = context
        self.model = model

    def close(self) -> None:
        pass

    def healthy(self) -> bool:
        return True

    # No tokenizer: the bridge estimates (4 characters a token, as this backend checks its context).
    def count_tokens(self, text: str) -> int | None:
        return None

    def count_chat_tokens(self, body: dict[str, Any]) -> int | None:
        return None

    def runtime_context(self, *, load: bool) -> int | None:
        return None  # its context never changes

    def probe(self, model: str | None) -> Capabilities:
        """Everything: it follows each part of the contract exactly, by construction."""
        caps = Capabilities(
            kind="scripted",
            model=model or self.model,
            context=self.context,
            features=set(KNOWN_CHAT_DECLARATIONS),
            image_transports={ChatImageTransport.BASE64, ChatImageTransport.URL, ChatImageTransport.MESSAGES_URL},
        )
        caps.notes.append(f"scripted backend: every feature and guarantee, context {self.context}")
        return caps

    # -- helpers

    def _directives(self, text: str) -> dict[str, str | None]:
        return {m.group("name"): m.group("value") for m in _DIRECTIVE.finditer(text)}

    def _run_directives(self, directives: dict[str, str | None], timeout: float) -> None:
        if "sleep" in directives:
            seconds = float(directives["sleep"] or 1)
            if seconds > timeout:
                time.sleep(max(timeout, 0))
                raise BackendDown("scripted backend timed out (sleep directive)")
            time.sleep(seconds)
        if "error" in directives:
            raise BackendError("scripted backend error (directive)", ChatFaultReason.GENERATION_ERROR, status=500)
        if "grammar-error" in directives:
            raise BackendError("scripted: failed to build the grammar", ChatFaultReason.UNBUILDABLE_GRAMMAR, status=400)
        if "overflow" in directives:
            raise BackendError("scripted: the prompt exceeds the context", ChatFaultReason.PROMPT_OVERFLOW, status=400)

    def _check_context(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.context:
            raise BackendError(
                f"scripted: the request exceeds the available context size ({prompt_tokens} + {max_tokens} > {self.context})",
                ChatFaultReason.PROMPT_OVERFLOW,
                status=400,
            )

    @staticmethod
    def _call_id(seed: str, index: int) -> str:
        return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]

    # -- Backend

    def chat(self, body: dict[str, Any], *, timeout: float, progress: ProgressSink | None = None) -> dict[str, Any]:
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        last_user = next((_text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        self._run_directives(self._directives(last_user), timeout)
        flattened = "\n".join(_text_of(m.get("content")) for m in messages)
        prompt_tokens = _estimate_tokens(flattened + json.dumps(body.get("tools") or []))
        max_tokens = int(body.get("max_tokens") or 512)
        self._check_context(prompt_tokens, max_tokens)
        seed = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()

        tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)]
        choice = body.get("tool_choice") or ("auto" if tools else "none")
        after_tool = bool(messages) and messages[-1].get("role") == "tool"
        wants_call = tools and choice != "none" and (
            choice == "required" or isinstance(choice, dict) or (not after_tool and "no tools" not in last_user.lower())
        )
        reasoning = None
        effort = body.get("reasoning_effort")
        if effort is not None and effort != "none":
            reasoning = f"The user wrote {len(last_user)} characters; effort {effort}. I answer plainly."

        message: dict[str, Any] = {"role": "assistant", "content": None}
        if wants_call:
            tool = tools[0]["function"]
            if isinstance(choice, dict):
                name = (choice.get("function") or {}).get("name")
                tool = next((t["function"] for t in tools if t["function"].get("name") == name), tool)
            arguments = minimal_instance(tool.get("parameters") or {"type": "object"})
            message["tool_calls"] = [
                {
                    "id": self._call_id(seed, 0),
                    "type": "function",
                    "function": {"name": tool.get("name"), "arguments": json.dumps(arguments, separators=(",", ":"))},
                }
            ]
            finish = "tool_calls"
            text = ""
        else:
            if after_tool:
                text = "The tool answered: " + _text_of(messages[-1].get("content"))
            else:
                text = f"Scripted reply to: {last_user}" if last_user else "Scripted reply."
            response_format = body.get("response_format") or {}
            kind = response_format.get("type") if isinstance(response_format, dict) else None
            if kind == "json_schema":
                schema = (response_format.get("json_schema") or {}).get("schema") or {}
                text = json.dumps(minimal_instance(schema), separators=(",", ":"))
            elif kind == "json_object":
                text = json.dumps({"reply": text})
            finish = "stop"
            budget = max_tokens * CHARS_PER_TOKEN
            if len(text) > budget and kind is None:
                text, finish = text[:budget], "length"
            message["content"] = text
        if reasoning is not None and progress is None:
            message["content"] = f"<think>{reasoning}</think>\n" + (message["content"] or "")
        elif reasoning is not None:
            # A streamed job's reply reaches the worker split as it was posted (ChatStreamReader), and
            # the worker does not split it again: the block goes apart here, as a stream would post it.
            message["reasoning_content"] = reasoning
        completion_tokens = _estimate_tokens((reasoning or "") + text + json.dumps(message.get("tool_calls") or ""))
        return {
            "id": "chatcmpl-" + seed[:24],
            "object": "chat.completion",
            "model": body.get("model") or self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                **(
                    {"completion_tokens_details": {"reasoning_tokens": _estimate_tokens(reasoning)}}
                    if reasoning
                    else {}
                ),
            },
        }

    def complete(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        prompt = str(body.get("prompt") or "")
        self._run_directives(self._directives(prompt), timeout)
        prompt_tokens = _estimate_tokens(prompt)
        max_tokens = int(body.get("max_tokens") or 80)
        self._check_context(prompt_tokens, max_tokens)
        text = " and the scripted story goes on, one sentence at a time."
        finish = "stop"
        budget = max_tokens * CHARS_PER_TOKEN
        if len(text) > budget:
            text, finish = text[:budget], "length"
        for stop in body.get("stop") or []:
            if stop and stop in text:
                text, finish = text[: text.index(stop)], "stop"
        return {
            "id": "cmpl-" + hashlib.sha256(prompt.encode()).hexdigest()[:24],
            "object": "text_completion",
            "model": body.get("model") or self.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": _estimate_tokens(text),
                "total_tokens": prompt_tokens + _estimate_tokens(text),
            },
        }
