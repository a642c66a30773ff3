"""POST /v1/chat/completions and GET /v1/models as two chat apps send them, replayed byte for byte.

KoboldAI Lite (index.html, "OpenAI Compatible API" with "Use ChatCompletions API" ticked, default
settings) posts from the browser: `Content-Type` and `Authorization` only, its sampler sliders as
OpenAI keys (`presence_penalty = rep_pen - 1`), its first four stop sequences and `stream: true`. It
splits the body at blank lines, keeps `data:` events that parse as JSON, and reads
`choices[0].delta.content` and `choices[0].finish_reason`; `GET {base}/models` must answer a `data`
list with entries.

Open WebUI (backend/open_webui/routers/openai.py; an older release: 0.12.4's exchanges, with its
built-in tools on every chat, are replayed in tests/oai/test_open_webui.py) posts from its server with aiohttp: `Content-Type`,
`Authorization`, and with ENABLE_FORWARD_USER_INFO_HEADERS its `X-OpenWebUI-User-*` and
`X-OpenWebUI-Chat-Id` headers. On a stream it adds `stream_options.include_usage`, and it marks the
last message with `cache_control: {"type": "ephemeral"}`; it reads `usage` from the stream's chunks.
"""

from __future__ import annotations

import contextlib
import json

import httpx

from tests.oai.conftest import MODEL

LITE_CHAT_BODY = {
    "max_tokens": 896,
    "model": MODEL,
    "temperature": 0.75,
    "top_p": 0.92,
    "stop": ["{{[INPUT]}}", "{{[OUTPUT]}}", "\nYou:", "\nKoboldAI:"],
    "presence_penalty": 0.07000000000000006,
    "messages": [
        {"role": "system", "content": "{{[SYSTEM]}}"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "How are you?"},
    ],
    "stream": True,
}

OPEN_WEBUI_HEADERS = {
    "Content-Type": "application/json",
    "X-OpenWebUI-User-Name": "Jo Doe",
    "X-OpenWebUI-User-Id": "7f1c2a4e-0000-4000-8000-000000000001",
    "X-OpenWebUI-User-Email": "jo@example.org",
    "X-OpenWebUI-User-Role": "admin",
    "X-OpenWebUI-Chat-Id": "a3c1e7f0-0000-4000-8000-000000000002",
}


def lite_events(text: str) -> list[dict]:
    """Lite's reader: /^data: ?(.*)(\\r?\\n){2}/m, JSON events only ([DONE] is skipped)."""
    events = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data:"):
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line[5:].lstrip(" ")))
    return events


def test_kobold_lite_chat_mode_replay(front, requester, start_worker):
    worker = start_worker()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {requester.key}"}
    models = httpx.get(f"{front.live.v1}/models", headers=headers, timeout=20)
    assert models.status_code == 200
    data = models.json()
    assert not data.get("error") and MODEL in [m["id"] for m in data["data"]]

    with httpx.stream(
        "POST",
        f"{front.live.v1}/chat/completions",
        content=json.dumps(LITE_CHAT_BODY),
        headers={**headers, "Origin": "null"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "*"
        body = response.read().decode()
    events = lite_events(body)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text == "Hello from the horde."
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "stop"
    payload = worker.jobs[0]["payload"]
    assert payload["messages"] == LITE_CHAT_BODY["messages"]
    assert payload["stop_sequence"] == LITE_CHAT_BODY["stop"]


def test_open_webui_replay(front, requester, start_worker):
    worker = start_worker()
    headers = {**OPEN_WEBUI_HEADERS, "Authorization": f"Bearer {requester.key}"}
    listed = httpx.get(f"{front.live.v1}/models", headers=headers, timeout=20)
    assert listed.status_code == 200 and MODEL in [m["id"] for m in listed.json()["data"]]

    last = {
        "role": "user",
        "content": [{"type": "text", "text": "Hello?", "cache_control": {"type": "ephemeral"}}],
    }
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, last], "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream(
        "POST", f"{front.live.v1}/chat/completions", content=json.dumps(body), headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        assert "text/event-stream" in response.headers["content-type"]
        text = response.read().decode()
    chunks = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == (
        "Hello from the horde."
    )
    assert [c["usage"]["total_tokens"] > 0 for c in chunks if c.get("usage")] == [True]
    assert text.rstrip().endswith("data: [DONE]")
    assert worker.jobs[0]["payload"]["messages"][1]["content"][0]["text"] == "Hello?"

    # Its title generation: the same headers, a whole answer.
    whole = httpx.post(
        f"{front.live.v1}/chat/completions",
        content=json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "Title?"}], "stream": False}
        ),
        headers=headers,
        timeout=30,
    )
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["message"]["content"] == "Hello from the horde."
