"""Wire shape of the native chat status body (GET/DELETE /v2/generate/chat/status/<id>).

The horde builds the body itself (its status selector) and the front reads it; these models
document it for the OpenAPI schema, and the tests hold real bodies to them. Keys appear in the
body's order. A key the body leaves out when it does not apply is `not_sent()`.
"""

from __future__ import annotations

from typing import Any, Literal
from uuid import UUID

from pydantic import Field, StrictBool, StrictInt, StrictStr
from pydantic.json_schema import JsonDict

from contract.chat_declaration import ChatFinishReason
from contract.chat_shapes import ChatContextAdjustmentReason, ChatShape
from contract.chat_verify import ChatReplyMessage


def _drop_default(schema: JsonDict) -> None:
    schema.pop("default", None)


def not_sent() -> Any:
    """A key absent from the body when it does not apply (never null): not required, not nullable."""
    return Field(default=None, json_schema_extra=_drop_default)


class ChatContextAdjustment(ChatShape):
    """One change the horde made to the request's sizes (spec: "Context sizing")."""

    # `from` on the wire; from_ is the Python name only.
    from_: StrictInt = Field(alias="from")
    to: StrictInt
    reason: ChatContextAdjustmentReason
    dropped_messages: StrictInt = not_sent()


class ChatImpossibleReason(ChatShape):
    """Why no online worker can serve the request: what their declarations lack."""

    kind: Literal["declaration_gap"]
    missing_declarations: list[StrictStr]
    exceeded_limits: list[StrictStr]


class ChatStatusGeneration(ChatShape):
    """A finished generation: the text status keys, then the structured reply."""

    text: StrictStr | None
    seed: StrictInt
    gen_metadata: list[dict[str, Any]]
    worker_id: UUID
    worker_name: StrictStr
    model: StrictStr
    state: StrictStr
    message: ChatReplyMessage | None
    finish_reason: ChatFinishReason | None
    native_finish_reason: StrictStr | None
    prompt_tokens: StrictInt | None
    completion_tokens: StrictInt | None
    reasoning_tokens: StrictInt | None
    charge_basis: StrictStr | None
    queue_wait_seconds: float = Field(description="From the request's creation to the generation's pop")


class ChatStatus(ChatShape):
    """The text status keys, with structured generations, then the chat request's own keys."""

    generations: list[ChatStatusGeneration]
    finished: StrictInt
    processing: StrictInt
    restarted: StrictInt
    waiting: StrictInt
    done: StrictBool
    faulted: StrictBool
    wait_time: StrictInt
    queue_position: StrictInt
    kudos: float
    is_possible: StrictBool
    eligible_worker_threads: StrictInt
    impossible_reason: ChatImpossibleReason | None = Field(
        description="Only while nothing is eligible and nothing is processing"
    )
    context_adjustments: list[ChatContextAdjustment] | None
    fault_reason: StrictStr | None
    fault_rc: StrictStr | None
