"""The OpenAI routes, mounted under /v1/ by the horde's urls and by the standalone front."""

from __future__ import annotations

from django.urls import path

from oai.views import ChatCompletionsView, ModelsView

urlpatterns = [
    path("chat/completions", ChatCompletionsView.as_view()),
    path("models", ModelsView.as_view()),
]
