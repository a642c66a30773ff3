"""Native error return codes (`rc`) with their upstream HTTP statuses."""

from __future__ import annotations

# rc -> HTTP status, as the upstream AI Horde answers them.
RC_STATUS: dict[str, int] = {
    "BadRequest": 400,
    "InvalidAPIKey": 401,
    "MissingPrompt": 400,
    "InvalidSize": 400,
    "TooManyPrompts": 429,
    "KudosUpfront": 403,
    "RequestNotFound": 404,
    "AnonForbiddenWorker": 403,
    "AnonForbidden": 403,
    "MaintenanceMode": 503,
    "WrongCredentials": 403,
    "TooManyWorkers": 403,
    "TooManyWorkersTrusted": 403,
    "InvalidJobID": 404,
    "DuplicateGen": 400,
    "AbortedGen": 400,
    "WorkerMaintenance": 403,
    "TooManySameIPs": 403,
    "RateLimited": 429,
    "NotTrusted": 403,
    "NotModerator": 403,
    "UserNotFound": 404,
    "WorkerNotFound": 404,
    "ValidationError": 400,
    "ProfaneWorkerName": 400,
    "NoValidWorkers": 400,
    "Forbidden": 403,
    "SharedKeyEmpty": 403,
    "SharedKeyExpired": 403,
    "SharedKeyInsufficientKudos": 403,
    "NoSharedKeyModSelected": 400,
    "NotOwner": 403,
    "NoWorkerModSelected": 400,
    "TooLongWorkerName": 400,
    "WorkerNameAlreadyExists": 400,
    "Locked": 423,
    "TokenOverflow": 400,
    "MissingFullSamplerOrder": 400,
    "TooManyStopSequences": 400,
    "ExcessiveStopSequence": 400,
}


class HordeError(Exception):
    """A refusal the native API answers as {"message", "rc"} with the rc's upstream status."""

    def __init__(
        self, rc: str, message: str, *, status: int | None = None, extra: dict | None = None
    ) -> None:
        super().__init__(message)
        self.rc = rc
        self.message = message
        self.status = status if status is not None else RC_STATUS.get(rc, 400)
        self.extra = extra or {}
        self.headers: dict[str, str] = {}

    def body(self) -> dict:
        return {"message": self.message, "rc": self.rc, **self.extra}


def request_too_large_body(limit: int) -> dict:
    """The 413 RequestTooLarge body, wherever a body is refused for its size (the serving layer, the
    middleware, DRF's handler, the chat route's own read)."""
    return {"message": request_too_large_message(limit), "rc": "RequestTooLarge"}


def request_too_large_message(limit: int) -> str:
    """The 413 message, native and front alike."""
    return f"The request body is over {limit} bytes."


def unsupported_content_encoding(value: str | None) -> str | None:
    """A request's Content-Encoding that the horde does not decode (none does: it reads bodies as
    sent), or None for none or identity."""
    codings = [coding.strip() for coding in (value or "").split(",") if coding.strip()]
    if all(coding.lower() == "identity" for coding in codings):
        return None
    return value.strip()[:100] if value else None


def unsupported_content_encoding_message(encoding: str) -> str:
    """The 415 message for a compressed body, native and front alike (RFC 9110 15.5.16: the answer
    names the coding it would take in Accept-Encoding)."""
    return f"The request body's Content-Encoding {encoding!r} is not supported: send it uncompressed."


# SQLSTATEs of a statement PostgreSQL rolled back for a concurrent transaction's sake:
# deadlock_detected, serialization_failure and lock_not_available. The horde takes its locks in one
# order (docs/adr/0068-one-lock-order.md); one met anyway costs a retry, never a 500 or a sweep.
TRANSACTION_CONFLICT_SQLSTATES = frozenset({"40P01", "40001", "55P03"})


def is_transaction_conflict(exc: BaseException) -> bool:
    """A database error (the driver's, or Django's around it) of TRANSACTION_CONFLICT_SQLSTATES."""
    for error in (exc, exc.__cause__):
        if getattr(error, "sqlstate", None) in TRANSACTION_CONFLICT_SQLSTATES:
            return True
    return False

