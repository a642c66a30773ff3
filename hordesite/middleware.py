"""CORS for browser clients (KoboldAI Lite runs from file://, origin null): every answer carries
Access-Control-Allow-Origin, and preflights are answered here."""

from __future__ import annotations

from django.http import HttpResponse

ALLOWED_HEADERS = "apikey, client-agent, content-type, authorization, x-stainless-retry-count"
EXPOSED_HEADERS = "Retry-After, x-should-retry"


class CorsMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.method == "OPTIONS" and "HTTP_ACCESS_CONTROL_REQUEST_METHOD" in request.META:
            response = HttpResponse(status=200)
            response["Access-Control-Allow-Methods"] = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
            requested = request.META.get("HTTP_ACCESS_CONTROL_REQUEST_HEADERS")
            response["Access-Control-Allow-Headers"] = f"{ALLOWED_HEADERS}, {requested}" if requested else ALLOWED_HEADERS
            response["Access-Control-Max-Age"] = "86400"
        else:
            response = self.get_response(request)
        response["Access-Control-Allow-Origin"] = "*"
        response["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        return response
