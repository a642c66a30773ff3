"""DRF (adrf async) views of the OpenAI routes: POST /v1/chat/completions, POST /v1/completions,
POST /v1/responses (and GET, DELETE and the input items of a kept response) and GET /v1/models; every other /v1/ path is `unknown_path`'s 404 in OpenAI's error shape.

DRF runs authentication (the Bearer key is the horde API key), the error envelope (OpenAI's, through
`openai_exception_handler`) and the OpenAPI schema for them. A streamed answer is Django's async
StreamingHttpResponse returned from the same view (docs/adr/0007-oai-front-on-drf.md).
"""

from __future__ import annotations

import inspect
import json
import logging
from typing import Any

from adrf.views import APIView
from django.core.exceptions import DisallowedHost
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    inline_serializer,
)
from rest_framework import exceptions, serializers
from rest_framework.authentication import BaseAuthentication
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.permissions import AllowAny
from rest_framework.response import Response

from oai import app
from oai.errors import HOST_NOT_SERVED_MESSAGE, ChatFrontError, invalid_api_key
from oai.state import get_front_state


class FrontCaller:
    """The caller DRF sees: its key is passed on to the horde, which authenticates it."""

    is_authenticated = True

    def __init__(self, api_key: str):
        self.api_key = api_key


class BearerKeyAuthentication(BaseAuthentication):
    """`Authorization: Bearer <horde API key>`; the upstream `apikey` header is accepted too. The key
    is checked by the horde at submit: a key it does not know is 401 authentication_error there."""

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        scheme, _, key = header.partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        key = key or request.META.get("HTTP_APIKEY", "").strip()
        if not key:
            return None
        return FrontCaller(key), key

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="ai-horde"'


class BearerKeyScheme(OpenApiAuthenticationExtension):
    """The Bearer key in the OpenAPI schema."""

    target_class = "oai.views.BearerKeyAuthentication"
    name = "HordeBearerKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "The horde API key (anonymous where allowed).",
        }


def openai_exception_handler(exc, context) -> Response:
    """Every error of these views in OpenAI's envelope."""
    if isinstance(exc, ChatFrontError):
        error = exc
    elif isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        error = invalid_api_key(str(exc.detail))
    elif isinstance(exc, exceptions.MethodNotAllowed):
        error = ChatFrontError(405, "method_not_allowed", str(exc.detail), should_retry=False)
    elif isinstance(exc, exceptions.Throttled):
        error = ChatFrontError(
            429,
            "rate_limit_exceeded",
            str(exc.detail),
            type="rate_limit_error",
            # DRF sets wait (seconds, or None); its stubs leave it out.
            retry_after=int(exc.wait or 1),  # type: ignore[attr-defined]
        )
    elif isinstance(exc, exceptions.APIException):
        error = ChatFrontError(exc.status_code, "BadRequest", str(exc.detail), should_retry=False)
    else:
        logging.getLogger("oai").exception("unhandled error in the OpenAI front")
        error = ChatFrontError(
            500, "InternalError", "The AI Horde front failed to handle the request.", type="api_error"
        )
    return Response(error.body(), status=error.status, headers=error.headers())


def client_source(request, trusted_proxy_count: int) -> str:
    """The client address the per-source in-flight cap counts: the socket peer, or the address the
    trusted proxies forwarded."""
    if trusted_proxy_count > 0:
        forwarded = [a.strip() for a in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if a.strip()]
        if len(forwarded) >= trusted_proxy_count:
            return forwarded[-trusted_proxy_count]
    return request.META.get("REMOTE_ADDR") or "unknown"


_ERROR = inline_serializer(
    "OpenAIError",
    {
        "error": inline_serializer(
            "OpenAIErrorObject",
            {
                "message": serializers.CharField(),
                "type": serializers.CharField(),
                "param": serializers.CharField(allow_null=True),
                "code": serializers.CharField(allow_null=True),
            },
        )
    },
)
# The statuses a completions request can answer with an OpenAI error body.
_COMPLETION_ERRORS = dict.fromkeys((400, 401, 404, 408, 413, 415, 429, 502, 503), _ERROR)


class AnswerAsTheBodyAsks(DefaultContentNegotiation):
    """OpenAI's routes answer JSON, or an event stream when the body sets `stream`, whatever the
    Accept header or a `format` parameter asks: an SSE client sends `Accept: text/event-stream`
    (fetch-event-source, httpx-sse, a browser's hand-written reader), and DRF's negotiation would
    refuse it with 406 for want of a renderer of that type."""

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class FrontView(APIView):
    authentication_classes = [BearerKeyAuthentication]
    # A keyless request is the anonymous user's unless HORDE_OAI_ALLOW_ANONYMOUS is off (then 401):
    # AllowAny documents the key as optional (ADR 0114).
    permission_classes = [AllowAny]
    throttle_classes: list = []
    content_negotiation_class = AnswerAsTheBodyAsks

    def get_exception_handler(self):
        return openai_exception_handler

    async def async_dispatch(self, request, *args: Any, **kwargs: Any):
        """adrf's dispatch, with `initial` run on the event loop: for these views it does no I/O (the
        Bearer key is read from a header; no permission or throttle classes), where adrf sends it
        through sync_to_async, a thread hop per request."""
        self.args = args
        self.kwargs = kwargs
        request = self.initialize_request(request, *args, **kwargs)
        self.request = request
        self.headers = self.default_response_headers
        try:
            _check_host(request._request)
            self.initial(request, *args, **kwargs)
            method = request.method.lower()
            handler = getattr(self, method, None) if method in self.http_method_names else None
            handler = handler or self.http_method_not_allowed
            response = handler(request, *args, **kwargs)
            if inspect.isawaitable(response):
                response = await response
        except Exception as exc:
            response = self.handle_exception(exc)
        self.response = self.finalize_response(request, response, *args, **kwargs)
        return self.response


def _check_host(django_request) -> None:
    """ALLOWED_HOSTS, as the native routes hold to it (hordesite.middleware): the front's routes
    skip the horde's middleware (oai.asgi.front_django_handler)."""
    try:
        django_request.get_host()
    except DisallowedHost as error:
        logging.getLogger("django.security.DisallowedHost").warning(str(error))
        raise ChatFrontError(400, "invalid_host", HOST_NOT_SERVED_MESSAGE, should_retry=False) from None


def _response(answer: app.JsonAnswer) -> HttpResponse:
    """The answer rendered here, as DRF's JSONRenderer renders it (compact, UTF-8): a DRF Response
    is rendered by Django's handler through sync_to_async, one more thread hop per request."""
    content = json.dumps(answer.body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    response = HttpResponse(content, status=answer.status, content_type="application/json")
    response["Content-Length"] = str(len(content))
    for name, value in (answer.headers or {}).items():
        response[name] = value
    return response


class ChatCompletionsView(FrontView):
    """POST /v1/chat/completions (OpenAI's chat completions, whole or streamed)."""

    @extend_schema(
        operation_id="oai_chat_completions",
        tags=["openai"],
        request=inline_serializer(
            "ChatCompletionRequest",
            {
                "model": serializers.CharField(required=False),
                "models": serializers.ListField(child=serializers.CharField(), required=False),
                "messages": serializers.ListField(child=serializers.DictField()),
                "stream": serializers.BooleanField(required=False),
                "max_tokens": serializers.IntegerField(required=False),
                "horde": serializers.DictField(required=False),
            },
        ),
        responses={
            200: OpenApiResponse(
                description="chat.completion, or text/event-stream of chat.completion.chunk"
            ),
            **_COMPLETION_ERRORS,
        },
        examples=[
            OpenApiExample(
                "hello",
                value={"model": "Gryphe/MythoMax-L2-13b", "messages": [{"role": "user", "content": "Hello"}]},
                request_only=True,
            )
        ],
    )
    async def post(self, request, *args: Any, **kwargs: Any):
        return await _completions_answer(app.chat_completions, request)


async def _completions_answer(serve: Any, request) -> HttpResponse | StreamingHttpResponse:
    """One completions request handed to `serve` (app.chat_completions or app.text_completions):
    the JSON answer, or the event stream."""
    django_request = request._request
    # The body as the front's ASGI layer read it (oai.asgi), which hands Django none; a Django
    # served without that layer has it itself.
    raw = django_request.scope.get("oai.body") if hasattr(django_request, "scope") else None
    if raw is None:
        raw = django_request.read()
    state = await get_front_state()
    headers = {key.lower(): value for key, value in request.headers.items()}

    answer = await serve(
        raw_body=raw,
        api_key=request.auth,
        headers=headers,
        source=client_source(django_request, state.settings.trusted_proxy_count),
        disconnected=getattr(django_request, "scope", {}).get("oai.disconnected"),
    )
    return _answer(answer)


def _answer(answer: app.JsonAnswer | app.StreamAnswer) -> HttpResponse | StreamingHttpResponse:
    """A JSON answer, or an event stream."""
    if isinstance(answer, app.StreamAnswer):
        response = StreamingHttpResponse(answer.events, content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
        return response
    return _response(answer)


class TextCompletionsView(FrontView):
    """POST /v1/completions (OpenAI's legacy completions, whole or streamed) over a native text request."""

    @extend_schema(
        operation_id="oai_completions",
        tags=["openai"],
        request=inline_serializer(
            "TextCompletionRequest",
            {
                "model": serializers.CharField(required=False),
                "models": serializers.ListField(child=serializers.CharField(), required=False),
                # The horde refuses a blank prompt (ADR 0114).
                "prompt": serializers.CharField(min_length=1),
                "max_tokens": serializers.IntegerField(required=False),
                "temperature": serializers.FloatField(required=False),
                "top_p": serializers.FloatField(required=False),
                "stop": serializers.ListField(child=serializers.CharField(), required=False),
                "stream": serializers.BooleanField(required=False),
                "horde": serializers.DictField(required=False),
            },
        ),
        responses={
            200: OpenApiResponse(
                description="text_completion, or text/event-stream of text_completion chunks"
            ),
            **_COMPLETION_ERRORS,
        },
        examples=[
            OpenApiExample(
                "once upon a time",
                value={
                    "model": "koboldcpp/LLaMA2-13B-Psyfighter2",
                    "prompt": "Once upon a time",
                    "max_tokens": 80,
                },
                request_only=True,
            )
        ],
    )
    async def post(self, request, *args: Any, **kwargs: Any):
        return await _completions_answer(app.text_completions, request)


class ResponsesView(FrontView):
    """POST /v1/responses (OpenAI's Responses API, whole or streamed) over a chat request."""

    @extend_schema(
        operation_id="oai_responses",
        tags=["openai"],
        request=inline_serializer(
            "ResponsesRequest",
            {
                "model": serializers.CharField(required=False),
                "models": serializers.ListField(child=serializers.CharField(), required=False),
                "input": serializers.JSONField(),
                "instructions": serializers.CharField(required=False),
                "max_output_tokens": serializers.IntegerField(required=False),
                "temperature": serializers.FloatField(required=False),
                "top_p": serializers.FloatField(required=False),
                "stream": serializers.BooleanField(required=False),
                "stream_options": serializers.DictField(required=False),
                "store": serializers.BooleanField(required=False),
                "background": serializers.BooleanField(required=False),
                "tools": serializers.ListField(child=serializers.DictField(), required=False),
                "tool_choice": serializers.JSONField(required=False),
                "parallel_tool_calls": serializers.BooleanField(required=False),
                "text": serializers.DictField(required=False),
                "reasoning": serializers.DictField(required=False),
                "truncation": serializers.ChoiceField(choices=["auto", "disabled"], required=False),
                "include": serializers.ListField(child=serializers.CharField(), required=False),
                "metadata": serializers.DictField(child=serializers.CharField(), required=False),
                "user": serializers.CharField(required=False),
                "horde": serializers.DictField(required=False),
            },
        ),
        responses={
            200: OpenApiResponse(description="response, or text/event-stream of the Responses API's events"),
            **_COMPLETION_ERRORS,
            503: OpenApiResponse(
                response=_ERROR,
                description="no_eligible_worker, queue_unavailable, HordeUnavailable, FrontAtCapacity, FrontStopping, or "
                "ResponseItemsUnavailable: the kept responses that previous_response_id or an item_reference names could "
                "not be read just now",
            ),
        },
        examples=[
            OpenApiExample(
                "hello",
                value={"model": "Gryphe/MythoMax-L2-13b", "input": "Hello", "store": False},
                request_only=True,
            )
        ],
    )
    async def post(self, request, *args: Any, **kwargs: Any):
        return await _completions_answer(app.responses, request)


_KEPT_RESPONSE_ERRORS = {
    401: OpenApiResponse(response=_ERROR, description="invalid_api_key: no key, where anonymous requests are not served"),
    404: OpenApiResponse(
        response=_ERROR, description="not_found: no response with this id is kept for this key (ADR 0103)"
    ),
    503: OpenApiResponse(
        response=_ERROR,
        description="ResponseItemsUnavailable: the kept responses could not be read just now; HordeUnavailable: the "
        "status of a background response's request could not be read (ADR 0102)",
    ),
}


class ResponseView(FrontView):
    """GET /v1/responses/{id}: a kept response as it was delivered, a background one as it is now
    (ADR 0102); DELETE /v1/responses/{id}: it and its output items forgotten
    (docs/adr/0103-kept-responses-read-and-deleted.md), a background one not finished cancelled first."""

    @extend_schema(
        operation_id="oai_response",
        tags=["openai"],
        parameters=[
            OpenApiParameter(
                "stream", bool, description="true: a background response's events, from the first (ADR 0106)"
            ),
            OpenApiParameter("starting_after", int, description="with stream: the events after this sequence number"),
        ],
        responses={
            200: OpenApiResponse(
                description="the response object, or text/event-stream of a background response's events"
            ),
            400: OpenApiResponse(
                response=_ERROR,
                description="BadRequest: stream or starting_after not valid, or stream=true for a response not "
                "created with background=true",
            ),
            **_KEPT_RESPONSE_ERRORS,
            503: OpenApiResponse(
                response=_ERROR,
                description=f"{_KEPT_RESPONSE_ERRORS[503].description}; FrontStopping: stream=true asked of a "
                "process that is stopping (ADR 0106)",
            ),
        },
    )
    async def get(self, request, response_id: str, *args: Any, **kwargs: Any):
        query = {key: request.query_params[key] for key in ("stream", "starting_after") if key in request.query_params}
        disconnected = getattr(request._request, "scope", {}).get("oai.disconnected")
        return _answer(await app.retrieve_response(response_id, request.auth, query, disconnected=disconnected))

    @extend_schema(
        operation_id="oai_response_delete",
        tags=["openai"],
        responses={200: OpenApiResponse(description='{"id", "object": "response", "deleted": true}'), **_KEPT_RESPONSE_ERRORS},
    )
    async def delete(self, request, response_id: str, *args: Any, **kwargs: Any):
        return _response(await app.delete_response(response_id, request.auth))


class ResponseInputItemsView(FrontView):
    """GET /v1/responses/{id}/input_items: a page of a kept response's own input items."""

    @extend_schema(
        operation_id="oai_response_input_items",
        tags=["openai"],
        parameters=[
            OpenApiParameter("limit", int, description="1-100, default 20"),
            OpenApiParameter("order", str, enum=["asc", "desc"], description="default desc"),
            OpenApiParameter("after", str, description="the id of the item the page starts after"),
            OpenApiParameter("before", str, description="the id of the item the page ends before"),
        ],
        responses={
            200: OpenApiResponse(description="list of input items"),
            400: OpenApiResponse(response=_ERROR, description="BadRequest: limit, order or after not valid"),
            **_KEPT_RESPONSE_ERRORS,
        },
    )
    async def get(self, request, response_id: str, *args: Any, **kwargs: Any):
        query = {key: request.query_params[key] for key in ("limit", "order", "after", "before") if key in request.query_params}
        return _response(await app.list_input_items(response_id, request.auth, query))


class ResponseCancelView(FrontView):
    """POST /v1/responses/{id}/cancel: a background response not finished is cancelled."""

    @extend_schema(
        operation_id="oai_response_cancel",
        tags=["openai"],
        request=None,
        responses={
            200: OpenApiResponse(description="response: cancelled, or as it finished"),
            400: OpenApiResponse(response=_ERROR, description="the response was not made with background=true"),
            **_KEPT_RESPONSE_ERRORS,
        },
    )
    async def post(self, request, response_id: str, *args: Any, **kwargs: Any):
        return _response(await app.cancel_response(response_id, request.auth))


# What app.list_models answers when it cannot read the horde's model list (ADR 0085).
MODEL_LIST_UNAVAILABLE = {
    502: OpenApiResponse(description="HordeUnavailable: the horde's model list could not be read"),
    503: OpenApiResponse(description="HordeUnavailable: the horde could not be reached"),
}


class ModelsView(FrontView):
    """GET /v1/models: each text model with at least one online chat worker, as a model card."""

    @extend_schema(
        operation_id="oai_models",
        tags=["openai"],
        responses={
            200: OpenApiResponse(description="list of model cards"),
            401: OpenApiResponse(description="invalid_api_key: a key was sent that the horde does not know"),
            **MODEL_LIST_UNAVAILABLE,
        },
    )
    async def get(self, request, *args: Any, **kwargs: Any):
        return _response(await app.list_models(request.auth))


class ModelView(FrontView):
    """GET /v1/models/{model}: one model card of the list (a model id may hold slashes)."""

    @extend_schema(
        operation_id="oai_model",
        tags=["openai"],
        responses={
            200: OpenApiResponse(description="the model card"),
            401: OpenApiResponse(description="invalid_api_key: a key was sent that the horde does not know"),
            404: OpenApiResponse(description="model_not_found: no online chat worker serves it"),
            **MODEL_LIST_UNAVAILABLE,
        },
    )
    async def get(self, request, model_id: str, *args: Any, **kwargs: Any):
        return _response(await app.retrieve_model(model_id, request.auth))


async def unknown_path(request, *args: Any, **kwargs: Any) -> JsonResponse:
    """Any other /v1/ path, whatever the method: 404 in OpenAI's error shape (OpenAI's own message)."""
    error = ChatFrontError(
        404,
        "unknown_url",
        f"Invalid URL ({request.method} {request.path}): the AI Horde serves /v1/chat/completions, "
        "/v1/completions, /v1/responses and /v1/models.",
        should_retry=False,
    )
    return JsonResponse(error.body(), status=404, headers=error.headers())
