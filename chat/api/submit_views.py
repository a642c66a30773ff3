"""POST /api/v2/generate/text/submit: a worker's result; the first submit wins."""

from __future__ import annotations

from collections.abc import Mapping

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.callers import registered_caller
from accounts.api.openapi_errors import refusals
from chat.api import serializers as s
from chat.api import submit_serializers as cs
from chat.api.fast_validation import canonical_validated_data, validated_body
from chat.services.submit import TextSubmit, job_submit
from contract.chat_verify import is_chat_submit


def _text_fields(data: dict) -> TextSubmit:
    return TextSubmit(
        text=data["generation"],
        state=data["state"],
        seed=data["seed"],
        gen_metadata=[dict(m) for m in data["gen_metadata"]],
    )


class TextSubmitView(APIView):
    """POST /api/v2/generate/text/submit: a worker's result; the first submit wins.

    A body carrying message, model_id, finish_reason or fault_reason is a chat submit; any other
    is a text submit, validated as before.
    """

    @extend_schema(
        request=cs.JobSubmitInputSerializer,
        responses={
            200: s.SubmitOutputSerializer,
            **refusals(
                s400=["BadRequest", "AbortedGen", "DuplicateGen", "ChatSubmitInvalid", "ChatSubmitNonconformant",
                      "ChatModelMismatch"],
                s403=["AnonForbiddenWorker", "WrongCredentials"],
                s404=["InvalidJobID"],
            ),
        },
    )
    def post(self, request):
        owner = registered_caller(request, rc="AnonForbiddenWorker")
        body = request.data
        if isinstance(body, Mapping) and is_chat_submit(body):
            ident = validated_body(cs.SubmitIdSerializer, body)
            # The text fields matter only if the job turns out to be a text job.
            text_data = canonical_validated_data(s.TextSubmitInputSerializer, body)
            if text_data is None:
                text_form = s.TextSubmitInputSerializer(data=body)
                text_data = text_form.validated_data if text_form.is_valid() else None
            text = _text_fields(text_data) if text_data is not None else None
            reward = job_submit(user=owner, generation_id=ident["id"], text=text, chat_body=body)
        else:
            data = validated_body(s.TextSubmitInputSerializer, body)
            reward = job_submit(user=owner, generation_id=data["id"], text=_text_fields(data), chat_body=None)
        return Response(s.SUBMIT_OUTPUT.to_representation({"reward": reward}))
