"""The text model reference (upstream's JSON): which models are known and their parameter counts."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from time import monotonic

import httpx
from django.conf import settings

log = logging.getLogger(__name__)
_lock = threading.Lock()

# After a failed read the reference is empty (every model unknown) this long, then read again: a
# URL that failed once at start would otherwise price every model at 1B for the process's life.
REFERENCE_RETRY_SECONDS = 60.0

# The reference read, and when to read it again after a failure (None: it was read).
_read: tuple[dict[str, dict], float | None] | None = None


def _load(source: str) -> dict[str, dict] | None:
    """The reference at `source` (a path or an http(s) URL), None when it cannot be read."""
    try:
        if source.startswith(("http://", "https://")):
            response = httpx.get(source, timeout=10)
            response.raise_for_status()  # an error answer's body is not the reference
            data = response.json()
        else:
            data = json.loads(Path(source).read_text())
    except (OSError, ValueError, httpx.HTTPError):
        log.exception("text model reference unreadable at %s; every model counts as unknown for now", source)
        return None
    if not isinstance(data, dict):
        log.error("text model reference at %s is not a JSON object; every model counts as unknown for now", source)
        return None
    return data


def _reference() -> dict[str, dict]:
    global _read
    read = _read
    if read is not None and (read[1] is None or monotonic() < read[1]):
        return read[0]
    with _lock:
        current = _read
        if current is read or current is None:  # not read meanwhile by another thread
            data = _load(settings.HORDE_TEXT_MODEL_REFERENCE)
            current = _read = (data, None) if data is not None else ({}, monotonic() + REFERENCE_RETRY_SECONDS)
    return current[0]


def reload_reference() -> None:
    global _read
    with _lock:
        _read = None


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
