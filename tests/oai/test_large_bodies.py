"""A large body on the OpenAI front (docs/adr/0127-large-bodies-parsed-off-the-event-loop.md): its
parse and screening leave the event loop free for every other request and open stream of the
process, and its answers are the ones a small body of the same kind gets.

The event loop's stall is measured on the live server's own loop: a task that sleeps 1 ms at a time
records how late it wakes. The reference is the same body parsed and screened inline on that loop,
in the same test, so a slow or loaded machine slows both alike.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time

import httpx
import pytest

from contract.chat_limits import MAX_CHAT_IMAGE_BYTES, MIB
from oai.schema import parse_body, screen_request
from tests.oai.conftest import MODEL

pytestmark = pytest.mark.django_db(transaction=True)

# The front at its in-flight limit: a body that passes its screening is answered 503 FrontAtCapacity
# there, before anything is submitted, so what the request costs the loop is its body's.
AT_CAPACITY = {
    "message": "This AI Horde front is at its in-flight request limit; try again shortly.",
    "type": "api_error",
    "param": None,
    "code": "FrontAtCapacity",
    "metadata": {"retry_after": 2},
}


def image_url(decoded_bytes: int, seed: int = 0) -> str:
    """A base64 data URL of `decoded_bytes` bytes (the front checks its size, not its pixels)."""
    payload = (bytes(range(256)) * (decoded_bytes // 256 + 1))[:decoded_bytes]
    return "data:image/png;base64," + base64.b64encode(bytes([seed]) + payload[1:]).decode()


def images_chat_body(images: int = 5) -> bytes:
    """A valid chat body of about 6.4 MiB per image: the largest images the front takes, 25 MiB in all
    at five (a 33 MiB body)."""
    size = min(MAX_CHAT_IMAGE_BYTES, 25 * MIB // images) - 1024
    parts = [{"type": "text", "text": "What is in these pictures?"}]
    parts += [{"type": "image_url", "image_url": {"url": image_url(size, i)}} for i in range(images)]
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": parts}]}).encode()


def many_parts_chat_body() -> bytes:
    """A valid chat body whose screening is long (about 2 MiB: 1,024 messages of 40 short text
    parts each, not ASCII): its parse and screening cost the loop about half a second inline,
    while no one step of it holds the interpreter for more than a few tens of ms."""
    content = [{"type": "text", "text": "héllo wörld"} for _ in range(40)]
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": content} for i in range(1024)]
    return json.dumps({"model": MODEL, "messages": messages}).encode()


class LoopStall:
    """The longest the live server's event loop left a 1 ms sleep waiting past its time."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.longest = 0.0
        self._stop = threading.Event()
        self._running = asyncio.run_coroutine_threadsafe(self._watch(), loop)

    async def _watch(self) -> None:
        while not self._stop.is_set():
            before = self.loop.time()
            await asyncio.sleep(0.001)
            self.longest = max(self.longest, self.loop.time() - before - 0.001)

    def reset(self) -> None:
        time.sleep(0.05)  # a sleep already under way when reset is measured from before it
        self.longest = 0.0

    def stop(self) -> None:
        self._stop.set()
        self._running.result(5)


@pytest.fixture
def loop_stall(live_horde):
    stall = LoopStall(live_horde.loop)
    yield stall
    stall.stop()


def warm(front, key: str) -> None:
    """One small request through the route first: the process's first request imports modules on
    the loop, which is not the body's cost."""
    small = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert post(front, "/chat/completions", small, key).status_code == 503


def post(front, path: str, raw: bytes, key: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(f"{front.live.v1}{path}", content=raw, headers=headers, timeout=60, **kwargs)


def test_a_large_body_is_parsed_without_stalling_the_event_loop(front, requester, loop_stall):
    front.configure(max_inflight=0)
    raw = many_parts_chat_body()
    warm(front, requester.key)

    async def inline() -> float:
        started = time.perf_counter()
        screen_request(parse_body(raw))
        return time.perf_counter() - started

    # The least of up to three tries: a loaded box can hold the loop's thread off its core for a
    # moment in any one of them, while a body parsed on the loop stalls it in every one.
    tries = []
    for _ in range(3):
        loop_stall.reset()
        response = post(front, "/chat/completions", raw, requester.key)
        assert response.status_code == 503, response.text[:300]
        assert response.json()["error"] == AT_CAPACITY  # screened as valid, then refused at admission
        while_served = loop_stall.longest
        inline_seconds = front.live.run(inline(), timeout=30)  # the loop is held for all of it
        tries.append((while_served, inline_seconds))
        # Inline, the loop waits for the whole parse (a stall of 0.8-1.2 times it, measured); off it,
        # at most for the longest step that holds the interpreter (the JSON decoder's or pydantic's
        # one call over the body: 0.1-0.25 times it).
        assert inline_seconds > 0.05, inline_seconds
        if while_served < inline_seconds / 2:
            break
    else:
        raise AssertionError(f"the loop stalled for half the inline parse or more each time: {tries}")


def test_a_large_text_prompt_and_responses_input_are_screened_as_a_small_one(front, requester):
    front.configure(max_inflight=0)
    prompt = json.dumps({"model": MODEL, "prompt": "Once upon a time " * (2 * MIB // 17)}).encode()
    answer = post(front, "/completions", prompt, requester.key)
    assert (answer.status_code, answer.json()["error"]) == (503, AT_CAPACITY)

    parts = [{"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": image_url(4 * MIB)}]
    responses = json.dumps({"model": MODEL, "input": [{"role": "user", "content": parts}], "store": False}).encode()
    answer = post(front, "/responses", responses, requester.key)
    assert (answer.status_code, answer.json()["error"]) == (503, AT_CAPACITY)


def test_a_malformed_large_body_is_the_same_400(front, requester):
    raw = images_chat_body(images=1)
    cut = raw[: len(raw) // 2]  # inside the image's data URL
    answer = post(front, "/chat/completions", cut, requester.key)
    column = cut.index(b"data:") - 1
    assert answer.status_code == 400
    assert answer.json() == {
        "error": {
            "message": "We could not parse the JSON body of your request: Unterminated string starting at: "
            f"line 1 column {column + 1} (char {column})",
            "type": "invalid_request_error",
            "param": None,
            "code": "BadRequest",
        }
    }
    assert answer.headers["x-should-retry"] == "false"


def test_a_large_body_with_a_lone_surrogate_or_too_large_an_image_is_the_same_400(front, requester):
    url = image_url(4 * MIB)
    lone = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    ).encode()
    answer = post(front, "/chat/completions", lone, requester.key)
    assert (answer.status_code, answer.json()["error"]) == (
        400,
        {
            "message": "Invalid value for 'messages[0].content[0].text': the text holds a lone surrogate, which is not "
            "valid Unicode.",
            "type": "invalid_request_error",
            "param": "messages[0].content[0].text",
            "code": "BadRequest",
        },
    )

    too_large = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(MAX_CHAT_IMAGE_BYTES + 1)}}]}]}
    ).encode()
    answer = post(front, "/chat/completions", too_large, requester.key)
    assert (answer.status_code, answer.json()["error"]) == (
        400,
        {
            "message": f"The image is {MAX_CHAT_IMAGE_BYTES + 1} bytes; each image may be at most {MAX_CHAT_IMAGE_BYTES} bytes.",
            "type": "invalid_request_error",
            "param": "messages[0].content[0].image_url.url",
            "code": "SourceImageSizeExceeded",
        },
    )


def test_a_body_over_the_size_guard_is_still_413(front, requester):
    front.configure(max_body_bytes=2 * MIB)
    raw = images_chat_body(images=1)
    for sent in (raw, iter([raw[: MIB], raw[MIB:]])):  # declared, then chunked
        answer = post(front, "/chat/completions", sent, requester.key)
        assert answer.status_code == 413
        assert answer.json() == {
            "error": {
                "message": "The request body is over 2097152 bytes.",
                "type": "invalid_request_error",
                "param": None,
                "code": "RequestTooLarge",
            }
        }
        assert answer.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("depth", [1_000, 50_000])
def test_a_large_body_nested_past_the_parsers_depth_is_the_same_400(front, requester, depth):
    raw = b'{"model": "m", "user": "' + b"u" * 32 * 1024 + b'", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    answer = post(front, "/chat/completions", raw, requester.key)
    error = answer.json()["error"]
    assert (answer.status_code, error["code"], error["param"]) == (400, "BadRequest", None), error
    assert error["message"].startswith(
        "We could not parse the JSON body of your request: maximum recursion depth exceeded"
    ), error
