"""POST /api/v2/generate/text/progress: a streaming worker's text so far (spec: "Streaming progress").

Called about once a second by every streaming worker, so it reads nothing from PostgreSQL on the
way: it authenticates from the job's lease in Redis (no DRF authentication class, which would read
the user), and one Lua script checks and appends the post.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.openapi_errors import refusals
from chat.services.progress import job_progress
from contract.chat_progress import (
    PROGRESS_MESSAGES,
    ProgressBodyInvalid,
    ProgressDeltaEmpty,
    parse_progress_post,
)
from contract.errors import HordeError


class ProgressDeltaSerializer(serializers.Serializer):
    content = serializers.CharField(required=False, allow_blank=True)
    reasoning_content = serializers.CharField(required=False, allow_blank=True)


class ProgressInputSerializer(serializers.Serializer):
    """The documented shape; contract.chat_progress.parse_progress_post validates it."""

    id = serializers.UUIDField()
    seq = serializers.IntegerField(min_value=1)
    delta = ProgressDeltaSerializer()


class TextProgressView(APIView):
    """POST /api/v2/generate/text/progress."""

    # Authenticated from the lease, never from the users table.
    authentication_classes = ()
    permission_classes = ()

    @extend_schema(
        request=ProgressInputSerializer,
        responses={
            200: inline_serializer(
                "ProgressAccepted", {"accepted_seq": serializers.IntegerField(), "cancelled": serializers.BooleanField()}
            ),
            **refusals(
                s400=["BadRequest"],
                s403=["WrongCredentials"],
                s404=["ChatJobAborted", "ChatProgressNotStreaming"],
                s409=["ChatProgressOutOfSequence"],
                s413=["ChatProgressCapReached", "RequestTooLarge"],
                s503=["ChatProgressUnavailable", "DatabaseUnavailable"],
            ),
        },
    )
    def post(self, request):
        try:
            post = parse_progress_post(request.data)
        except ProgressBodyInvalid as invalid:
            raise ValidationError(invalid.errors) from None
        except ProgressDeltaEmpty:
            raise HordeError("BadRequest", PROGRESS_MESSAGES["BadRequest"], status=400) from None
        # META, not request.headers: the latter builds a mapping of every header on each request.
        return Response(job_progress(api_key=request.META.get("HTTP_APIKEY") or "", post=post))
