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

import os
import re
import socket
import uuid

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
    if not (text.isascii() and text.isdigit()):  # isdigit alone takes "²", which int() refuses
        return None
    seconds = int(text)
    return seconds if 1 <= seconds <= FRONT_LEASE_MAX_SECONDS else None


# --- the front's process (docs/adr/0028-dead-front-requests.md) ----------------------------------

# Sent beside the lease header: the front process that took the lease. Its host part lets a horde
# process on the same host tell at once that this front process is gone (a kill -9, a restart).
# Sent alone with a background response's chat submit: no lease, so the process's end cancels
# nothing, but that front may end the request as undelivered (docs/adr/0110).
FRONT_ID_HEADER = "Horde-Front-Id"
FRONT_ID_MAX_LENGTH = 320
# <32 hex, the process's own>[/<host>/<boot id>/<pid namespace>/<pid>/<start time in clock ticks>]
_FRONT_ID = re.compile(
    r"(?P<token>[0-9a-f]{32})"
    r"(?:/(?P<host>[A-Za-z0-9._-]{1,253})/(?P<boot>[0-9a-f-]{36})/(?P<pidns>\d{1,20})/(?P<pid>\d{1,10})/(?P<start>\d{1,20}))?"
)


# --- a stopping front's undelivered requests (docs/adr/0086-a-stopping-front-ends-undelivered-requests-unpaid.md)

# Sent on the cancel (DELETE of the status route) of a request whose reply the front can no longer
# deliver because its process stops: the request is ended as a dead front's (nobody pays for the
# generation). The horde honours it only from a front it knows by its proxy passkey
# (`Proxy-Authorization`, contract.rate_limits) and for a request leased under the same
# `Horde-Front-Id`; otherwise it is the spec's cancel.
FRONT_UNDELIVERED_HEADER = "Horde-Front-Undelivered"
FRONT_UNDELIVERED_VALUE = "stopping"


def parse_front_id(value: str | None) -> str | None:
    """The front id a header names, or None (absent or malformed: the lease alone)."""
    if value is None:
        return None
    text = value.strip()
    return text if len(text) <= FRONT_ID_MAX_LENGTH and _FRONT_ID.fullmatch(text) else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            return file.read()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22), None if gone."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name in () may hold spaces
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _host_part() -> tuple[str, str, str] | None:
    """(host, boot id, pid namespace) of this process, None where /proc does not tell."""
    boot = (_read("/proc/sys/kernel/random/boot_id") or "").strip()
    try:
        pidns = "".join(ch for ch in os.readlink("/proc/self/ns/pid") if ch.isdigit())
    except OSError:
        return None
    host = socket.gethostname()
    if not (boot and pidns and host):
        return None
    return host, boot, pidns


def new_front_id(pid: int | None = None) -> str:
    """An id for this front process (or the process `pid` of this host): a fresh token, and where
    /proc allows, the process itself."""
    token = uuid.uuid4().hex
    pid = os.getpid() if pid is None else pid
    where = _host_part()
    start = _start_ticks(pid)
    if where is None or start is None:
        return token
    host, boot, pidns = where
    front_id = f"{token}/{host}/{boot}/{pidns}/{pid}/{start}"
    return front_id if parse_front_id(front_id) else token


def front_process_gone(front_id: str) -> bool:
    """Whether the front process behind this id is known to be gone: it ran on this host, since its
    boot, in this pid namespace, and no process with its pid and start time runs now. False when
    this process cannot tell (another host or container, or an id without its process)."""
    match = _FRONT_ID.fullmatch(front_id or "")
    if match is None or match["host"] is None or _host_part() != (match["host"], match["boot"], match["pidns"]):
        return False
    return _start_ticks(int(match["pid"])) != int(match["start"])
