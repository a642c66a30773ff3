"""Native text routes: thin views that validate, call a service or selector, and render.

The status routes answer the body the status selector builds (and caches) as it is: it is the
wire body already."""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.callers import registered_caller, requester, shared_key_of
from accounts.api.openapi_errors import OBJECT_LIST, refusals
from accounts.api.query_params import whole_number_parameter, whole_number_query
from accounts.ratelimit import check_submit_rate_limits
from chat import selectors, services
from chat.api import serializers as s
from chat.api.fast_validation import validated_body
from chat.api.openapi import undelivered_cancel_headers
from chat.services import front_lease
from contract.errors import HordeError


def _not_found(request_id) -> HordeError:
    return HordeError("RequestNotFound", f"Request with ID '{request_id}' not found.")


class TextAsyncView(APIView):
    """POST /api/v2/generate/text/async: queue a text request (202), or quote it (dry run, 200)."""

    @extend_schema(
        request=s.TextAsyncInputSerializer,
        responses={
            202: s.TextAsyncOutputSerializer,
            200: s.TextAsyncOutputSerializer,
            **refusals(
                s400=["BadRequest", "MissingPrompt", "TokenOverflow", "MissingFullSamplerOrder", "TooManyStopSequences",
                      "ExcessiveStopSequence", "OperationKeyConflict", "NoValidWorkers"],
                s403=["KudosUpfront", "AnonForbidden", "SharedKeyEmpty", "SharedKeyExpired",
                      "SharedKeyInsufficientKudos"],
                s429=["RateLimited", "TooManyPrompts"],
                s503=["MaintenanceMode", "DatabaseUnavailable"],
            ),
        },
    )
    def post(self, request):
        address = check_submit_rate_limits(
            request, scope="text_async", limits_per_ip=settings.HORDE_TEXT_ASYNC_RATE_LIMITS
        )
        body = validated_body(s.TextAsyncInputSerializer, request.data)
        created = services.text_request_create(
            user=requester(request),
            data=services.TextRequestInput(**body),
            client_agent=request.headers.get("Client-Agent", ""),
            ip_address=address,
            front_lease_seconds=front_lease.front_lease_seconds(request.headers),
            front_id=front_lease.front_lease_front_id(request.headers),
            shared_key=shared_key_of(request),
        )
        # Queued: 202; a dry run's quote, or a repeated operation key's claim (nothing queued): 200.
        queued = created.request is not None and not created.repeated
        return Response(s.TEXT_ASYNC_OUTPUT.to_representation(created), status=202 if queued else 200)


class TextStatusView(APIView):
    """GET (status) and DELETE (cancel) /api/v2/generate/text/status/<id>: the id is the credential,
    as upstream (KoboldAI Lite polls and cancels without a key), so no key is read or checked."""

    authentication_classes: list = []

    @extend_schema(responses={200: s.TextStatusOutputSerializer, **refusals(s404=["RequestNotFound"])})
    def get(self, request, request_id):
        front_lease.front_lease_renew(
            request_id=request_id, header=request.META.get(front_lease.FRONT_LEASE_META_KEY)
        )
        body = selectors.text_status_body(request_id)
        if body is None:
            raise _not_found(request_id)
        return Response(body)

    # The cancelled request's status, 200 as upstream's (not drf-spectacular's 204 for a DELETE).
    @extend_schema(
        parameters=undelivered_cancel_headers(),
        responses={200: s.TextStatusOutputSerializer, **refusals(s404=["RequestNotFound"])},
    )
    def delete(self, request, request_id):
        wp = selectors.request_get(request_id)
        if wp is None:
            raise _not_found(request_id)
        # A stopping front's cancel of a request it cannot deliver ends it unpaid (docs/adr/0086).
        front_id = front_lease.stopping_front(request.META)
        if front_id is None or not front_lease.cancel_undelivered(request_id=wp.pk, front_id=front_id):
            services.request_cancel(request=wp)
        wp = selectors.request_get(request_id)  # re-read: the cancel changed it
        if wp is None:  # expired meanwhile
            raise _not_found(request_id)
        return Response(selectors.request_status(wp))


# A list of model entries (an empty one while no online worker serves the model).
MODEL_ENTRIES = OBJECT_LIST


class HeartbeatView(APIView):
    authentication_classes: list = []

    @extend_schema(responses={200: dict})
    def get(self, request):
        return Response({"message": "OK", "version": "2.0.0"})


MODEL_STATES = ("known", "custom", "all")


class ModelsStatusView(APIView):
    """GET /api/v2/status/models[?type=text][&chat=true][&model_state=][&min_count=][&max_count=]: the
    text models the online workers serve; with chat=true only those an online chat worker serves,
    each with its chat object; upstream's filters as horde_sdk sends them (model_state=all at least)."""

    @extend_schema(
        parameters=[
            OpenApiParameter("type", str, enum=["image", "text"]),
            OpenApiParameter("chat", bool, description="Only chat-served text models, with their chat object"),
            OpenApiParameter(
                "model_state", str, enum=list(MODEL_STATES), description="In the text model reference, out of it, or either"
            ),
            whole_number_parameter("min_count", description="Only models served by at least this many threads"),
            whole_number_parameter("max_count", description="Only models served by at most this many threads"),
        ],
        responses={200: MODEL_ENTRIES, **refusals(s400=["BadRequest"])},
    )
    def get(self, request):
        kind = request.query_params.get("type", "image")
        if kind not in ("image", "text"):
            raise HordeError("BadRequest", "type must be 'image' or 'text'.")
        chat = request.query_params.get("chat", "false").lower()
        if chat not in ("true", "false"):
            raise HordeError("BadRequest", "chat must be true or false.")
        if chat == "true" and kind != "text":
            raise HordeError("BadRequest", "chat=true lists text models only: use it with type=text.")
        model_state = request.query_params.get("model_state", "all")
        if model_state not in MODEL_STATES:
            raise HordeError("BadRequest", "'model_state' needs to be one of ['known', 'custom', 'all']")
        return Response(
            selectors.models_status(
                kind=kind,
                chat=chat == "true",
                model_state=model_state,
                min_count=whole_number_query(request, "min_count"),
                max_count=whole_number_query(request, "max_count"),
            )
        )


class ModelStatusView(APIView):
    """GET /api/v2/status/models/{model_name}: the one text model's entry of the list, as a list (empty
    while no online worker serves it), as upstream's answers."""

    @extend_schema(operation_id="api_v2_status_model_single_retrieve", responses={200: MODEL_ENTRIES})
    def get(self, request, model_name):
        return Response([entry for entry in selectors.models_status(kind="text", chat=False) if entry["name"] == model_name])


class TextStatsTotalsView(APIView):
    """GET /api/v2/stats/text/totals: the finished text generations and their tokens (the requests'
    max_length, as upstream counts them) of the past minute, hour, day, 30 days and all time (ADR 0100)."""

    authentication_classes: list = []

    @extend_schema(responses={200: s.StatsTxtTotalsSerializer})
    def get(self, request):
        return Response(selectors.text_stats_totals())


class TextStatsModelsView(APIView):
    """GET /api/v2/stats/text/models[?model_state=]: the finished text generations per model of the
    past day, 30 days and all time (ADR 0100)."""

    authentication_classes: list = []

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "model_state", str, enum=list(MODEL_STATES), description="In the text model reference, out of it, or either"
            ),
        ],
        responses={200: s.TxtModelStatsSerializer, **refusals(s400=["BadRequest"])},
    )
    def get(self, request):
        model_state = request.query_params.get("model_state", "all")
        if model_state not in MODEL_STATES:
            raise HordeError("BadRequest", "'model_state' needs to be one of ['known', 'custom', 'all']")
        return Response(selectors.text_stats_models(model_state=model_state))


class PerformanceView(APIView):
    @extend_schema(responses={200: dict})
    def get(self, request):
        return Response(selectors.horde_performance())


class ModesView(APIView):
    """GET /api/v2/status/modes: the horde's modes, as upstream's; PUT: a moderator switches
    maintenance mode (upstream's key `maintenance_mode`, or `maintenance`)."""

    @extend_schema(
        responses={
            200: inline_serializer(
                "HordeModes",
                {"maintenance_mode": serializers.BooleanField(), "invite_only_mode": serializers.BooleanField()},
            )
        },
    )
    def get(self, request):
        return Response(selectors.horde_modes())

    @extend_schema(
        # As the route reads it: a body without a boolean switch is refused (ADR 0114). The
        # horde's first key, `maintenance`, is still read and left out of the schema.
        request=inline_serializer("HordeModesInput", {"maintenance_mode": serializers.BooleanField()}),
        responses={
            200: inline_serializer("HordeModesOutput", {"maintenance_mode": serializers.BooleanField()}),
            **refusals(s400=["BadRequest"], s403=["NotModerator", "AnonForbidden"]),
        },
    )
    def put(self, request):
        body = request.data if isinstance(request.data, dict) else {}
        given = [body[key] for key in ("maintenance_mode", "maintenance") if key in body]
        maintenance = given[0] if given else None
        if not isinstance(maintenance, bool) or any(value is not maintenance for value in given):
            raise HordeError("BadRequest", "maintenance_mode must be true or false.")
        services.horde_modes_set(actor=registered_caller(request, rc="NotModerator"), maintenance=maintenance)
        return Response({"maintenance_mode": maintenance})
