"""POST /api/v2/generate/text/submit: a worker's result; the first submit wins."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.callers import registered_caller
from chat.api import serializers as s
from chat.submit import generation_submit


class TextSubmitView(APIView):
    """POST /api/v2/generate/text/submit: a worker's result; the first submit wins."""

    @extend_schema(request=s.TextSubmitInputSerializer, responses=s.SubmitOutputSerializer)
    def post(self, request):
        owner = registered_caller(request, rc="AnonForbiddenWorker")
        body = s.TextSubmitInputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        reward = generation_submit(
            user=owner,
            generation_id=data["id"],
            text=data["generation"],
            state=data["state"],
            seed=data["seed"],
            gen_metadata=[dict(m) for m in data["gen_metadata"]],
        )
        return Response({"reward": float(reward)})


