"""A kept response read again (`GET /v1/responses/{id}`), its input items listed (`GET
/v1/responses/{id}/input_items`) and its deletion's answer, from its record in the kept responses
(oai.response_items; docs/adr/0103-kept-responses-read-and-deleted.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oai.errors import ChatFrontError
from oai.responses.reply import output_text_part

INPUT_ITEMS_DEFAULT_LIMIT = 20
INPUT_ITEMS_MAX_LIMIT = 100
# GET /v1/responses/{id}?stream=: what each accepted value (any case) means.
STREAM_QUERY_VALUES = {"true": True, "1": True, "false": False, "0": False}
# The id prefix of a listed input item, by its type (an input item keeps no id of its own).
INPUT_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def response_not_found(response_id: str, hint: str) -> ChatFrontError:
    return ChatFrontError(
        404, "not_found", f"Response with id '{response_id}' not found. {hint}", should_retry=False
    )


def kept_response(record: Mapping[str, Any]) -> dict[str, Any]:
    """The response object as it was delivered."""
    return {**record["response"], "output": record["output"]}


def deleted_response(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "deleted": True}


def _input_parts(content: Any, role: str) -> list[dict[str, Any]]:
    """A kept message's content as the listed message's parts: an assistant's are output parts,
    the others' input parts."""
    parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else list(content)
    listed: list[dict[str, Any]] = []
    for part in parts:
        text = part.get("text", part.get("refusal", ""))
        if part.get("type") == "input_image":
            listed.append({"type": "input_image", "image_url": part.get("image_url"), "detail": part.get("detail", "auto")})
        elif role == "assistant":
            listed.append(
                {"type": "refusal", "refusal": text} if part.get("type") == "refusal" else output_text_part(text)
            )
        else:
            listed.append({"type": "input_text", "text": text})
    return listed


def input_item(item: Mapping[str, Any], item_id: str) -> dict[str, Any]:
    """A kept input item (oai.responses.request.turn_input) as the input items list shows it."""
    kind = item["type"]
    if kind == "message":
        role = item.get("role", "user")
        return {
            "id": item_id,
            "type": "message",
            "role": role,
            "status": "completed",
            "content": _input_parts(item.get("content", ""), role),
        }
    return {"id": item_id, **item, "status": "completed"}


def _query_error(param: str, message: str) -> ChatFrontError:
    return ChatFrontError(400, "BadRequest", message, param=param, should_retry=False)


def stream_query(query: Mapping[str, str]) -> tuple[bool, int | None]:
    """(stream, starting_after) of GET /v1/responses/{id}: `stream` true or false (any case, as the
    openai SDKs send a boolean) or 1 or 0 (as a hand-written query or a form may: docs/adr/0110),
    `starting_after` a sequence number (an integer from 0)."""
    raw_stream = query.get("stream", "false")
    if raw_stream.lower() not in STREAM_QUERY_VALUES:
        raise _query_error(
            "stream", f"Invalid value for 'stream': '{raw_stream}'; expected true or false (or 1 or 0)."
        )
    raw_after = query.get("starting_after")
    if raw_after is not None and not (raw_after.isascii() and raw_after.isdigit()):
        raise _query_error(
            "starting_after", f"Invalid value for 'starting_after': '{raw_after}'; expected an integer from 0."
        )
    return STREAM_QUERY_VALUES[raw_stream.lower()], int(raw_after) if raw_after is not None else None


def input_items_page(record: Mapping[str, Any], response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
    """One page of the response's own input items (this turn's, not the conversation it continues),
    in OpenAI's list shape: `order` desc (the default, last first) or asc, at most `limit` (1-100,
    default 20), those after the item `after` and before the item `before`."""
    suffix = response_id.removeprefix("resp_")
    items = [
        input_item(item, f"{INPUT_ITEM_ID_PREFIXES[item['type']]}_{suffix}in{index}")
        for index, item in enumerate(record["input"])
    ]
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _query_error("order", f"Invalid value for 'order': '{order}'; expected 'asc' or 'desc'.")
    if order == "desc":
        items.reverse()
    raw_limit = query.get("limit", str(INPUT_ITEMS_DEFAULT_LIMIT))
    if not (raw_limit.isascii() and raw_limit.isdigit()) or not 1 <= int(raw_limit) <= INPUT_ITEMS_MAX_LIMIT:
        raise _query_error(
            "limit", f"Invalid value for 'limit': '{raw_limit}'; expected an integer from 1 to {INPUT_ITEMS_MAX_LIMIT}."
        )
    ids = [item["id"] for item in items]
    places: dict[str, int] = {}
    for cursor in ("after", "before"):
        item_id = query.get(cursor)
        if item_id is not None:
            if item_id not in ids:
                raise _query_error(cursor, f"No input item with id '{item_id}' in response '{response_id}'.")
            places[cursor] = ids.index(item_id)
    items = items[places.get("after", -1) + 1 : places.get("before", len(items))]
    # `before` pages backwards: the `limit` items nearest to it, in the list's order.
    page = items[-int(raw_limit) :] if "before" in query and "after" not in query else items[: int(raw_limit)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }
