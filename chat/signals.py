"""The completion signal: chat requests publish their progress on Redis channel horde:chat:<id>
(the channel, database and message keys: contract/chat_signal.py).

Publishing is best effort and happens after the commit that stored what it announces: a Redis
failure is logged and never fails the submit, cancel or sweep that published. Without Redis the
message is delivered in process (chat_signal_in_process).
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from uuid import UUID

import redis
from django.conf import settings
from django.db import transaction
from django.dispatch import Signal
from django.utils.module_loading import import_string

from contract.chat_signal import CHAT_SIGNAL_DB, CHAT_SIGNAL_FAULT_KEYS, chat_signal_channel

log = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    # On request paths (publish, pop, progress, submit, cancel): the configured short timeouts, and
    # refused at once while this Redis is marked unavailable (hordesite/redis_guard.py).
    pool = import_string(settings.HORDE_REDIS_POOL_CLASS).from_url(url, **settings.HORDE_REDIS_POOL_KWARGS)
    # A database in the URL would win over a keyword: the signal, the leases and the progress
    # streams live on CHAT_SIGNAL_DB, whatever the URL names.
    pool.connection_kwargs["db"] = CHAT_SIGNAL_DB
    return redis.Redis(connection_pool=pool)


def signal_url() -> str | None:
    return settings.HORDE_CHAT_SIGNAL_REDIS_URL or settings.REDIS_URL


def signal_redis() -> redis.Redis | None:
    """The client of the chat signal database, or None without Redis (the embedded default)."""
    url = signal_url()
    return _client(url) if url else None


# Without Redis the message is sent here instead, in the process that committed what it announces:
# hordesite/asgi.py hands it to the front mounted in the same process (docs/adr/0054). Receivers get
# `message`, the dict that would have been published.
chat_signal_in_process = Signal()


def publish_now(request_id: UUID | str, event: str, generations: int, **fault: str | None) -> bool:
    """Publish one message; returns whether Redis took it. Without Redis the message goes to this
    process's receivers of chat_signal_in_process instead."""
    message = {"id": str(request_id), "event": event, "generations": generations}
    # fault_reason and fault_rc only when present; a message never carries generated text.
    message.update({key: value for key, value in fault.items() if key in CHAT_SIGNAL_FAULT_KEYS and value})
    url = signal_url()
    if not url:
        chat_signal_in_process.send_robust(sender=None, message=message)
        return False
    try:
        _client(url).publish(chat_signal_channel(request_id), json.dumps(message))
        return True
    except Exception as error:  # best effort: nothing Redis does may fail what published
        log.warning("completion signal %s for %s not published: %s", event, request_id, error)
        return False


def publish_chat_signal(request_id: UUID | str, event: str, generations: int, **fault: str | None) -> None:
    """Publish after the surrounding transaction commits (at once outside one), so a subscriber woken
    by the message reads the committed state; a failure never reaches the caller."""
    transaction.on_commit(lambda: publish_now(request_id, event, generations, **fault), robust=True)
