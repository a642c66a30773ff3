"""Helpers for the chat route tests: chat workers as rows (their declaration as a pop stores it),
and the chat submit, status and cancel calls."""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.utils import timezone

from contract.chat_policy import KNOWN_CHAT_DECLARATIONS
from workers.declarations import declaration_mask
from workers.models import Worker
from workers.serving_version import serving_changed

MODEL = "Gryphe/MythoMax-L2-13b"  # 13B in the reference
SMALL_MODEL = "koboldcpp/Marx-3B-V3"  # 3B
BIG_MODEL = "koboldcpp/Enterredaas-65b"  # 65B
CHAT_ASYNC = "/api/v2/generate/chat/async"
# Every feature and guarantee: a worker that can serve any request.
ALL_DECLARATIONS = sorted(KNOWN_CHAT_DECLARATIONS)


def chat_worker(
    owner,
    *,
    model: str = MODEL,
    max_context_length: int = 8192,
    max_length: int = 2048,
    features: list[str] | None = None,
    image_transports: list[str] | None = None,
    threads: int = 1,
    online: bool = True,
    tools_max_temperature: float | None = None,
) -> Worker:
    """A worker whose latest pop declared chat jobs with `model` (default: every declaration)."""
    features = ALL_DECLARATIONS if features is None else features
    now = timezone.now()
    worker = Worker.objects.create(
        name=f"chat-worker-{uuid.uuid4().hex[:8]}",
        owner=owner.user if hasattr(owner, "user") else owner,
        served_models=[model],
        max_length=512,
        max_context_length=4096,
        threads=threads,
        bridge_agent="KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp",
        last_check_in=now if online else now - timedelta(seconds=301),
        accepts_chat_jobs=True,
        chat_model_id=model,
        chat_max_context_length=max_context_length,
        chat_max_length=max_length,
        chat_features=sorted(features),
        chat_feature_mask=declaration_mask(features),
        image_transports=image_transports or [],
        chat_tools_max_temperature=tools_max_temperature,
    )
    serving_changed()  # as the pop that declared it: availability read before it sees it now
    return worker


def chat_body(**body) -> dict:
    if "models" not in body:
        body.setdefault("model", MODEL)
    body.setdefault("messages", [{"role": "user", "content": "Hello"}])
    return body


def chat_async(client, key: str | None, **body):
    headers = {"HTTP_APIKEY": key} if key else {}
    return client.post(CHAT_ASYNC, chat_body(**body), format="json", **headers)


def chat_status(client, request_id, key: str | None = None):
    headers = {"HTTP_APIKEY": key} if key else {}
    return client.get(f"/api/v2/generate/chat/status/{request_id}", **headers)


def chat_cancel(client, request_id, key: str | None = None):
    headers = {"HTTP_APIKEY": key} if key else {}
    return client.delete(f"/api/v2/generate/chat/status/{request_id}", **headers)
