"""What a Responses request refers to, from the kept responses (oai.response_items): its
`item_reference` input items, replaced by the items they name (what the Vercel AI SDK sends for an
earlier assistant turn unless `store` is false), and its `previous_response_id`, the conversation it
continues (what openai-agents and LangChain send when asked to)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oai.errors import ChatFrontError
from oai.response_items import (
    MAX_RESPONSE_CHAIN,
    ResponseChainTooLong,
    ResponseInProgress,
    ResponseItems,
    ResponseItemsUnavailable,
)

KEPT_FOR = (
    "This AI Horde front keeps a response for {seconds} s, for the API key that made it, unless it was "
    "sent with store: false"
)
KEPT_HINT = (
    KEPT_FOR + "; send the whole conversation in 'input' instead (the Vercel AI SDK does with "
    "providerOptions.openai.store = false)."
)


@dataclass
class PreparedBody:
    """A Responses body with its references resolved, and the conversation it continues."""

    body: Any
    history: list[dict[str, Any]] = field(default_factory=list)
    previous_response_id: str | None = None


def _references(body: Any) -> list[tuple[int, str]]:
    """(index in input, id) of each item_reference with a string id."""
    items = body.get("input") if isinstance(body, Mapping) else None
    if not isinstance(items, list):
        return []
    return [
        (i, item["id"])
        for i, item in enumerate(items)
        if isinstance(item, Mapping) and item.get("type") == "item_reference" and isinstance(item.get("id"), str)
    ]


def items_unavailable() -> ChatFrontError:
    return ChatFrontError(
        503,
        "ResponseItemsUnavailable",
        "The responses this request refers to could not be read just now; send it again.",
        type="api_error",
        retry_after=1,
        should_retry=True,
    )


async def resolve_references(body: Any, api_key: str, items: ResponseItems) -> PreparedBody:
    """The body with each item_reference replaced by its kept item, and the conversation of its
    previous_response_id: 400 item_not_found or previous_response_not_found for what is not kept (for
    this key), 503 when Redis cannot tell."""
    if not isinstance(body, Mapping):
        return PreparedBody(body)
    previous = body.get("previous_response_id")
    references = _references(body)
    hint = KEPT_HINT.format(seconds=items.keep_seconds)
    history: list[dict[str, Any]] = []
    try:
        if previous is not None:
            if not isinstance(previous, str):
                raise ChatFrontError(
                    400,
                    "BadRequest",
                    "Invalid type for 'previous_response_id': expected a string.",
                    param="previous_response_id",
                    should_retry=False,
                )
            conversation = await items.conversation(api_key, previous)
            if conversation is None:
                raise ChatFrontError(
                    400,
                    "previous_response_not_found",
                    f"Previous response with id '{previous}' not found. {hint}",
                    param="previous_response_id",
                    should_retry=False,
                )
            history = conversation
        found = await items.recall(api_key, sorted({item_id for _, item_id in references}))
    except ResponseItemsUnavailable:
        raise items_unavailable() from None
    except ResponseInProgress as error:
        raise ChatFrontError(
            400,
            "previous_response_in_progress",
            f"Previous response with id '{error.response_id}' is a background response that has not finished: "
            "read it with GET /v1/responses/{id} until its status is final, then continue it.",
            param="previous_response_id",
            should_retry=False,
        ) from None
    except ResponseChainTooLong:
        raise ChatFrontError(
            400,
            "ConversationTooLong",
            f"The conversation of previous response '{previous}' is more than {MAX_RESPONSE_CHAIN} responses "
            "long, the most this AI Horde front continues: send the conversation in 'input' instead.",
            param="previous_response_id",
            should_retry=False,
        ) from None
    if references:
        resolved = list(body["input"])
        for index, item_id in references:
            item = found.get(item_id)
            if item is None:
                raise ChatFrontError(
                    400,
                    "item_not_found",
                    f"Item with id '{item_id}' not found. {hint}",
                    param=f"input[{index}].id",
                    should_retry=False,
                )
            resolved[index] = item
        body = {**body, "input": resolved}
    return PreparedBody(body, history, previous)
