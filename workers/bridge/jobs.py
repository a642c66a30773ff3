"""A horde job as a backend request, and the backend's answer as the horde submit.

Pure functions over dicts: the job payload (spec: "Chat job pop response"), the OpenAI request and
response bodies, and the structured submit (spec: "Structured submit", "Reasoning").
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contract.chat_declaration import ChatFaultReason, ChatFinishReason
from contract.chat_limits import (
    CHAT_SAMPLING_DEFAULTS,
    MAX_CHAT_NATIVE_FINISH_REASON_LENGTH,
    MAX_CHAT_REPORTED_TOKENS,
    MAX_CHAT_TEXT_BYTES,
    MAX_CHAT_TOOL_CALL_COUNT,
    MAX_CHAT_TOOL_CALL_ID_LENGTH,
)
from workers.bridge.backends import KIND_EXTRA_SAMPLING, BackendError

CHARS_PER_TOKEN = 4
TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")
# Ollama's /v1 reads reasoning_effort from 0.11.5 as none, low, medium or high (max from 0.22) and
# answered 400 "invalid reasoning value" to minimal and xhigh until 0.32.11, which clamps them
# itself (to low and max): sent as the nearest value every version reads.
OLLAMA_REASONING_EFFORT = {"minimal": "low", "xhigh": "high"}


# --- requests --------------------------------------------------------------------------------------


def _sampling(payload: dict[str, Any], kind: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """OpenAI sampling keys, plus the kind's own names for rep_pen/top_k/min_p when not neutral
    (`extra`: the names of the route the job goes to, where they are not the kind's /v1 ones)."""
    body: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        if payload.get(key) is not None:
            body[key] = payload[key]
    for key in ("frequency_penalty", "presence_penalty"):
        if payload.get(key):  # 0 is the default every server applies
            body[key] = payload[key]
    neutral = {"rep_pen": 1.0, "top_k": 0, "min_p": 0.0}
    for key, name in (KIND_EXTRA_SAMPLING.get(kind, {}) if extra is None else extra).items():
        value = payload.get(key)
        if value is not None and value != neutral[key]:
            body[name] = value
    return body


def chat_backend_request(payload: dict[str, Any], *, model: str, kind: str) -> dict[str, Any]:
    """The /v1/chat/completions body for a chat job: messages, sampling, tools as narrowed by the
    horde, response format and stop sequences; every sampling field the job carries."""
    body: dict[str, Any] = {
        "model": model,
        "messages": payload.get("messages") or [],
        "max_tokens": int(payload.get("max_length") or 512),
        **_sampling(payload, kind),
    }
    for key in ("temperature", "top_p"):
        body.setdefault(key, CHAT_SAMPLING_DEFAULTS[key])
    if payload.get("seed") is not None:
        body["seed"] = payload["seed"]
    if payload.get("reasoning_effort") is not None:
        effort = payload["reasoning_effort"]
        body["reasoning_effort"] = OLLAMA_REASONING_EFFORT.get(effort, effort) if kind == "ollama" else effort
    if payload.get("stop_sequence"):
        body["stop"] = list(payload["stop_sequence"])
    for key in TOOL_KEYS:
        if payload.get(key) is not None:
            body[key] = payload[key]
    if kind == "llamacpp" and isinstance(body.get("tool_choice"), dict):
        body.update(forced_function_for_llamacpp(body["tool_choice"], body.get("tools") or []))
    if isinstance(body.get("response_format"), dict):
        body.update(response_format_for(kind, body.pop("response_format")))
    return body


def forced_function_for_llamacpp(choice: dict[str, Any], tools: list[Any]) -> dict[str, Any]:
    """A named function choice in the form llama-server enforces: it reads tool_choice as a
    string (an object is taken as "auto", whose grammar is lazy), so "required" with the named
    tool alone. The horde already narrows a named choice so (spec: "Chat job pop response")."""
    name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
    named = [t for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") == name]
    return {"tool_choice": "required", "tools": named or tools}


# Any JSON object: what a json_object reply must be, as a schema a backend compiles to a grammar.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def response_format_for(kind: str, response_format: dict[str, Any]) -> dict[str, Any]:
    """The body keys that make `kind` enforce the job's response format.

    A json_object is sent where each backend compiles it into a grammar: llama.cpp turns a bare
    {"type": "json_object"} into an empty schema and constrains nothing, so it (and vLLM, whose
    structured outputs read the same form) gets the schema {"type": "object"}; TabbyAPI reads a
    schema from its json_schema field; Ollama's /v1 turns json_object into its format "json".
    """
    if response_format.get("type") != "json_object":
        return {"response_format": response_format}
    if kind in ("llamacpp", "vllm"):
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "json_object", "schema": dict(JSON_OBJECT_SCHEMA)}}}
    if kind == "tabbyapi":
        return {"json_schema": dict(JSON_OBJECT_SCHEMA)}
    return {"response_format": response_format}


def estimate_tokens(text: str) -> int:
    """The characters' estimate, where the backend has no tokenizer."""
    return -(-len(text) // CHARS_PER_TOKEN)


def trim_prompt_start(prompt: str, budget: int, count: Callable[[str], int]) -> tuple[str, int]:
    """The prompt cut from its start until `count` says it is at most `budget` tokens, as
    koboldcpp's worker keeps the end of a story that outgrew its context; (prompt, tokens)."""
    tokens = count(prompt)
    for _ in range(12):
        if tokens <= budget:
            return prompt, tokens
        if budget <= 0:
            return "", 0
        # Drop the share of characters the excess is, and count again (from above, so the kept
        # end is as long as fits).
        drop = max(1, -(-len(prompt) * (tokens - budget) // tokens))
        prompt = prompt[drop:]
        tokens = count(prompt)
    return prompt, tokens


# Ollama's text jobs go to its native /api/generate (OpenAIBackend.complete), whose options take these.
OLLAMA_TEXT_SAMPLING = {"rep_pen": "repeat_penalty", "top_k": "top_k", "min_p": "min_p"}


def text_backend_request(payload: dict[str, Any], *, model: str, kind: str) -> dict[str, Any]:
    """The /v1/completions body for a text job."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": payload.get("prompt") or "",
        "max_tokens": int(payload.get("max_length") or 80),
        **_sampling(payload, kind, OLLAMA_TEXT_SAMPLING if kind == "ollama" else None),
    }
    if payload.get("stop_sequence"):
        body["stop"] = list(payload["stop_sequence"])
    return body


# --- replies ----------------------------------------------------------------------------------------

_THINK_CLOSED = re.compile(r"^\s*<think>(?P<reasoning>.*?)</think>\s*(?P<content>.*)$", re.DOTALL)


def split_reasoning(content: str | None, reasoning: str | None = None) -> tuple[str | None, str | None]:
    """(content, reasoning_content): the backend's reasoning field, or a <think> block at the start
    of the content (an unclosed block cut off at max_length is all reasoning), or the text before a
    lone </think> (templates that open the block in the prompt). Reasoning never stays in content."""
    think: str | None = None
    if isinstance(content, str):
        match = _THINK_CLOSED.match(content)
        if match:
            think, content = match.group("reasoning").strip(), match.group("content")
        elif content.lstrip().startswith("<think>"):
            think, content = content.lstrip()[len("<think>"):].strip(), ""
        elif "</think>" in content and "<think>" not in content:
            think, _, content = content.partition("</think>")
            think, content = think.strip(), content.lstrip()
    parts = [p for p in (reasoning, think) if p]
    return content, ("\n".join(parts) if parts else None)


def _text_content(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_CHAT_REPORTED_TOKENS:
        return value
    return None


def _utf8_cut(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    return text if len(data) <= limit else data[:limit].decode("utf-8", "ignore")


_FINISH = {
    "stop": ChatFinishReason.STOP,
    "eos": ChatFinishReason.STOP,
    "eos_token": ChatFinishReason.STOP,
    "stop_sequence": ChatFinishReason.STOP,
    "end_turn": ChatFinishReason.STOP,
    "length": ChatFinishReason.LENGTH,
    "max_tokens": ChatFinishReason.LENGTH,
    "model_length": ChatFinishReason.LENGTH,
    "content_filter": ChatFinishReason.CONTENT_FILTER,
    "tool_calls": ChatFinishReason.TOOL_CALLS,
    "function_call": ChatFinishReason.TOOL_CALLS,
}


# vLLM ends a request its engine aborted (or failed) with these: the reply is cut off, not done.
_FAILED_FINISH = ("abort", "error")


def _refuse_failed_finish(native: Any) -> None:
    if isinstance(native, str) and native.lower() in _FAILED_FINISH:
        raise BackendError(f"backend ended the reply with finish_reason {native!r}")


def finish_reason(native: Any, has_calls: bool) -> ChatFinishReason:
    finish = _FINISH.get(str(native).lower(), ChatFinishReason.STOP) if native else ChatFinishReason.STOP
    if has_calls and finish == ChatFinishReason.STOP:
        return ChatFinishReason.TOOL_CALLS  # OpenAI finishes a reply with calls as tool_calls
    if finish == ChatFinishReason.TOOL_CALLS and not has_calls:
        return ChatFinishReason.STOP
    return finish


def _tool_calls(raw: Any) -> list[dict[str, Any]] | None:
    """The calls as the backend minted them; an id only where it gave none (or an unusable one)."""
    if not isinstance(raw, list) or not raw:
        return None
    calls = []
    for call in raw[:MAX_CHAT_TOOL_CALL_COUNT]:
        if not isinstance(call, dict):
            raise BackendError("backend answered a tool call that is not an object")
        function = call["function"] if isinstance(call.get("function"), dict) else {}
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise BackendError("backend answered a tool call without a function name", ChatFaultReason.TOOL_VIOLATION)
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {}, separators=(",", ":"))
        call_id = call.get("id")
        if not isinstance(call_id, str) or not 1 <= len(call_id) <= MAX_CHAT_TOOL_CALL_ID_LENGTH:
            call_id = f"call_{uuid.uuid4().hex[:24]}"
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


@dataclass
class ChatReply:
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: ChatFinishReason
    native_finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None

    @property
    def tokens(self) -> int:
        """Output tokens: the backend's count, else an estimate from the characters."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        chars = len(self.content or "") + len(self.reasoning or "")
        chars += sum(len(c["function"]["name"]) + len(c["function"]["arguments"]) for c in self.tool_calls or [])
        return -(-chars // CHARS_PER_TOKEN)


def parse_chat_response(response: dict[str, Any], *, split_think: bool = True) -> ChatReply:
    """The reply to submit. `split_think` false for a streamed reply, already split as it was
    posted (backends.ChatStreamReader.response): split again, a lone </think> would take off the
    content the front relayed, and the front would end the stream ChatStreamDiverged."""
    choice = response["choices"][0] if isinstance(response["choices"][0], dict) else {}
    message = choice["message"] if isinstance(choice.get("message"), dict) else {}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    content = _text_content(message.get("content"))
    reasoning = reasoning if isinstance(reasoning, str) else None
    if split_think:
        content, reasoning = split_reasoning(content, reasoning)
    calls = _tool_calls(message.get("tool_calls"))
    native = choice.get("finish_reason")
    _refuse_failed_finish(native)
    usage = response["usage"] if isinstance(response.get("usage"), dict) else {}
    details = usage["completion_tokens_details"] if isinstance(usage.get("completion_tokens_details"), dict) else {}
    if content is None and not calls:
        content = ""  # an empty reply is a completed reply
    if calls and not content:
        content = None  # as OpenAI answers a reply that only calls tools
    return ChatReply(
        content=content,
        reasoning=_utf8_cut(reasoning, MAX_CHAT_TEXT_BYTES) if reasoning else None,
        tool_calls=calls,
        finish_reason=finish_reason(native, bool(calls)),
        native_finish_reason=str(native)[:MAX_CHAT_NATIVE_FINISH_REASON_LENGTH] if native else None,
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        reasoning_tokens=_count(details.get("reasoning_tokens")),
    )


def forces_a_tool_call(payload: dict[str, Any]) -> bool:
    """Whether the job's tool controls force a call: tool_choice required or a named function."""
    choice = payload.get("tool_choice")
    return bool(payload.get("tools")) and (choice == "required" or isinstance(choice, dict))


# llama-server's grammar under tool_choice required lets text come before the call, so a model that
# talks first can reach max_tokens before it (ADR 0112): the grammar held, the budget ran out.
CUT_BEFORE_THE_CALL = "tool_choice required, and the reply was cut at max_tokens before the required call"


def reply_was_cut(reply: ChatReply) -> bool:
    """Whether the reply ended at its token budget (finish_reason length)."""
    return str(reply.finish_reason) == "length"


def enforce_tool_controls(payload: dict[str, Any], reply: ChatReply) -> str | None:
    """Hold the reply to the job's tool controls (as the horde narrowed them); the violation, or None.

    More than one call under parallel_tool_calls false keeps the first (as the horde does under
    strict), so it is not a violation.
    """
    tools = payload.get("tools") or []
    names = {
        t["function"].get("name") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
    }
    calls = reply.tool_calls or []
    for call in calls:
        if call["function"]["name"] not in names:
            return f"the model called '{call['function']['name']}', which the job does not define"
    ids = [call["id"] for call in calls]
    if len(set(ids)) != len(ids):
        return "the model repeated a tool call id"
    choice = payload.get("tool_choice")
    if forces_a_tool_call(payload) and not calls:
        if reply_was_cut(reply):
            return CUT_BEFORE_THE_CALL
        return "tool_choice required, and the model answered without a call"
    if isinstance(choice, dict):
        forced = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        stray = next((call["function"]["name"] for call in calls if call["function"]["name"] != forced), None)
        if stray is not None:
            return f"tool_choice names '{forced}', and the model called '{stray}'"
    if choice == "none" and calls:
        return "tool_choice none, and the model called a tool"
    if payload.get("parallel_tool_calls") is False and len(calls) > 1:
        reply.tool_calls = calls[:1]
    return None


def chat_submit_body(job_id: str, model_id: str, reply: ChatReply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    body: dict[str, Any] = {
        "id": job_id,
        "message": message,
        "finish_reason": str(reply.finish_reason),
        "model_id": model_id,
        "state": "ok",
    }
    if reply.native_finish_reason:
        body["native_finish_reason"] = reply.native_finish_reason
    for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
        value = getattr(reply, key)
        if value is not None:  # omitted when the backend did not report it
            body[key] = value
    return body


def chat_fault_body(job_id: str, model_id: str, fault_reason: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": job_id, "state": "faulted", "model_id": model_id}
    if fault_reason:
        body["fault_reason"] = str(fault_reason)
    return body


@dataclass
class TextReply:
    text: str
    completion_tokens: int | None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else -(-len(self.text) // CHARS_PER_TOKEN)


def parse_text_response(response: dict[str, Any]) -> TextReply:
    choice = response["choices"][0] if isinstance(response["choices"][0], dict) else {}
    text = choice.get("text")
    if not isinstance(text, str):
        raise BackendError("backend answered a completion without text")
    _refuse_failed_finish(choice.get("finish_reason"))
    usage = response["usage"] if isinstance(response.get("usage"), dict) else {}
    return TextReply(text=text, completion_tokens=_count(usage.get("completion_tokens")))


def text_submit_body(job_id: str, reply: TextReply) -> dict[str, Any]:
    return {"id": job_id, "generation": reply.text, "seed": 0}


def text_fault_body(job_id: str) -> dict[str, Any]:
    return {"id": job_id, "generation": "", "state": "faulted", "seed": 0}
