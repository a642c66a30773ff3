"""A large body on the OpenAI front (docs/adr/0127-large-bodies-parsed-off-the-event-loop.md): its
parse and screening leave the event loop free for every other request and open stream of the
process, and its answers are the ones a small body of the same kind gets.

The event loop's stall is measured on the live server's own loop: a task that sleeps 1 ms at a time
records how late it wakes. The reference is the same body parsed and screened inline on that loop,
in the same test, so a slow or loaded machine slows both alike.
"""

from __future__ import annotations

import base64
import json
import threading

import httpx
import pytest

from contract.chat_limits import MAX_CHAT_IMAGE_BYTES, MIB
from oai import app as oai_app
from oai.schema import parse_body
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


def warm(front, key: str) -> None:
    """One small request through the route first: the process's first request imports modules on
    the loop, which is not the body's cost."""
    small = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert post(front, "/chat/completions", small, key).status_code == 503


def post(front, path: str, raw: bytes, key: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(f"{front.live.v1}{path}", content=raw, headers=headers, timeout=60, **kwargs)


def test_a_large_body_is_parsed_off_the_event_loop_and_a_small_one_on_it(front, requester, monkeypatch):
    """Where the parse runs, not how long the loop stalls: on a loaded two-core CI box the loop's
    stall read 0.8 s for either (the body thread and the loop share one interpreter lock), so the
    stall is measured in docs/adr/0127, not asserted here."""
    front.configure(max_inflight=0)
    warm(front, requester.key)
    threads: list[str] = []

    def parse_recording_its_thread(raw: bytes):
        threads.append(threading.current_thread().name)
        return parse_body(raw)

    monkeypatch.setattr(oai_app, "parse_body", parse_recording_its_thread)
    loop_thread = front.live.run(_thread_name(), timeout=10)

    response = post(front, "/chat/completions", many_parts_chat_body(), requester.key)
    assert response.status_code == 503, response.text[:300]
    assert response.json()["error"] == AT_CAPACITY  # screened as valid, then refused at admission
    small = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert post(front, "/chat/completions", small, requester.key).json()["error"] == AT_CAPACITY
    assert len(threads) == 2, threads
    assert threads[0].startswith("oai-body") and threads[0] != loop_thread, threads
    assert threads[1] == loop_thread, (threads, loop_thread)


async def _thread_name() -> str:
    return threading.current_thread().name


@pytest.mark.parametrize("native", ["in_process", "http"])
def test_the_native_submits_json_is_encoded_off_the_event_loop(front, client, start_worker, monkeypatch, native):
    """The front's native submit body (the client's images and all) is encoded on a thread, mounted
    in process or calling the horde over HTTP, never on the loop."""
    from oai import horde_client

    if native == "http":
        front.configure(native_roots=[f"{front.live.url}/api/v2"])
    start_worker()
    threads: list[str] = []
    encode = horde_client._json_bytes

    def encode_recording_its_thread(value):
        threads.append(threading.current_thread().name)
        return encode(value)

    monkeypatch.setattr(horde_client, "_json_bytes", encode_recording_its_thread)
    loop_thread = front.live.run(_thread_name(), timeout=10)
    completion = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].finish_reason == "stop"
    assert threads and loop_thread not in threads, (threads, loop_thread)


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
