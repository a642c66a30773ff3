"""Delivered Responses API replies, kept for a while so that a later request may name their output
items (`{"type": "item_reference", "id": "msg_..."}`, what the Vercel AI SDK sends for an earlier
assistant turn unless its app sets `store: false`) or continue one (`previous_response_id`), and
its client read it again (`GET /v1/responses/{id}`, its input items) or delete it
(docs/adr/0101-responses-api.md, docs/adr/0103-kept-responses-read-and-deleted.md). Each output item is kept by its id, and each response as a record
of its turn's input, its output and the response before it: a conversation is walked back record by
record, so none holds the conversation before it.

A response is kept `HORDE_OAI_RESPONSE_ITEMS_SECONDS` (0: none) from when it was made or last read
(continued or referred to), only for the API key whose request made it (a reference from another
key is not found), in Redis when the front has one (every front process reads what any of them
kept) and else in the process (the embedded default's one process).
Keeping is never worth a reply: a Redis that fails to keep them drops the items with a warning; one
that fails to read them makes the referring request a retryable 503.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from time import monotonic
from typing import Any

from contract.aio import within
from contract.process_cache import ProcessCache

log = logging.getLogger("oai")

RESPONSE_ITEM_KEY_PREFIX = "horde:oai:response_item:"
# A response's own record, for `previous_response_id`: its turn's input items, its output items and
# the response before it.
RESPONSE_KEY_PREFIX = "horde:oai:response:"
# The longest chain of previous responses a request may continue.
MAX_RESPONSE_CHAIN = 200
RESPONSE_ITEMS_REDIS_TIMEOUT_SECONDS = 1.0
# Beside a background response's record from its create, kept as long, which a DELETE leaves: a record
# gone with its mark went with Redis's data (a restart without persistence), not by a DELETE.
RESPONSE_MARK_KEY_PREFIX = "horde:oai:response_mark:"
# After a Redis failure, this long without trying again: a hung Redis costs one reply a timeout, not
# every reply.
RESPONSE_ITEMS_BACKOFF_SECONDS = 5.0
# Without Redis, the items of this many replies' worth at most stay in the process.
RESPONSE_ITEMS_MAX_LOCAL_ENTRIES = 20_000


# Sets KEYS (the record, then its output items) to ARGV[3:] for ARGV[2] seconds only while the
# record is the pending one of a background response made by ARGV[1]: the check and the write in
# one step, against a cancel, a GET or a DELETE of the same response.
KEEP_FINISHED_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if not current then return 0 end
local ok, record = pcall(cjson.decode, current)
if not ok or record['owner'] ~= ARGV[1] or record['background'] == nil then return 0 end
for i = 1, #KEYS do redis.call('SET', KEYS[i], ARGV[i + 2], 'EX', tonumber(ARGV[2])) end
return 1
"""


class ResponseItemsUnavailable(Exception):
    """Redis did not answer a recall: the references cannot be told found or not."""


class ResponseChainTooLong(Exception):
    """The conversation of a previous_response_id is more than MAX_RESPONSE_CHAIN responses long."""


class ResponseInProgress(Exception):
    """A response of the conversation is a background response not finished yet (its output is not
    known: docs/adr/0102-responses-background.md)."""

    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.response_id = response_id


def response_item_key(item_id: str) -> str:
    return RESPONSE_ITEM_KEY_PREFIX + item_id


def response_key(response_id: str) -> str:
    return RESPONSE_KEY_PREFIX + response_id


def response_mark_key(response_id: str) -> str:
    return RESPONSE_MARK_KEY_PREFIX + response_id


def _owner(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _record(
    owner: str,
    response: dict[str, Any],
    previous_response_id: str | None,
    turn_input: list[dict[str, Any]],
    output: list[dict[str, Any]],
    **extra: Any,
) -> str:
    """A response's record, as kept: its turn's input, its output, the response before it, and the
    object GET /v1/responses/{id} answers but its output (kept once, under `output`)."""
    record = {
        "owner": owner,
        "previous": previous_response_id,
        "input": turn_input,
        "output": output,
        "response": {key: value for key, value in response.items() if key != "output"},
        **extra,
    }
    return json.dumps(record, separators=(",", ":"))


def _delivered(
    owner: str,
    response: dict[str, Any],
    previous_response_id: str | None,
    turn_input: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, str]:
    """What a delivered response keeps: its record (first), then each output item by its id."""
    output = response["output"]
    record = _record(owner, response, previous_response_id, turn_input, output, **extra)
    values = {response_key(response["id"]): record}
    values.update(
        (response_item_key(item["id"]), json.dumps({"owner": owner, "item": item}, separators=(",", ":")))
        for item in output
    )
    return values


def _held_keys(response_id: str, record: dict[str, Any]) -> list[str]:
    """The keys a record holds beside it, kept as long as it is: its output items, and the mark of a
    pending background response (docs/adr/0110)."""
    keys = [response_item_key(item["id"]) for item in record.get("output") or []]
    if "background" in record:
        keys.append(response_mark_key(response_id))
    return keys


class ResponseItems:
    def __init__(self, redis_url: str | None, *, keep_seconds: int):
        self.redis_url = redis_url
        self.keep_seconds = keep_seconds
        self._client: Any = None
        self._down_until = 0.0  # monotonic: Redis is not tried before it after a failure
        self._local: ProcessCache[str, tuple[str, str]] = ProcessCache(
            "oai-response-items", ttl=keep_seconds, max_entries=RESPONSE_ITEMS_MAX_LOCAL_ENTRIES
        )

    @property
    def enabled(self) -> bool:
        return self.keep_seconds > 0

    def _redis(self) -> Any:
        assert self.redis_url is not None
        if self._client is None:
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(
                self.redis_url,
                socket_timeout=RESPONSE_ITEMS_REDIS_TIMEOUT_SECONDS,
                socket_connect_timeout=RESPONSE_ITEMS_REDIS_TIMEOUT_SECONDS,
            )
        return self._client

    async def keep(
        self,
        api_key: str,
        *,
        response: dict[str, Any],
        previous_response_id: str | None,
        turn_input: list[dict[str, Any]],
    ) -> None:
        """Keep a delivered `response` for `api_key`: each output item by its id, and the response's
        record (the response object, its turn's input, its output, the response before it). A
        failure is logged, never raised."""
        if not self.enabled:
            return
        values = _delivered(_owner(api_key), response, previous_response_id, turn_input)
        try:
            await self._write(values)
        except ResponseItemsUnavailable as error:  # the reply is delivered; only a later reference to it fails
            log.warning("keeping %d response items failed: %s", len(values), error)

    async def keep_pending(
        self,
        api_key: str,
        *,
        response: dict[str, Any],
        previous_response_id: str | None,
        turn_input: list[dict[str, Any]],
        background: dict[str, Any],
    ) -> None:
        """Keep the record of a background response not finished yet (oai.responses.background): the
        `response` object (queued, no output) and what reading its progress needs under
        `background`. Raises ResponseItemsUnavailable when it could not be kept: its id would name
        nothing."""
        owner = _owner(api_key)
        record = _record(owner, response, previous_response_id, turn_input, [], background=background)
        mark = json.dumps({"owner": owner})
        await self._write({response_key(response["id"]): record, response_mark_key(response["id"]): mark})

    async def reachable(self) -> None:
        """Raises ResponseItemsUnavailable when Redis does not answer now (or failed moments ago): a
        background create asks before it submits, so that a record it could not keep leaves no
        request behind that a worker might pop meanwhile and its requester pay for."""
        if self.redis_url is None:
            return
        if monotonic() < self._down_until:
            raise ResponseItemsUnavailable(f"Redis failed less than {RESPONSE_ITEMS_BACKOFF_SECONDS:g} s ago")
        try:
            await within(self._redis().ping(), RESPONSE_ITEMS_REDIS_TIMEOUT_SECONDS)
        except Exception as error:
            await self._failed()
            raise ResponseItemsUnavailable(str(error)) from None

    async def lost(self, api_key: str, response_id: str) -> bool:
        """Whether Redis lost the record of the background response `response_id` (its record and
        the mark kept beside it are both gone: Redis restarted without its data), rather than a
        DELETE forgetting it. Never without Redis. Raises ResponseItemsUnavailable."""
        if self.redis_url is None:
            return False
        (mark,) = await self._read(api_key, [response_mark_key(response_id)])
        return mark is None

    async def keep_finished(
        self,
        api_key: str,
        *,
        response: dict[str, Any],
        previous_response_id: str | None,
        turn_input: list[dict[str, Any]],
        queued_model: str,
    ) -> bool:
        """Keep the finished record of a background response, as `keep` keeps a delivered one, only
        while its kept record is still the pending one: false when another read (a cancel, the
        watcher, a GET) finished it first or it was deleted meanwhile, so that neither a finished
        reply is overwritten nor a deleted record brought back. `queued_model` is the model its
        queued object named, which its stream's first events show (ADR 0106). Raises
        ResponseItemsUnavailable."""
        owner = _owner(api_key)
        record_key = response_key(response["id"])
        values = _delivered(owner, response, previous_response_id, turn_input, queued_model=queued_model)
        if self.redis_url is None:  # no await between the check and the write: one step of the loop
            entry = self._local.get(record_key)
            if entry is None or entry[0] != owner or "background" not in json.loads(entry[1]):
                return False
            for key, value in values.items():
                self._local.set(key, (owner, value))
            return True
        if monotonic() < self._down_until:
            raise ResponseItemsUnavailable(f"Redis failed less than {RESPONSE_ITEMS_BACKOFF_SECONDS:g} s ago")
        try:
            kept = await within(
                self._redis().eval(
                    KEEP_FINISHED_SCRIPT, len(values), *values, owner, self.keep_seconds, *values.values()
                ),
                RESPONSE_ITEMS_REDIS_TIMEOUT_SECONDS,
            )
        except Exception as error:
            await self._failed()
            raise ResponseItemsUnavailable(str(error)) from None
        return bool(kept)

    async def _write(self, values: dict[str, str]) -> None:
        """Set `values` for keep_seconds; raises ResponseItemsUnavailable when Redis did not take them."""
        if self.redis_url is None:
            for key, value in values.items():
                self._local.set(key, (json.loads(value)["owner"], value))
            return
        if monotonic() < self._down_until:
            raise ResponseItemsUnavailable(f"Redis failed less than {RESPONSE_ITEMS_BACKOFF_SECONDS:g} s ago")
        try:
            pipe = self._redis().pipeline(transaction=False)
            for key, value in values.items():
                pipe.set(key, value, ex=self.keep_seconds)
            await within(pipe.execute(), RESPONSE_ITEMS_REDIS_TIMEOUT_SECONDS)
        except Exception as error:
            await self._failed()
            raise ResponseItemsUnavailable(str(error)) from None

    async def _read(self, api_key: str, keys: list[str]) -> list[dict[str, Any] | None]:
        """The kept values under `keys` that `api_key` made (None where none is). Each one found is
        kept its whole time again from this read: a conversation that goes on is not cut at its
        oldest turn, `keep_seconds` after it was made. A record found keeps what it holds as long:
        its output items (written with it, an `item_reference` reads them by id) and a pending
        background response's mark, so that none of them lapses while its response is still read."""
        owner = _owner(api_key)
        if self.redis_url is None:
            entries = [self._local.get(key) for key in keys]
            raw = [entry[1] if entry is not None and entry[0] == owner else None for entry in entries]
        else:
            if monotonic() < self._down_until:
                raise ResponseItemsUnavailable("Redis failed moments ago")
            try:
                raw = await within(self._redis().mget(keys), RESPONSE_ITEMS_REDIS_TIMEOUT_SECONDS)
            except Exception as error:
                log.warning("reading %d response items from Redis failed: %s", len(keys), error)
                await self._failed()
                raise ResponseItemsUnavailable(str(error)) from None
        kept = [json.loads(value) if value is not None else None for value in raw]
        found = [value if value is not None and value["owner"] == owner else None for value in kept]
        held = [
            held_key
            for key, value in zip(keys, found, strict=True)
            if value is not None and key.startswith(RESPONSE_KEY_PREFIX)
            for held_key in _held_keys(key.removeprefix(RESPONSE_KEY_PREFIX), value)
        ]
        refreshed = [key for key, value in zip(keys, found, strict=True) if value is not None] + held
        if self.redis_url is None:
            for key in refreshed:
                entry = self._local.get(key)
                if entry is not None and entry[0] == owner:
                    self._local.set(key, entry)
        else:
            await self._refresh(refreshed)
        return found

    async def _refresh(self, keys: list[str]) -> None:
        """Keeps `keys` (read, and this key's) their whole time again; a failure is logged: what was
        read is still used."""
        if not keys:
            return
        try:
            pipe = self._redis().pipeline(transaction=False)
            for key in keys:
                pipe.expire(key, self.keep_seconds)
            await within(pipe.execute(), RESPONSE_ITEMS_REDIS_TIMEOUT_SECONDS)
        except Exception as error:
            log.warning("keeping %d read response items longer failed: %s", len(keys), error)
            await self._failed()

    async def recall(self, api_key: str, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The kept items among `item_ids` that `api_key` made: id -> item."""
        if not self.enabled or not item_ids:
            return {}
        values = await self._read(api_key, [response_item_key(i) for i in item_ids])
        return {i: value["item"] for i, value in zip(item_ids, values, strict=True) if value is not None}

    async def record(self, api_key: str, response_id: str) -> dict[str, Any] | None:
        """The record of the response `response_id` that `api_key` made (None when none is kept):
        `response` (the object, but its output), `output`, `input` (its turn's input items) and
        `previous`."""
        if not self.enabled:
            return None
        (record,) = await self._read(api_key, [response_key(response_id)])
        return record

    async def forget(self, api_key: str, response_id: str) -> bool:
        """Deletes the response `response_id` that `api_key` made, with its output items: false when
        none is kept. A later reference to it or to its items is not found, nor is the conversation
        of a response that continued it."""
        record = await self.record(api_key, response_id)
        if record is None:
            return False
        keys = [response_key(response_id), *(response_item_key(item["id"]) for item in record["output"])]
        if self.redis_url is None:
            for key in keys:
                self._local.forget(key)
            return True
        try:
            await within(self._redis().delete(*keys), RESPONSE_ITEMS_REDIS_TIMEOUT_SECONDS)
        except Exception as error:
            log.warning("deleting response %s from Redis failed: %s", response_id, error)
            await self._failed()
            raise ResponseItemsUnavailable(str(error)) from None
        return True

    async def conversation(self, api_key: str, response_id: str) -> list[dict[str, Any]] | None:
        """The items of the conversation that ends with `response_id`, oldest first (each response's
        turn input, then its output); None when a response of the chain is not kept for this key.
        Raises ResponseChainTooLong past MAX_RESPONSE_CHAIN responses, ResponseInProgress at a
        background response not finished yet."""
        if not self.enabled:
            return None
        turns: list[dict[str, Any]] = []
        next_id: str | None = response_id
        while next_id is not None:
            if len(turns) == MAX_RESPONSE_CHAIN:
                raise ResponseChainTooLong(response_id)
            (record,) = await self._read(api_key, [response_key(next_id)])
            if record is None:
                return None
            if "background" in record:
                raise ResponseInProgress(next_id)
            turns.append(record)
            next_id = record["previous"]
        return [item for turn in reversed(turns) for item in (*turn["input"], *turn["output"])]

    async def _failed(self) -> None:
        self._down_until = monotonic() + RESPONSE_ITEMS_BACKOFF_SECONDS
        await self._drop_client()

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def close(self) -> None:
        await self._drop_client()
