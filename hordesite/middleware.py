"""CORS for browser clients (KoboldAI Lite runs from file://, origin null): every answer carries
Access-Control-Allow-Origin, and preflights are answered here, by the front's implementation
(oai.asgi) with the native API's policy.

The middleware is sync and async capable, so under ASGI an async view (the OpenAI front) is not
sent through a thread for it."""

from __future__ import annotations

import logging

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import DisallowedHost
from django.http import HttpResponse, JsonResponse
from rest_framework.exceptions import UnsupportedMediaType
from rest_framework.utils.mediatypes import media_type_matches

from contract.errors import (
    request_too_large_body,
    unsupported_content_encoding,
    unsupported_content_encoding_message,
)
from hordesite.body_limits import body_limit
from oai.asgi import FRONT_PATH_PREFIX, CorsPolicy, cors_headers, is_preflight, preflight_headers
from oai.errors import HOST_NOT_SERVED_MESSAGE, IN_PROCESS_ENVIRON_KEY

# The native API's CORS policy; the implementation is the front's (oai.asgi), one for both APIs.
NATIVE_CORS = CorsPolicy(
    allowed_headers="apikey, client-agent, content-type, authorization, x-stainless-retry-count",
    allowed_methods="GET, POST, PUT, PATCH, DELETE, OPTIONS",
    preflight_status=200,
)


def _is_preflight(request) -> bool:
    return is_preflight(request.method, request.META.get("HTTP_ACCESS_CONTROL_REQUEST_METHOD"))


def _preflight(request) -> HttpResponse:
    response = HttpResponse(status=NATIVE_CORS.preflight_status)
    for name, value in preflight_headers(NATIVE_CORS, request.META.get("HTTP_ACCESS_CONTROL_REQUEST_HEADERS")):
        response[name] = value
    return response


def _with_cors(response):
    for name, value in cors_headers():
        response[name] = value
    return response


class CorsMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        # Decided once, as Django's own MiddlewareMixin does: asking inspect on every call costs.
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.async_mode:
            return self._acall(request)
        return _with_cors(_preflight(request) if _is_preflight(request) else self.get_response(request))

    async def _acall(self, request):
        return _with_cors(_preflight(request) if _is_preflight(request) else await self.get_response(request))


# --- the admin's middleware, only for the admin ------------------------------------------------

ADMIN_PATH_PREFIX = "/admin/"


class AdminOnlyMiddleware:
    """Django's security, common, session, authentication, message and clickjacking middleware, for
    the admin pages alone. Under ASGI each of them hops to a thread for its request and response hooks, about
    ten hops a request; the API routes use none of them (no sessions, no cookies, exact paths), so
    they skip the chain and get the two headers of it that apply to a JSON answer."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        from django.contrib.auth.middleware import AuthenticationMiddleware
        from django.contrib.messages.middleware import MessageMiddleware
        from django.contrib.sessions.middleware import SessionMiddleware
        from django.middleware.clickjacking import XFrameOptionsMiddleware
        from django.middleware.common import CommonMiddleware
        from django.middleware.security import SecurityMiddleware

        self.get_response = get_response
        self.admin = SecurityMiddleware(
            CommonMiddleware(
                SessionMiddleware(
                    AuthenticationMiddleware(MessageMiddleware(XFrameOptionsMiddleware(get_response)))
                )
            )
        )
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.async_mode:
            return self._acall(request)
        if request.path.startswith(ADMIN_PATH_PREFIX):
            return self.admin(request)
        return _api_headers(_host_refusal(request) or self.get_response(request))

    async def _acall(self, request):
        if request.path.startswith(ADMIN_PATH_PREFIX):
            return await self.admin(request)
        return _api_headers(_host_refusal(request) or await self.get_response(request))


# Probes (a load balancer's, Kubernetes') often name the address they dial, not the site.
HOST_CHECK_EXEMPT_PATHS = frozenset({"/healthz"})
_security_log = logging.getLogger("django.security.DisallowedHost")


def _host_refusal(request) -> JsonResponse | None:
    """ALLOWED_HOSTS on the API routes, as CommonMiddleware holds the admin to it: a Host it does
    not list is 400 in the native error shape (Django's own answer is an HTML page). The front's
    views check their own in OpenAI's shape (served in process, they skip this middleware), and
    its in-process native calls were checked there."""
    if (
        request.path_info in HOST_CHECK_EXEMPT_PATHS
        or request.path_info.startswith(FRONT_PATH_PREFIX)
        or IN_PROCESS_ENVIRON_KEY in request.META  # the mounted front's own call, checked at the front
    ):
        return None
    try:
        request.get_host()
    except DisallowedHost as error:
        _security_log.warning(str(error))
        return JsonResponse({"message": HOST_NOT_SERVED_MESSAGE, "rc": "BadRequest"}, status=400)
    return None


def _api_headers(response):
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    if not response.streaming and "Content-Length" not in response:
        response["Content-Length"] = str(len(response.content))
    return response


# --- one body rule for every native JSON route ---------------------------------------------------

JSON_MEDIA_TYPE = "application/json"


def _has_body(request) -> bool:
    length = request.META.get("CONTENT_LENGTH") or ""
    return (length.isascii() and length.isdigit() and int(length) > 0) or "HTTP_TRANSFER_ENCODING" in request.META


def _body_refusal(request) -> JsonResponse | None:
    """413 for a declared length over the route's bound, 415 for a compressed body or one that is not
    JSON (as DRF's JSON parser decides it): the same for the routes DRF parses and the one that reads its own body
    (chat/async), on ASGI and WSGI alike. A body-less request is left to the view."""
    limit = body_limit(request.method, request.path)
    if limit is None or not _has_body(request):
        return None
    length = request.META.get("CONTENT_LENGTH") or ""
    if length.isascii() and length.isdigit() and int(length) > limit:
        return JsonResponse(
            request_too_large_body(limit), status=413
        )
    encoding = unsupported_content_encoding(request.META.get("HTTP_CONTENT_ENCODING"))
    if encoding is not None:
        return JsonResponse(
            {"message": unsupported_content_encoding_message(encoding), "rc": "BadRequest"},
            status=415,
            headers={"Accept-Encoding": "identity"},
        )
    content_type = request.META.get("CONTENT_TYPE", "")
    if not media_type_matches(JSON_MEDIA_TYPE, content_type):
        return JsonResponse({"message": str(UnsupportedMediaType(content_type).detail), "rc": "BadRequest"}, status=415)
    return None


class JsonBodyMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.async_mode:
            return self._acall(request)
        return _body_refusal(request) or self.get_response(request)

    async def _acall(self, request):
        return _body_refusal(request) or await self.get_response(request)
