"""A chat request's images at submit (spec: chat_requests.md, "Images"): the requester's total,
the fetch of URL images, the header checks, the normalisation to JPEG and the store, with the
messages object of "Messages offload"; and at pop, the transport the worker declared: each image
reference replaced, or the messages object's URL in place of the messages.

The caps every request is held to when the body is parsed (count, size per data URL, the 25 MiB
total) are the contract's (contract.chat_shapes); here come the caps that need the user, the
fetched bytes or the decoded image.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import json
import logging
import struct
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.conf import settings
from PIL import Image, ImageMath, UnidentifiedImageError

from accounts.models import HordeUser
from chat.image_fetch import ImageTooLarge, ImageUrlInvalid, ImageUrlRefused, fetch_public_image
from chat.object_store import (
    ChatObjectStoreUnavailable,
    chat_image_key,
    chat_image_reference,
    chat_images_save,
    chat_messages_key,
    chat_messages_save,
    chat_object_read,
    chat_object_url,
    gzip_if_smaller,
    messages_with_image_urls,
)
from contract.chat_errors import ChatRefusal
from contract.chat_limits import (
    CHAT_IMAGE_FETCH_TOTAL_SECONDS,
    CHAT_IMAGE_JPEG_QUALITY,
    CHAT_IMAGE_MAX_SIDE,
    CHAT_IMAGE_REFERENCE_PREFIX,
    CHAT_MESSAGES_URL_SECONDS,
    MAX_CHAT_IMAGE_BYTES,
    MAX_CHAT_IMAGE_PIXELS,
    MAX_CHAT_IMAGE_TOTAL_BYTES,
    MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED,
    MIN_CHAT_IMAGE_URL_SECONDS,
)
from contract.chat_shapes import data_url_decoded_size, image_too_large, images_total_exceeded
from contract.errors import HordeError

log = logging.getLogger(__name__)

# Each image adds this to the activation tax (upstream's extra source image tax), in the quote too.
EXTRA_SOURCE_IMAGE_HORDE_TAX = 5

DATA_IMAGE_URL_PREFIX = "data:image/"


@dataclass(frozen=True)
class ImagePart:
    """An image part of the kept messages: its path in the submitted body and its url."""

    path: str
    url: str

    @property
    def is_data_url(self) -> bool:
        return self.url[: len(DATA_IMAGE_URL_PREFIX)].lower() == DATA_IMAGE_URL_PREFIX


def image_parts(kept: list[dict[str, Any]], submitted: list[dict[str, Any]]) -> list[ImagePart]:
    """The image parts of the kept messages (a truncated request keeps some of the submitted
    ones, the same objects), each with its path in the submitted body."""
    index_of = {id(message): i for i, message in enumerate(submitted)}
    parts = []
    for message in kept:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        i = index_of.get(id(message), 0)
        for j, part in enumerate(content):
            if part.get("type") == "image_url":
                parts.append(ImagePart(f"messages[{i}].content[{j}].image_url.url", part["image_url"]["url"]))
    return parts


def user_image_total_cap(user: HordeUser) -> int:
    """The requester's total: 25 MiB for trusted users, 5 MiB for anyone else."""
    return MAX_CHAT_IMAGE_TOTAL_BYTES if user.trusted else MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED


def check_data_url_total(parts: list[ImagePart], cap: int) -> int:
    """The data URLs' decoded sizes against the requester's total, before anything is fetched (all
    a dry run checks). Returns their total."""
    total = sum(data_url_decoded_size(p.url) for p in parts if p.is_data_url)
    if total > cap:
        raise images_total_exceeded(total, cap)
    return total


def load_chat_images(
    *, parts: list[ImagePart], user: HordeUser, fetch_seconds: float = CHAT_IMAGE_FETCH_TOTAL_SECONDS
) -> list[bytes]:
    """The images of a request as the JPEGs to store, in order, after the requester's total, the
    fetches, the header checks and the normalisation; each refusal is the spec's. Fetching every URL
    image of the request takes at most `fetch_seconds` in all (docs/adr/0069)."""
    cap = user_image_total_cap(user)
    total = check_data_url_total(parts, cap)
    # Fetching, checking and re-encoding hold the web thread: in one of the process's image slots,
    # or refused at once (docs/adr/0092).
    slots = _image_slots()
    if not slots.acquire(blocking=False):
        raise images_busy()
    try:
        return _loaded(parts, cap=cap, total=total, fetch_seconds=fetch_seconds)
    finally:
        slots.release()


def _loaded(parts: list[ImagePart], *, cap: int, total: int, fetch_seconds: float) -> list[bytes]:
    deadline = time.monotonic() + fetch_seconds
    raw: list[bytes] = []
    for part in parts:
        if part.is_data_url:
            raw.append(_decoded(part))
            continue
        data = _fetched(part, deadline=deadline, budget=fetch_seconds)
        # A URL image's size is known once fetched: the total is checked before the next fetch.
        total += len(data)
        if total > cap:
            raise images_total_exceeded(total, cap)
        raw.append(data)
    for part, data in zip(parts, raw, strict=True):
        _check_header(part, data)
    jpegs = []
    for part, data in zip(parts, raw, strict=True):
        try:
            jpegs.append(normalise_chat_image(data))
        except _UNREADABLE:  # a header that reads over a body that does not (truncated, corrupt)
            raise _unreadable(part) from None
    encoded = sum(len(j) for j in jpegs)
    if encoded > cap:  # a compact PNG can re-encode to a far larger JPEG
        raise images_total_exceeded(encoded, cap, encoded=True)
    return jpegs


# A slot frees within the fetch bound and a few seconds of decoding; most take well under a second.
CHAT_IMAGES_BUSY_RETRY_AFTER_SECONDS = 5
_slots_lock = threading.Lock()
_slots: tuple[int, threading.BoundedSemaphore] | None = None


def _image_slots() -> threading.BoundedSemaphore:
    """The process's HORDE_CHAT_IMAGE_CONCURRENCY slots for requests loading their images (each
    holds a web thread while it fetches, checks and re-encodes them): a new set when the setting
    changes."""
    global _slots
    size = settings.HORDE_CHAT_IMAGE_CONCURRENCY
    with _slots_lock:
        if _slots is None or _slots[0] != size:
            _slots = (size, threading.BoundedSemaphore(size))
        return _slots[1]


def images_busy() -> HordeError:
    error = HordeError(
        "ChatImagesBusy",
        "This horde is loading the images of as many requests as it allows at once; send the request again shortly.",
        status=503,
    )
    error.headers["Retry-After"] = str(CHAT_IMAGES_BUSY_RETRY_AFTER_SECONDS)
    return error


def _decoded(part: ImagePart) -> bytes:
    payload = part.url.split(",", 1)[1]
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError):
        raise ChatRefusal("SourceImageUnreadable", "The image's base64 data is not valid.", param=part.path) from None


def _allowed_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(n, strict=False) for n in settings.HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS]


def _fetched(part: ImagePart, *, deadline: float, budget: float) -> bytes:
    """One URL image, within what is left of the request's fetch bound (`budget` seconds in all)."""
    try:
        if deadline - time.monotonic() <= 0:
            raise ImageUrlInvalid("no time left")
        return fetch_public_image(
            part.url,
            max_bytes=MAX_CHAT_IMAGE_BYTES,
            allowed_networks=_allowed_networks(),
            total_timeout=deadline - time.monotonic(),
        )
    except ImageTooLarge as error:
        raise image_too_large(part.path, error.size) from None
    except ImageUrlRefused as error:
        raise ChatRefusal("SourceImageUrlRefused", f"The image URL is refused: {error}.", param=part.path) from None
    except ImageUrlInvalid as error:
        late = time.monotonic() >= deadline
        reason = f"the request's image URLs took longer than {budget:g} seconds in all" if late else str(error)
        raise ChatRefusal(
            "SourceImageUrlInvalid", f"The image URL could not be fetched: {reason}.", param=part.path
        ) from None


# The formats a chat image may come in: what browsers and the OpenAI API take. Naming them keeps
# Pillow from handing anything else (EPS to Ghostscript, say) to a decoder.
CHAT_IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
# What a decoder raises on a file that is not a readable image of those formats.
_UNREADABLE = (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def _unreadable(part: ImagePart) -> ChatRefusal:
    return ChatRefusal("SourceImageUnreadable", "The image could not be read as an image.", param=part.path)


def _open(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data), formats=CHAT_IMAGE_FORMATS)


def _check_header(part: ImagePart, data: bytes) -> None:
    """Readable as an image, and at most MAX_CHAT_IMAGE_PIXELS as its header states."""
    if len(data) > MAX_CHAT_IMAGE_BYTES:
        raise image_too_large(part.path, len(data))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with _open(data) as image:  # reads the header only
                width, height = image.size
    except _UNREADABLE:
        raise _unreadable(part) from None
    if width * height > MAX_CHAT_IMAGE_PIXELS:
        raise ChatRefusal(
            "SourceImageResolutionExceeded",
            f"The image is {width}x{height} pixels; at most {MAX_CHAT_IMAGE_PIXELS} pixels (3072x3072) are "
            "supported.",
            param=part.path,
        )


def normalise_chat_image(data: bytes) -> bytes:
    """RGB (RGBA flattened onto white), longest side at most CHAT_IMAGE_MAX_SIDE, as JPEG at
    CHAT_IMAGE_JPEG_QUALITY: what every chat worker's image loader decodes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with _open(data) as opened:
            turn = _exif_transposition(opened)
            image = _as_rgb_or_rgba(opened)
    if turn is not None:  # the JPEG is stored without EXIF: its pixels are turned as it is shown
        image = image.transpose(turn)
    if image.mode == "RGBA":
        flat = Image.new("RGB", image.size, (255, 255, 255))
        flat.paste(image, mask=image.getchannel("A"))
        image = flat
    if max(image.size) > CHAT_IMAGE_MAX_SIDE:
        image.thumbnail((CHAT_IMAGE_MAX_SIDE, CHAT_IMAGE_MAX_SIDE), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=CHAT_IMAGE_JPEG_QUALITY)
    return out.getvalue()


# EXIF Orientation to the transposition that shows the image upright (Pillow's ImageOps table).
_EXIF_ORIENTATION = 0x0112
_EXIF_TRANSPOSITIONS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _exif_transposition(image: Image.Image) -> Image.Transpose | None:
    """How to turn the pixels so the image shows as a browser shows it (a phone's photo is stored
    on its side with an EXIF Orientation); None for an image without one, or whose EXIF does not
    read, which is kept as sent (docs/adr/0121). Not ImageOps.exif_transpose: it writes the EXIF
    back, which fails on a tag the reading tolerated."""
    try:
        orientation = image.getexif().get(_EXIF_ORIENTATION)
    except (*_UNREADABLE, struct.error, KeyError, IndexError, TypeError, EOFError):
        return None
    return _EXIF_TRANSPOSITIONS.get(orientation) if isinstance(orientation, int) else None


def _as_rgb_or_rgba(image: Image.Image) -> Image.Image:
    """RGBA when the image has transparency, else RGB. A 16- or 32-bit grey image is scaled to 8
    bits first (Pillow's own conversion clips it), its transparent value made a mask."""
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
        wide = image.convert("I") if image.mode != "F" else image
        grey = wide.point(lambda v: v / 256 if image.mode != "F" else v * 255).convert("L")
        transparent = image.info.get("transparency")
        if transparent is None or isinstance(transparent, bytes):
            return grey.convert("RGB")
        alpha = ImageMath.lambda_eval(lambda a: a["v"] != transparent, v=wide).point(lambda v: v * 255).convert("L")
        rgba = grey.convert("RGBA")
        rgba.putalpha(alpha)
        return rgba
    return image.convert("RGBA") if _has_transparency(image) else image.convert("RGB")


def _has_transparency(image: Image.Image) -> bool:
    """An alpha channel, or a transparent colour or palette entry (any mode)."""
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def stored_image_messages(messages: list[dict[str, Any]], request_id: UUID) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages as stored: each image part's url replaced by its key's reference, n counting
    the request's images from 0. Returns them and the keys."""
    keys: list[str] = []

    def reference(_url: str) -> str:
        keys.append(chat_image_key(request_id, len(keys)))
        return chat_image_reference(keys[-1])

    return messages_with_image_urls(messages, reference), keys


def chat_images_store(keys: list[str], jpegs: list[bytes]) -> None:
    """Store the images; a failure (which deletes those stored) refuses with 503."""
    try:
        chat_images_save(zip(keys, jpegs, strict=True))
    except ChatObjectStoreUnavailable:
        log.warning("chat images of a submission not stored", exc_info=True)
        raise _storage_unavailable() from None


def _storage_unavailable() -> HordeError:
    return HordeError(
        "ChatImageStorageUnavailable",
        "The request's images could not be stored; nothing was charged. Please try again later.",
        status=503,
    )


def jpeg_data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")


def worker_messages_body(messages: list[dict[str, Any]], jpegs: list[bytes]) -> bytes:
    """The messages as a base64 worker receives them, as compact JSON: each image inlined as its
    stored JPEG, in order. What the offload threshold measures and the object holds."""
    inlined = iter(jpegs)
    inline = messages_with_image_urls(messages, lambda _url: jpeg_data_url(next(inlined))) if jpegs else messages
    text = json.dumps(inline, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escaped, so the object stays valid UTF-8
        return json.dumps(inline, separators=(",", ":")).encode("ascii")


def offloaded_messages_body(messages: list[dict[str, Any]], jpegs: list[bytes]) -> bytes | None:
    """The messages object to store when the offload is on and the messages pass its threshold."""
    if not settings.HORDE_CHAT_MESSAGES_OFFLOAD_ENABLED:
        return None
    body = worker_messages_body(messages, jpegs)
    return body if len(body) > settings.HORDE_CHAT_MESSAGES_OFFLOAD_BYTES else None


def chat_messages_store(key: str, body: bytes) -> None:
    """Store the messages object (gzipped when HORDE_CHAT_MESSAGES_OFFLOAD_GZIP and smaller); a
    failure refuses with 503."""
    gzipped = False
    if settings.HORDE_CHAT_MESSAGES_OFFLOAD_GZIP:
        body, gzipped = gzip_if_smaller(body)
    try:
        chat_messages_save(key, body, gzipped=gzipped)
    except ChatObjectStoreUnavailable:
        log.warning("messages object %s not stored", key, exc_info=True)
        raise _storage_unavailable() from None


# --- at pop --------------------------------------------------------------------------------------


def select_chat_transport(declared: list[str] | None, *, offloaded: bool, has_images: bool) -> str | None:
    """The transport a job is sent with: messages_url for an offloaded request to a worker that
    declared it; for images, a URL when the worker fetches them, else base64; None: inline."""
    declared = declared or []
    if offloaded and "messages_url" in declared:
        return "messages_url"
    if has_images:
        return "url" if "url" in declared else "base64"
    return None


def job_messages_url(request_id: UUID, *, base_url: str) -> str:
    """The messages object's URL, valid CHAT_MESSAGES_URL_SECONDS: the worker fetches right away."""
    return chat_object_url(chat_messages_key(request_id), seconds=CHAT_MESSAGES_URL_SECONDS, base_url=base_url)


def job_image_messages(
    messages: list[dict[str, Any]], *, transport: str, seconds: int, base_url: str
) -> list[dict[str, Any]]:
    """The job's messages with each reference replaced as the transport says: a presigned URL valid
    `seconds` (at least MIN_CHAT_IMAGE_URL_SECONDS), or a data URL of the stored JPEG."""
    lifetime = max(seconds, MIN_CHAT_IMAGE_URL_SECONDS)

    def resolved(url: str) -> str:
        if not url.startswith(CHAT_IMAGE_REFERENCE_PREFIX):
            return url
        key = url.removeprefix(CHAT_IMAGE_REFERENCE_PREFIX)
        if transport == "url":
            return chat_object_url(key, seconds=lifetime, base_url=base_url)
        return jpeg_data_url(chat_object_read(key))

    return messages_with_image_urls(messages, resolved)
