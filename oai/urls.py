"""The OpenAI routes, mounted under /v1/ by the horde's urls and by the standalone front."""

from __future__ import annotations

from django.urls import path, re_path

from oai.views import (
    ChatCompletionsView,
    ModelsView,
    ModelView,
    ResponseCancelView,
    ResponseInputItemsView,
    ResponsesView,
    ResponseView,
    TextCompletionsView,
    unknown_path,
)

urlpatterns = [
    path("chat/completions", ChatCompletionsView.as_view()),
    path("completions", TextCompletionsView.as_view()),
    path("responses", ResponsesView.as_view()),
    # OpenAI's endpoints under /responses/ that the front does not serve: not response ids (ADR 0109).
    path("responses/compact", unknown_path),
    path("responses/input_tokens", unknown_path),
    path("responses/<str:response_id>", ResponseView.as_view()),
    path("responses/<str:response_id>/cancel", ResponseCancelView.as_view()),
    path("responses/<str:response_id>/input_items", ResponseInputItemsView.as_view()),
    path("models", ModelsView.as_view()),
    path("models/<path:model_id>", ModelView.as_view()),
    # Last: every other /v1/ path is 404 in OpenAI's error shape.
    re_path(r"^.*$", unknown_path),
]
