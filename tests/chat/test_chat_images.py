"""A chat request's images (chat_requests.md, "Images"): the requester's total, URL fetches, the
header checks, the normalisation to JPEG, the store and its refusals, the extra source image tax,
what a worker receives under each transport, and the deletes with their retry."""

from __future__ import annotations

import base64
import io
import threading
import time
import uuid
from decimal import Decimal
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from django.utils import timezone
from PIL import Image

from accounts.models import KudosTransaction
from chat.models import Generation, GenerationRequest
from chat.object_store import CHAT_IMAGE_DELETE_RETRY_KEY, chat_image_key
from chat.services.chat_images import normalise_chat_image
from chat.services.create_chat import inactive_request_create
from chat.services.sweeps import expire_requests
from contract.chat_limits import MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED, MIN_CHAT_IMAGE_URL_SECONDS
from contract.text import FAULTED_GENERATIONS_LIMIT
from tests.chat.chat_route_helpers import chat_async, chat_worker
from tests.chat.pop_helpers import ALL_GUARANTEES, chat_pop
from tests.http_fakes import QuietHandler

VISION = ["vision", *ALL_GUARANTEES]


def png(width: int = 8, height: int = 8, *, mode: str = "RGB", color=(200, 30, 30), noise: bool = False) -> bytes:
    image = Image.frombytes(mode, (width, height), _noise(width * height * len(mode))) if noise else Image.new(
        mode, (width, height), color
    )
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _noise(n: int) -> bytes:
    import random

    return random.Random(n).randbytes(n)


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def image_message(*urls: str, text: str = "What is it?") -> dict:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url, "detail": "low"}} for url in urls]
    return {"role": "user", "content": parts}


@pytest.fixture
def image_store(settings, tmp_path) -> Path:
    """The chat image store in a folder of this test's own."""
    folder = tmp_path / "chat-images"
    settings.STORAGES = {
        **settings.STORAGES,
        "chat_images": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(folder)}},
    }
    return folder


def stored_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture
def vision_owner(make_user):
    owner = make_user("vision-owner", trusted=True)
    chat_worker(owner, features=[*VISION], image_transports=["url", "base64"])
    return owner


class ImageHost:
    """A local image host: paths to (status, body)."""

    def __init__(self, routes: dict[str, tuple[int, bytes]], *, delay: float = 0.0):
        routes_ = routes
        self.requested: list[str] = []  # the paths asked for, in order
        requested = self.requested

        class Handler(QuietHandler):
            def do_GET(self):  # noqa: N802
                requested.append(self.path)
                status, body = routes_.get(self.path, (404, b"missing"))
                self.send_response(status)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                time.sleep(delay)  # a slow host: the body comes within the read timeout, late
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_port}{path}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def image_host():
    hosts = []

    def start(routes, **options):
        hosts.append(ImageHost(routes, **options))
        return hosts[-1]

    yield start
    for host in hosts:
        host.close()


# --- submit: stored as JPEG, referenced by key, taxed -------------------------------------------------


def test_an_image_is_stored_as_jpeg_under_its_key_and_the_row_holds_only_the_reference(
    horde, make_user, vision_owner, image_store
):
    requester = make_user("r", kudos=1000)
    transparent = png(4, 4, mode="RGBA", color=(0, 0, 0, 0))
    wide = png(3000, 1000, color=(10, 120, 10))
    response = chat_async(
        horde.client, requester.key, messages=[image_message(data_url(transparent), data_url(wide))], max_tokens=64
    )
    assert response.status_code == 202, response.json()
    request_id = response.json()["id"]
    request = GenerationRequest.objects.get(pk=request_id)
    parts = request.messages[0]["content"]
    assert [p["image_url"] for p in parts[1:]] == [
        {"url": f"horde-r2://{request_id}_chat_0.jpg", "detail": "low"},
        {"url": f"horde-r2://{request_id}_chat_1.jpg", "detail": "low"},
    ]
    assert "base64" not in str(request.messages)
    assert stored_files(image_store) == [chat_image_key(request_id, 0), chat_image_key(request_id, 1)]
    with Image.open(image_store / chat_image_key(request_id, 0)) as first:
        # Transparency flattened onto white, as RGB JPEG.
        assert (first.format, first.mode) == ("JPEG", "RGB")
        assert all(channel >= 250 for channel in first.getpixel((1, 1)))
    with Image.open(image_store / chat_image_key(request_id, 1)) as second:
        assert second.format == "JPEG" and second.size == (2048, 683)


def test_each_image_adds_the_extra_source_image_tax_to_the_quote_and_the_charge(
    horde, make_user, vision_owner, image_store
):
    requester = make_user("r", kudos=1000)
    image = data_url(png())
    messages = [image_message(image, image)]
    words_only = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}]}]
    quote = chat_async(horde.client, requester.key, messages=messages, max_tokens=64, horde={"dry_run": True})
    plain = chat_async(horde.client, requester.key, messages=words_only, max_tokens=64, horde={"dry_run": True})
    assert quote.status_code == plain.status_code == 200
    assert stored_files(image_store) == []  # a dry run stores nothing
    created = chat_async(horde.client, requester.key, messages=messages, max_tokens=64)
    assert created.status_code == 202, created.json()
    assert created.json()["kudos"] == quote.json()["kudos"]
    request = GenerationRequest.objects.get(pk=created.json()["id"])
    assert request.consumed_kudos == Decimal("11")  # the horde tax, 1, and 5 per image
    tax = KudosTransaction.objects.get(request_id=request.id, kind=KudosTransaction.Kind.HORDE_TAX)
    assert tax.amount == Decimal("-11")
    assert requester.refresh().kudos == Decimal("989")


# --- submit: refusals ---------------------------------------------------------------------------------


def _refused(response, rc: str, path: str | None = None) -> str:
    assert response.status_code == 400, response.json()
    body = response.json()
    assert body["rc"] == rc, body
    if path is not None:
        assert body["message"].startswith(f"'{path}': "), body
    return body["message"]


def test_a_picture_over_the_pixel_cap_is_refused_from_its_header(horde, make_user, vision_owner, image_store):
    requester = make_user("r", kudos=1000)
    big = data_url(png(3073, 3072))
    response = chat_async(horde.client, requester.key, messages=[image_message(big)], max_tokens=64)
    message = _refused(response, "SourceImageResolutionExceeded", "messages[0].content[1].image_url.url")
    assert "3073x3072" in message
    assert not GenerationRequest.objects.exists() and stored_files(image_store) == []
    assert requester.refresh().kudos == Decimal("1000")


def test_bytes_that_are_not_an_image_are_refused_as_unreadable(horde, make_user, vision_owner, image_store):
    requester = make_user("r", kudos=1000)
    messages = [{"role": "system", "content": "S"}, image_message(data_url(png()), data_url(b"not an image at all"))]
    response = chat_async(horde.client, requester.key, messages=messages, max_tokens=64)
    _refused(response, "SourceImageUnreadable", "messages[1].content[2].image_url.url")
    assert not GenerationRequest.objects.exists() and stored_files(image_store) == []


def _truncated_png() -> bytes:
    whole = png(64, 64, noise=True)
    return whole[: len(whole) // 2]  # the header reads; the pixels do not


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(_truncated_png(), id="truncated-png"),
        pytest.param(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", id="eps"),
        pytest.param(b"GIF89a\x0a\x00\x0a\x00\x80\x00\x00broken", id="corrupt-gif"),
    ],
)
def test_an_image_whose_body_does_not_decode_is_unreadable(horde, make_user, vision_owner, image_store, data):
    requester = make_user("r", kudos=1000)
    response = chat_async(horde.client, requester.key, messages=[image_message(data_url(data))], max_tokens=64)
    _refused(response, "SourceImageUnreadable", "messages[0].content[1].image_url.url")
    assert not GenerationRequest.objects.exists() and stored_files(image_store) == []


def test_a_sixteen_bit_grey_image_keeps_its_greys_and_its_transparent_value_turns_white(
    horde, make_user, vision_owner, image_store
):
    grey = Image.new("I;16", (32, 32), 20000)
    grey.putpixel((0, 0), 1000)  # the transparent value
    out = io.BytesIO()
    grey.save(out, format="PNG", transparency=1000)
    requester = make_user("r", kudos=1000)
    response = chat_async(horde.client, requester.key, messages=[image_message(data_url(out.getvalue()))], max_tokens=64)
    assert response.status_code == 202, response.json()
    with Image.open(image_store / chat_image_key(response.json()["id"], 0)) as stored:
        assert abs(stored.getpixel((28, 28))[0] - 20000 // 256) <= 3  # not clipped to white
        assert stored.getpixel((0, 0))[0] >= 200  # transparent: white (JPEG blurs the one pixel)


def _camera_jpeg(exif: bytes) -> bytes:
    """A photo as a phone stores it: pixels 40x10 (red left half), shown 10x40 by its EXIF Orientation."""
    image = Image.new("RGB", (40, 10), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 20, 10))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=95, exif=exif)
    return out.getvalue()


def _orientation_six() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to show
    return exif.tobytes()


# Orientation 6 beside a tag whose type is out of range: readable, but Pillow's own exif_transpose
# fails writing it back (struct.error); the orientation is still applied.
_ORIENTATION_SIX_BESIDE_A_BROKEN_TAG = (
    b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\x00\x02\x01%\x00\x02\x00\x00\x00\x1f\x00\x00\x00&\x01\x12\x00\x03"
    b"\x00\x00\x00\x01\x00\x06\x00\x00\x00\x00\x00\x00" + b"x" * 30 + b"\x00\x00"
)


@pytest.mark.parametrize(
    "exif",
    [pytest.param(_orientation_six(), id="exif"), pytest.param(_ORIENTATION_SIX_BESIDE_A_BROKEN_TAG, id="odd-exif")],
)
def test_a_photo_is_stored_upright_as_its_exif_orientation_shows_it(
    horde, make_user, vision_owner, image_store, exif
):
    """The stored JPEG carries no EXIF, so the orientation is applied to its pixels: the worker sees
    the photo as the requester's browser showed it, not lying on its side."""
    requester = make_user("r", kudos=1000)
    url = data_url(_camera_jpeg(exif), "jpeg")
    response = chat_async(horde.client, requester.key, messages=[image_message(url)], max_tokens=64)
    assert response.status_code == 202, response.json()
    with Image.open(image_store / chat_image_key(response.json()["id"], 0)) as stored:
        assert stored.size == (10, 40)
        assert stored.getpixel((5, 5))[0] > 200 and stored.getpixel((5, 35))[2] > 200  # red on top
        assert stored.getexif().get(0x0112) is None


def test_an_untrusted_requester_is_held_to_five_mib_in_all_and_a_trusted_one_to_twenty_five(
    horde, make_user, vision_owner, image_store
):
    """Counted over the data URLs before anything else: a dry run is refused the same way."""
    noisy = png(1024, 1024, noise=True)  # about 3 MiB: two pass each cap alone, not the untrusted total
    assert 2 * len(noisy) > MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED > len(noisy)
    messages = [image_message(data_url(noisy), data_url(noisy))]
    untrusted, trusted = make_user("u", kudos=1000), make_user("t", kudos=1000, trusted=True)
    for options in ({}, {"horde": {"dry_run": True}}):
        refused = chat_async(horde.client, untrusted.key, messages=messages, max_tokens=64, **options)
        message = _refused(refused, "SourceImageSizeExceeded")
        assert f"{2 * len(noisy)} bytes, over the {MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED} byte cap" in message
    accepted = chat_async(horde.client, trusted.key, messages=messages, max_tokens=64)
    assert accepted.status_code == 202, accepted.json()
    assert len(stored_files(image_store)) == 2


def test_a_url_image_is_fetched_and_stored(horde, make_user, vision_owner, image_store, image_host, settings):
    settings.HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    host = image_host({"/cat.png": (200, png(16, 8))})
    requester = make_user("r", kudos=1000)
    response = chat_async(horde.client, requester.key, messages=[image_message(host.url("/cat.png"))], max_tokens=64)
    assert response.status_code == 202, response.json()
    (name,) = stored_files(image_store)
    with Image.open(image_store / name) as stored:
        assert stored.format == "JPEG" and stored.size == (16, 8)


def test_a_url_image_whose_path_is_not_ascii_is_fetched(
    horde, make_user, vision_owner, image_store, image_host, settings
):
    settings.HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    host = image_host({"/caf%C3%A9.png": (200, png(16, 8))})
    requester = make_user("r", kudos=1000)
    messages = [image_message(host.url("/café.png"))]
    response = chat_async(horde.client, requester.key, messages=messages, max_tokens=64)
    assert response.status_code == 202, response.content
    assert host.requested == ["/caf%C3%A9.png"] and len(stored_files(image_store)) == 1


def test_url_images_stop_being_fetched_once_the_running_total_passes_the_cap(
    horde, make_user, vision_owner, image_store, image_host, settings
):
    """Each fetched image counts at once: the fetch that passes the total is the last one made."""
    settings.HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    noisy = png(1024, 1024, noise=True)  # about 3 MiB: the second one passes the untrusted total
    assert 2 * len(noisy) > MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED > len(noisy)
    host = image_host({"/a.png": (200, noisy), "/b.png": (200, noisy), "/c.png": (200, noisy)})
    requester = make_user("r", kudos=1000)
    urls = [host.url(p) for p in ("/a.png", "/b.png", "/c.png")]
    response = chat_async(horde.client, requester.key, messages=[image_message(*urls)], max_tokens=64)
    message = _refused(response, "SourceImageSizeExceeded")
    assert message == (
        f"'messages': The request's images total {2 * len(noisy)} bytes, over the "
        f"{MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED} byte cap for this request."
    )
    assert host.requested == ["/a.png", "/b.png"]
    assert not GenerationRequest.objects.exists() and stored_files(image_store) == []
    assert requester.refresh().kudos == Decimal("1000")


def test_the_image_urls_of_a_request_share_one_fetch_bound(make_user, image_host, settings):
    """Each image of a slow host comes in time on its own; together they pass the request's bound,
    and the fetch that would pass it is cut off: 20 slow hosts cannot hold a web thread 20 times as
    long as one."""
    from chat.services.chat_images import ImagePart, load_chat_images
    from contract.chat_errors import ChatRefusal

    settings.HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    host = image_host({f"/{name}.png": (200, png()) for name in "abc"}, delay=0.6)
    parts = [
        ImagePart(path=f"messages[0].content[{index}]", url=host.url(f"/{name}.png"))
        for index, name in enumerate("abc", start=1)
    ]
    started = time.monotonic()
    with pytest.raises(ChatRefusal) as refused:
        load_chat_images(parts=parts, user=make_user("r").user, fetch_seconds=1.0)
    # The bound ended the fetching: the third image was never asked for (all three take 1.8 s).
    assert host.requested == ["/a.png", "/b.png"]
    assert time.monotonic() - started < 5
    assert (refused.value.rc, refused.value.param) == ("SourceImageUrlInvalid", "messages[0].content[2]")
    assert refused.value.message.endswith(
        "The image URL could not be fetched: the request's image URLs took longer than 1 seconds in all."
    )
    assert host.requested == ["/a.png", "/b.png"]


def _tiled_noise_png(side: int = 2048, tile: int = 8) -> bytes:
    """A tile of noise repeated: a small PNG that re-encodes to a large JPEG."""
    import random

    piece = Image.frombytes("RGB", (tile, tile), random.Random(tile).randbytes(tile * tile * 3))
    image = Image.new("RGB", (side, side))
    for x in range(0, side, tile):
        for y in range(0, side, tile):
            image.paste(piece, (x, y))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_the_images_as_stored_are_held_to_the_total_too(horde, make_user, vision_owner, image_store):
    """Two PNGs far under the total whose JPEGs together pass it: refused for the encoded size."""
    tiled = _tiled_noise_png()
    jpeg = normalise_chat_image(tiled)
    assert 2 * len(tiled) < MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED < 2 * len(jpeg)
    messages = [image_message(data_url(tiled), data_url(tiled))]
    untrusted, trusted = make_user("u", kudos=1000), make_user("t", kudos=1000, trusted=True)
    response = chat_async(horde.client, untrusted.key, messages=messages, max_tokens=64)
    message = _refused(response, "SourceImageSizeExceeded")
    assert message == (
        f"'messages': The request's images as stored (JPEG) total {2 * len(jpeg)} bytes, over the "
        f"{MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED} byte cap for this request."
    )
    assert not GenerationRequest.objects.exists() and stored_files(image_store) == []
    assert untrusted.refresh().kudos == Decimal("1000")
    # A dry run counts the data URLs only; a trusted requester's 25 MiB holds both JPEGs.
    dry = chat_async(horde.client, untrusted.key, messages=messages, max_tokens=64, horde={"dry_run": True})
    assert dry.status_code == 200, dry.json()
    accepted = chat_async(horde.client, trusted.key, messages=messages, max_tokens=64)
    assert accepted.status_code == 202, accepted.json()
    assert [(image_store / name).stat().st_size for name in stored_files(image_store)] == [len(jpeg), len(jpeg)]


def test_a_url_into_a_private_network_is_refused_and_a_missing_image_is_invalid(
    horde, make_user, vision_owner, image_store, image_host, settings
):
    host = image_host({"/cat.png": (200, png())})
    requester = make_user("r", kudos=1000)
    refused = chat_async(horde.client, requester.key, messages=[image_message(host.url("/cat.png"))], max_tokens=64)
    _refused(refused, "SourceImageUrlRefused", "messages[0].content[1].image_url.url")
    settings.HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    missing = chat_async(horde.client, requester.key, messages=[image_message(host.url("/dog.png"))], max_tokens=64)
    assert "404" in _refused(missing, "SourceImageUrlInvalid", "messages[0].content[1].image_url.url")
    assert not GenerationRequest.objects.exists() and stored_files(image_store) == []


def test_a_store_that_fails_refuses_with_503_and_charges_nothing(horde, make_user, vision_owner, settings, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's folder should be")
    settings.STORAGES = {
        **settings.STORAGES,
        "chat_images": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(blocker / "chat-images")},
        },
    }
    requester = make_user("r", kudos=1000)
    response = chat_async(horde.client, requester.key, messages=[image_message(data_url(png()))], max_tokens=64)
    assert response.status_code == 503 and response.json()["rc"] == "ChatImageStorageUnavailable", response.json()
    assert not GenerationRequest.objects.exists()
    assert requester.refresh().kudos == Decimal("1000")
    assert list(KudosTransaction.objects.filter(user=requester.user).values_list("kind", flat=True)) == ["grant"]


def test_a_refused_activation_deletes_the_row_and_the_images_it_stored(
    horde, make_user, vision_owner, image_store, django_capture_on_commit_callbacks
):
    """A requester without the kudos a request holds upfront is refused inside the
    activation, after the images were stored: they go with the inactive row, once its deletion
    commits."""
    requester = make_user("r", kudos=0)
    # Without slow workers a request always holds its kudos: this requester has none.
    with django_capture_on_commit_callbacks(execute=True):
        response = chat_async(
            horde.client, requester.key, messages=[image_message(data_url(png()))], max_tokens=64,
            horde={"slow_workers": False},
        )
    assert response.status_code == 403 and response.json()["rc"] == "KudosUpfront", response.json()
    assert not GenerationRequest.objects.exists()
    assert stored_files(image_store) == []


# --- pop: what the worker receives ---------------------------------------------------------------


def _queued_image_request(horde, make_user, image: bytes) -> str:
    requester = make_user("r", kudos=1000)
    response = chat_async(horde.client, requester.key, messages=[image_message(data_url(image))], max_tokens=64)
    assert response.status_code == 202, response.json()
    return response.json()["id"]


def _queued_for_a_popping_worker(horde, make_user, transports: list[str]) -> tuple[object, str]:
    """A worker registered by its first (empty) pop, then a request with one image."""
    owner = make_user("o", trusted=True)
    assert chat_pop(horde, owner.key, features=VISION, transports=transports).json()["id"] is None
    return owner, _queued_image_request(horde, make_user, png(6, 6))


def test_a_url_worker_receives_a_signed_download_url_that_serves_the_stored_jpeg(horde, make_user, image_store):
    owner, request_id = _queued_for_a_popping_worker(horde, make_user, ["url", "base64"])
    popped = chat_pop(horde, owner.key, features=VISION, transports=["url", "base64"])
    assert popped.status_code == 200 and popped.json()["id"], popped.json()
    image_url = popped.json()["payload"]["messages"][0]["content"][1]["image_url"]
    assert image_url["detail"] == "low"
    parts = urlsplit(image_url["url"])
    assert (parts.scheme, parts.netloc) == ("http", "testserver")
    assert parts.path == f"/api/v2/chat_images/{chat_image_key(request_id, 0)}"
    expires = int(parse_qs(parts.query)["expires"][0])
    assert expires >= time.time() + MIN_CHAT_IMAGE_URL_SECONDS - 5
    assert Generation.objects.get(pk=popped.json()["id"]).image_transport == "url"
    download = horde.client.get(f"{parts.path}?{parts.query}")
    assert download.status_code == 200 and download["Content-Type"] == "image/jpeg"
    assert download.content == (image_store / chat_image_key(request_id, 0)).read_bytes()
    forged = parts.query.replace("signature=", "signature=0")
    assert horde.client.get(f"{parts.path}?{forged}").status_code == 403
    assert horde.client.get(parts.path).status_code == 403


def test_a_signed_url_serves_nothing_once_it_expired(horde, make_user, image_store, settings):
    settings.HORDE_PUBLIC_URL = "https://horde.example"
    owner, request_id = _queued_for_a_popping_worker(horde, make_user, ["url"])
    popped = chat_pop(horde, owner.key, features=VISION, transports=["url"])
    parts = urlsplit(popped.json()["payload"]["messages"][0]["content"][1]["image_url"]["url"])
    assert (parts.scheme, parts.netloc) == ("https", "horde.example")  # the configured address
    query = parse_qs(parts.query)
    from chat.object_store import _signature  # the local store's own signer

    past = int(time.time()) - 1
    stale = f"expires={past}&signature={_signature(chat_image_key(request_id, 0), past)}"
    assert horde.client.get(f"{parts.path}?{stale}").status_code == 403
    assert horde.client.get(f"{parts.path}?expires={query['expires'][0]}&signature={query['signature'][0]}").status_code == 200
    # An expiry that is not ASCII digits, or too long to be a time, is refused, not a 500.
    for expires in ("%C2%B2", "9" * 5000, "-1", "1e9"):
        assert horde.client.get(f"{parts.path}?expires={expires}&signature={query['signature'][0]}").status_code == 403


def test_a_base64_worker_receives_the_stored_jpeg_inline(horde, make_user, image_store):
    owner, request_id = _queued_for_a_popping_worker(horde, make_user, ["base64"])
    popped = chat_pop(horde, owner.key, features=VISION, transports=["base64"])
    assert popped.status_code == 200 and popped.json()["id"], popped.json()
    url = popped.json()["payload"]["messages"][0]["content"][1]["image_url"]["url"]
    stored = (image_store / chat_image_key(request_id, 0)).read_bytes()
    assert url == "data:image/jpeg;base64," + base64.b64encode(stored).decode()
    assert Generation.objects.get(pk=popped.json()["id"]).image_transport == "base64"
    # The stored row keeps its reference: the payload is the worker's copy.
    stored_url = GenerationRequest.objects.get(pk=request_id).messages[0]["content"][1]["image_url"]["url"]
    assert stored_url == f"horde-r2://{chat_image_key(request_id, 0)}"


def test_a_worker_without_an_image_transport_is_not_given_the_request(horde, make_user, image_store):
    owner, _ = _queued_for_a_popping_worker(horde, make_user, ["base64"])
    popped = chat_pop(horde, owner.key, features=VISION, transports=[])
    assert popped.status_code == 200 and popped.json()["id"] is None


def test_a_store_that_cannot_give_the_image_at_pop_gives_the_job_back(horde, make_user, image_store):
    owner, request_id = _queued_for_a_popping_worker(horde, make_user, ["base64"])
    key = chat_image_key(request_id, 0)
    saved = (image_store / key).read_bytes()
    (image_store / key).unlink()
    (image_store / key).mkdir()  # unreadable for now: the store answers with an error, not "missing"
    popped = chat_pop(horde, owner.key, features=VISION, transports=["base64"])
    assert popped.status_code == 503 and popped.json()["rc"] == "ChatImageStorageUnavailable", popped.json()
    assert not Generation.objects.exists()
    assert GenerationRequest.objects.get(pk=request_id).jobs_waiting == 1
    (image_store / key).rmdir()
    (image_store / key).write_bytes(saved)
    assert chat_pop(horde, owner.key, features=VISION, transports=["base64"]).json()["id"]


def test_an_image_gone_from_the_store_faults_the_job_until_the_request_faults(horde, make_user, image_store):
    """A missing object will not come back: each pop faults the job, and the fault limit ends the
    request instead of handing it to every pop until it expires."""
    owner, request_id = _queued_for_a_popping_worker(horde, make_user, ["base64"])
    (image_store / chat_image_key(request_id, 0)).unlink()
    answers = [chat_pop(horde, owner.key, features=VISION, transports=["base64"]) for _ in range(FAULTED_GENERATIONS_LIMIT + 2)]
    assert [a.status_code for a in answers[: FAULTED_GENERATIONS_LIMIT + 1]] == [503] * (FAULTED_GENERATIONS_LIMIT + 1)
    assert answers[-1].status_code == 200 and answers[-1].json()["id"] is None
    request = GenerationRequest.objects.get(pk=request_id)
    assert request.faulted and request.jobs_waiting == 0
    assert Generation.objects.filter(request=request, state="faulted").count() == FAULTED_GENERATIONS_LIMIT + 1


# --- deletes ----------------------------------------------------------------------------------------


def test_expiry_deletes_the_images_with_their_row(
    horde, make_user, vision_owner, image_store, django_capture_on_commit_callbacks
):
    request_id = _queued_image_request(horde, make_user, png())
    assert stored_files(image_store)
    GenerationRequest.objects.filter(pk=request_id).update(expires_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        assert expire_requests() == 1
    assert stored_files(image_store) == []


def test_an_inactive_row_left_by_a_crash_is_deleted_with_its_images_at_expiry(
    make_user, image_store, django_capture_on_commit_callbacks
):
    """A process that dies between storing the images and the activation leaves the row, which
    the expiry sweep deletes with the images: nothing stays stored unreferenced."""
    requester = make_user("r", kudos=10)
    fields = {"prompt": "user: [image]", "max_length": 64, "max_context_length": 2048,
              "messages": [image_message("data:image/png;base64,AAAA")]}
    inactive = inactive_request_create(user=requester.user, fields=fields, jpegs=[b"jpeg bytes"])
    key = chat_image_key(inactive.id, 0)
    assert stored_files(image_store) == [key]
    row = GenerationRequest.objects.get(pk=inactive.id)
    assert row.jobs_waiting == 0 and row.messages[0]["content"][1]["image_url"]["url"] == f"horde-r2://{key}"
    GenerationRequest.objects.filter(pk=inactive.id).update(expires_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        expire_requests()
    assert stored_files(image_store) == [] and not GenerationRequest.objects.exists()
    assert requester.refresh().kudos == Decimal("10")


def test_deleting_the_requester_deletes_its_requests_images(
    horde, make_user, vision_owner, image_store, django_capture_on_commit_callbacks
):
    """However a row goes (here with its user, as from the admin), its objects go with it."""
    request_id = _queued_image_request(horde, make_user, png())
    assert stored_files(image_store)
    with django_capture_on_commit_callbacks(execute=True):
        GenerationRequest.objects.get(pk=request_id).user.delete()
    assert stored_files(image_store) == [] and not GenerationRequest.objects.filter(pk=request_id).exists()


def test_the_orphan_sweep_deletes_the_objects_whose_request_is_gone_and_nothing_else(
    horde, make_user, vision_owner, image_store, settings
):
    """A process that died between a row's deletion and its objects' leaves them unreferenced:
    the hourly sweep deletes them, and keeps a live request's objects and files not the horde's."""
    from chat.object_store import chat_messages_key
    from chat.services.sweeps import delete_orphaned_chat_objects

    assert delete_orphaned_chat_objects() == 0  # nothing stored yet: the folder does not exist
    live = _queued_image_request(horde, make_user, png())
    gone = uuid.uuid4()
    (image_store / chat_image_key(gone, 0)).write_bytes(b"jpeg")
    (image_store / chat_image_key(gone, 1)).write_bytes(b"jpeg")
    messages_store = Path(settings.STORAGES["chat_messages"]["OPTIONS"]["location"])
    messages_store.mkdir(parents=True, exist_ok=True)
    (messages_store / chat_messages_key(gone)).write_bytes(b"[]")
    (image_store / "README.txt").write_bytes(b"not a chat object")
    (image_store / chat_messages_key(uuid.uuid4())).write_bytes(b"[]")  # not this store's kind
    assert delete_orphaned_chat_objects() == 3
    assert len(stored_files(image_store)) == 3 and chat_image_key(live, 0) in stored_files(image_store)
    assert stored_files(messages_store) == []
    assert delete_orphaned_chat_objects() == 0


@pytest.mark.redis_only
def test_a_delete_that_fails_is_queued_and_retried_by_the_sweep(
    horde, make_user, vision_owner, image_store, django_capture_on_commit_callbacks
):
    from chat.signals import signal_redis

    client = signal_redis()
    client.delete(CHAT_IMAGE_DELETE_RETRY_KEY)
    request_id = _queued_image_request(horde, make_user, png())
    key = chat_image_key(request_id, 0)
    # Make the stored object undeletable for now: a non-empty folder under its key.
    (image_store / key).unlink()
    (image_store / key).mkdir()
    (image_store / key / "pinned").write_bytes(b"x")
    GenerationRequest.objects.filter(pk=request_id).update(expires_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        assert expire_requests() == 1
    assert client.smembers(CHAT_IMAGE_DELETE_RETRY_KEY) == {key.encode()}
    expire_requests()  # still undeletable: it stays queued
    assert client.smembers(CHAT_IMAGE_DELETE_RETRY_KEY) == {key.encode()}
    (image_store / key / "pinned").unlink()
    expire_requests()
    assert not (image_store / key).exists()
    assert client.smembers(CHAT_IMAGE_DELETE_RETRY_KEY) == set()


