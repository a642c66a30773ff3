"""POST /api/v2/generate/text/pop: a worker checks in and takes a job (text, and later chat)."""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.callers import registered_caller
from accounts.api.openapi_errors import refusals
from chat.api import serializers as s
from chat.api.fast_validation import validated_body
from chat.services.pop import worker_check_in_and_pop
from chat.services.pop_wait import POP_LISTS_HEADER, POP_RECHECK_HEADER, POP_REPEATED_ENVIRON, POP_WAIT_HEADER
from contract.text import TEXT_POP_WAIT_MAX_SECONDS


class TextPopView(APIView):
    """POST /api/v2/generate/text/pop: check in, and take a job when one is eligible."""

    @extend_schema(
        request=s.TextPopInputSerializer,
        responses={
            200: s.TextPopOutputSerializer,
            **refusals(
                s400=["BadRequest (no model, another's branded model)", "InvalidPriorityUsername", "ChatDeclarationInvalid",
                      "TooLongWorkerName", "ProfaneWorkerName"],
                s403=["AnonForbiddenWorker", "WrongCredentials (another's worker name)",
                      "WorkerMaintenance (in maintenance, nothing of its owner's waiting)",
                      "TooManyWorkers (an untrusted owner's fifth worker)", "TooManyWorkersTrusted (past 21)"],
                s503=["ChatImageStorageUnavailable", "DatabaseUnavailable"],
            ),
        },
    )
    def post(self, request):
        owner = registered_caller(request, rc="AnonForbiddenWorker")
        data = dict(validated_body(s.TextPopInputSerializer, request.data))
        wait = data.pop("wait")
        job = worker_check_in_and_pop(
            owner=owner,
            repeated=bool(request.META.get(POP_REPEATED_ENVIRON)),
            image_url_base=lambda: request.build_absolute_uri("/"),
            **data,
        )
        response = Response(s.POP_OUTPUT.to_representation(job))
        if job.request is None and wait:
            # How long the serving layer may hold this empty answer for a job (ADR 0024), and the
            # queue lists whose growth wakes it (ADR 0051).
            response[POP_WAIT_HEADER] = str(min(wait, TEXT_POP_WAIT_MAX_SECONDS))
            response[POP_LISTS_HEADER] = ",".join(job.wake_on)
            # A remembered answer changes only with its lists, whose growth the signal announces:
            # it is looked at again when it ages out, not every HORDE_POP_WAIT_RECHECK_SECONDS.
            recheck = max(settings.HORDE_POP_WAIT_RECHECK_SECONDS, job.remembered_for)
            response[POP_RECHECK_HEADER] = f"{recheck:.3f}"
        return response
