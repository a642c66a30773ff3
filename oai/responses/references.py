"""`item_reference` input items, replaced by the items they name (oai.response_items): what the
Vercel AI SDK sends for an earlier assistant turn of a multi-turn chat unless `store` is false."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oai.errors import ChatFrontError
from oai.response_items import ResponseItems, ResponseItemsUnavailable

ITEM_NOT_FOUND_HINT = (
    "This AI Horde front keeps the items of a response for {seconds} s, for the API key that made it; "
    "send the item itself instead (the Vercel AI SDK does with providerOptions.openai.store = false)."
)


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


async def resolve_item_references(body: Any, api_key: str, items: ResponseItems) -> Any:
    """The body with each item_reference replaced by the kept item; 400 item_not_found for one that
    is not kept (for this key), 503 when Redis cannot tell."""
    references = _references(body)
    if not references:
        return body
    try:
        found = await items.recall(api_key, sorted({item_id for _, item_id in references}))
    except ResponseItemsUnavailable:
        raise ChatFrontError(
            503,
            "ResponseItemsUnavailable",
            "The items this request refers to could not be read just now; send it again.",
            type="api_error",
            retry_after=1,
            should_retry=True,
        ) from None
    resolved = list(body["input"])
    for index, item_id in references:
        item = found.get(item_id)
        if item is None:
            raise ChatFrontError(
                400,
                "item_not_found",
                f"Item with id '{item_id}' not found. "
                + ITEM_NOT_FOUND_HINT.format(seconds=items.keep_seconds),
                param=f"input[{index}].id",
                should_retry=False,
            )
        resolved[index] = item
    return {**body, "input": resolved}
