"""The reply side: the response shapes, the completion, usage estimate, model cards (spec:
chat_front.md, Response shape and Model card fields). Pure functions over plain dicts: the hot path
builds one reply. The request side (oai.schema) imports it, never the other way."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from contract.chat_limits import CHARS_PER_TOKEN_ESTIMATE
from contract.chat_shapes import ChatContextAdjustmentReason

EMPTY_REPLY_NOTICE = "The worker returned neither text nor tool calls."
BASE_SUPPORTED_PARAMETERS = ("max_tokens", "temperature", "top_p", "stop")
SAME_NAME_FEATURES = ("seed", "frequency_penalty", "presence_penalty")


# --- response shapes ------------------------------------------------------------------------------


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    native_finish_reason: str | None = None
    logprobs: None = None


# OpenRouter's top-level `provider`, the name of the upstream that served the request: clients typed on
# OpenRouter's reply (pydantic-ai's OpenRouterModel) require it on a whole reply (ADR 0087).
PROVIDER = "AI Horde"


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    provider: str = PROVIDER
    system_fingerprint: str | None
    choices: list[Choice]
    usage: Usage
    x_horde: dict[str, Any] = Field(default_factory=dict)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ai-horde"
    name: str
    context_length: int | None
    architecture: dict[str, Any]
    top_provider: dict[str, Any]
    supported_parameters: list[str]
    x_horde: dict[str, Any]


class RepliedRequest(Protocol):
    """What a reply reads of its request (oai.schema.ChatCompletionRequest): the reply side imports
    nothing of the request side."""

    def prompt_estimate(self) -> int:
        """The prompt's tokens as estimated when its worker reports none."""
        ...

    @property
    def include_reasoning(self) -> bool: ...

    @property
    def requested_models(self) -> list[str]: ...


def build_system_fingerprint(worker_id: str | None, model: str | None) -> str | None:
    if not worker_id:
        return None
    digest = hashlib.sha256(f"{worker_id}:{model or ''}".encode()).hexdigest()
    return f"fp_{digest[:10]}"


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN_ESTIMATE) if text else 0


def estimate_context_tokens(text: str) -> int:
    """The tokens a text prompt is asked a context for: an estimate that errs high (three ASCII
    characters a token, a token for each other character). A text worker cuts a prompt from its
    start to its job's context, and four characters a token is English's average (ADR 0111)."""
    ascii_characters = len(text.encode("ascii", "ignore"))
    return math.ceil(ascii_characters / 3) + len(text) - ascii_characters


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        parts.extend(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        parts.append(f"{function.get('name', '')}{function.get('arguments', '')}")
    return "\n".join(parts)


def estimate_prompt_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    return estimate_tokens("\n".join(f"{m.get('role')}: {_message_text(m)}" for m in messages))


def served_model(request: RepliedRequest, generation: Mapping[str, Any] | None) -> str:
    if generation and generation.get("model"):
        return generation["model"]
    return request.requested_models[0]


def reply_parts(generation: Mapping[str, Any]) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
    """(content, tool_calls, reasoning) of a finished generation's structured reply."""
    message = generation.get("message") or {}
    content = message.get("content") if "content" in message else generation.get("text")
    calls = message.get("tool_calls") or None
    reasoning = message.get("reasoning_content") or None
    return content, calls, reasoning


def build_usage(
    request: RepliedRequest,
    generation: Mapping[str, Any],
    content: str | None,
    calls: list[dict[str, Any]] | None,
    reasoning: str | None,
) -> tuple[Usage, bool]:
    """Usage with the worker's counts, estimated where it reported none; returns (usage, estimated)."""
    estimated = False
    prompt_tokens = generation.get("prompt_tokens")
    if prompt_tokens is None:
        prompt_tokens = request.prompt_estimate()
        estimated = True
    completion_tokens = generation.get("completion_tokens")
    if completion_tokens is None:
        text = (content or "") + (reasoning or "")
        text += "".join(f"{c['function']['name']}{c['function']['arguments']}" for c in calls or ())
        completion_tokens = estimate_tokens(text)
        estimated = True
    reasoning_tokens = generation.get("reasoning_tokens")
    usage = Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        completion_tokens_details=(
            CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
            if reasoning_tokens is not None
            else None
        ),
    )
    return usage, estimated


def build_x_horde(status: Mapping[str, Any], content: str | None, calls: Any) -> dict[str, Any]:
    x_horde: dict[str, Any] = {}
    if not content and not calls:
        x_horde["notice"] = EMPTY_REPLY_NOTICE
    if status.get("context_adjustments"):
        x_horde["context_adjustments"] = status["context_adjustments"]
    return x_horde


class Completion:
    """The delivered reply, shared by the JSON body and the stream's chunks."""

    __slots__ = (
        "id",
        "created",
        "model",
        "fingerprint",
        "content",
        "tool_calls",
        "reasoning",
        "finish_reason",
        "native_finish_reason",
        "usage",
        "estimated_usage",
        "x_horde",
        "queue_wait",
    )

    def __init__(
        self, request: RepliedRequest, request_id: str, created: int, status: Mapping[str, Any]
    ):
        generation = status["generations"][0]
        content, calls, reasoning = reply_parts(generation)
        self.id = f"chatcmpl-{request_id}"
        self.created = created
        self.model = served_model(request, generation)
        self.fingerprint = build_system_fingerprint(generation.get("worker_id"), generation.get("model"))
        self.content = content
        self.tool_calls = calls
        self.reasoning = reasoning if request.include_reasoning else None
        self.finish_reason = generation.get("finish_reason") or "stop"
        self.native_finish_reason = generation.get("native_finish_reason")
        self.usage, self.estimated_usage = build_usage(request, generation, content, calls, reasoning)
        self.x_horde = build_x_horde(status, content, calls)
        self.queue_wait = generation.get("queue_wait_seconds")

    @property
    def max_length_lowered(self) -> bool:
        """Whether the horde lowered the request's max_length to its workers' (the status's
        worker_max_length adjustment): a length finish then reflects the workers' limit."""
        return any(
            isinstance(a, Mapping) and a.get("reason") == ChatContextAdjustmentReason.WORKER_MAX_LENGTH
            for a in self.x_horde.get("context_adjustments") or ()
        )

    @property
    def empty(self) -> bool:
        """The reply x_horde.notice reports: neither text nor tool calls."""
        return not self.content and not self.tool_calls

    def tool_call_models(self) -> list[ToolCall] | None:
        if not self.tool_calls:
            return None
        return [
            ToolCall(
                id=c["id"],
                function=FunctionCall(name=c["function"]["name"], arguments=c["function"]["arguments"]),
            )
            for c in self.tool_calls
        ]


def build_completion(completion: Completion) -> dict[str, Any]:
    message = AssistantMessage(
        content=completion.content if (completion.content or not completion.tool_calls) else None,
        tool_calls=completion.tool_call_models(),
        reasoning_content=completion.reasoning,
    )
    if message.content is None and not completion.tool_calls:
        message.content = ""
    response = ChatCompletionResponse(
        id=completion.id,
        created=completion.created,
        model=completion.model,
        system_fingerprint=completion.fingerprint,
        choices=[
            Choice(
                message=message,
                finish_reason=completion.finish_reason,
                native_finish_reason=completion.native_finish_reason,
            )
        ],
        usage=completion.usage,
        x_horde=completion.x_horde,
    )
    data = response.model_dump(exclude_none=False)
    # content is always written; tool_calls and reasoning_content only when present.
    msg = data["choices"][0]["message"]
    for key in ("tool_calls", "reasoning_content"):
        if msg.get(key) is None:
            msg.pop(key, None)
    if data["usage"].get("completion_tokens_details") is None:
        data["usage"].pop("completion_tokens_details", None)
    if not data["x_horde"]:
        data.pop("x_horde")
    return data


def build_model_card(entry: Mapping[str, Any]) -> dict[str, Any]:
    """One /v1/models entry from a chat model list entry (GET /status/models?type=text&chat=true)."""
    chat = entry.get("chat") or {}
    features = set(chat.get("features") or ())
    supported = list(BASE_SUPPORTED_PARAMETERS)
    supported += [f for f in SAME_NAME_FEATURES if f in features]
    if "tools" in features:
        supported.append("tools")
        if "tool_choice_enforced" in features:
            supported.append("tool_choice")
        if "single_tool_call_enforced" in features:
            supported.append("parallel_tool_calls")
    if features & {"json_object", "json_schema"}:
        supported.append("response_format")
    modalities = ["text", "image"] if "vision" in features else ["text"]
    card = ModelCard(
        id=entry["name"],
        created=chat.get("created") or 0,
        name=entry["name"],
        context_length=chat.get("max_context_length"),
        architecture={"input_modalities": modalities, "output_modalities": ["text"]},
        top_provider={
            "context_length": chat.get("max_context_length"),
            "max_completion_tokens": chat.get("max_length"),
            "is_moderated": False,
        },
        supported_parameters=supported,
        x_horde={
            "workers": chat.get("workers", 0),
            "queued": entry.get("queued", 0),
            "jobs": entry.get("jobs", 0),
        },
    )
    return card.model_dump()
