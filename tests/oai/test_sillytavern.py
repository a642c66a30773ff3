"""SillyTavern 1.12.6 and 1.19.0 (each server unchanged) against the horde: the exchanges each server sent,
captured on the wire and replayed here byte for byte against the live horde: the body's bytes (the model name
aside), the headers in their order and casing (but Host, which httpx writes first and node-fetch last).

Two ways 1.12.6's users reach a horde:

- Chat Completion, source "Custom (OpenAI-compatible)", the custom URL being the horde's /v1. Its server
  (src/endpoints/backends/chat-completions.js, node-fetch 2) checks the status with GET {url}/models and
  posts {url}/chat/completions, whole or streamed. Its browser page (public/scripts/openai.js,
  sse-stream.js) reads the stream: `data:` events split at a blank line, `JSON.parse`, then
  `data.choices[0]?.delta?.content` appended and shown; a top-level `error` or `message` is shown as an
  error. It neither sends `stream_options` nor reads `reasoning_content` (a reasoning delta shows nothing).
  Its Stop button aborts the page's fetch; its server then aborts its own fetch, which closes the
  connection to the horde.
- The AI Horde text API (src/endpoints/horde.js): the horde URL is hard-coded (https://aihorde.net/api/v2),
  so the capture redirected that host to this horde at the TLS layer; the requests are the program's.
  The page polls the status every 2.5 s through its server, which sends only `Client-Agent` (no key),
  and cancels with DELETE on the same URL.

1.19.0, the newest release (docs/adr/0108, which says how it was run), below 1.12.6's tests:

- Its server's fetches are node-fetch 3's (headers lower-cased and sorted, `accept-encoding: gzip,
  deflate, br`, `user-agent: node-fetch`); the ai_horde library's stay undici's.
- Custom: the body no longer carries an empty `logit_bias`, and carries `reasoning_effort` for a
  koboldcpp/ model when an effort other than Auto is picked. Its page shows the reasoning: a stream's
  `delta.reasoning_content` (else `delta.reasoning`), a whole reply's `message.reasoning_content`
  (else `message.reasoning`), with `choices` read through optional chaining. Stop is as in 1.12.6.
- Text Completion "Generic (OpenAI-compatible)": GET {url}/v1/models (with a JSON content type) and
  POST {url}/v1/completions with OpenAI's keys only, in the page's order; `choices[0].text` is read.
- The AI Horde mode: the same routes; "show kudos" now asks GET /sharedkeys/<the API key> first
  (read as no shared key when refused), then /find_user. The GUI preset is refused by the page itself.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import pytest

from chat.models import Generation, GenerationRequest
from tests.oai.conftest import ALL_DECLARATIONS, MODEL, OTHER_MODEL, wait_for
from tests.oai.test_text_completions_samplers import st_event_data

pytestmark = pytest.mark.slow

NODE_FETCH_AGENT = "node-fetch/1.0 (+https://github.com/bitinn/node-fetch)"
ST_CLIENT_AGENT = "SillyTavern:1.12.6:Cohee#1207"

# The body its server posted for the default settings (temperature 1, top_p 1, penalties 0, 300 tokens,
# the bias preset "Default (none)" as {}; no seed, n, stop or logprobs: JSON.stringify drops undefined).
ST_MESSAGES = (
    '[{"role":"system","content":"Write Seraphina\'s next reply in a fictional chat between Seraphina and '
    'User."},{"role":"system","content":"[Start a new Chat]"},{"role":"assistant","content":"*You wake with '
    'a start...*"},{"role":"user","content":"Tell me a story"}]'
)


def st_chat_body(*, stream: bool) -> bytes:
    return (
        '{"messages":' + ST_MESSAGES + ',"model":"' + MODEL + '","temperature":1,"max_tokens":300,'
        '"stream":' + json.dumps(stream) + ',"presence_penalty":0,"frequency_penalty":0,"top_p":1,'
        '"logit_bias":{}}'
    ).encode()


def st_post_headers(key: str, body: bytes, host: str) -> list[tuple[str, str]]:
    """node-fetch's headers after the ones its caller set, in the order it wrote them."""
    return [
        ("Content-Type", "application/json"),
        ("Authorization", f"Bearer {key}"),
        ("Accept", "*/*"),
        ("Content-Length", str(len(body))),
        ("User-Agent", NODE_FETCH_AGENT),
        ("Accept-Encoding", "gzip,deflate"),
        ("Connection", "close"),
        ("Host", host),
    ]


def st_get_headers(host: str, first: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [
        *first,
        ("Accept", "*/*"),
        ("User-Agent", NODE_FETCH_AGENT),
        ("Accept-Encoding", "gzip,deflate"),
        ("Connection", "close"),
        ("Host", host),
    ]


class StPage:
    """What SillyTavern's page shows of a stream: EventSourceStream (sse-stream.js), then streamData
    (openai.js sendOpenAIRequest): each data event parsed, an `error` or `message` raised, the text of
    getStreamingReply appended; `shown` is the text after each event."""

    def __init__(self) -> None:
        self.buffer = ""
        self.text = ""
        self.shown: list[str] = []
        self.events: list[Any] = []
        self.done = False

    def feed(self, chunk: str) -> None:
        self.buffer += chunk
        events = re.split(r"\r\n\r\n|\r\r|\n\n", self.buffer)
        self.buffer = events.pop()
        for event in events:
            data = st_event_data(event)
            if data is None:
                continue
            if data == "[DONE]":
                self.done = True
                continue
            parsed = json.loads(data)
            self.events.append(parsed)
            self.show(parsed)
            self.shown.append(self.text)

    def show(self, parsed: dict[str, Any]) -> None:
        """One parsed event, as the page shows it."""
        assert not parsed.get("error") and not parsed.get("message"), parsed  # shown as an error
        # data.choices[0]?.delta?.content: `choices` must be there, or the page throws.
        choice = parsed["choices"][0] if parsed["choices"] else None
        if choice is not None:
            delta, message = choice.get("delta") or {}, choice.get("message") or {}
            self.text += delta.get("content") or message.get("content") or choice.get("text") or ""


class StStream(threading.Thread):
    """SillyTavern's server streaming from the horde: the captured request, the answer read as it comes
    and handed to the page; `stop` closes the connection as its abort does."""

    def __init__(self, url: str, key: str, host: str, *, stop_at: str | None = None):
        super().__init__(daemon=True)
        self.url, self.key, self.host, self.stop_at = url, key, host, stop_at
        self.page = StPage()
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.first_bytes = b""
        self.closed = threading.Event()

    def request(self) -> tuple[bytes, list[tuple[str, str]]]:
        """The body and headers SillyTavern's server posts."""
        body = st_chat_body(stream=True)
        return body, st_post_headers(self.key, body, self.host)

    def run(self) -> None:
        body, headers = self.request()
        with httpx.Client(timeout=30) as http:
            request = http.build_request("POST", self.url, content=body, headers=headers)
            response = http.send(request, stream=True)
            try:
                self.status, self.headers = response.status_code, response.headers
                for chunk in response.iter_raw():
                    self.first_bytes = self.first_bytes or chunk
                    self.page.feed(chunk.decode())
                    if self.stop_at is not None and self.page.text == self.stop_at:
                        break  # the user presses Stop once this much is shown
            finally:
                response.close()
                self.closed.set()

    def wait_shown(self, text: str, timeout: float = 5) -> None:
        assert wait_for(lambda: self.page.text == text, timeout), (self.page.text, self.page.events)




def _host(live_horde) -> str:
    return f"127.0.0.1:{live_horde.port}"


def test_sillytavern_status_check_lists_the_models(front, requester, start_worker, live_horde):
    """Its "Connect": GET {url}/models with the key; it lists data[].id and picks the first when no
    model is set."""
    start_worker()
    headers = st_get_headers(_host(live_horde), [("Authorization", f"Bearer {requester.key}")])
    response = httpx.get(f"{front.live.v1}/models", headers=headers, timeout=10)
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"] if isinstance(m, dict)] == [MODEL]


def test_sillytavern_whole_reply(front, requester, start_worker, live_horde):
    start_worker()
    body = st_chat_body(stream=False)
    response = httpx.post(
        f"{front.live.v1}/chat/completions",
        content=body,
        headers=st_post_headers(requester.key, body, _host(live_horde)),
        timeout=20,
    )
    assert response.status_code == 200
    data = response.json()
    assert data["choices"][0]["message"]["content"] == "Hello from the horde."
    assert data["choices"][0]["index"] == 0  # checkFunctionToolCalls looks for index 0


@pytest.mark.redis_only  # the relayed stream
def test_sillytavern_stream_shows_each_token_and_skips_the_reasoning(
    front, requester, streaming_worker, live_horde
):
    """The page shows the text token by token as the worker posts it; the reasoning deltas the horde
    sends by default (ADR 0058) reach it as chunks with `choices` and show nothing."""
    client = StStream(f"{front.live.v1}/chat/completions", requester.key, _host(live_horde))
    client.start()
    job = streaming_worker.pop()
    assert job["payload"].get("stream_progress") is True
    streaming_worker.post(job, 1, reasoning="The user wants a story.")
    streaming_worker.post(job, 2, "Once")
    client.wait_shown("Once")
    streaming_worker.post(job, 3, " upon a time")
    client.wait_shown("Once upon a time")
    streaming_worker.submit(job, "Once upon a time, the end.", reasoning="The user wants a story.")
    client.join(10)
    assert not client.is_alive()
    assert client.status == 200 and client.headers is not None
    assert client.headers["content-type"].startswith("text/event-stream")
    assert client.first_bytes.startswith(b": keepalive")  # a comment: no field the page reads
    assert client.page.done and client.page.text == "Once upon a time, the end."
    assert "" in client.page.shown[:2]  # the role chunk, then the reasoning chunk, show nothing
    reasoning = [
        e["choices"][0]["delta"]["reasoning_content"]
        for e in client.page.events
        if e["choices"] and "reasoning_content" in e["choices"][0].get("delta", {})
    ]
    assert reasoning == ["The user wants a story."]


@pytest.mark.redis_only  # the relayed stream
def test_sillytavern_stop_mid_stream_cancels_and_settles_on_what_was_streamed(
    front, requester, worker_owner, streaming_worker, live_horde
):
    """Its Stop button: the connection closes mid-stream. The horde cancels the request, tells the worker
    to stop, and settles the generation on the content it streamed (reasoning aside), paying the worker
    for it (chat_requests.md, Pricing)."""
    content = ["Once upon a time, ", "a horde of volunteers ", "ran models for everyone."]
    posted = "".join(content)
    client = StStream(f"{front.live.v1}/chat/completions", requester.key, _host(live_horde), stop_at=posted)
    client.start()
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, reasoning="Thinking about a story. " * 4)
    for seq, part in enumerate(content, start=2):
        streaming_worker.post(job, seq, part)
    assert client.closed.wait(5) and client.page.text == posted

    request = GenerationRequest.objects.get()
    assert wait_for(lambda: GenerationRequest.objects.get(pk=request.pk).cancelled, 5), "not cancelled"
    answer = streaming_worker.post(job, 5, " The end.")
    assert answer["cancelled"] is True
    generation = Generation.objects.get(pk=job["id"])
    assert generation.state == Generation.State.CANCELLED
    assert generation.settled_character_count == len(posted)
    assert generation.kudos > 0
    assert worker_owner.refresh().kudos == generation.kudos
    submit = streaming_worker.http.post(
        "/api/v2/generate/text/submit",
        json={
            "id": job["id"],
            "model_id": MODEL,
            "message": {"role": "assistant", "content": posted},
            "finish_reason": "stop",
        },
    )
    assert submit.status_code == 400 and submit.json()["rc"] == "AbortedGen"


# --- the AI Horde text API ---------------------------------------------------------------------------

ST_PROMPT = (
    "Seraphina's Persona: a kind guardian.\n***\nSeraphina: *You wake with a start...*\n"
    "User: Hello Seraphina\nSeraphina:"
)
# The Kobold preset the program starts with (RecoveredRuins), as getKoboldGenerationData builds it for the
# horde, then generateHorde's n and frmt* keys; api_server is its KoboldAI URL setting, sent along.
ST_PRESET_PARAMS = (
    '{"gui_settings":false,"sampler_order":[6,0,1,2,3,4,5],"max_context_length":8192,"max_length":350,'
    '"rep_pen":1.1,"rep_pen_range":600,"rep_pen_slope":0,"temperature":1,"tfs":1,"top_a":0,"top_k":0,'
    '"top_p":0.95,"min_p":0,"typical":1,"use_world_info":false,"singleline":false,'
    '"stop_sequence":["\\nUser:","<START>","\\nSeraphina:"],"streaming":false,"can_abort":false,'
    '"mirostat":0,"mirostat_tau":5,"mirostat_eta":0.1,"use_default_badwordsids":false,"grammar":"",'
    '"api_server":"http://127.0.0.1:5000/api","n":1,"frmtadsnsp":false,"frmtrmblln":false,'
    '"frmtrmspch":false,"frmttriminc":false}'
)
# The preset "GUI KoboldAI Settings": only the lengths and api_server.
ST_GUI_PARAMS = (
    '{"gui_settings":true,"max_length":350,"max_context_length":8192,'
    '"api_server":"http://127.0.0.1:5000/api","n":1,"frmtadsnsp":false,"frmtrmblln":false,"frmtrmspch":false,"frmttriminc":false}'
)


def st_horde_body(params: str) -> bytes:
    return (
        '{"prompt":' + json.dumps(ST_PROMPT) + ',"params":' + params + ',"trusted_workers":false,'
        '"models":["' + MODEL + '"]}'
    ).encode()


def _horde_get(live_horde, path: str, *first: tuple[str, str]) -> httpx.Response:
    headers = st_get_headers(_host(live_horde), [("Client-Agent", ST_CLIENT_AGENT), *first])
    return httpx.get(f"{live_horde.url}/api/v2{path}", headers=headers, timeout=10)


def _horde_async(live_horde, key: str, params: str) -> httpx.Response:
    body = st_horde_body(params)
    headers = [
        ("Content-Type", "application/json"),
        ("apikey", key),
        ("Client-Agent", ST_CLIENT_AGENT),
        ("Accept", "*/*"),
        ("Content-Length", str(len(body))),
        ("User-Agent", NODE_FETCH_AGENT),
        ("Accept-Encoding", "gzip,deflate"),
        ("Connection", "close"),
        ("Host", _host(live_horde)),
    ]
    return httpx.post(
        f"{live_horde.url}/api/v2/generate/text/async", content=body, headers=headers, timeout=10
    )


@pytest.mark.parametrize("params", [ST_PRESET_PARAMS, ST_GUI_PARAMS], ids=["preset", "gui"])
def test_sillytavern_horde_mode(live_horde, transactional_db, requester, start_text_worker, params):
    worker = start_text_worker(generation=lambda job: " *She smiles.* Welcome back.", max_context_length=8192)
    # At load and on "Connect": the heartbeat, the models, the workers, the user (its kudos).
    assert _horde_get(live_horde, "/status/heartbeat").status_code == 200
    models = _horde_get(live_horde, "/status/models?type=text").json()
    assert [m["name"] for m in models] == [MODEL]
    (listed,) = _horde_get(live_horde, "/workers?type=text").json()
    assert (listed["models"], listed["max_length"], listed["max_context_length"]) == ([MODEL], 512, 8192)
    user = httpx.get(  # @zeldafan0225/ai_horde's findUser, over Node's own fetch (undici)
        f"{live_horde.url}/api/v2/find_user",
        headers=[
            ("host", _host(live_horde)),
            ("connection", "keep-alive"),
            ("Client-Agent", ST_CLIENT_AGENT),
            ("Content-Type", "application/json"),
            ("apikey", requester.key),
            ("accept", "*/*"),
            ("accept-language", "*"),
            ("sec-fetch-mode", "cors"),
            ("user-agent", "node"),
            ("accept-encoding", "br, gzip, deflate"),
        ],
        timeout=10,
    ).json()
    assert user["username"] == f"{requester.user.username}#{requester.user.pk}" and user["kudos"] == 100_000

    submitted = _horde_async(live_horde, requester.key, params)
    assert submitted.status_code == 202, submitted.text  # its server passes any 2xx body on
    task = submitted.json()["id"]
    assert wait_for(lambda: _horde_get(live_horde, f"/generate/text/status/{task}").json()["done"], 10)
    status = _horde_get(live_horde, f"/generate/text/status/{task}").json()
    assert (status["faulted"], status["is_possible"]) == (False, True)
    (generation,) = status["generations"]
    assert (generation["text"], generation["worker_name"], generation["model"]) == (
        " *She smiles.* Welcome back.",
        worker.name,
        MODEL,
    )
    payload = worker.jobs[0]["payload"]
    assert (payload["max_length"], payload["max_context_length"]) == (350, 8192)


def test_sillytavern_horde_mode_stop(live_horde, transactional_db, requester, start_text_worker):
    """Its Stop button while the request waits: DELETE on the status URL, with only Client-Agent."""
    submitted = _horde_async(live_horde, requester.key, ST_PRESET_PARAMS)
    assert submitted.status_code == 202, submitted.text
    task = submitted.json()["id"]
    queued = _horde_get(live_horde, f"/generate/text/status/{task}").json()
    assert queued["done"] is False and isinstance(queued["queue_position"], int)
    headers = st_get_headers(_host(live_horde), [("Client-Agent", ST_CLIENT_AGENT)])
    cancelled = httpx.delete(
        f"{live_horde.url}/api/v2/generate/text/status/{task}", headers=headers, timeout=10
    )
    assert cancelled.status_code == 200 and isinstance(cancelled.json(), dict)  # its server reads it as JSON
    assert GenerationRequest.objects.get(pk=task).cancelled
    assert not Generation.objects.exists()
    assert requester.refresh().kudos == 100_000 - 1  # only the horde tax of its activation


# --- SillyTavern 1.19.0 ------------------------------------------------------------------------------

ST119_CLIENT_AGENT = "SillyTavern:1.19.0:Cohee#1207"


def node_fetch3_headers(host: str, **given: str) -> list[tuple[str, str]]:
    """node-fetch 3's headers (1.19.0's server): its own and its caller's, lower-cased and sorted by
    name, then Node's Host and Connection."""
    headers = {"accept": "*/*", "accept-encoding": "gzip, deflate, br", "user-agent": "node-fetch", **given}
    return [*sorted(headers.items()), ("Host", host), ("Connection", "close")]


def undici_headers(host: str, *given: tuple[str, str]) -> list[tuple[str, str]]:
    """@zeldafan0225/ai_horde over Node's own fetch (undici), as 1.19.0's server calls it."""
    return [
        ("host", host),
        ("connection", "keep-alive"),
        ("Client-Agent", ST119_CLIENT_AGENT),
        ("Content-Type", "application/json"),
        *given,
        ("accept", "*/*"),
        ("accept-language", "*"),
        ("sec-fetch-mode", "cors"),
        ("user-agent", "node"),
        ("accept-encoding", "br, gzip, deflate"),
    ]


def st119_chat_body(model: str, *, stream: bool, reasoning_effort: str | None = None) -> bytes:
    """The body 1.19.0's server posted for the default settings: as 1.12.6's but without `logit_bias`
    (an empty bias is left undefined now); `reasoning_effort` last when the model's name starts with
    koboldcpp/ and the user picked an effort other than Auto (Minimum is sent as minimal, Maximum as
    xhigh)."""
    effort = "" if reasoning_effort is None else ',"reasoning_effort":"' + reasoning_effort + '"'
    return (
        '{"messages":' + ST_MESSAGES + ',"model":"' + model + '","temperature":1,"max_tokens":300,'
        '"stream":' + json.dumps(stream) + ',"presence_penalty":0,"frequency_penalty":0,"top_p":1' + effort + "}"
    ).encode()


def st119_post_headers(key: str, body: bytes, host: str) -> list[tuple[str, str]]:
    return node_fetch3_headers(
        host,
        authorization=f"Bearer {key}",
        **{"content-length": str(len(body)), "content-type": "application/json"},
    )


class St119Page(StPage):
    """1.19.0's page on a Custom source's stream (openai.js sendOpenAIRequest, getStreamingReply):
    tryParseStreamingError on each event (`error`, `message` or `detail` shown as an error), then the
    reasoning, when "Show thoughts" is on (its default), from the first choice whose delta has
    `reasoning_content`, else `reasoning`, and the text from `choices?.[0]?.delta?.content`, else
    `message.content`, else `text` (optional chaining: a chunk without `choices` shows nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.reasoning = ""

    def show(self, parsed: dict[str, Any]) -> None:
        assert not any(parsed.get(key) for key in ("error", "message", "detail")), parsed
        choices = parsed.get("choices") or []
        with_reasoning = [c for c in choices if (c.get("delta") or {}).get("reasoning_content")]
        with_alias = [c for c in choices if (c.get("delta") or {}).get("reasoning")]
        if with_reasoning:
            self.reasoning += with_reasoning[0]["delta"]["reasoning_content"]
        elif with_alias:
            self.reasoning += with_alias[0]["delta"]["reasoning"]
        first = choices[0] if choices else {}
        for value in (
            (first.get("delta") or {}).get("content"),
            (first.get("message") or {}).get("content"),
            first.get("text"),
        ):
            if value is not None:
                self.text += value
                break


class St119Stream(StStream):
    """1.19.0's server streaming from the horde, read by 1.19.0's page."""

    def __init__(self, url: str, key: str, host: str, body: bytes, *, stop_at: str | None = None):
        super().__init__(url, key, host, stop_at=stop_at)
        self.body = body
        self.page = St119Page()

    def request(self) -> tuple[bytes, list[tuple[str, str]]]:
        return self.body, st119_post_headers(self.key, self.body, self.host)


@pytest.mark.parametrize("source", ["custom", "generic"])
def test_sillytavern_1_19_status_check_lists_the_models(front, requester, start_worker, live_horde, source):
    """Chat Completion's Custom source and Text Completion's Generic type check the connection with
    GET {url}/models (Generic's with its JSON content type on the GET) and list data[].id."""
    start_worker()
    given = {"authorization": f"Bearer {requester.key}"}
    if source == "generic":
        given["content-type"] = "application/json"
    response = httpx.get(
        f"{front.live.v1}/models", headers=node_fetch3_headers(_host(live_horde), **given), timeout=10
    )
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"] if isinstance(m, dict)] == [MODEL]


def test_sillytavern_1_19_whole_reply_shows_the_reasoning(front, requester, start_worker, live_horde):
    """A koboldcpp/ model with the Reasoning Effort High: the effort reaches the worker, and the page
    shows the reply's `message.reasoning_content` (reasoning.js: `reasoning_content ?? reasoning`)."""

    def reply(job: dict[str, Any]) -> dict[str, Any]:
        message = {"role": "assistant", "content": "Hello from the horde.", "reasoning_content": "A greeting."}
        return {"message": message, "finish_reason": "stop"}

    worker = start_worker(model=OTHER_MODEL, reply=reply)
    body = st119_chat_body(OTHER_MODEL, stream=False, reasoning_effort="high")
    response = httpx.post(
        f"{front.live.v1}/chat/completions",
        content=body,
        headers=st119_post_headers(requester.key, body, _host(live_horde)),
        timeout=20,
    )
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["content"] == "Hello from the horde."
    assert (message.get("reasoning_content") or message.get("reasoning")) == "A greeting."
    assert worker.jobs[0]["payload"]["reasoning_effort"] == "high"


@pytest.mark.redis_only  # the relayed stream
def test_sillytavern_1_19_stream_shows_the_reasoning_then_each_token(front, requester, streaming_worker, live_horde):
    """1.19.0 reads `delta.reasoning_content`: the reasoning the horde streams by default (ADR 0058)
    is shown as the model's thoughts, the content token by token."""
    body = st119_chat_body(MODEL, stream=True)
    client = St119Stream(f"{front.live.v1}/chat/completions", requester.key, _host(live_horde), body)
    client.start()
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, reasoning="The user wants a story.")
    assert wait_for(lambda: client.page.reasoning == "The user wants a story.", 5), client.page.events
    assert client.page.text == ""
    streaming_worker.post(job, 2, "Once")
    client.wait_shown("Once")
    streaming_worker.post(job, 3, " upon a time")
    client.wait_shown("Once upon a time")
    streaming_worker.submit(job, "Once upon a time, the end.", reasoning="The user wants a story.")
    client.join(10)
    assert not client.is_alive()
    assert client.status == 200 and client.headers is not None
    assert client.headers["content-type"].startswith("text/event-stream")
    assert client.page.done and client.page.text == "Once upon a time, the end."
    assert client.page.reasoning == "The user wants a story."


@pytest.mark.redis_only  # the relayed stream
def test_sillytavern_1_19_stop_mid_stream_cancels_and_settles_on_what_was_streamed(
    front, requester, worker_owner, streaming_worker, live_horde
):
    """Its Stop button, as in 1.12.6: the page aborts its fetch, its server aborts its own, and the
    connection to the horde closes; the horde cancels and settles on the content streamed."""
    content = ["Once upon a time, ", "a horde of volunteers ", "ran models for everyone."]
    posted = "".join(content)
    body = st119_chat_body(MODEL, stream=True)
    client = St119Stream(
        f"{front.live.v1}/chat/completions", requester.key, _host(live_horde), body, stop_at=posted
    )
    client.start()
    job = streaming_worker.pop()
    streaming_worker.post(job, 1, reasoning="Thinking about a story. " * 4)
    for seq, part in enumerate(content, start=2):
        streaming_worker.post(job, seq, part)
    assert client.closed.wait(5) and client.page.text == posted

    request = GenerationRequest.objects.get()
    assert wait_for(lambda: GenerationRequest.objects.get(pk=request.pk).cancelled, 5), "not cancelled"
    assert streaming_worker.post(job, 5, " The end.")["cancelled"] is True
    generation = Generation.objects.get(pk=job["id"])
    assert generation.state == Generation.State.CANCELLED
    assert generation.settled_character_count == len(posted)
    assert worker_owner.refresh().kudos == generation.kudos > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sillytavern_1_19_reasoning_effort_without_a_declaring_worker_is_refused_with_its_cause(
    front, requester, start_worker, live_horde, stream
):
    """An effort picked for a koboldcpp/ model that no worker declaring reasoning_effort serves:
    404 no_worker_supports_features (chat_requests.md). Streamed, its server passes the status and
    body on and the page shows `error.message`; whole, its server shows only the status text."""
    start_worker(model=OTHER_MODEL, features=[f for f in ALL_DECLARATIONS if f != "reasoning_effort"])
    body = st119_chat_body(OTHER_MODEL, stream=stream, reasoning_effort="minimal")
    response = httpx.post(
        f"{front.live.v1}/chat/completions",
        content=body,
        headers=st119_post_headers(requester.key, body, _host(live_horde)),
        timeout=20,
    )
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "no_worker_supports_features"
    assert "reasoning_effort" in error["message"]


# Text Completion, type "Generic (OpenAI-compatible)": the page's createTextGenGenerationData for the
# default settings, reduced by its server to OpenAI's keys in the page's order (no model until one is
# picked from the list: JSON.stringify drops it).
ST119_TEXT_PROMPT = ST_PROMPT


def st119_generic_body(model: str | None, *, stream: bool) -> bytes:
    picked = "" if model is None else ',"model":"' + model + '"'
    tail = ',"stream":true' if stream else ""
    return (
        '{"prompt":' + json.dumps(ST119_TEXT_PROMPT) + picked + ',"max_tokens":350,"temperature":0.7,'
        '"top_p":0.5,"frequency_penalty":0,"presence_penalty":0,"stop":["\\nUser:","\\n***"]' + tail + "}"
    ).encode()


@pytest.mark.parametrize("model", [MODEL, None], ids=["picked", "none"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sillytavern_1_19_generic_text_completion(front, requester, start_text_worker, live_horde, model, stream):
    """POST {url}/v1/completions; the page reads `choices[0].text` (streamed: each event's, with
    the reasoning from `choices[0].reasoning`, which a text reply has none of)."""
    worker = start_text_worker(generation=lambda job: " *She smiles.* Welcome back.\nUser: hi")
    body = st119_generic_body(model, stream=stream)
    response = httpx.post(
        f"{front.live.v1}/completions",
        content=body,
        headers=st119_post_headers(requester.key, body, _host(live_horde)),
        timeout=20,
    )
    assert response.status_code == 200, response.text
    if stream:
        page = St119Page()
        page.feed(response.text)
        assert page.done and page.reasoning == ""
        text = page.text
    else:
        text = response.json()["choices"][0]["text"]
    assert text == " *She smiles.* Welcome back."  # cut at the stop sequence
    payload = worker.jobs[0]["payload"]
    assert payload["max_length"] == 350 and payload["stop_sequence"] == ["\nUser:", "\n***"]


# The AI Horde mode: the page's getKoboldGenerationData for the preset it starts with (RecoveredRuins,
# whose min_p is now 0.01), max_length as the workers allow (auto-adjust, on by default), the stop
# strings of the default context (the names, then its chat start "***"). 1.19.0 refuses the preset
# "GUI KoboldAI Settings" for the horde itself, so that body is no longer sent.
ST119_HORDE_PARAMS = (
    '{"gui_settings":false,"sampler_order":[6,0,1,2,3,4,5],"max_context_length":8192,"max_length":350,'
    '"rep_pen":1.1,"rep_pen_range":600,"rep_pen_slope":0,"temperature":1,"tfs":1,"top_a":0,"top_k":0,'
    '"top_p":0.95,"min_p":0.01,"typical":1,"use_world_info":false,"singleline":false,'
    '"stop_sequence":["\\nUser:","\\n***"],"streaming":false,"can_abort":false,"mirostat":0,'
    '"mirostat_tau":5,"mirostat_eta":0.1,"use_default_badwordsids":false,"grammar":"",'
    '"api_server":"http://127.0.0.1:5000/api","n":1,"frmtadsnsp":false,"frmtrmblln":false,'
    '"frmtrmspch":false,"frmttriminc":false}'
)


def _horde119(live_horde, method: str, path: str, *, key: str | None = None) -> httpx.Response:
    given = {"client-agent": ST119_CLIENT_AGENT}
    content = None
    if key is not None:  # the async POST: its key, JSON body
        content = st_horde_body(ST119_HORDE_PARAMS)
        given |= {"apikey": key, "content-length": str(len(content)), "content-type": "application/json"}
    return httpx.request(
        method,
        f"{live_horde.url}/api/v2{path}",
        content=content,
        headers=node_fetch3_headers(_host(live_horde), **given),
        timeout=10,
    )


def test_sillytavern_1_19_horde_mode(live_horde, transactional_db, requester, start_text_worker):
    worker = start_text_worker(generation=lambda job: " *She smiles.* Welcome back.", max_context_length=8192)
    assert _horde119(live_horde, "GET", "/status/heartbeat").status_code == 200
    models = _horde119(live_horde, "GET", "/status/models?type=text").json()
    assert [m["name"] for m in models] == [MODEL]
    (listed,) = _horde119(live_horde, "GET", "/workers?type=text").json()
    # adjustHordeGenerationParams: `model.cluster === worker.cluster` holds when neither has one.
    assert "cluster" not in listed and "cluster" not in models[0]
    assert (listed["models"], listed["max_length"], listed["max_context_length"]) == ([MODEL], 512, 8192)

    # "Show kudos": getSharedKey(the API key) first, whose failure it reads as no shared key, then findUser.
    host = _host(live_horde)
    shared = httpx.get(f"{live_horde.url}/api/v2/sharedkeys/{requester.key}", headers=undici_headers(host), timeout=10)
    assert shared.status_code == 401 and shared.json()["rc"] == "InvalidAPIKey"
    user = httpx.get(
        f"{live_horde.url}/api/v2/find_user", headers=undici_headers(host, ("apikey", requester.key)), timeout=10
    ).json()
    assert user["username"] == f"{requester.user.username}#{requester.user.pk}" and user["kudos"] == 100_000

    submitted = _horde119(live_horde, "POST", "/generate/text/async", key=requester.key)
    assert submitted.status_code == 202, submitted.text
    task = submitted.json()["id"]
    assert wait_for(lambda: _horde119(live_horde, "GET", f"/generate/text/status/{task}").json()["done"], 10)
    status = _horde119(live_horde, "GET", f"/generate/text/status/{task}").json()
    assert (status["faulted"], status["is_possible"]) == (False, True)
    (generation,) = status["generations"]
    assert (generation["text"], generation["worker_name"], generation["model"]) == (
        " *She smiles.* Welcome back.",
        worker.name,
        MODEL,
    )
    payload = worker.jobs[0]["payload"]
    assert (payload["max_length"], payload["max_context_length"], payload["min_p"]) == (350, 8192, 0.01)
    assert payload["stop_sequence"] == ["\nUser:", "\n***"]


def test_sillytavern_1_19_horde_mode_stop(live_horde, transactional_db, requester):
    """Its Stop button while the request waits: DELETE on the status URL with only its Client-Agent;
    its server reads the answer as JSON and hands it to the page."""
    submitted = _horde119(live_horde, "POST", "/generate/text/async", key=requester.key)
    assert submitted.status_code == 202, submitted.text
    task = submitted.json()["id"]
    queued = _horde119(live_horde, "GET", f"/generate/text/status/{task}").json()
    assert queued["done"] is False and isinstance(queued["queue_position"], int)
    cancelled = _horde119(live_horde, "DELETE", f"/generate/text/status/{task}")
    assert cancelled.status_code == 200 and isinstance(cancelled.json(), dict)
    assert GenerationRequest.objects.get(pk=task).cancelled
    assert not Generation.objects.exists()
    assert requester.refresh().kudos == 100_000 - 1
