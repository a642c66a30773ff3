"""Worker registry routes: list, details (by id and by name), and the owner's changes and delete."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.callers import registered_caller, shared_key_of
from accounts.api.openapi_errors import OBJECT_LIST, refusals
from accounts.models import HordeUser
from contract.errors import HordeError
from workers.models import WORKER_MAINTENANCE_MESSAGE_MAX_LENGTH, Worker
from workers.selectors import (
    worker_details,
    worker_get,
    worker_get_cached,
    worker_get_cached_by_name,
    workers_online_details,
)
from workers.services import worker_delete, worker_update


def _first_query_value(request, key: str) -> str:
    values = request.query_params.getlist(key)
    return values[0] if values else ""


def _as_seen_by(request, details: dict) -> dict:
    """A worker's details as the caller may read them: its owner's alias only for that owner and
    for moderators, as upstream's details privilege (docs/adr/0126). A shared key is not its owner."""
    user = request.user
    itself = isinstance(user, HordeUser) and not user.is_anonymous and shared_key_of(request) is None
    if itself and (user.moderator or details["owner"].rpartition("#")[2] == str(user.pk)):
        return details
    return {key: value for key, value in details.items() if key != "owner"}


def _worker_or_404(worker_id, *, cached: bool = False) -> Worker:
    worker = worker_get_cached(worker_id) if cached else worker_get(worker_id)
    if worker is None:
        raise HordeError("WorkerNotFound", f"Worker with ID '{worker_id}' not found.")
    return worker


class WorkerListView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("type", str, description="Only workers of this type (image, text or interrogation)"),
            OpenApiParameter("name", str, description="Only the worker of this name (case insensitive)"),
        ],
        responses={200: OBJECT_LIST},
        operation_id="api_v2_workers_list",
    )
    def get(self, request):
        # Upstream's filters: a name first, whatever the type; an empty value filters nothing
        # (horde_sdk sends `?type=` for all workers). Its parser keeps a repeated parameter's first
        # value, where QueryDict.get keeps the last.
        name = _first_query_value(request, "name")
        if name:
            listed = workers_online_details(name=name)
        elif _first_query_value(request, "type") not in ("", "text"):
            listed = []
        else:
            listed = workers_online_details()
        return Response([_as_seen_by(request, details) for details in listed])


class WorkerByNameView(APIView):
    """GET /api/v2/workers/name/<name>: the same details as by id (spec: "Worker details")."""

    @extend_schema(
        responses={200: dict, **refusals(s404=["WorkerNotFound"])}, operation_id="api_v2_workers_name_retrieve"
    )
    def get(self, request, worker_name):
        worker = worker_get_cached_by_name(worker_name)
        if worker is None:
            # Upstream's words: its WorkerNotFound names an ID even for a name.
            raise HordeError("WorkerNotFound", f"Worker with ID '{worker_name}' not found.")
        return Response(_as_seen_by(request, worker_details(worker)))


class WorkerDetailView(APIView):
    class UpdateSerializer(serializers.Serializer):
        maintenance = serializers.BooleanField(required=False)
        maintenance_msg = serializers.CharField(
            required=False, allow_blank=True, max_length=WORKER_MAINTENANCE_MESSAGE_MAX_LENGTH
        )
        paused = serializers.BooleanField(required=False)
        # Length bounds are the service's, with upstream's rc (TooLongWorkerName). A name is
        # trimmed, as the pop trims the name it registers.
        info = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False)
        name = serializers.CharField(required=False, allow_blank=True)

    class WorkerModifiedSerializer(serializers.Serializer):
        maintenance = serializers.BooleanField(required=False)
        paused = serializers.BooleanField(required=False)
        info = serializers.CharField(required=False)
        name = serializers.CharField(required=False)

    class WorkerDeletedSerializer(serializers.Serializer):
        deleted_id = serializers.CharField()
        deleted_name = serializers.CharField()

    @extend_schema(responses={200: dict, **refusals(s404=["WorkerNotFound"])})
    def get(self, request, worker_id):
        return Response(_as_seen_by(request, worker_details(_worker_or_404(worker_id, cached=True))))

    @extend_schema(
        request=UpdateSerializer,
        responses={
            200: WorkerModifiedSerializer,
            **refusals(
                s400=["BadRequest", "NoWorkerModSelected", "TooLongWorkerName", "WorkerNameAlreadyExists"],
                s403=["AnonForbidden", "NotOwner", "NotModerator", "WrongCredentials"],
                s404=["WorkerNotFound"],
                s423=["Locked"],
            ),
        },
    )
    def put(self, request, worker_id):
        actor = registered_caller(request)
        body = self.UpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        changed = worker_update(worker_id=worker_id, actor=actor, **body.validated_data)
        return Response(self.WorkerModifiedSerializer(changed).data)

    @extend_schema(
        responses={
            200: WorkerDeletedSerializer,
            **refusals(s403=["AnonForbidden", "NotOwner", "NotModerator"], s404=["WorkerNotFound"], s423=["Locked"]),
        }
    )
    def delete(self, request, worker_id):
        deleted = worker_delete(worker_id=worker_id, actor=registered_caller(request))
        return Response(self.WorkerDeletedSerializer(deleted).data)
