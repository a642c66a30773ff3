"""The `response` object of a delivered reply, and its output items (docs/adr/0101-responses-api.md).

The output holds, in order: a reasoning item when the reply carries reasoning (shown as its
summary text: the worker's reasoning, under the chat route's `horde.include_reasoning`), a message
item with one `output_text` part when the reply has text or no tool calls, and a `function_call`
item per tool call. A reply cut at its length is `incomplete` with reason `max_output_tokens`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oai.mapping import Completion
from oai.responses.request import ResponsesRequest

# finish_reason -> incomplete_details.reason; every other finish is a completed response.
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_id(request_id: str) -> str:
    """The response's id, from the horde request's: one id names both."""
    return "resp_" + request_id.replace("-", "")


def item_ids(request_id: str) -> tuple[str, str, str]:
    """(reasoning, message, function call prefix) item ids of a request's reply."""
    suffix = request_id.replace("-", "")
    return f"rs_{suffix}", f"msg_{suffix}", f"fc_{suffix}"


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, *, status: str = "completed") -> dict[str, Any]:
    """The assistant's message item; `incomplete` when the reply was cut within it (OpenAI's
    status for a message ended by max_output_tokens), `in_progress` (without content) while open."""
    content = [output_text_part(text)] if status != "in_progress" else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    summary = [{"type": "summary_text", "text": text}] if text is not None else []
    return {"id": item_id, "type": "reasoning", "summary": summary}


def function_call_item(
    item_id: str,
    call: dict[str, Any],
    *,
    status: str = "completed",
    namespaced: Mapping[str, tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """A chat tool call as a `function_call` item; the call of a function of a namespace tool (its
    chat name in `namespaced`) is named as in its namespace, which the item carries."""
    name = call["function"]["name"]
    item = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": name,
        "arguments": call["function"]["arguments"] if status == "completed" else "",
    }
    if namespaced and name in namespaced:
        item["namespace"], item["name"] = namespaced[name]
    return item


def build_output(
    completion: Completion, request_id: str, namespaced: Mapping[str, tuple[str, str]] | None = None
) -> list[dict[str, Any]]:
    reasoning_id, message_id, call_prefix = item_ids(request_id)
    output: list[dict[str, Any]] = []
    if completion.reasoning:
        output.append(reasoning_item(reasoning_id, completion.reasoning))
    if completion.content or not completion.tool_calls:
        # A cut reply is cut in its last item: the message, unless tool calls follow it (as the
        # stream closes a message still open at its end; oai.responses.events).
        cut = completion_status(completion)[0] == "incomplete" and not completion.tool_calls
        output.append(message_item(message_id, completion.content or "", status="incomplete" if cut else "completed"))
    for i, call in enumerate(completion.tool_calls or ()):
        output.append(function_call_item(f"{call_prefix}_{i}", call, namespaced=namespaced))
    return output


def build_usage(completion: Completion) -> dict[str, Any]:
    usage = completion.usage
    details = usage.completion_tokens_details
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": details.reasoning_tokens if details else 0},
        "total_tokens": usage.total_tokens,
    }


def build_response_object(
    echo: Mapping[str, Any],
    request_id: str,
    *,
    created: int,
    model: str,
    status: str,
    output: list[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
    error: dict[str, Any] | None = None,
    x_horde: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `response` object: in progress (no output yet), completed, incomplete or failed."""
    body: dict[str, Any] = {
        "id": response_id(request_id),
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "model": model,
        "output": output or [],
        "service_tier": "default",
        "top_logprobs": 0,
        "max_tool_calls": None,
        "usage": usage,
        **echo,
    }
    if x_horde:
        body["x_horde"] = x_horde
    return body


# The keys of a `response` object that build_response_object sets itself; the others are its
# request's echo.
RESPONSE_OWN_KEYS = frozenset(
    {
        "id",
        "object",
        "created_at",
        "status",
        "error",
        "incomplete_details",
        "model",
        "output",
        "service_tier",
        "top_logprobs",
        "max_tool_calls",
        "usage",
        "x_horde",
    }
)


def queued_response(response: Mapping[str, Any], *, model: str) -> dict[str, Any]:
    """A background response's `queued` object as its create answered it (`model`: the one it was
    answered with), from any of its response objects, queued or finished."""
    echo = {key: value for key, value in response.items() if key not in RESPONSE_OWN_KEYS}
    request_id = response["id"].removeprefix("resp_")
    return build_response_object(echo, request_id, created=response["created_at"], model=model, status="queued")


def completion_status(completion: Completion) -> tuple[str, str | None]:
    """(status, incomplete reason) of a delivered reply."""
    reason = INCOMPLETE_REASONS.get(completion.finish_reason)
    return ("incomplete", reason) if reason else ("completed", None)


def build_response(completion: Completion, request: ResponsesRequest, request_id: str) -> dict[str, Any]:
    """The whole `response` object of a delivered reply."""
    return build_finished_response(completion, echo=request.echo, namespaced=request.namespaced, request_id=request_id)


def build_finished_response(
    completion: Completion,
    *,
    echo: Mapping[str, Any],
    namespaced: Mapping[str, tuple[str, str]],
    request_id: str,
) -> dict[str, Any]:
    """The whole `response` object of a delivered reply, from what its request echoes and its
    namespaced functions (a background response's, read back from its kept record)."""
    status, reason = completion_status(completion)
    return build_response_object(
        echo,
        request_id,
        created=completion.created,
        model=completion.model,
        status=status,
        output=build_output(completion, request_id, namespaced),
        usage=build_usage(completion),
        incomplete_reason=reason,
        x_horde=completion.x_horde,
    )
