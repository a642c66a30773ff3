"""A worker's chat declaration on pop, and the worker-side vocabularies (fault, finish, transport)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from contract.chat_errors import ChatDeclarationInvalid
from contract.chat_policy import KNOWN_CHAT_DECLARATIONS


class ChatImageTransport(StrEnum):
    URL = "url"
    BASE64 = "base64"
    MESSAGES_URL = "messages_url"  # offloaded messages; does not by itself receive images


IMAGE_RECEIVING_TRANSPORTS = frozenset({ChatImageTransport.URL, ChatImageTransport.BASE64})
KNOWN_IMAGE_TRANSPORTS = frozenset(t.value for t in ChatImageTransport)


class ChatFaultReason(StrEnum):
    """Why a worker faulted a chat job (a faulted submit's fault_reason)."""

    PROMPT_OVERFLOW = "prompt_overflow"
    UNBUILDABLE_GRAMMAR = "unbuildable_grammar"
    TOOL_VIOLATION = "tool_violation"
    REPLY_REFUSED = "reply_refused"
    GENERATION_ERROR = "generation_error"


# The stored chat_fault_reason per value; the horde never stores text from the worker.
CHAT_WORKER_FAULT_MESSAGES: dict[str, str] = {
    ChatFaultReason.PROMPT_OVERFLOW: "The worker could not fit the prompt into its context.",
    ChatFaultReason.UNBUILDABLE_GRAMMAR: (
        "The worker could not build the grammar the request's tool choice or response format needs."
    ),
    ChatFaultReason.TOOL_VIOLATION: "The model's reply broke the request's tool controls.",
    ChatFaultReason.REPLY_REFUSED: "The AI Horde refused the worker's reply.",
    ChatFaultReason.GENERATION_ERROR: "The worker's backend failed while generating.",
}


def chat_worker_fault_message(fault_reason: Any) -> str | None:
    """The message stored for a fault reason; None for a missing or unknown value."""
    return CHAT_WORKER_FAULT_MESSAGES.get(fault_reason) if isinstance(fault_reason, str) else None


def chat_worker_fault_metric_reason(fault_reason: Any) -> str:
    """horde.reason of horde.chat.worker_faults: the value, unknown, or none when absent."""
    if fault_reason is None:
        return "none"
    return str(fault_reason) if chat_worker_fault_message(fault_reason) else "unknown"


class ChatFinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CONTENT_FILTER = "content_filter"
    TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class ChatLimits:
    """The limits chat jobs run under; the text pop's limits bound only text jobs."""

    max_context_length: int
    max_length: int
    tools_max_temperature: float | None = None  # None: every temperature applied as sent

    def as_dict(self) -> dict[str, Any]:
        limits: dict[str, Any] = {
            "max_context_length": self.max_context_length,
            "max_length": self.max_length,
        }
        if self.tools_max_temperature is not None:
            limits["tools_max_temperature"] = self.tools_max_temperature
        return limits


@dataclass(frozen=True)
class ChatDeclaration:
    """The six chat fields of a text pop, as the worker row stores them."""

    chat_jobs: bool = False
    prompt_jobs: bool = True
    chat_features: frozenset[str] = field(default_factory=frozenset)
    chat_limits: ChatLimits | None = None
    model_id: str | None = None
    image_transports: frozenset[str] = field(default_factory=frozenset)

    @property
    def receives_images(self) -> bool:
        return bool(self.image_transports & IMAGE_RECEIVING_TRANSPORTS)

    def serves_model(self, models: Iterable[str]) -> bool:
        """Eligibility rule 1: chat_jobs declared, and model_id is one of the request's models."""
        return self.chat_jobs and self.model_id is not None and self.model_id in set(models)

    def details(self) -> dict[str, Any] | None:
        """The worker details' chat object; None when the worker does not accept chat jobs."""
        if not self.chat_jobs:
            return None
        return {
            "model_id": self.model_id,
            "features": sorted(self.chat_features),
            "limits": self.chat_limits.as_dict() if self.chat_limits else None,
            "image_transports": sorted(self.image_transports),
        }

    def pop_fields(self) -> dict[str, Any]:
        """The fields a worker adds to its pop body."""
        fields: dict[str, Any] = {"chat_jobs": self.chat_jobs, "prompt_jobs": self.prompt_jobs}
        if self.chat_jobs:
            fields["chat_features"] = sorted(self.chat_features)
            fields["chat_limits"] = self.chat_limits.as_dict() if self.chat_limits else None
            fields["model_id"] = self.model_id
            fields["image_transports"] = sorted(self.image_transports)
        return fields


def _strict_bool(pop: Mapping[str, Any], key: str, default: bool) -> bool:
    value = pop.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ChatDeclarationInvalid(f"{key} has to be a boolean.", param=key)
    return value


def _recognised(pop: Mapping[str, Any], key: str, known: frozenset[str]) -> frozenset[str]:
    """The known names of a string list; unknown values are ignored, absent means none."""
    values = pop.get(key)
    if values is None:
        return frozenset()
    if not isinstance(values, list):
        raise ChatDeclarationInvalid(f"{key} has to be an array of strings.", param=key)
    return frozenset(v for v in values if isinstance(v, str) and v in known)


# The largest chat limit a worker may declare: the columns that store them (workers.chat_max_*)
# are PostgreSQL integers, so a larger value failed the pop's write (a 500).
MAX_CHAT_LIMIT = 2**31 - 1


def _positive_int(limits: Mapping[str, Any], key: str) -> int:
    value = limits.get(key)
    if value is None:
        raise ChatDeclarationInvalid(f"chat_jobs needs chat_limits.{key}.", param=f"chat_limits.{key}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ChatDeclarationInvalid(
            f"chat_limits.{key} has to be a positive integer.", param=f"chat_limits.{key}"
        )
    if value > MAX_CHAT_LIMIT:
        raise ChatDeclarationInvalid(
            f"chat_limits.{key} has to be at most {MAX_CHAT_LIMIT}.", param=f"chat_limits.{key}"
        )
    return value


def parse_chat_declaration(pop: Mapping[str, Any], *, models: Sequence[str]) -> ChatDeclaration:
    """Read the chat declaration of a text pop body; raise ChatDeclarationInvalid.

    A pop without chat_jobs withdraws the whole declaration, so its other chat fields are not
    read. `models` is the pop's models list.
    """
    chat_jobs = _strict_bool(pop, "chat_jobs", False)
    prompt_jobs = _strict_bool(pop, "prompt_jobs", True)
    if not prompt_jobs and not chat_jobs:
        raise ChatDeclarationInvalid(
            "prompt_jobs false needs chat_jobs: a worker has to accept text or chat jobs.",
            param="prompt_jobs",
        )
    if not chat_jobs:
        return ChatDeclaration(chat_jobs=False, prompt_jobs=prompt_jobs)

    limits = pop.get("chat_limits")
    if not isinstance(limits, Mapping):
        raise ChatDeclarationInvalid(
            "chat_jobs needs chat_limits with max_context_length and max_length.",
            param="chat_limits",
        )
    max_context_length = _positive_int(limits, "max_context_length")
    max_length = _positive_int(limits, "max_length")
    tools_max_temperature = limits.get("tools_max_temperature")
    if tools_max_temperature is not None:
        if (
            isinstance(tools_max_temperature, bool)
            or not isinstance(tools_max_temperature, int | float)
            or not math.isfinite(tools_max_temperature)
        ):
            raise ChatDeclarationInvalid(
                "chat_limits.tools_max_temperature has to be a number.",
                param="chat_limits.tools_max_temperature",
            )
        if tools_max_temperature < 0:
            raise ChatDeclarationInvalid(
                "chat_limits.tools_max_temperature cannot be negative.",
                param="chat_limits.tools_max_temperature",
            )
        tools_max_temperature = float(tools_max_temperature)

    model_id = pop.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        raise ChatDeclarationInvalid("chat_jobs needs a model_id.", param="model_id")
    # model_id is opaque: no character in it is reserved.
    if model_id not in models:
        raise ChatDeclarationInvalid(
            f"model_id '{model_id}' is not one of the worker's models.", param="model_id"
        )

    return ChatDeclaration(
        chat_jobs=True,
        prompt_jobs=prompt_jobs,
        chat_features=_recognised(pop, "chat_features", KNOWN_CHAT_DECLARATIONS),
        chat_limits=ChatLimits(max_context_length, max_length, tools_max_temperature),
        model_id=model_id,
        image_transports=_recognised(pop, "image_transports", KNOWN_IMAGE_TRANSPORTS),
    )
