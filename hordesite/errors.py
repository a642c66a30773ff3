"""One error shape for the native API: {"message", "rc"}; schema failures list their fields."""

from __future__ import annotations

import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import Http404
from rest_framework import exceptions
from rest_framework.response import Response

from contract.chat_errors import ChatRefusal
from contract.errors import HordeError, request_too_large_body
from hordesite import db_guard

log = logging.getLogger(__name__)

VALIDATION_MESSAGE = "Input payload validation failed"
TOO_DEEP_MESSAGE = "The request body nests too deeply."


def _flatten(detail, prefix: str = "") -> dict[str, str]:
    """DRF's nested error detail -> {"params.max_length": "message"}, as upstream's flask-restx does."""
    out: dict[str, str] = {}
    if isinstance(detail, dict):
        for key, value in detail.items():
            if isinstance(key, int):  # a list item's errors, keyed by index
                path = f"{prefix}[{key}]"
            elif key == "non_field_errors":  # the object itself is wrong
                path = prefix or "payload"
            else:
                path = f"{prefix}.{key}" if prefix else str(key)
            out.update(_flatten(value, path))
    elif isinstance(detail, list):
        if detail and all(not isinstance(item, (dict, list)) for item in detail):
            out[prefix or "payload"] = " ".join(str(item) for item in detail)
        else:
            for index, item in enumerate(detail):
                if item:
                    out.update(_flatten(item, f"{prefix}[{index}]"))
    else:
        out[prefix or "payload"] = str(detail)
    return out


def horde_exception_handler(exc, context):
    if isinstance(exc, HordeError):
        return Response(exc.body(), status=exc.status, headers=exc.headers or None)
    if isinstance(exc, ChatRefusal):
        return Response({"message": exc.message, "rc": exc.rc}, status=exc.status)
    if isinstance(exc, RecursionError) or (
        isinstance(exc, exceptions.ParseError) and isinstance(exc.__context__, RecursionError)
    ):
        # Only a request body nests deep enough: the JSON parser (DRF's lets RecursionError through;
        # the chat route's turns it into a ParseError), or what walks the parsed body.
        return Response({"message": TOO_DEEP_MESSAGE, "rc": "BadRequest"}, status=400)
    if isinstance(exc, exceptions.ValidationError):
        return Response({"errors": _flatten(exc.detail), "message": VALIDATION_MESSAGE}, status=400)
    if isinstance(exc, exceptions.ParseError):
        return Response({"errors": {"payload": str(exc.detail)}, "message": VALIDATION_MESSAGE}, status=400)
    if isinstance(exc, RequestDataTooBig):
        # A chunked body past DATA_UPLOAD_MAX_MEMORY_SIZE where no ASGI guard ran (WSGI).
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return Response(request_too_large_body(limit), status=413)
    if isinstance(exc, Http404):
        return Response({"message": "Not found", "rc": "NotFound"}, status=404)
    if isinstance(exc, exceptions.Throttled):
        headers = {"Retry-After": str(int(exc.wait or 1))}
        return Response({"message": str(exc.detail), "rc": "RateLimited"}, status=429, headers=headers)
    if isinstance(exc, exceptions.APIException):
        rc = {401: "InvalidAPIKey", 403: "Forbidden", 405: "MethodNotAllowed", 415: "BadRequest"}.get(
            exc.status_code, "BadRequest"
        )
        return Response({"message": str(exc.detail), "rc": rc}, status=exc.status_code)
    if db_guard.is_connection_failure(exc):
        # A lost or unobtainable connection: 503 with Retry-After, marked for one more run when
        # nothing was written (hordesite/db_guard.py).
        retry = db_guard.on_connection_failure(exc)
        return Response(db_guard.unavailable_body(), status=503, headers=db_guard.unavailable_headers(retry=retry))
    if db_guard.is_database_file_unavailable(exc):
        log.warning("%s: the database file is out of reach: %s", context.get("view"), exc)
        return Response(db_guard.unavailable_body(), status=503, headers=db_guard.unavailable_headers())
    if db_guard.is_transaction_conflict(exc):
        log.warning("%s rolled back at the database: %s", context.get("view"), exc)
        return Response(
            {"message": db_guard.DATABASE_CONFLICT_MESSAGE, "rc": db_guard.DATABASE_CONFLICT_RC},
            status=503,
            headers={"Retry-After": str(db_guard.DATABASE_CONFLICT_RETRY_AFTER_SECONDS)},
        )
    log.exception("unhandled error in %s", context.get("view"))
    return Response({"message": "Internal server error", "rc": "InternalError"}, status=500)
