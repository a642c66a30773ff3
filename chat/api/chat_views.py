"""Native chat routes: POST /api/v2/generate/chat/async and GET/DELETE .../chat/status/<id>.

Thin: bound and parse the body, validate it with the contract, call the service, render. The
request's schema and the status body's are the contract's pydantic models; the status routes
answer the body the status selector builds (and caches) as it is.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, PolymorphicProxySerializer, extend_schema
from rest_framework.exceptions import ParseError
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.callers import requester, shared_key_of
from accounts.api.openapi_errors import refusals
from accounts.ratelimit import chat_request_limits_per_ip, check_submit_rate_limits
from chat.api import openapi  # noqa: F401  (the contract's models in the schema)
from chat.api import serializers as s
from chat.api.openapi import undelivered_cancel_headers
from chat.selectors import status as chat_selectors
from chat.services import create_chat as chat_create
from chat.services import front_lease
from contract.chat_errors import ChatRefusal
from contract.chat_limits import MAX_CHAT_BODY_BYTES
from contract.chat_shapes import ChatRequest, validate_chat_request
from contract.chat_status import ChatStatus
from contract.errors import HordeError, request_too_large_message
from contract.strict_json import loads_strict
from contract.text import replace_nul

# Read a body without a declared length in pieces, to stop one byte past the limit.
BODY_READ_CHUNK_BYTES = 1024 * 1024


def request_too_large() -> HordeError:
    return HordeError("RequestTooLarge", request_too_large_message(MAX_CHAT_BODY_BYTES), status=413)


def read_chat_request_body(request) -> bytes:
    """The raw body, refused with 413 before parsing when it declares or reaches more than
    MAX_CHAT_BODY_BYTES; a chunked body is read only up to one byte past the limit."""
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > MAX_CHAT_BODY_BYTES:
        raise request_too_large()
    chunks, size = [], 0
    while size <= MAX_CHAT_BODY_BYTES:
        chunk = request.read(min(BODY_READ_CHUNK_BYTES, MAX_CHAT_BODY_BYTES + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > MAX_CHAT_BODY_BYTES:
        raise request_too_large()
    return b"".join(chunks)


def _clean_strings(value):
    """NUL is replaced (PostgreSQL text cannot hold it, as in stored replies); a lone surrogate,
    which UTF-8 cannot encode, refuses the body."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise HordeError("BadRequest", "The request body holds text that is not valid Unicode.") from None
        return replace_nul(value)
    if isinstance(value, list):
        return [_clean_strings(item) for item in value]
    if isinstance(value, dict):
        return {_clean_strings(k): _clean_strings(v) for k, v in value.items()}
    return value


def parse_chat_body(raw: bytes):
    """NaN and Infinity refused, as DRF's strict parser refuses them on the other native routes,
    and a number past a float's range, which reads as infinity."""
    try:
        return _clean_strings(loads_strict(raw))
    except (ValueError, RecursionError) as error:
        raise ParseError(f"The body is not valid JSON: {error}") from None


def refusal_error(refusal: ChatRefusal) -> HordeError:
    """A contract refusal as the native body {"message", "rc"}; the message starts with the path."""
    return HordeError(refusal.rc, refusal.message, status=refusal.status)


class ChatAsyncView(APIView):
    """POST /api/v2/generate/chat/async: queue a chat request (202), answer a repeated operation key
    or quote a dry run (200)."""

    def perform_authentication(self, request):
        # Lazy: the body bound (413) and its validation come before the key is looked at.
        pass

    @extend_schema(
        # The contract's model, which validate_chat_request returns (docs/adr/0031).
        request=ChatRequest,
        responses={
            202: s.ChatAsyncOutputSerializer,
            200: OpenApiResponse(
                PolymorphicProxySerializer(
                    component_name="ChatAsyncAnswer",
                    serializers=[s.ChatAsyncRepeatSerializer, s.ChatQuoteSerializer],
                    resource_type_field_name=None,
                ),
                description="Repeated operation key, or dry run",
            ),
            **refusals(
                s400=["BadRequest", "UnsupportedChatParameter", "ChatRequestConflict", "OperationKeyConflict",
                      "PromptExceedsContext", "ChatKudosCapExceeded", "SourceImageUrlRefused", "..."],
                s403=["NoEligibleWorker", "KudosUpfront", "AnonForbidden", "SharedKeyEmpty", "SharedKeyExpired",
                      "SharedKeyInsufficientKudos"],
                s404=["UnknownChatModel"],
                s413=["RequestTooLarge"],
                s429=["RateLimited", "TooManyPrompts"],
                s503=["MaintenanceMode", "ChatAdmissionDisabled", "ChatImageStorageUnavailable", "ChatImagesBusy",
                      "DatabaseUnavailable"],
            ),
        },
    )
    def post(self, request):
        address = check_submit_rate_limits(request, scope="chat_async", limits_per_ip=chat_request_limits_per_ip())
        body = parse_chat_body(read_chat_request_body(request._request))
        try:
            chat = validate_chat_request(body)
        except ChatRefusal as refusal:
            raise refusal_error(refusal) from None
        except RecursionError:
            raise HordeError("BadRequest", "The request body nests too deeply.") from None
        try:
            user = requester(request)
        except HordeError:
            # Authentication is step 5: a caller who holds no claim hears the flag and maintenance first.
            chat_create.ensure_chat_admitting()
            raise
        created = chat_create.chat_request_create(
            user=user,
            chat=chat,
            client_agent=request.headers.get("Client-Agent", ""),
            ip_address=address,
            front_lease_seconds=front_lease.front_lease_seconds(request.headers),
            front_id=front_lease.front_lease_front_id(request.headers),
            shared_key=shared_key_of(request),
        )
        if created.request is None:
            return Response(s.CHAT_QUOTE_OUTPUT.to_representation(created), status=200)
        if created.repeated:
            return Response(s.CHAT_ASYNC_REPEAT_OUTPUT.to_representation(created), status=200)
        return Response(s.CHAT_ASYNC_OUTPUT.to_representation(created), status=202)


def _not_found(request_id) -> HordeError:
    return HordeError("RequestNotFound", f"Request with ID '{request_id}' not found.")


class ChatStatusView(APIView):
    """GET (status) and DELETE (cancel) /api/v2/generate/chat/status/<id>."""

    @extend_schema(responses={200: ChatStatus, **refusals(s404=["RequestNotFound"])})
    def get(self, request, request_id):
        front_lease.front_lease_renew(
            request_id=request_id, header=request.META.get(front_lease.FRONT_LEASE_META_KEY)
        )
        body = chat_selectors.chat_status_body(request_id)
        if body is None:
            raise _not_found(request_id)
        return Response(body)

    @extend_schema(parameters=undelivered_cancel_headers(), responses={200: ChatStatus, **refusals(s404=["RequestNotFound"])})
    def delete(self, request, request_id):
        wp = chat_selectors.chat_request_get(request_id)
        if wp is None:
            raise _not_found(request_id)
        # A stopping front's cancel of a request it cannot deliver ends it unpaid (docs/adr/0086).
        front_id = front_lease.stopping_front(request.META)
        if front_id is None or not front_lease.cancel_undelivered(request_id=wp.pk, front_id=front_id):
            chat_create.chat_request_cancel(request=wp)
        wp = chat_selectors.chat_request_get(request_id)  # re-read: the cancel changed it
        if wp is None:  # expired meanwhile
            raise _not_found(request_id)
        return Response(chat_selectors.chat_request_status(wp))
