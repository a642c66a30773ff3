"""Chat jobs for submit tests, written the way the spec stores them.

A chat request row (is_chat, messages, chat_extras, chat_conformance, params, RequestModel rows,
jobs_waiting) and its popped generations (state processing, assigned_model and the assigned chat
limits), without going through creation or the pop, so the submit tests do not depend on them.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from django.db.models import F
from django.utils import timezone

from chat.models import Generation, GenerationRequest, RequestModel
from contract.text import TEXT_JOB_LEASE_SECONDS, TEXT_REQUEST_TTL_SECONDS
from workers.models import Worker

CHAT_MODEL = "Gryphe/MythoMax-L2-13b"
CHEAP_MODEL = "acrastt/Marx-3B-V3"
SUBMIT = "/api/v2/generate/text/submit"

DEFAULT_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]


def make_chat_worker(owner, *, name: str = "chat-worker", model: str = CHAT_MODEL, features=()) -> Worker:
    return Worker.objects.create(
        name=name,
        owner=owner,
        served_models=[model],
        max_length=512,
        max_context_length=4096,
        bridge_agent="horde-bridge:1:https://example.org",
        last_check_in=timezone.now(),
        accepts_chat_jobs=True,
        chat_features=sorted(features),
        chat_model_id=model,
        chat_max_context_length=8192,
        chat_max_length=2048,
    )


def make_chat_request(
    requester,
    *,
    models: tuple[str, ...] = (CHAT_MODEL,),
    extras: dict | None = None,
    conformance: str = "strict",
    n: int = 1,
    max_length: int = 512,
    messages: list | None = None,
    kudos_quote: Decimal = Decimal("20"),
) -> GenerationRequest:
    messages = messages if messages is not None else DEFAULT_MESSAGES
    now = timezone.now()
    request = GenerationRequest.objects.create(
        user=requester,
        is_chat=True,
        prompt="\n".join(f"{m['role']}: {m['content']}" for m in messages),
        params={"temperature": 1.0, "top_p": 1.0},
        n=n,
        jobs_waiting=n,
        max_length=max_length,
        max_context_length=4096,
        requested_models=list(models),
        any_model=False,
        messages=messages,
        chat_extras=extras,
        chat_conformance=conformance,
        kudos_quote=kudos_quote,
        expires_at=now + timedelta(seconds=TEXT_REQUEST_TTL_SECONDS),
    )
    RequestModel.objects.bulk_create([RequestModel(request=request, name=m) for m in models])
    return request


def pop_chat_job(request: GenerationRequest, worker: Worker, *, jobs: int = 1) -> list[Generation]:
    """Hand `jobs` of the request's waiting jobs to the worker, as a chat pop records them."""
    now = timezone.now()
    model = worker.chat_model_id
    generations = Generation.objects.bulk_create(
        [
            Generation(
                request=request,
                worker=worker,
                model=model,
                lease_expires_at=now + timedelta(seconds=TEXT_JOB_LEASE_SECONDS),
                assigned_model=model,
                assigned_max_context_length=worker.chat_max_context_length,
                assigned_max_length=worker.chat_max_length,
            )
            for _ in range(jobs)
        ]
    )
    GenerationRequest.objects.filter(pk=request.pk).update(jobs_waiting=F("jobs_waiting") - jobs)
    request.refresh_from_db()
    return generations


def reply(
    content: str | None = "Hi there.", *, model_id: str = CHAT_MODEL, finish_reason="stop", **extra
) -> dict:
    """A chat submit body (without id)."""
    message = {"role": "assistant", "content": content}
    for key in ("tool_calls", "reasoning_content"):
        if key in extra:
            message[key] = extra.pop(key)
    return {"message": message, "finish_reason": finish_reason, "model_id": model_id, **extra}


def call(name: str, arguments: str = "{}", call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def submit(api, key: str, generation_id, body: dict):
    return api.post(SUBMIT, {"id": str(generation_id), **body}, format="json", HTTP_APIKEY=key)
