"""Streaming progress: the wire of POST /api/v2/generate/text/progress, its caps and the job lease
rules a streaming worker and the horde share (spec: chat_requests.md, "Streaming progress" and
"Job lease"). Pure Python: the horde's route and the reference worker read the same names.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from contract.text import replace_nul

# The stream hint, in a request's chat_extras and in its job payload.
CHAT_STREAM_PROGRESS_KEY = "stream_progress"

PROGRESS_ROUTE = "/api/v2/generate/text/progress"

# --- Job lease --------------------------------------------------------------------------------
# An appended post extends the job lease to end this long after the post (the base lease).
CHAT_PROGRESS_RENEWAL_SECONDS = 150
# The lease measured from the pop never exceeds the cap of the worker owner's trust at pop.
TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS = 600
UNTRUSTED_TEXT_JOB_LEASE_CAP_SECONDS = 200
# The capacity rule: speed * (TEXT_JOB_LEASE_SECONDS - TEXT_JOB_PREPARATION_SECONDS) >= max_length.
TEXT_JOB_PREPARATION_SECONDS = 30

# --- Stream lease and stream ------------------------------------------------------------------
# The lease outlives the job's TTL by this much, covering the stale-generation sweep's 60 s tick.
CHAT_PROGRESS_LEASE_GRACE_SECONDS = 90
# One post per second covers past the front's 600 second stream budget.
MAX_CHAT_PROGRESS_ENTRIES = 1000
# A token decodes to a few characters of at most four UTF-8 bytes.
CHAT_PROGRESS_BYTES_PER_TOKEN = 16
# The front's stream budget plus 300 seconds for a stalled reader; reset on each append.
CHAT_PROGRESS_STREAM_TTL_SECONDS = 900
# Approximate trim: room for every attempt a request gets before its faults fault it.
CHAT_PROGRESS_STREAM_MAX_ENTRIES = 4000

CHAT_PROGRESS_LEASE_PREFIX = "horde:chat:lease:"
CHAT_PROGRESS_STREAM_PREFIX = "horde:chat:stream:"

# --- Return codes -----------------------------------------------------------------------------
PROGRESS_RC_STATUS: dict[str, int] = {
    "BadRequest": 400,
    "ChatJobAborted": 404,
    "ChatProgressNotStreaming": 404,
    "WrongCredentials": 403,
    "ChatProgressOutOfSequence": 409,
    "ChatProgressCapReached": 413,
    "ChatProgressUnavailable": 503,
}
PROGRESS_MESSAGES: dict[str, str] = {
    "BadRequest": "A progress delta needs content or reasoning_content.",
    "ChatJobAborted": "The job was aborted (its lease lapsed, its request was cancelled or expired). "
    "Stop generating and do not submit.",
    "ChatProgressNotStreaming": "The job does not stream progress (not streamed, already submitted or "
    "past its lease). Stop posting; still submit the reply.",
    "WrongCredentials": "Wrong credentials to post progress for this job.",
    "ChatProgressOutOfSequence": "The post's seq is not the next one, or repeats the last one with "
    "other content.",
    "ChatProgressCapReached": "The job reached its progress entry or byte cap. Stop posting; still "
    "submit the reply.",
    "ChatProgressUnavailable": "Progress cannot be recorded right now. Keep generating and submit the reply.",
}


def chat_stream_lease_key(generation_id: uuid.UUID | str) -> str:
    return f"{CHAT_PROGRESS_LEASE_PREFIX}{generation_id}"


def chat_progress_stream_key(request_id: uuid.UUID | str) -> str:
    return f"{CHAT_PROGRESS_STREAM_PREFIX}{request_id}"


def text_job_lease_cap(owner_trusted: bool) -> int:
    return TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS if owner_trusted else UNTRUSTED_TEXT_JOB_LEASE_CAP_SECONDS


def chat_progress_max_bytes(max_length: int) -> int:
    return CHAT_PROGRESS_BYTES_PER_TOKEN * max_length


def streams_progress(chat_extras: Any) -> bool:
    """Whether a request (its chat_extras) or a job (its payload) carries the stream hint."""
    return isinstance(chat_extras, dict) and chat_extras.get(CHAT_STREAM_PROGRESS_KEY) is True


# --- The post's body --------------------------------------------------------------------------


@dataclass(frozen=True)
class ProgressPost:
    id: uuid.UUID
    seq: int
    content: str
    reasoning_content: str | None


class ProgressBodyInvalid(Exception):
    """A schema failure: `errors` maps each path to its message."""

    def __init__(self, errors: dict[str, str]):
        super().__init__(errors)
        self.errors = errors


class ProgressDeltaEmpty(Exception):
    """Neither content nor reasoning_content: 400 BadRequest."""


# seq is bounded well above MAX_CHAT_PROGRESS_ENTRIES so a value Redis reads as an integer never overflows.
MAX_PROGRESS_SEQ = 2**31 - 1


def _text(value: Any, path: str, errors: dict[str, str]) -> str | None:
    if value is None:
        return None
    if type(value) is not str:
        errors[path] = "Not a valid string."
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        errors[path] = "Surrogate characters are not allowed."
        return None
    # NUL replaced as in the stored reply (contract.text.NUL_REPLACEMENT): relayed as sent,
    # the final reply would not start with the text relayed, and the front would end a faithful
    # stream with ChatStreamDiverged.
    return replace_nul(value)


def parse_progress_post(body: Any) -> ProgressPost:
    """The body {id, seq, delta: {content?, reasoning_content?}}; raises ProgressBodyInvalid or
    ProgressDeltaEmpty."""
    if not isinstance(body, dict):
        raise ProgressBodyInvalid({"payload": "Expected a JSON object."})
    errors: dict[str, str] = {}
    raw_id = body.get("id")
    job_id = None
    if raw_id is None:
        errors["id"] = "This field is required."
    else:
        try:
            job_id = uuid.UUID(str(raw_id)) if type(raw_id) is str else None
        except ValueError:
            job_id = None
        if job_id is None:
            errors["id"] = "Must be a valid UUID."
    seq = body.get("seq")
    if seq is None:
        errors["seq"] = "This field is required."
    elif type(seq) is not int or not 1 <= seq <= MAX_PROGRESS_SEQ:
        errors["seq"] = f"A whole number from 1 to {MAX_PROGRESS_SEQ} is required."
    delta = body.get("delta")
    content = reasoning = None
    if delta is None:
        errors["delta"] = "This field is required."
    elif not isinstance(delta, dict):
        errors["delta"] = "Expected a JSON object."
    else:
        content = _text(delta.get("content"), "delta.content", errors)
        reasoning = _text(delta.get("reasoning_content"), "delta.reasoning_content", errors)
    if errors:
        raise ProgressBodyInvalid(errors)
    assert job_id is not None and seq is not None  # each names an error above otherwise
    if not content and not reasoning:
        raise ProgressDeltaEmpty
    return ProgressPost(id=job_id, seq=seq, content=content or "", reasoning_content=reasoning or None)
