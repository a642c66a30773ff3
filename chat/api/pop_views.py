"""POST /api/v2/generate/text/pop: a worker checks in and takes a job (text, and later chat)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import IntegrityError
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.callers import registered_caller
from accounts.models import HordeUser
from chat.api import serializers as s
from chat.api.fast_validation import validated_body
from chat.services.pop import PoppedJob, worker_pop
from chat.services.pop_wait import POP_WAIT_HEADER
from contract.chat_declaration import parse_chat_declaration
from contract.chat_errors import ChatDeclarationInvalid
from contract.errors import HordeError
from contract.text import TEXT_POP_WAIT_MAX_SECONDS
from workers.services import TextWorkerDeclaration, worker_check_in, worker_rows


def pop_declaration(data: Mapping[str, Any], body: Any) -> TextWorkerDeclaration:
    """The worker's declaration from the validated pop body; the chat fields are read from the
    body by the contract, whose refusal is the spec's."""
    models = list(dict.fromkeys(data["models"]))
    try:
        chat = parse_chat_declaration(body, models=models)
    except ChatDeclarationInvalid as refusal:
        raise HordeError(refusal.rc, refusal.message, status=refusal.status) from refusal
    return TextWorkerDeclaration(
        name=data["name"].strip(),
        models=models,
        max_length=data["max_length"],
        max_context_length=data["max_context_length"],
        threads=data["threads"],
        bridge_agent=data["bridge_agent"],
        nsfw=data["nsfw"],
        softprompts=data["softprompts"],
        priority_usernames=data["priority_usernames"],
        chat=chat,
    )


def check_in_and_pop(*, owner: HordeUser, declaration: TextWorkerDeclaration, amount: int) -> PoppedJob:
    """Check the worker in, then hand it a job when one is eligible."""
    worker = worker_check_in(owner=owner, declaration=declaration)
    worker.owner = owner
    try:
        return worker_pop(worker=worker, amount=amount)
    except IntegrityError:
        # The process's copy of the worker row outlived the row (an operator deleted it): the
        # pop wrote nothing; check in afresh, which registers the worker again, and pop once more.
        worker_rows.forget(declaration.name)
        worker = worker_check_in(owner=owner, declaration=declaration)
        worker.owner = owner
        return worker_pop(worker=worker, amount=amount)


class TextPopView(APIView):
    """POST /api/v2/generate/text/pop: check in, and take a job when one is eligible."""

    @extend_schema(request=s.TextPopInputSerializer, responses=s.TextPopOutputSerializer)
    def post(self, request):
        owner = registered_caller(request, rc="AnonForbiddenWorker")
        data = validated_body(s.TextPopInputSerializer, request.data)
        job = check_in_and_pop(owner=owner, declaration=pop_declaration(data, request.data), amount=data["amount"])
        response = Response(s.POP_OUTPUT.to_representation(job))
        if job.request is None and data["wait"]:
            # How long the serving layer may hold this empty answer for a job (ADR 0024).
            response[POP_WAIT_HEADER] = str(min(data["wait"], TEXT_POP_WAIT_MAX_SECONDS))
        return response
