"""The text model reference (upstream's JSON): which models are known and their parameter counts."""

from __future__ import annotations

import json
import logging
import threading
from functools import lru_cache
from pathlib import Path

import httpx
from django.conf import settings

log = logging.getLogger(__name__)
_lock = threading.Lock()


@lru_cache(maxsize=1)
def _reference() -> dict[str, dict]:
    source = settings.HORDE_TEXT_MODEL_REFERENCE
    with _lock:
        try:
            if source.startswith(("http://", "https://")):
                data = httpx.get(source, timeout=10).json()
            else:
                data = json.loads(Path(source).read_text())
        except (OSError, ValueError, httpx.HTTPError):
            log.exception("text model reference unreadable at %s; every model counts as unknown", source)
            return {}
    return data if isinstance(data, dict) else {}


def reload_reference() -> None:
    _reference.cache_clear()


def is_known_text_model(model_name: str) -> bool:
    return model_name in _reference()


def dearest_known_text_model() -> str | None:
    """The reference's model of the most parameters (None with an empty reference): the dearest
    model a request that lists none can be served and charged at (docs/adr/0089)."""
    reference = _reference()
    return max(reference, key=text_model_multiplier, default=None)


def text_model_multiplier(model_name: str) -> float:
    """Billions of parameters, the upstream multiplier; 1 for an unknown model."""
    entry = _reference().get(model_name)
    if not entry:
        return 1.0
    try:
        return int(entry["parameters"]) / 1_000_000_000
    except (KeyError, TypeError, ValueError):
        return 1.0
