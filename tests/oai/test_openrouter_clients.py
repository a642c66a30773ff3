"""POST /v1/chat/completions as OpenRouter-style clients send it, replayed against the live horde
(daphne, the mounted /v1 front) and a test worker that answers with reasoning (ADR 0087).

pydantic-ai's `OpenRouterModel` (pydantic-ai-slim 2.78 with the openai SDK 3.63, pointed at the
front with `OpenRouterProvider(base_url=...)`) sends OpenRouter's `reasoning` object in the body:
`openrouter_reasoning` as it is, and the unified `thinking` setting as `{"effort", "enabled": true}`
(`{"effort": "none"}` for `thinking=False`). It validates a whole reply against OpenRouter's shape,
which requires a top-level `provider` string; a stream's chunks may leave it out. The bodies and
headers below are the ones it sent, captured at the socket.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.oai.conftest import MODEL

pytestmark = pytest.mark.slow

PYDANTIC_AI_HEADERS = {
    "accept": "application/json",
    "content-type": "application/json",
    "user-agent": "pydantic-ai/2.78.0",
    "x-stainless-lang": "python",
    "x-stainless-package-version": "3.63.0",
    "x-stainless-os": "Linux",
    "x-stainless-arch": "x64",
    "x-stainless-runtime": "CPython",
    "x-stainless-runtime-version": "3.11.7",
    "x-stainless-async": "async:asyncio",
    "x-stainless-retry-count": "0",
    "x-stainless-read-timeout": "600",
}
USER = [{"role": "user", "content": "hello, no tools"}]
REASONING_REPLY = {
    "message": {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting; I greet back."},
    "finish_reason": "stop",
    "reasoning_tokens": 6,
}


def _post(front, key: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{front.live.v1}/chat/completions",
        content=json.dumps(body, separators=(",", ":")).encode(),
        headers={**PYDANTIC_AI_HEADERS, "authorization": f"Bearer {key}"},
        timeout=20,
    )


@pytest.mark.parametrize(
    ("reasoning", "effort", "shown"),
    [
        ({"effort": "high", "enabled": True}, "high", True),  # thinking="high"
        ({"effort": "low"}, "low", True),  # openrouter_reasoning={"effort": "low"}
        ({"effort": "low", "exclude": True}, "low", False),
        ({"effort": "none"}, "none", True),  # thinking=False
    ],
)
def test_pydantic_ai_openrouter_model_reasoning(front, requester, start_worker, reasoning, effort, shown):
    worker = start_worker(reply=lambda job: REASONING_REPLY)
    response = _post(front, requester.key, {"model": MODEL, "stream": False, "messages": USER, "reasoning": reasoning})
    assert response.status_code == 200, response.text
    body = response.json()
    assert worker.jobs[-1]["payload"]["reasoning_effort"] == effort
    # OpenRouter's shape, which the client validates: a provider string beside OpenAI's keys.
    assert body["provider"] == "AI Horde"
    message = body["choices"][0]["message"]
    assert message["content"] == "Hello."
    assert ("reasoning_content" in message) is shown
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


def test_pydantic_ai_openrouter_model_stream(front, requester, start_worker):
    start_worker(reply=lambda job: REASONING_REPLY)
    response = _post(
        front,
        requester.key,
        {
            "model": MODEL,
            "stream": True,
            "messages": USER,
            "stream_options": {"include_usage": True},
            "reasoning": {"effort": "low"},
        },
    )
    assert response.status_code == 200, response.text
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert chunks and all(chunk["provider"] == "AI Horde" for chunk in chunks)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "A greeting; I greet back."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello."


def test_pydantic_ai_openrouter_model_reasoning_budget_is_refused(front, requester):
    """openrouter_reasoning={"max_tokens": 1000}: a budget no worker declares is a 400 naming the
    key to send instead, before any native call."""
    response = _post(front, requester.key, {"model": MODEL, "stream": False, "messages": USER, "reasoning": {"max_tokens": 1000}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("reasoning.max_tokens", "UnsupportedChatParameter")
    assert "reasoning.effort" in error["message"]
