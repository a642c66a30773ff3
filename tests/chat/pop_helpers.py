"""Queue chat requests directly, as the chat submission route stores them (spec: "Schema"), so the
pop and availability tests do not depend on that route. Requirements come from the contract's one
derivation, as the route derives them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from chat.models import GenerationRequest, RequestModel, RequestWorker
from chat.services.admission import queue_score
from contract.chat_policy import chat_request_requirements
from contract.text import TEXT_REQUEST_TTL_SECONDS
from workers.declarations import declaration_mask

MODEL = "Gryphe/MythoMax-L2-13b"
OTHER = "koboldcpp/Pernicious_Prophecy_70B"
ALL_GUARANTEES = ["prompt_overflow_refused", "tool_choice_enforced", "structured_output_enforced"]
PARAM_KEYS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "reasoning_effort")
EXTRAS_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")


def queue_chat(
    user,
    body: dict[str, Any] | None = None,
    *,
    models: list[str] | None = None,
    max_length: int = 512,
    max_context_length: int = 2048,
    only: list | None = None,
    ignore: list | None = None,
    trusted_workers: bool = False,
    validated_backends: bool = False,
    slow_workers: bool = True,
    priority: int = 0,
) -> GenerationRequest:
    """One queued chat request; `body` is the OpenAI-shaped body (messages, tools, sampling, horde)."""
    body = {"messages": [{"role": "user", "content": "Hello"}], **(body or {})}
    models = models or [MODEL]
    requirements = chat_request_requirements(body)
    params = {key: body[key] for key in PARAM_KEYS if body.get(key) is not None}
    if body.get("stop") is not None:
        params["stop_sequence"] = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
    extras = {key: body[key] for key in EXTRAS_KEYS if key in body}
    if body.get("stream"):
        extras["stream_progress"] = True
    now = timezone.now()
    workers = only or ignore or []
    request = GenerationRequest.objects.create(
        user=user,
        is_chat=True,
        prompt="user: flattened",
        params=params,
        n=1,
        jobs_waiting=1,
        max_length=max_length,
        max_context_length=max_context_length,
        requested_models=models,
        any_model=False,
        has_worker_list=bool(workers),
        worker_blacklist=bool(ignore),
        trusted_workers=trusted_workers,
        validated_backends=validated_backends,
        slow_workers=slow_workers,
        priority=priority,
        queue_score=queue_score(priority, now.timestamp()),
        expires_at=now + timedelta(seconds=TEXT_REQUEST_TTL_SECONDS),
        messages=body["messages"],
        chat_extras=extras or None,
        chat_required_features=requirements.declarations,
        chat_required_mask=declaration_mask(requirements.declarations),
        chat_conformance=str(requirements.conformance),
        chat_tools_temperature=requirements.tools_temperature,
        chat_has_images=requirements.has_images,
    )
    RequestModel.objects.bulk_create([RequestModel(request=request, name=m) for m in models])
    RequestWorker.objects.bulk_create([RequestWorker(request=request, worker_id=w) for w in workers])
    return request


def chat_pop(
    horde,
    key: str,
    *,
    name: str = "chat-worker",
    model_id: str = MODEL,
    features: list[str] | None = None,
    limits: dict | None = None,
    transports: list[str] | None = None,
    **body,
):
    """A pop declaring chat jobs; features default to the guarantees a plain strict request needs."""
    body.setdefault("models", [model_id])
    return horde.pop(
        key,
        name=name,
        chat_jobs=True,
        chat_features=ALL_GUARANTEES if features is None else features,
        chat_limits=limits or {"max_context_length": 8192, "max_length": 1024},
        model_id=model_id,
        image_transports=transports or [],
        **body,
    )
