"""The completion signal: chat requests publish their progress on Redis channel horde:chat:<id>.

Publishing is best effort and happens after the commit that stored what it announces: a Redis
failure is logged and never fails the submit, cancel or sweep that published.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from uuid import UUID

import redis
from django.conf import settings
from django.db import transaction

log = logging.getLogger(__name__)

CHAT_SIGNAL_CHANNEL_PREFIX = "horde:chat:"
# The logical database the publishing client uses; pub/sub reaches subscribers on any database.
CHAT_SIGNAL_DB = 7
CHAT_SIGNAL_EVENTS = ("generation", "done", "cancelled", "faulted")


def chat_signal_channel(request_id: UUID | str) -> str:
    return f"{CHAT_SIGNAL_CHANNEL_PREFIX}{request_id}"


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, db=CHAT_SIGNAL_DB, socket_timeout=0.5, socket_connect_timeout=0.5)


def signal_url() -> str | None:
    return settings.HORDE_CHAT_SIGNAL_REDIS_URL or settings.REDIS_URL


def publish_now(request_id: UUID | str, event: str, generations: int, **fault: str | None) -> bool:
    """Publish one message; returns whether Redis took it."""
    url = signal_url()
    if not url:
        return False
    message = {"id": str(request_id), "event": event, "generations": generations}
    message.update({key: value for key, value in fault.items() if value})
    try:
        _client(url).publish(chat_signal_channel(request_id), json.dumps(message))
        return True
    except redis.RedisError as error:
        log.warning("completion signal %s for %s not published: %s", event, request_id, error)
        return False


def publish_chat_signal(request_id: UUID | str, event: str, generations: int, **fault: str | None) -> None:
    """Publish after the surrounding transaction commits (at once outside one)."""
    transaction.on_commit(lambda: publish_now(request_id, event, generations, **fault))
