"""The front lease: a short renewable claim that a front still waits for a request (ADR 0020).

A front (the OpenAI front, or any native caller that delivers to a client of its own) asks for the
lease with the `Horde-Front-Lease` header on its submit, the lease's length in seconds. It keeps
the lease alive every FRONT_LEASE_RENEW_SECONDS, either by writing the Redis key
`horde:front:lease:<request id>` (with the length as its expiry) on the chat signal database, or,
without Redis, by sending the same header on a status read. The horde's sweep cancels a request
whose lease lapsed on both (a front that died, or gave up a submit it never learned the answer to),
so nobody is charged for a reply no client can receive.
"""

from __future__ import annotations

from contract.chat_signal import CHAT_SIGNAL_DB

FRONT_LEASE_HEADER = "Horde-Front-Lease"
FRONT_LEASE_KEY_PREFIX = "horde:front:lease:"
# The chat signal database, where the progress streams live too.
FRONT_LEASE_REDIS_DB = CHAT_SIGNAL_DB
FRONT_LEASE_RENEW_SECONDS = 10
# A few renewal periods: one late or lost renewal never lets a lease lapse.
FRONT_LEASE_TTL_SECONDS = 30
# The longest lease a header may ask for; a longer or malformed value is ignored.
FRONT_LEASE_MAX_SECONDS = 600


def front_lease_key(request_id: object) -> str:
    return f"{FRONT_LEASE_KEY_PREFIX}{request_id}"


def parse_front_lease_header(value: str | None) -> int | None:
    """The lease length a header asks for, in whole seconds (1 to FRONT_LEASE_MAX_SECONDS), or None."""
    if value is None:
        return None
    text = value.strip()
    if not text.isdigit():
        return None
    seconds = int(text)
    return seconds if 1 <= seconds <= FRONT_LEASE_MAX_SECONDS else None
