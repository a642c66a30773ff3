"""The id of each /v1/ request (docs/adr/0128-x-request-id.md): `req_` and 32 hex digits, new per
HTTP request, sent as `x-request-id` on its answer as OpenAI does (the SDKs read it as
`_request_id` and `APIStatusError.request_id`), and on every log record made while the request
is served, with the client's own `X-Client-Request-Id` beside it when it is printable ASCII of at
most 512 characters (OpenAI's bound). The client's id is logged, never used as the request's id.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

REQUEST_ID_HEADER = "x-request-id"
CLIENT_REQUEST_ID_HEADER = "x-client-request-id"
CLIENT_REQUEST_ID_MAX_CHARS = 512


@dataclass(frozen=True)
class RequestIds:
    request_id: str
    client_request_id: str | None = None


_current: contextvars.ContextVar[RequestIds | None] = contextvars.ContextVar("oai_request_ids", default=None)


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)


def client_request_id(value: str | None) -> str | None:
    """The client's id as logged: printable ASCII, 1 to 512 characters; else none (not refused:
    the front only logs it)."""
    if not value or len(value) > CLIENT_REQUEST_ID_MAX_CHARS:
        return None
    if not all(" " <= char <= "~" for char in value) or not value.strip():
        return None
    return value


def begin(headers: dict[str, str]) -> RequestIds:
    """A request's ids, current for the rest of its task (and the tasks and threads it starts with
    a copy of its context: Django's handler, the stream's tasks, sync_to_async)."""
    ids = RequestIds(new_request_id(), client_request_id(headers.get(CLIENT_REQUEST_ID_HEADER)))
    _current.set(ids)
    return ids


def current() -> RequestIds | None:
    return _current.get()


@contextlib.contextmanager
def serving(ids: RequestIds | None) -> Iterator[None]:
    """`ids` current on this thread for the block, then whatever was before: for work a request hands
    to a thread of a pool, which runs in the thread's own context, not a copy of the request's (the
    front's in-process native calls, whose Django state must stay the thread's)."""
    token = _current.set(ids)
    try:
        yield
    finally:
        _current.reset(token)


# --- the log records -----------------------------------------------------------------------------

_installed = False


def install_log_records() -> None:
    """Every log record made while a request is served gets its `x_request_id` (and
    `client_request_id`) as attributes: OpenTelemetry's log bridge sends them as attributes, and
    RequestIdFormatter writes them. Once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    make_record = logging.getLogRecordFactory()

    def record_with_request_ids(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        ids = _current.get()
        if ids is not None:
            record.x_request_id = ids.request_id
            if ids.client_request_id is not None:
                record.client_request_id = ids.client_request_id
        return record

    logging.setLogRecordFactory(record_with_request_ids)


class RequestIdFormatter(logging.Formatter):
    """The console's lines: a record made while a request was served carries
    `x_request_id=req_…` (and ` client_request_id="…"`, quoted) just before its message, so one
    grep finds the request and the message still ends the line (the spec's finished line ends
    with its first_read_ values)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "x_request_id", None)
        if request_id is None:
            return super().formatMessage(record)
        tag = f"x_request_id={request_id}"
        client_id = getattr(record, "client_request_id", None)
        if client_id is not None:
            tag += f" client_request_id={json.dumps(client_id)}"
        message = record.message
        record.message = f"{tag} {message}"
        try:
            return super().formatMessage(record)
        finally:
            record.message = message
