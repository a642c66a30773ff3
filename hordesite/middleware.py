"""CORS for browser clients (KoboldAI Lite runs from file://, origin null): every answer carries
Access-Control-Allow-Origin, and preflights are answered here.

The middleware is sync and async capable, so under ASGI an async view (the OpenAI front) is not
sent through a thread for it."""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpResponse

ALLOWED_HEADERS = "apikey, client-agent, content-type, authorization, x-stainless-retry-count"
EXPOSED_HEADERS = "Retry-After, x-should-retry"


def _is_preflight(request) -> bool:
    return request.method == "OPTIONS" and "HTTP_ACCESS_CONTROL_REQUEST_METHOD" in request.META


def _preflight(request) -> HttpResponse:
    response = HttpResponse(status=200)
    response["Access-Control-Allow-Methods"] = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
    requested = request.META.get("HTTP_ACCESS_CONTROL_REQUEST_HEADERS")
    response["Access-Control-Allow-Headers"] = f"{ALLOWED_HEADERS}, {requested}" if requested else ALLOWED_HEADERS
    response["Access-Control-Max-Age"] = "86400"
    return response


def _with_cors(response):
    response["Access-Control-Allow-Origin"] = "*"
    response["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
    return response


class CorsMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
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
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self._acall(request)
        if request.path.startswith(ADMIN_PATH_PREFIX):
            return self.admin(request)
        return _api_headers(self.get_response(request))

    async def _acall(self, request):
        if request.path.startswith(ADMIN_PATH_PREFIX):
            return await self.admin(request)
        return _api_headers(await self.get_response(request))


def _api_headers(response):
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    if not response.streaming and "Content-Length" not in response:
        response["Content-Length"] = str(len(response.content))
    return response
