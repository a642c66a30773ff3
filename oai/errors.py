"""The front's error envelope, OpenAI's {"error": {"message", "type", "param", "code"}}, and the SSE
error event. `should_retry=False` sends x-should-retry: false, so the OpenAI SDK's own retries never
create a second paid request for an answer a retry cannot fix."""

from __future__ import annotations

import json
from typing import Any

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


# A Host header ALLOWED_HOSTS does not list, on either API (Django's own message is for the operator).
HOST_NOT_SERVED_MESSAGE = "The Host header names a host this horde does not serve."
# The WSGI environ key that marks the front's in-process native calls (oai.horde_client).
IN_PROCESS_ENVIRON_KEY = "horde.in_process"


class ChatFrontError(Exception):
    """One error answer: HTTP status, OpenAI type, code, param, message, headers and metadata."""

    def __init__(
        self,
        status: int,
        code: str | None,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        retry_after: int | None = None,
        should_retry: bool | None = None,
        metadata: dict[str, Any] | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "api_error")
        self.retry_after = retry_after
        self.should_retry = should_retry
        self.metadata = metadata or {}
        # Metric attribute for queue_unavailable (no_eligible_threads, wait_exceeds_budget).
        self.reason = reason

    def error_object(self, request_id: str | None = None) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        metadata = dict(self.metadata)
        if request_id:
            metadata.setdefault("request_id", request_id)
        if self.retry_after is not None:
            metadata.setdefault("retry_after", self.retry_after)
        if metadata:
            error["metadata"] = metadata
        return error

    def body(self, request_id: str | None = None) -> dict[str, Any]:
        return {"error": self.error_object(request_id)}

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(int(self.retry_after))
        if self.should_retry is not None:
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        return headers

    def __repr__(self) -> str:
        return f"ChatFrontError({self.status}, {self.code!r}, {self.message!r}, param={self.param!r})"


def invalid_api_key(message: str) -> ChatFrontError:
    """OpenAI's answer to a missing or unknown key: 401 authentication_error, not to be retried."""
    return ChatFrontError(401, "invalid_api_key", message, type="authentication_error", should_retry=False)


def sse_error_event(error: ChatFrontError, request_id: str | None = None) -> bytes:
    return b"data: " + json.dumps(error.body(request_id), separators=(",", ":")).encode() + b"\n\n"


# How long a client waits before sending again a request a stopping front cancelled: a restart's
# drain (up to 10 s, oai.server) and the next process's start. The SDKs wait Retry-After (up to
# 60 s) before their own retry, and x-should-retry: true makes them retry (docs/adr/0076).
FRONT_STOPPING_RETRY_AFTER_SECONDS = 5


def request_crashed() -> ChatFrontError:
    return ChatFrontError(
        500,
        "InternalError",
        "The AI Horde front failed to handle this request, which it cancelled; send it again.",
        type="api_error",
    )


FRONT_STOPPING_MESSAGE = (
    "This AI Horde front is restarting and cancelled this request, which it could not finish before stopping; "
    "send it again."
)


def front_stopping(message: str = FRONT_STOPPING_MESSAGE) -> ChatFrontError:
    """The answer of a request its front process could not finish before it stops (SIGTERM): the
    horde request is cancelled first, so the client's retry is the only one that runs."""
    return ChatFrontError(
        503,
        "FrontStopping",
        message,
        type="api_error",
        retry_after=FRONT_STOPPING_RETRY_AFTER_SECONDS,
        should_retry=True,
    )
