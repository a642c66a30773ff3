"""Helpers for the chat contract tests (pure Python; no Django needed)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from contract.chat_errors import ChatRefusal
from contract.chat_shapes import validate_chat_request

BASE_BODY: dict[str, Any] = {"model": "llama-3", "messages": [{"role": "user", "content": "Hello"}]}

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


def body(**overrides: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE_BODY)
    data.update(overrides)
    return data


def refuse(data: Any) -> ChatRefusal:
    with pytest.raises(ChatRefusal) as info:
        validate_chat_request(data)
    return info.value


def tool_call(call_id: str, name: str = "get_weather", arguments: str = "{}") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
