"""Images through the front, as an OpenAI client sends them: the horde stores each as a JPEG and the
worker fetches it from the signed URL its job carries; a bad image is an OpenAI error at its path."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from tests.http_fakes import QuietHandler
from tests.oai.conftest import MODEL


def png_data_url(width: int, height: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (20, 40, 200)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_messages(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


@pytest.fixture
def image_store(settings, tmp_path):
    settings.STORAGES = {
        **settings.STORAGES,
        "chat_images": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "chat-images")},
        },
    }
    return tmp_path / "chat-images"


def test_the_worker_fetches_the_stored_jpeg_of_an_sdk_image(client, start_worker, image_store):
    fetched: list[httpx.Response] = []

    def reply(job: dict) -> dict:
        url = job["payload"]["messages"][0]["content"][1]["image_url"]["url"]
        fetched.append(httpx.get(url, timeout=10))
        answer = fetched[-1]
        return {
            "message": {"role": "assistant", "content": f"{len(answer.content)} bytes of {answer.headers['content-type']}"},
            "finish_reason": "stop",
        }

    start_worker(image_transports=["url"], reply=reply)
    completion = client.chat.completions.create(model=MODEL, messages=image_messages(png_data_url(40, 30)))
    (answer,) = fetched
    assert answer.status_code == 200 and answer.content[:3] == b"\xff\xd8\xff"  # a JPEG
    with Image.open(io.BytesIO(answer.content)) as image:
        assert image.size == (40, 30)
    assert completion.choices[0].message.content == f"{len(answer.content)} bytes of image/jpeg"


def test_an_unreadable_image_is_a_bad_request_at_its_path(client, start_worker, image_store):
    start_worker(image_transports=["url"])
    not_an_image = "data:image/png;base64," + base64.b64encode(b"plain words").decode()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=image_messages(not_an_image))
    assert caught.value.code == "SourceImageUnreadable"
    assert caught.value.param == "messages[0].content[1].image_url.url"
    assert not image_store.exists() or not any(image_store.iterdir())  # nothing stored


def test_a_slow_image_url_is_waited_for_not_sent_again(front, client, start_worker, image_store, settings):
    """The horde fetches a URL image before it answers the submit: the front waits for that
    longer than its usual native timeout instead of taking the answer for lost and sending the
    submit again (which would fetch, encode and store every image a second time)."""
    import threading
    import time
    from http.server import ThreadingHTTPServer

    picture = io.BytesIO()
    Image.new("RGB", (12, 12), (200, 0, 0)).save(picture, format="PNG")
    fetches: list[float] = []

    class SlowHost(QuietHandler):
        def do_GET(self):  # noqa: N802
            fetches.append(time.monotonic())
            time.sleep(1.5)
            self.send_body(200, picture.getvalue(), "image/png")

    host = ThreadingHTTPServer(("127.0.0.1", 0), SlowHost)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        settings.HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS = ["127.0.0.0/8"]
        front.configure(native_timeout_seconds=1.0)
        start_worker(image_transports=["url"])
        url = f"http://127.0.0.1:{host.server_port}/red.png"
        completion = client.chat.completions.create(model=MODEL, messages=image_messages(url))
    finally:
        host.shutdown()
        host.server_close()
    assert completion.choices[0].message.content
    assert len(fetches) == 1  # one submit: the image was fetched once
