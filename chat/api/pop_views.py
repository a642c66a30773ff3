"""POST /api/v2/generate/text/pop: a worker checks in and takes a job (text, and later chat)."""

from __future__ import annotations

from django.conf import settings
from django.db import IntegrityError
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.callers import registered_caller
from chat.api import serializers as s
from chat.api.fast_validation import validated_body
from chat.dispatch import build_job_payload, worker_pop
from chat.pop_wait import POP_WAIT_HEADER
from contract.chat_declaration import parse_chat_declaration
from contract.chat_errors import ChatDeclarationInvalid
from contract.errors import HordeError
from contract.text import TEXT_POP_WAIT_MAX_SECONDS
from workers.services import TextWorkerDeclaration, worker_check_in, worker_rows


class TextPopView(APIView):
    """POST /api/v2/generate/text/pop: check in, and take a job when one is eligible."""

    @extend_schema(request=s.TextPopInputSerializer, responses=s.TextPopOutputSerializer)
    def post(self, request):
        owner = registered_caller(request, rc="AnonForbiddenWorker")
        data = validated_body(s.TextPopInputSerializer, request.data)
        models = list(dict.fromkeys(data["models"]))
        try:
            chat = parse_chat_declaration(request.data, models=models)
        except ChatDeclarationInvalid as refusal:
            raise HordeError(refusal.rc, refusal.message, status=refusal.status) from refusal
        declaration = TextWorkerDeclaration(
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
        worker = worker_check_in(owner=owner, declaration=declaration)
        worker.owner = owner
        try:
            job = worker_pop(worker=worker, amount=data["amount"])
        except IntegrityError:
            # The process's copy of the worker row outlived the row (an operator deleted it): the
            # pop wrote nothing; check in afresh, which registers the worker again, and pop once more.
            worker_rows.forget(declaration.name)
            worker = worker_check_in(owner=owner, declaration=declaration)
            worker.owner = owner
            job = worker_pop(worker=worker, amount=data["amount"])
        if job.request is None:
            response = Response(
                {
                    "payload": {},
                    "id": None,
                    "ids": [],
                    "messages": None,
                    "ttl": None,
                    "extra_source_images": [],
                    "skipped": job.skipped,
                    "softprompt": None,
                    "model": None,
                }
            )
            if data["wait"]:
                # How long the serving layer may hold this empty answer for a job (ADR 0024).
                response[POP_WAIT_HEADER] = str(min(data["wait"], TEXT_POP_WAIT_MAX_SECONDS))
            return response
        wp = job.request
        ids = [str(g.id) for g in job.generations]
        body = {
            "payload": build_job_payload(wp),
            "id": ids[0],
            "ids": ids,
            "messages": None,
            "ttl": settings.HORDE_TEXT_JOB_LEASE_SECONDS,
            "extra_source_images": [],
            "skipped": {},
            "softprompt": None if wp.is_chat else wp.softprompt or None,
            "model": job.model,
        }
        # Only a chat job carries the key; text jobs are unchanged.
        if wp.is_chat:
            body["chat"] = True
        return Response(body)


