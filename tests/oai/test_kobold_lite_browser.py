"""KoboldAI Lite's requests as the real page sent them, replayed byte for byte.

Captured from index.html (LostRuins/lite.koboldai.net, v339 Web), unchanged, in headless Chromium:
served from http://127.0.0.1:18480, in chat mode with its default settings, against a horde running
`scripts/run.py` (the demo worker serves `scripted` with max_length 512, the reference worker's
default). The bodies are the bytes the browser sent; the headers are its own, in its order, the key
swapped for the test requester's (same length). Lite has no setting for the horde's address (its
AI Horde mode always calls https://aihorde.net), so the native exchanges were captured with that
name mapped to the test horde; "OpenAI Compatible API" mode was pointed at `/v1`.

What the page does with an answer is replayed too: its SSE reader (a `data:` line and a blank
line, JSON only) and what it reads of a whole answer.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

from chat.models import GenerationRequest

pytestmark = pytest.mark.slow

LITE_MODEL = "scripted"
ORIGIN = "http://127.0.0.1:18480"
USER_AGENT = (
    "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) HeadlessChrome/156.0.0.0 "
    "Safari/537.36"
)
SEC_CH_UA = '"Not:A-Brand";v="8", "Chromium";v="156"'
KEY = "4mXbq90lWXksyedeskW4Cg"  # the key of the capture; replaced by the requester's


def browser_headers(
    key: str, *, content_type: bool, referer: bool, site: str, extra=()
) -> list[tuple[str, str]]:
    """Chromium's headers of a fetch() from the page, in its order (Host, Connection and Content-Length
    are httpx's, with the same values)."""
    headers = [
        ("sec-ch-ua-platform", '"Linux"'),
        *extra,
        ("User-Agent", USER_AGENT),
        ("sec-ch-ua", SEC_CH_UA),
    ]
    if content_type:
        headers.append(("Content-Type", "application/json"))
    headers += [
        ("sec-ch-ua-mobile", "?0"),
        ("Accept", "*/*"),
        ("Origin", ORIGIN),
        ("Sec-Fetch-Site", site),
        ("Sec-Fetch-Mode", "cors"),
        ("Sec-Fetch-Dest", "empty"),
    ]
    if referer:
        headers.append(("Referer", f"{ORIGIN}/"))
    return [*headers, ("Accept-Encoding", "gzip, deflate, br, zstd"), ("Accept-Language", "en-US,en;q=0.9")]


def oai_headers(key: str, *, referer: bool) -> list[tuple[str, str]]:
    return browser_headers(
        key, content_type=True, referer=referer, site="same-site", extra=[("Authorization", f"Bearer {key}")]
    )


def preflight_headers(
    method: str, requested: str | None, *, site: str, referer: bool
) -> list[tuple[str, str]]:
    headers = [("Accept", "*/*"), ("Access-Control-Request-Method", method)]
    if requested is not None:
        headers.append(("Access-Control-Request-Headers", requested))
    headers += [
        ("Origin", ORIGIN),
        ("User-Agent", USER_AGENT),
        ("Sec-Fetch-Mode", "cors"),
        ("Sec-Fetch-Site", site),
        ("Sec-Fetch-Dest", "empty"),
    ]
    if referer:
        headers.append(("Referer", f"{ORIGIN}/"))
    return [*headers, ("Accept-Encoding", "gzip, deflate, br, zstd"), ("Accept-Language", "en-US,en;q=0.9")]


# "OpenAI Compatible API", "Use ChatCompletions API" unticked (text mode): its chat turned into an
# Alpaca prompt, max_length 768 (its default) as max_tokens, rep_pen 1.05 as presence_penalty.
TEXT_BODY_SSE = (
    b'{"max_tokens":768,"model":"scripted","temperature":0.75,"top_p":0.92,"stop":["User:","\\nUser ",'
    b'"\\nKoboldAI: "],"presence_penalty":0.050000000000000044,"prompt":"\\n### Instruction:\\n[The following '
    b"is a lengthy and interesting chat message log between User and KoboldAI.]\\n\\n### Response:\\n\\nUser: "
    b'Hi.\\nKoboldAI: Hello.\\nUser: Hello, horde! Who are you?\\nKoboldAI:","stream":true}'
)
TEXT_BODY_WHOLE = TEXT_BODY_SSE.replace(b',"stream":true}', b"}")  # token streaming "Off"
# "Use ChatCompletions API" ticked (its default): the memory as a user turn, the chat as one
# assistant turn that ends with the bot's name (a prefill).
CHAT_BODY_SSE = (
    b'{"max_tokens":768,"model":"scripted","temperature":0.75,"top_p":0.92,"stop":["User:","\\nUser ",'
    b'"\\nKoboldAI: "],"presence_penalty":0.050000000000000044,"messages":[{"role":"user","content":"[The '
    b'following is a lengthy and interesting chat message log between User and KoboldAI.]\\n"},{"role":'
    b'"assistant","content":"\\nUser: Hi.\\nKoboldAI: Hello.\\nUser: Hello, horde! Who are you?\\nKoboldAI:"}],'
    b'"stream":true}'
)
CHAT_BODY_WHOLE = CHAT_BODY_SSE.replace(b',"stream":true}', b"}")
# The demo worker's text answer (the scripted backend continues the prompt's last line).
TEXT_GENERATION = " and the scripted story goes on, one sentence at a time."


def lite_sse_events(text: str) -> list[dict[str, Any]]:
    """Lite's reader: /^data: ?(.*)(\\r?\\n){2}/m over the buffer, JSON.parse each match, skip what
    does not parse ([DONE], comments)."""
    events, buffer = [], text
    pattern = re.compile(r"^data: ?(.*)(\r?\n){2}", re.M)
    while (match := pattern.search(buffer)) is not None:
        with contextlib.suppress(ValueError):
            events.append(json.loads(match.group(1)))
        buffer = buffer[match.end() :]
    return events


def assert_preflight(v1: str, path: str, *, referer: bool) -> None:
    answer = httpx.options(
        f"{v1}{path}",
        headers=preflight_headers(
            "POST" if "completions" in path else "GET",
            "authorization,content-type",
            site="same-site",
            referer=referer,
        ),
    )
    assert answer.status_code == 204, answer.text
    assert answer.headers["access-control-allow-origin"] == "*"
    allowed = {h.strip() for h in answer.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type"} <= allowed


def post(v1: str, path: str, key: str, body: bytes, *, referer: bool) -> httpx.Response:
    assert len(key) == len(KEY)  # the body and Content-Length stay the captured ones
    return httpx.post(f"{v1}{path}", content=body, headers=oai_headers(key, referer=referer), timeout=40)


def test_text_mode_with_default_settings_is_served_by_a_512_token_worker(front, requester, start_text_worker):
    """Lite's text mode asks max_tokens 768 (its default max_length) of workers that declare 512, as
    the reference worker does by default: the horde lowers it, as on the chat route, instead of
    answering 503 no_eligible_worker (which Lite's stream reader shows as nothing at all)."""
    worker = start_text_worker(model=LITE_MODEL, max_length=512, generation=lambda job: TEXT_GENERATION)
    v1 = front.live.v1
    listed = httpx.get(
        f"{v1}/models",
        headers=browser_headers(
            requester.key,
            content_type=True,
            referer=False,
            site="same-site",
            extra=[("Authorization", f"Bearer {requester.key}")],
        ),
        timeout=20,
    )
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "*"
    assert_preflight(v1, "/models", referer=False)
    assert_preflight(v1, "/completions", referer=True)

    # Token streaming "SSE" (its default).
    answer = post(v1, "/completions", requester.key, TEXT_BODY_SSE, referer=True)
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == "*"
    events = lite_sse_events(answer.text)
    assert not [e for e in events if "error" in e], events
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == TEXT_GENERATION
    finish = [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"]][-1]
    assert finish["x_horde"]["context_adjustments"] == [
        {"from": 768, "to": 512, "reason": "worker_max_length"}
    ]
    payload = worker.jobs[0]["payload"]
    assert payload["max_length"] == 512 and payload["prompt"] == json.loads(TEXT_BODY_SSE)["prompt"]
    assert payload["stop_sequence"] == ["User:", "\nUser ", "\nKoboldAI: "]
    row = GenerationRequest.objects.get(pk=answer_request_id(answer))
    assert row.max_length == 512

    # Token streaming "Off": a whole answer, choices[0].text read.
    whole = post(v1, "/completions", requester.key, TEXT_BODY_WHOLE, referer=False)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["text"] == TEXT_GENERATION
    assert whole.json()["x_horde"]["context_adjustments"][0]["to"] == 512
    assert worker.jobs[1]["payload"]["max_length"] == 512


def answer_request_id(answer: httpx.Response) -> str:
    """The request id of a /v1/completions answer (its id is cmpl-<request id>)."""
    for event in lite_sse_events(answer.text):
        if event.get("id"):
            return event["id"].removeprefix("cmpl-")
    return answer.json()["id"].removeprefix("cmpl-")


def test_chat_mode_replays(front, requester, start_worker):
    """Chat completions as Lite sends them (a trailing assistant turn), streamed and whole, served by
    a chat worker declaring 512 tokens: lowered (worker_max_length) and delivered."""
    worker = start_worker(model=LITE_MODEL, max_length=512)
    v1 = front.live.v1
    assert_preflight(v1, "/chat/completions", referer=True)
    answer = post(v1, "/chat/completions", requester.key, CHAT_BODY_SSE, referer=True)
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == "*"
    events = lite_sse_events(answer.text)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text == "Hello from the horde."
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "stop"
    payload = worker.jobs[0]["payload"]
    assert payload["messages"] == json.loads(CHAT_BODY_SSE)["messages"]
    assert payload["max_length"] == 512 and payload["stop_sequence"] == ["User:", "\nUser ", "\nKoboldAI: "]

    whole = post(v1, "/chat/completions", requester.key, CHAT_BODY_WHOLE, referer=False)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]  # Lite reads message.content
    assert message["content"] == "Hello from the horde."


# --- AI Horde mode ------------------------------------------------------------------------------------

# Its request after "AI" > AI Horde > `scripted` > OK: max_length clamped to the workers' (it reads
# /api/v2/workers in that dialog), the chat in its {{[INPUT]}}/{{[OUTPUT]}} placeholders.
HORDE_BODY = (
    b'{"prompt":"{{[INPUT]}}[The following is a lengthy and interesting chat message log between User and '
    b'KoboldAI.]\\n{{[OUTPUT]}}\\nUser: Hi.\\nKoboldAI: Hello.\\nUser: Hello, horde! Who are you?\\nKoboldAI:",'
    b'"params":{"n":1,"max_context_length":6144,"max_length":512,"rep_pen":1.05,"temperature":0.75,"top_p":0.92,'
    b'"top_k":100,"top_a":0,"typical":1,"tfs":1,"rep_pen_range":360,"rep_pen_slope":0.7,"sampler_order":'
    b'[6,0,1,3,4,2,5],"use_default_badwordsids":false,"stop_sequence":["User:","\\nUser ","\\nKoboldAI: "],'
    b'"min_p":0,"dynatemp_range":0,"dynatemp_exponent":1,"smoothing_factor":0},"models":["scripted"],'
    b'"workers":[]}'
)


def test_horde_mode_request_poll_and_abort(live_horde, transactional_db, make_user, worker_owner):
    """find_user (preflight asks for `apikey` alone), the async submit, the key-less polls, and the
    abort: a DELETE without key or Client-Agent, whose preflight asks for no header."""
    from tests.oai.conftest import ScribeTextWorker

    requester = make_user("lite-user", kudos=5000)
    base = f"{live_horde.url}/api/v2"
    release = threading.Event()

    def held(job: dict[str, Any]) -> str:
        release.wait(20)
        return TEXT_GENERATION

    # The demo worker's limits: 512 tokens, the scripted backend's 32768 context (Lite asks 6144).
    worker = ScribeTextWorker(
        live=live_horde,
        key=worker_owner.key,
        model=LITE_MODEL,
        max_length=512,
        max_context_length=32768,
        generation=held,
    )
    worker.check_in()
    worker.start()
    try:
        pre = httpx.options(
            f"{base}/find_user", headers=preflight_headers("GET", "apikey", site="cross-site", referer=True)
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        assert "apikey" in pre.headers["access-control-allow-headers"]
        found = httpx.get(
            f"{base}/find_user",
            headers=browser_headers(
                requester.key,
                content_type=False,
                referer=True,
                site="cross-site",
                extra=[("apikey", requester.key)],
            ),
        )
        assert found.status_code == 200 and found.json()["kudos"] == 5000

        pre = httpx.options(
            f"{base}/generate/text/async",
            headers=preflight_headers(
                "POST", "apikey,client-agent,content-type", site="cross-site", referer=True
            ),
        )
        assert pre.status_code == 200
        allowed = {h.strip() for h in pre.headers["access-control-allow-headers"].split(",")}
        assert {"apikey", "client-agent", "content-type"} <= allowed
        headers = browser_headers(requester.key, content_type=True, referer=True, site="cross-site", extra=[])
        # Chromium puts apikey and Client-Agent after Content-Type.
        at = [name for name, _ in headers].index("Content-Type") + 1
        headers[at:at] = [("apikey", requester.key), ("Client-Agent", "KoboldAiLite:17")]
        created = httpx.post(f"{base}/generate/text/async", content=HORDE_BODY, headers=headers, timeout=20)
        assert created.status_code == 202, created.text
        assert created.headers["access-control-allow-origin"] == "*"
        request_id = created.json()["id"]
        assert "message" not in created.json()  # the warning Lite would show: no worker can serve it

        poll = browser_headers(requester.key, content_type=False, referer=True, site="cross-site")
        status_url = f"{base}/generate/text/status/{request_id}"
        deadline = time.monotonic() + 30
        while not worker.jobs and time.monotonic() < deadline:
            status = httpx.get(status_url, headers=poll).json()
            # Lite gives up on a message, faulted or is_possible false.
            assert status["is_possible"] is True and not status["faulted"] and "message" not in status
            threading.Event().wait(0.05)
        assert worker.jobs and worker.jobs[0]["payload"]["max_length"] == 512

        pre = httpx.options(
            status_url, headers=preflight_headers("DELETE", None, site="cross-site", referer=True)
        )
        assert pre.status_code == 200 and "DELETE" in pre.headers["access-control-allow-methods"]
        cancelled = httpx.delete(status_url, headers=poll)
        assert cancelled.status_code == 200 and cancelled.headers["access-control-allow-origin"] == "*"
        assert GenerationRequest.objects.get(pk=request_id).cancelled
    finally:
        release.set()
        worker.stop()


def test_only_the_fronts_text_requests_are_lowered(live_horde, transactional_db, make_user, start_text_worker):
    """Lite's horde request after a reload (its saved max_length 768, unclamped) keeps upstream's
    answer: accepted, warned, impossible, not lowered. The same body with the front's option is
    lowered to the worker's 512 and says so."""
    start_text_worker(model=LITE_MODEL, max_length=512, max_context_length=32768)
    requester = make_user("lite-user", kudos=5000)
    body = HORDE_BODY.replace(b'"max_length":512', b'"max_length":768')
    headers = {"apikey": requester.key, "Client-Agent": "KoboldAiLite:17", "Content-Type": "application/json"}
    url = f"{live_horde.url}/api/v2/generate/text/async"
    upstream = httpx.post(url, content=body, headers=headers, timeout=20)
    assert upstream.status_code == 202 and "context_adjustments" not in upstream.json()
    assert upstream.json()["message"].startswith("Warning: No available workers can fulfill this request.")
    assert GenerationRequest.objects.get(pk=upstream.json()["id"]).max_length == 768

    lowered = httpx.post(
        url, content=body[:-1] + b',"lower_max_length_to_workers":true}', headers=headers, timeout=20
    )
    assert lowered.status_code == 202, lowered.text
    assert lowered.json()["context_adjustments"] == [{"from": 768, "to": 512, "reason": "worker_max_length"}]
    assert "message" not in lowered.json()
    row = GenerationRequest.objects.get(pk=lowered.json()["id"])
    assert (row.max_length, row.context_adjustments[0]["to"]) == (512, 512)


def test_a_lowered_max_length_lowers_the_context_it_needs(live_horde, transactional_db, make_user, start_text_worker):
    """The context a text request needs is its prompt and its completion (the front sends
    max_context_length as their sum): lowered by 256 tokens, it needs 256 fewer. Kept at 6144, it
    stayed above this worker's 6000, so the lowered request still waited for a worker that never comes."""
    worker = start_text_worker(model=LITE_MODEL, max_length=512, max_context_length=6000,
                               generation=lambda job: TEXT_GENERATION)
    requester = make_user("lite-user", kudos=5000)
    body = HORDE_BODY.replace(b'"max_length":512', b'"max_length":768')
    assert b'"max_context_length":6144' in body
    headers = {"apikey": requester.key, "Client-Agent": "KoboldAiLite:17", "Content-Type": "application/json"}
    url = f"{live_horde.url}/api/v2/generate/text/async"
    lowered = httpx.post(
        url, content=body[:-1] + b',"lower_max_length_to_workers":true}', headers=headers, timeout=20
    )
    assert lowered.status_code == 202, lowered.text
    assert lowered.json()["context_adjustments"] == [{"from": 768, "to": 512, "reason": "worker_max_length"}]
    assert "message" not in lowered.json(), lowered.json()
    row = GenerationRequest.objects.get(pk=lowered.json()["id"])
    assert (row.max_length, row.max_context_length) == (512, 6144 - 256)
    status_url = f"{live_horde.url}/api/v2/generate/text/status/{row.pk}"
    deadline = time.monotonic() + 60
    while not (status := httpx.get(status_url, timeout=20).json())["done"]:
        assert status["is_possible"] and time.monotonic() < deadline, status
        threading.Event().wait(0.1)
    assert status["generations"][0]["text"] == TEXT_GENERATION
    assert worker.jobs[0]["payload"]["max_context_length"] == 6144 - 256
