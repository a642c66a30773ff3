"""The completion signal's wire, shared by the horde (publisher) and any front (subscriber).

Each chat request publishes on Redis channel `horde:chat:<request id>` a JSON message
{"id", "event", "generations"} (plus fault_reason and fault_rc on a faulted one) after the commit
that stored what it announces. The publisher uses logical database CHAT_SIGNAL_DB; pub/sub reaches
subscribers on any database, so a subscriber only needs the host.
"""

from __future__ import annotations

CHAT_SIGNAL_CHANNEL_PREFIX = "horde:chat:"
# The logical database the publishing client uses (the spec's chat_signal_db).
CHAT_SIGNAL_DB = 7
CHAT_SIGNAL_FAULT_KEYS = ("fault_reason", "fault_rc")


def chat_signal_channel(request_id: object) -> str:
    return f"{CHAT_SIGNAL_CHANNEL_PREFIX}{request_id}"
