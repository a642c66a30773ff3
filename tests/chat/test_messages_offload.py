"""Messages offload (chat_requests.md): a request whose messages, as a base64 worker receives them,
pass the threshold is also stored as one JSON object, which a worker that declared messages_url
fetches from a short-lived URL instead of receiving the messages in its pop."""

from __future__ import annotations

import base64
import gzip
import io
import json
import time
from urllib.parse import parse_qs, urlsplit

import botocore.session
import pytest
from django.core.files.storage import Storage
from django.utils import timezone
from PIL import Image

from chat.models import Generation, GenerationRequest
from chat.object_store import chat_image_key, chat_messages_key
from chat.services.sweeps import expire_requests
from contract.chat_limits import CHAT_MESSAGES_URL_SECONDS
from tests.chat.chat_route_helpers import chat_async
from tests.chat.pop_helpers import ALL_GUARANTEES, chat_pop

VISION = ["vision", *ALL_GUARANTEES]


@pytest.fixture
def store(settings, tmp_path):
    folder = tmp_path / "chat-objects"
    local = {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(folder)}}
    settings.STORAGES = {**settings.STORAGES, "chat_images": local, "chat_messages": local}
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_ENABLED = True
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_BYTES = 64
    return folder


def png_data_url() -> str:
    out = io.BytesIO()
    Image.new("RGB", (6, 6), (0, 90, 200)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


IMAGE_TURN = {
    "role": "user",
    "content": [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": png_data_url()}}],
}
LONG_TEXT = [{"role": "user", "content": "Tell me about the sea. " * 20}]


def _register(horde, key: str, transports: list[str]) -> None:
    assert chat_pop(horde, key, features=VISION, transports=transports).json()["id"] is None


def _submit(horde, make_user, messages) -> str:
    requester = make_user("r", kudos=1000)
    response = chat_async(horde.client, requester.key, messages=messages, max_tokens=64)
    assert response.status_code == 202, response.json()
    return response.json()["id"]


def _directives(cache_control: str) -> set[str]:
    return {d.strip().lower() for d in cache_control.split(",")}


def test_a_messages_url_worker_fetches_the_whole_body_with_the_images_inlined(horde, make_user, store):
    owner = make_user("o", trusted=True)
    _register(horde, owner.key, ["messages_url", "url"])
    request_id = _submit(horde, make_user, [IMAGE_TURN])
    row = GenerationRequest.objects.get(pk=request_id)
    assert row.chat_messages_offloaded and row.chat_has_images
    jpeg = (store / chat_image_key(request_id, 0)).read_bytes()
    expected = [{**IMAGE_TURN, "content": [IMAGE_TURN["content"][0], {"type": "image_url", "image_url": {
        "url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()}}]}]
    assert json.loads((store / chat_messages_key(request_id)).read_bytes()) == expected

    popped = chat_pop(horde, owner.key, features=VISION, transports=["messages_url", "url"]).json()
    assert popped["id"] and "messages" not in popped["payload"], popped
    parts = urlsplit(popped["payload"]["messages_url"])
    assert parts.path == f"/api/v2/chat_images/{chat_messages_key(request_id)}"
    assert abs(int(parse_qs(parts.query)["expires"][0]) - (time.time() + CHAT_MESSAGES_URL_SECONDS)) < 5
    assert Generation.objects.get(pk=popped["id"]).image_transport == "messages_url"
    fetched = horde.client.get(f"{parts.path}?{parts.query}")
    assert fetched.status_code == 200 and fetched["Content-Type"] == "application/json"
    assert "no-transform" in _directives(fetched["Cache-Control"])
    assert "Content-Encoding" not in fetched and fetched.json() == expected
    # The rest of the payload is as without the offload.
    assert popped["payload"]["max_length"] == 64 and popped["payload"]["n"] == 1


def test_gzip_is_kept_only_when_smaller_and_served_as_stored(horde, make_user, store, settings):
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_GZIP = True
    owner = make_user("o", trusted=True)
    _register(horde, owner.key, ["messages_url"])
    packed_id = _submit(horde, make_user, LONG_TEXT)  # repetitive text: gzip is smaller
    stored = (store / chat_messages_key(packed_id)).read_bytes()
    assert stored[:2] == b"\x1f\x8b" and json.loads(gzip.decompress(stored)) == LONG_TEXT
    popped = chat_pop(horde, owner.key, features=VISION, transports=["messages_url"]).json()
    parts = urlsplit(popped["payload"]["messages_url"])
    fetched = horde.client.get(f"{parts.path}?{parts.query}", HTTP_ACCEPT_ENCODING="identity")
    assert fetched["Content-Encoding"] == "gzip" and json.loads(gzip.decompress(fetched.content)) == LONG_TEXT
    assert fetched["Content-Type"] == "application/json"
    assert "no-transform" in _directives(fetched["Cache-Control"])

    settings.HORDE_CHAT_MESSAGES_OFFLOAD_BYTES = 10
    short = [{"role": "user", "content": "Hi, how are you?"}]  # gzip would make it larger
    plain_id = _submit(horde, make_user, short)
    assert json.loads((store / chat_messages_key(plain_id)).read_bytes()) == short


# PutObject's parameters in S3's own API model, which boto3 checks before anything is sent.
PUT_OBJECT_PARAMS = set(
    botocore.session.get_session().get_service_model("s3").operation_model("PutObject").input_shape.members
)


class FakeBucket:
    """Stands in for the S3-style bucket (boto3's Bucket resource): it keeps each put_object call,
    refusing a parameter S3's PutObject does not have as boto3 would."""

    def __init__(self):
        self.puts: list[dict] = []

    def put_object(self, **params):
        unknown = set(params) - PUT_OBJECT_PARAMS
        if unknown:
            raise TypeError(f"PutObject has no parameter {sorted(unknown)}")
        self.puts.append(params)


class BucketStorage(Storage):
    """A bucket storage (STORAGE_BACKEND=s3's, not the local folder) over a FakeBucket."""

    def __init__(self, bucket: FakeBucket):
        self.bucket = bucket


@pytest.fixture
def bucket(settings, store):
    """The messages objects go to a bucket; the images stay in the local folder."""
    fake = FakeBucket()
    settings.STORAGES = {
        **settings.STORAGES,
        "chat_messages": {"BACKEND": f"{__name__}.BucketStorage", "OPTIONS": {"bucket": fake}},
    }
    return fake


@pytest.mark.parametrize("gzip_on", [False, True], ids=["plain", "gzip"])
def test_a_bucket_stores_the_object_as_json_never_transformed_and_gzip_encoded_when_gzipped(
    horde, make_user, bucket, settings, gzip_on
):
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_GZIP = gzip_on
    _register(horde, make_user("o", trusted=True).key, ["messages_url"])
    request_id = _submit(horde, make_user, LONG_TEXT)  # repetitive text: gzip is smaller
    (put,) = bucket.puts
    body = put.pop("Body")
    assert put == {
        "Key": chat_messages_key(request_id),
        "ContentType": "application/json",
        "CacheControl": "no-transform",
        **({"ContentEncoding": "gzip"} if gzip_on else {}),
    }
    assert json.loads(gzip.decompress(body) if gzip_on else body) == LONG_TEXT
    assert (body[:2] == b"\x1f\x8b") is gzip_on
    if gzip_on:  # a body gzip would make larger is stored plain, without the encoding
        settings.HORDE_CHAT_MESSAGES_OFFLOAD_BYTES = 10
        short = [{"role": "user", "content": "Hi, how are you?"}]
        plain_id = _submit(horde, make_user, short)
        plain = bucket.puts[1]
        assert json.loads(plain.pop("Body")) == short
        assert plain == {
            "Key": chat_messages_key(plain_id),
            "ContentType": "application/json",
            "CacheControl": "no-transform",
        }


def test_a_worker_without_messages_url_receives_an_offloaded_request_inline(horde, make_user, store):
    owner = make_user("o", trusted=True)
    _register(horde, owner.key, [])
    request_id = _submit(horde, make_user, LONG_TEXT)
    assert GenerationRequest.objects.get(pk=request_id).chat_messages_offloaded
    popped = chat_pop(horde, owner.key, features=VISION, transports=[]).json()
    assert popped["id"] and popped["payload"]["messages"] == LONG_TEXT and "messages_url" not in popped["payload"]
    assert Generation.objects.get(pk=popped["id"]).image_transport is None


def test_an_offloaded_image_request_goes_inline_to_a_base64_worker(horde, make_user, store):
    owner = make_user("o", trusted=True)
    _register(horde, owner.key, ["base64"])
    request_id = _submit(horde, make_user, [IMAGE_TURN])
    popped = chat_pop(horde, owner.key, features=VISION, transports=["base64"]).json()
    url = popped["payload"]["messages"][0]["content"][1]["image_url"]["url"]
    assert url == "data:image/jpeg;base64," + base64.b64encode((store / chat_image_key(request_id, 0)).read_bytes()).decode()
    assert Generation.objects.get(pk=popped["id"]).image_transport == "base64"


def test_nothing_is_offloaded_under_the_threshold_when_off_or_on_a_dry_run(horde, make_user, store, settings):
    owner = make_user("o", trusted=True)
    _register(horde, owner.key, ["messages_url"])
    requester = make_user("r", kudos=1000)
    dry = chat_async(horde.client, requester.key, messages=LONG_TEXT, max_tokens=64, horde={"dry_run": True})
    assert dry.status_code == 200 and not store.exists()
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_BYTES = 10_000
    under = _submit(horde, make_user, LONG_TEXT)
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_BYTES = 64
    settings.HORDE_CHAT_MESSAGES_OFFLOAD_ENABLED = False
    off = _submit(horde, make_user, LONG_TEXT)
    assert not GenerationRequest.objects.filter(pk__in=[under, off], chat_messages_offloaded=True).exists()
    assert not store.exists()


def test_expiry_deletes_the_messages_object_with_the_images(
    horde, make_user, store, django_capture_on_commit_callbacks
):
    owner = make_user("o", trusted=True)
    _register(horde, owner.key, ["messages_url"])
    request_id = _submit(horde, make_user, [IMAGE_TURN])
    assert sorted(p.name for p in store.iterdir()) == [chat_image_key(request_id, 0), chat_messages_key(request_id)]
    GenerationRequest.objects.filter(pk=request_id).update(expires_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        assert expire_requests() == 1
    assert list(store.iterdir()) == []
