"""Worker registry routes: list, details (by id and by name), and the owner's maintenance switch."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.callers import registered_caller
from contract.errors import HordeError
from workers.models import Worker
from workers.selectors import (
    online_cutoff,
    worker_chat_declaration,
    worker_get_cached,
    worker_get_cached_by_name,
    worker_speed,
    workers_online,
)
from workers.services import worker_update


def worker_details(worker: Worker) -> dict:
    details = {
        "type": "text",
        "name": worker.name,
        "id": str(worker.id),
        "online": worker.last_check_in >= online_cutoff(),
        "models": worker.served_models,
        "max_length": worker.max_length,
        "max_context_length": worker.max_context_length,
        "threads": worker.threads,
        "bridge_agent": worker.bridge_agent,
        "nsfw": worker.nsfw,
        "maintenance_mode": worker.maintenance,
        "paused": worker.paused,
        "trusted": worker.owner.trusted,
        "owner": worker.owner.unique_alias,
        "performance": f"{worker_speed(worker):.1f} tokens per second",
        "kudos_rewards": float(worker.kudos_earned),
        "requests_fulfilled": worker.fulfilments,
        "uncompleted_jobs": worker.aborted_jobs,
        "uptime": int((worker.last_check_in - worker.created).total_seconds()),
        "nonconformant_replies": worker.nonconformant_replies,
        # The declaration of the latest pop; `chat` is absent for a worker that takes no chat jobs.
        "accepts_chat_jobs": worker.accepts_chat_jobs,
        "accepts_prompt_jobs": worker.accepts_prompt_jobs,
    }
    chat = worker_chat_declaration(worker).details()
    if chat is not None:
        details["chat"] = chat
    return details


def _worker_or_404(worker_id, *, cached: bool = False) -> Worker:
    if cached:
        worker = worker_get_cached(worker_id)
    else:
        worker = Worker.objects.select_related("owner").filter(pk=worker_id).first()
    if worker is None:
        raise HordeError("WorkerNotFound", f"Worker with ID '{worker_id}' not found.")
    return worker


class WorkerListView(APIView):
    @extend_schema(responses={200: dict}, operation_id="api_v2_workers_list")
    def get(self, request):
        if request.query_params.get("type", "text") != "text":
            return Response([])
        return Response([worker_details(w) for w in workers_online().order_by("name")])


class WorkerByNameView(APIView):
    """GET /api/v2/workers/name/<name>: the same details as by id (spec: "Worker details")."""

    @extend_schema(responses={200: dict}, operation_id="api_v2_workers_name_retrieve")
    def get(self, request, worker_name):
        worker = worker_get_cached_by_name(worker_name)
        if worker is None:
            raise HordeError("WorkerNotFound", f"Worker with name '{worker_name}' not found.")
        return Response(worker_details(worker))


class WorkerDetailView(APIView):
    class UpdateSerializer(serializers.Serializer):
        maintenance = serializers.BooleanField(required=False)
        paused = serializers.BooleanField(required=False)

    @extend_schema(responses={200: dict})
    def get(self, request, worker_id):
        return Response(worker_details(_worker_or_404(worker_id, cached=True)))

    @extend_schema(request=UpdateSerializer, responses={200: dict})
    def put(self, request, worker_id):
        actor = registered_caller(request)
        body = self.UpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        worker = worker_update(worker=_worker_or_404(worker_id), actor=actor, **body.validated_data)
        return Response({"maintenance": worker.maintenance, "paused": worker.paused})
