"""Client-Agent attribution: the native route reads Client-Agent as on text requests; the front names
itself and the client program it serves (its own Client-Agent, else the SDK's user agent)."""

from __future__ import annotations

from collections.abc import Mapping

FRONT_AGENT = "horde-oai:1"
MAX_CLIENT_AGENT_LENGTH = 200


def build_client_agent(headers: Mapping[str, str]) -> str:
    client = headers.get("client-agent") or headers.get("x-title") or headers.get("user-agent") or "unknown"
    client = "".join(ch for ch in client if ch.isprintable())
    return f"{FRONT_AGENT}:{client}"[:MAX_CLIENT_AGENT_LENGTH]
