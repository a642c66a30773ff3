"""URLs of the standalone front: the OpenAI routes under /v1/ and their OpenAPI schema
(/healthz is answered by oai.asgi.FrontASGI before Django)."""

from __future__ import annotations

from django.http import JsonResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularJSONAPIView

urlpatterns = [
    # Before the OpenAI routes, whose last pattern answers every other /v1/ path with a 404.
    path("v1/openapi.json", SpectacularJSONAPIView.as_view(), name="oai-openapi-schema"),
    path("v1/", include("oai.urls")),
]


def json_not_found(request, exception=None):
    return JsonResponse(
        {
            "error": {
                "message": "Not found",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
        },
        status=404,
    )


handler404 = json_not_found
