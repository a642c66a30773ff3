"""Where a chat request's objects are kept (spec: chat_requests.md, "Images" and "Messages
offload"): its images and an offloaded messages object. Keys, the stores, the download URLs a
worker receives, and deletes that are retried until they succeed.

The stores are Django's storages `chat_images` and `chat_messages` (settings.STORAGES), told apart
by the key's suffix: one folder under MEDIA_ROOT in the embedded default, the source image bucket
(and R2_CHAT_MESSAGES_BUCKET) with STORAGE_BACKEND=s3. A URL into a bucket is presigned by the S3
client, locally; a URL into the folder is signed here with the secret key and served by the horde
itself (chat.api.image_views).
"""

from __future__ import annotations

import gzip
import logging
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, cast
from urllib.parse import urlencode
from uuid import UUID

from django.core.files.base import ContentFile
from django.core.files.storage import FileSystemStorage, Storage, storages
from django.db import transaction
from django.utils.crypto import constant_time_compare, salted_hmac

from chat.signals import signal_redis
from contract.chat_limits import CHAT_IMAGE_REFERENCE_PREFIX, CHAT_MESSAGES_OBJECT_SUFFIX

log = logging.getLogger(__name__)

# Keys whose delete failed, retried by the expiry sweep; no TTL, since a key that expired out of
# the set would leave its image stored and unreferenced. Bounded: past the bound keys are logged.
CHAT_IMAGE_DELETE_RETRY_KEY = "horde:chat:image_delete_retry"
MAX_CHAT_IMAGE_DELETE_RETRY_KEYS = 100_000
CHAT_IMAGE_DELETE_RETRY_BATCH = 1000
# How many stored objects the orphan sweep reads per pass.
CHAT_ORPHAN_SWEEP_BATCH = 10_000
# A stored object's key starts with its request's id (chat_image_key, chat_messages_key).
CHAT_OBJECT_KEY_PATTERN = re.compile(r"^(?P<request_id>[0-9a-f]{8}-(?:[0-9a-f]{4}-){3}[0-9a-f]{12})_chat_")
# The path the horde serves images of the local store under (hordesite/urls.py).
LOCAL_CHAT_IMAGE_PATH = "/api/v2/chat_images/"
_SIGNATURE_SALT = "chat.object_store.signed_url"


class BucketStorage(Protocol):
    """What a store that is not the local folder is used through: django-storages' S3Storage
    (STORAGE_BACKEND=s3), which Django's Storage type does not describe."""

    bucket: Any  # boto3's Bucket resource

    def url(self, name: str, *, expire: int) -> str: ...


class ChatObjectStoreUnavailable(Exception):
    """The store did not take, give or sign an object."""


class ChatObjectMissing(ChatObjectStoreUnavailable):
    """The store answered that the object is not there: it will not come back."""


def chat_image_key(request_id: UUID | str, n: int) -> str:
    """The key of a request's n-th image (from 0)."""
    return f"{request_id}_chat_{n}.jpg"


def chat_messages_key(request_id: UUID | str) -> str:
    """The key of a request's offloaded messages object."""
    return f"{request_id}{CHAT_MESSAGES_OBJECT_SUFFIX}"


def chat_image_reference(key: str) -> str:
    """An image part's url in the stored request."""
    return f"{CHAT_IMAGE_REFERENCE_PREFIX}{key}"


def _image_parts(messages: Iterable[dict[str, Any]] | None) -> Iterator[dict[str, Any]]:
    for message in messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
                    yield part


def referenced_image_keys(messages: Iterable[dict[str, Any]] | None) -> list[str]:
    """The store keys a stored request's messages reference, in order."""
    keys = []
    for part in _image_parts(messages):
        url = part["image_url"].get("url")
        if isinstance(url, str) and url.startswith(CHAT_IMAGE_REFERENCE_PREFIX):
            keys.append(url.removeprefix(CHAT_IMAGE_REFERENCE_PREFIX))
    return keys


def stored_object_keys(
    request_id: UUID | str, messages: Iterable[dict[str, Any]] | None, *, offloaded: bool
) -> list[str]:
    """Every object a stored request owns: its images and its messages object (the spec's
    list_stored_chat_object_keys)."""
    return referenced_image_keys(messages) + ([chat_messages_key(request_id)] if offloaded else [])


def messages_with_image_urls(messages: list[dict[str, Any]], url_of: Any) -> list[dict[str, Any]]:
    """A copy of `messages` with each image part's url replaced by `url_of(url)`; the parts'
    other keys (detail) and the other messages are kept as they are."""
    replaced = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content
        ):
            replaced.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
                part = {**part, "image_url": {**part["image_url"], "url": url_of(part["image_url"]["url"])}}
            parts.append(part)
        replaced.append({**message, "content": parts})
    return replaced


def chat_object_storage(key: str) -> Storage:
    """The store a key lives in: its suffix tells a messages object from an image."""
    return storages["chat_messages" if key.endswith(CHAT_MESSAGES_OBJECT_SUFFIX) else "chat_images"]


def chat_images_save(images: Iterable[tuple[str, bytes]]) -> None:
    """Store each (key, JPEG bytes). When one is not taken, those already stored are deleted and
    ChatObjectStoreUnavailable is raised."""
    stored: list[str] = []
    for key, data in images:
        storage = chat_object_storage(key)
        try:
            saved = storage.save(key, ContentFile(data))
        except Exception as error:  # any storage backend's failure: the caller refuses with 503
            chat_objects_delete(stored)
            raise ChatObjectStoreUnavailable(f"the image store did not take {key}: {error}") from error
        stored.append(saved)
        if saved != key:  # a key is a request id's: another object under it is not ours to overwrite
            chat_objects_delete(stored)
            raise ChatObjectStoreUnavailable(f"the image store already holds {key}")


def chat_messages_save(key: str, body: bytes, *, gzipped: bool) -> None:
    """Store an offloaded messages object: JSON, never transformed by a CDN, and gzipped as a
    transport encoding of the whole body when `gzipped`."""
    storage = chat_object_storage(key)
    try:
        if isinstance(storage, FileSystemStorage):  # served by chat.api.image_views with its headers
            saved = storage.save(key, ContentFile(body))
            if saved != key:
                storage.delete(saved)
                raise ChatObjectStoreUnavailable(f"the store already holds {key}")
            return
        headers = {"ContentType": "application/json", "CacheControl": "no-transform"}
        if gzipped:
            headers["ContentEncoding"] = "gzip"
        cast(BucketStorage, storage).bucket.put_object(Key=key, Body=body, **headers)
    except ChatObjectStoreUnavailable:
        raise
    except Exception as error:
        raise ChatObjectStoreUnavailable(f"the store did not take {key}: {error}") from error


def stored_object_is_gzip(body: bytes) -> bool:
    """Whether a stored messages object was kept gzipped (JSON never starts with gzip's magic)."""
    return body[:2] == b"\x1f\x8b"


def gzip_if_smaller(body: bytes) -> tuple[bytes, bool]:
    """The body gzipped when that is smaller, and whether it is."""
    packed = gzip.compress(body, mtime=0)
    return (packed, True) if len(packed) < len(body) else (body, False)


def chat_object_read(key: str) -> bytes:
    try:
        with chat_object_storage(key).open(key, "rb") as stored:
            return stored.read()
    except FileNotFoundError as error:  # what the folder and the bucket storages both raise
        raise ChatObjectMissing(f"the store does not hold {key}") from error
    except Exception as error:
        raise ChatObjectStoreUnavailable(f"the image store did not give {key}: {error}") from error


def chat_object_url(key: str, *, seconds: int, base_url: str) -> str:
    """A download URL for a worker, valid `seconds`: presigned by the bucket's client, or signed
    here for the local store (served under LOCAL_CHAT_IMAGE_PATH of `base_url`)."""
    storage = chat_object_storage(key)
    if isinstance(storage, FileSystemStorage):
        expires = int(time.time()) + seconds
        query = urlencode({"expires": expires, "signature": _signature(key, expires)})
        return f"{base_url.rstrip('/')}{LOCAL_CHAT_IMAGE_PATH}{key}?{query}"
    try:
        return cast(BucketStorage, storage).url(key, expire=seconds)
    except Exception as error:
        raise ChatObjectStoreUnavailable(f"the image store did not sign {key}: {error}") from error


def _signature(key: str, expires: int) -> str:
    return salted_hmac(_SIGNATURE_SALT, f"{key}:{expires}", algorithm="sha256").hexdigest()


_EXPIRES = re.compile(r"[0-9]{1,12}")


def local_image_url_valid(key: str, expires: str | None, signature: str | None) -> bool:
    """Whether a local download URL's signature is ours and it has not expired."""
    # ASCII digits of a plausible time: str.isdigit() also takes "²", which int() refuses (a 500).
    if not expires or not signature or not _EXPIRES.fullmatch(expires):
        return False
    return int(expires) >= time.time() and constant_time_compare(signature, _signature(key, int(expires)))


def chat_objects_delete(keys: Iterable[str]) -> int:
    """Delete each key; a key the store does not delete is queued for the retry. Returns how many
    were deleted."""
    deleted, failed = 0, []
    for key in keys:
        try:
            chat_object_storage(key).delete(key)
            deleted += 1
        except Exception:
            log.warning("chat object %s was not deleted; queued for a retry", key, exc_info=True)
            failed.append(key)
    if failed:
        _queue_delete_retry(failed)
    return deleted


def _queue_delete_retry(keys: list[str]) -> None:
    client = signal_redis()
    if client is None:
        log.error("chat images not deleted and no retry set without Redis: %s", ", ".join(keys))
        return
    try:
        room = MAX_CHAT_IMAGE_DELETE_RETRY_KEYS - int(client.scard(CHAT_IMAGE_DELETE_RETRY_KEY))
        if room > 0:
            client.sadd(CHAT_IMAGE_DELETE_RETRY_KEY, *keys[:room])
        if len(keys) > max(room, 0):
            log.error("chat image delete retry set is full; not deleted: %s", ", ".join(keys[max(room, 0):]))
    except Exception:
        log.error("chat images not deleted and not queued: %s", ", ".join(keys), exc_info=True)


def retry_chat_object_deletes() -> int:
    """The expiry sweep's retry of failed deletes: up to CHAT_IMAGE_DELETE_RETRY_BATCH keys, each
    removed from the set once it deletes. Returns how many deleted."""
    client = signal_redis()
    if client is None:
        return 0
    try:
        # With a count SRANDMEMBER answers a list (empty for no set); the stubs allow any reply.
        members = cast(list[bytes | str], client.srandmember(CHAT_IMAGE_DELETE_RETRY_KEY, CHAT_IMAGE_DELETE_RETRY_BATCH))
        keys = [k.decode() if isinstance(k, bytes) else k for k in members]
    except Exception:
        log.warning("chat image delete retry set unreadable", exc_info=True)
        return 0
    done = []
    for key in keys:
        try:
            chat_object_storage(key).delete(key)
            done.append(key)
        except Exception:
            log.warning("chat object %s still not deleted", key, exc_info=True)
    if done:
        try:
            client.srem(CHAT_IMAGE_DELETE_RETRY_KEY, *done)
        except Exception:  # deleted already: a later retry deletes nothing and removes them
            log.warning("chat image delete retry set not updated", exc_info=True)
    return len(done)


def listed_chat_objects(*, batch: int = CHAT_ORPHAN_SWEEP_BATCH) -> Iterator[dict[str, list[str]]]:
    """The chat objects the stores hold, by request id, in batches of at most `batch` keys: what
    the orphan sweep compares with the request rows, a batch at a time. Every object is listed,
    not the first batch only: a store holding more live objects than a batch would otherwise
    never show the sweep the orphans listed after them. A store lists only its own kind of object,
    so that two aliases on one folder or bucket list each object once, from the store that deletes it."""
    listed: dict[str, list[str]] = {}
    seen: set[str] = set()
    count = 0
    for alias in ("chat_images", "chat_messages"):
        try:
            _folders, names = storages[alias].listdir("")
        except FileNotFoundError:  # a local store's folder is made by its first save
            continue
        for name in names:
            match = CHAT_OBJECT_KEY_PATTERN.match(name)
            # Only the objects this store is the home of (chat_object_storage): each is deleted there.
            if match is None or name in seen or chat_object_storage(name) is not storages[alias]:
                continue
            if count >= batch:
                yield listed
                listed, count = {}, 0
            seen.add(name)
            listed.setdefault(match["request_id"], []).append(name)
            count += 1
    if listed:
        yield listed


def delete_objects_with_request(sender: Any, instance: Any, **kwargs: Any) -> None:
    """pre_delete of a request row, however it goes (the expiry sweep, a refused activation, an
    operator's delete in the admin, its user's deletion): its stored objects are deleted once the
    row's deletion commits, or their keys queued for the retry."""
    if not instance.is_chat or not (instance.chat_has_images or instance.chat_messages_offloaded):
        return
    keys = stored_object_keys(instance.pk, instance.messages, offloaded=instance.chat_messages_offloaded)
    if keys:
        transaction.on_commit(lambda: chat_objects_delete(keys), robust=True)
