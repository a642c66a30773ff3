"""The front's side of the front lease (contract.front_lease, docs/adr/0020-front-lease.md).

Every request the front submits asks for a lease (the header on the submit) and the front keeps it
alive while it waits. With Redis, one task per process renews every open request's key in one
pipeline every renewal period. Without Redis, or while that pipeline fails, each request renews
through the database: the header rides on its next status read, and the waits read at least once
per renewal period. A front that dies renews nothing, and the horde's sweep cancels its requests.

Beside the lease the front names itself (`Horde-Front-Id`, one id per process): a horde process on
the same host then knows the moment this process is gone, and cancels its requests without waiting
for the lease to lapse (docs/adr/0028-dead-front-requests.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from contract.aio import cancel_and_wait, within
from contract.front_lease import (
    FRONT_ID_HEADER,
    FRONT_LEASE_HEADER,
    FRONT_LEASE_REDIS_DB,
    front_lease_key,
    new_front_id,
)

log = logging.getLogger("oai.front_lease")

# One renewal pipeline waits at most this long; a hung Redis falls back to the database.
FRONT_LEASE_REDIS_TIMEOUT_SECONDS = 0.5


_front_id: tuple[int, str] | None = None


def front_id() -> str:
    """This process's front id (a forked child is another process, with its own)."""
    global _front_id
    if _front_id is None or _front_id[0] != os.getpid():
        _front_id = (os.getpid(), new_front_id())
    return _front_id[1]


def lease_header(seconds: int) -> dict[str, str]:
    return {FRONT_LEASE_HEADER: str(seconds), FRONT_ID_HEADER: front_id()} if seconds > 0 else {}


def front_id_header() -> dict[str, str]:
    """This process named without a lease (a background response's submit, docs/adr/0110): the
    horde does not cancel the request when the process goes, and grants this process the undelivered
    cancel of it (docs/adr/0086), for a reply it then knows nobody can read."""
    return {FRONT_ID_HEADER: front_id()}


class FrontLeaseRenewer:
    """Renews the Redis lease key of every open request, one pipeline per period."""

    def __init__(
        self, redis_url: str, *, lease_seconds: int, renew_seconds: float, open_ids: Callable[[], Iterable[str]]
    ):
        self.redis_url = redis_url
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds
        self.open_ids = open_ids
        # Whether the last pipeline went through: while false, requests renew through the database.
        self.healthy = False
        self._client: Any = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            # A context of its own: it serves every request, not the one that started it (docs/adr/0128).
            self._task = asyncio.create_task(self._run(), name="oai-front-lease", context=contextvars.Context())

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None

    async def renew(self, ids: list[str] | None = None) -> bool:
        ids = list(self.open_ids()) if ids is None else ids
        if not ids:
            return self.healthy
        try:
            if self._client is None:
                import redis.asyncio as aioredis

                pool = aioredis.ConnectionPool.from_url(
                    self.redis_url,
                    socket_timeout=FRONT_LEASE_REDIS_TIMEOUT_SECONDS,
                    socket_connect_timeout=FRONT_LEASE_REDIS_TIMEOUT_SECONDS,
                )
                pool.connection_kwargs["db"] = FRONT_LEASE_REDIS_DB  # whatever database the URL names
                self._client = aioredis.Redis(connection_pool=pool)
            pipe = self._client.pipeline(transaction=False)
            for request_id in ids:
                pipe.set(front_lease_key(request_id), b"1", ex=self.lease_seconds)
            await within(pipe.execute(), FRONT_LEASE_REDIS_TIMEOUT_SECONDS * 2)
        except Exception as error:  # the database path takes over; nothing fails
            if self.healthy:
                log.warning("front lease renewal in Redis failed (%s): renewing through status reads", error)
            self.healthy = False
            client, self._client = self._client, None
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()
            return False
        self.healthy = True
        return True

    async def _run(self) -> None:
        while True:
            await self.renew()
            await asyncio.sleep(self.renew_seconds)
