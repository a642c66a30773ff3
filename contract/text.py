"""Rules of the base text horde that the server and any worker share (upstream values)."""

from __future__ import annotations

import re
from functools import lru_cache

ANONYMOUS_API_KEY = "0000000000"

# Request parameter bounds (upstream text params).
TEXT_N_RANGE = (1, 20)
TEXT_MAX_LENGTH_RANGE = (16, 4096)
TEXT_MAX_LENGTH_DEFAULT = 80
TEXT_MAX_CONTEXT_LENGTH_RANGE = (80, 1048576)
TEXT_MAX_CONTEXT_LENGTH_DEFAULT = 2048

# Queue and leases.
TEXT_REQUEST_TTL_SECONDS = 20 * 60
TEXT_JOB_LEASE_SECONDS = 150
STALE_GENERATION_SWEEP_SECONDS = 60
FAULTED_GENERATIONS_LIMIT = 2
WORKER_ONLINE_SECONDS = 300
QUEUE_PRIORITY_STEP = 50
QUEUE_PRIORITY_STEP_SECONDS = 10
WORKER_SPEED_SAMPLES = 20
UNMEASURED_TEXT_WORKER_TOKENS_PER_SECOND = 10
# Below this many tokens per second a worker is slow; requests with slow_workers=false skip it.
SLOW_TEXT_WORKER_TOKENS_PER_SECOND = 2

# Kudos.
TEXT_HORDE_TAX = 1
TEXT_KUDOS_MIN_TOKENS = 20

# Worker pop limits.
MAX_BRIDGE_AGENT_LENGTH = 1000
MAX_WORKER_NAME_LENGTH = 100
TEXT_POP_AMOUNT_RANGE = (1, 20)
# A pop's optional `wait` (whole seconds, this project's extension): longer asks are held this long.
TEXT_POP_WAIT_MAX_SECONDS = 20

GENERATION_STATES = ("ok", "censored", "faulted", "csam")

# bridge_agent is "name:version:url". A worker's backend is validated when its program name (the
# part before the first ":", with the "~engine" suffixes the upstream worker adds) is one the horde
# vouches for: upstream's list of validated LLM backends, plus upstream's other official worker
# program (reGen) and this project's reference worker.
VALIDATED_TEXT_BRIDGES = frozenset(
    {
        "AI Horde Worker",
        "AI Horde Worker reGen",
        "AI Horde Worker~aphrodite~kai",
        "AI Horde Worker~aphrodite~oai",
        "KoboldCppEmbedWorker",
        "TabbyAPI",
        "horde-bridge",
    }
)

_BRIDGE_NAME = re.compile(r"^([^:]*)")
# The upstream text worker appends "~kai" again on every config reload ("~aphrodite~kai~kai"):
# a segment repeating the one before it names nothing new.
_REPEATED_ENGINE = re.compile(r"(~[^~]*)(?:\1)+(?=~|$)")


def bridge_name(bridge_agent: str) -> str:
    """The program name of a bridge_agent string ("KoboldCppEmbedWorker:2:url" -> "KoboldCppEmbedWorker")."""
    match = _BRIDGE_NAME.match(bridge_agent or "")
    return match.group(1).strip() if match else ""


def validated_bridge_name(bridge_agent: str) -> str:
    """The program name as the validated list spells it: repeated "~engine" segments collapsed
    ("AI Horde Worker~aphrodite~kai~kai" -> "AI Horde Worker~aphrodite~kai")."""
    return _REPEATED_ENGINE.sub(r"\1", bridge_name(bridge_agent))


@lru_cache(maxsize=1024)  # read on every pop; a horde sees few distinct bridge_agent strings
def is_validated_bridge(bridge_agent: str) -> bool:
    return validated_bridge_name(bridge_agent) in VALIDATED_TEXT_BRIDGES
