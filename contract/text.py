"""Rules of the base text horde that the server and any worker share (upstream values)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

ANONYMOUS_API_KEY = "0000000000"

# PostgreSQL text and JSONB cannot hold NUL: every stored string of a worker's reply (text or chat)
# gets this in its place, and a relayed delta too, so the stream and the stored reply agree.
NUL_REPLACEMENT = "\ufffd"


def replace_nul(value: str) -> str:
    return value.replace("\x00", NUL_REPLACEMENT) if "\x00" in value else value


# Request parameter bounds (upstream text params).
TEXT_N_RANGE = (1, 20)
TEXT_MAX_LENGTH_RANGE = (16, 4096)
TEXT_MAX_LENGTH_DEFAULT = 80
TEXT_MAX_CONTEXT_LENGTH_RANGE = (80, 1048576)
TEXT_MAX_CONTEXT_LENGTH_DEFAULT = 2048
# What a worker's pop that leaves its limits out declares (upstream's pop defaults).
TEXT_POP_MAX_LENGTH_DEFAULT = 512
TEXT_POP_MAX_CONTEXT_LENGTH_DEFAULT = 2048

# Each numeric native text param: its JSON type ("integer" or "number") and inclusive range. The one
# definition read by the native params serializer, the chat route's mapped params and the front.
TEXT_PARAM_RANGES: dict[str, tuple[str, int | float, int | float]] = {
    "n": ("integer", *TEXT_N_RANGE),
    "max_length": ("integer", *TEXT_MAX_LENGTH_RANGE),
    "max_context_length": ("integer", *TEXT_MAX_CONTEXT_LENGTH_RANGE),
    "rep_pen": ("number", 1, 3),
    "rep_pen_range": ("integer", 0, 4096),
    "rep_pen_slope": ("number", 0, 10),
    "temperature": ("number", 0, 5),
    "tfs": ("number", 0, 1),
    "top_a": ("number", 0, 1),
    "top_k": ("integer", 0, 200),
    "top_p": ("number", 0.001, 1),
    "typical": ("number", 0, 1),
    "min_p": ("number", 0, 1),
    "smoothing_factor": ("number", 0, 10),
    "dynatemp_range": ("number", 0, 5),
    "dynatemp_exponent": ("number", 0, 5),
}
# The boolean native text params (KoboldAI's output formatting switches and the EOS ban).
TEXT_BOOLEAN_PARAMS = (
    "frmtadsnsp",
    "frmtrmblln",
    "frmtrmspch",
    "frmttriminc",
    "singleline",
    "use_default_badwordsids",
)
# sampler_order: a list of integers in this range.
TEXT_SAMPLER_ORDER_RANGE = (0, 10)
# stop_sequence on the native text route, upstream's rule (its validate_text_params): at most this
# many distinct sequences of at most this many characters in all. An empty one stops nothing and is
# dropped: KoboldAI Lite sends its instruct tags as stops, and a tag may be empty.
TEXT_MAX_STOP_SEQUENCES = 128
TEXT_MAX_STOP_SEQUENCES_TOTAL_CHARS = 2000
TEXT_TOO_MANY_STOP_SEQUENCES_MESSAGE = f"Too many stop sequences specified (max allowed is {TEXT_MAX_STOP_SEQUENCES})."
TEXT_STOP_SEQUENCES_TOO_LONG_MESSAGE = (
    f"Your total stop sequence length exceeds the allowed limit ({TEXT_MAX_STOP_SEQUENCES_TOTAL_CHARS} chars)."
)
# The chat route's mapped stop (OpenAI's `stop`): at most this many non-empty strings of at most this
# many characters.
CHAT_MAPPED_MAX_STOP_SEQUENCES = 32
CHAT_MAPPED_MAX_STOP_SEQUENCE_CHARS = 1000


# Upstream's refusal of a text request whose prompt is "" (one of spaces is a prompt).
TEXT_MISSING_PROMPT_MESSAGE = "You cannot specify an empty prompt."


# Upstream's other refusals of a text request's params (its validate_text_params), each a 400 with
# its own rc: a completion longer than the context, and a custom sampler order that leaves samplers out.
TEXT_TOKEN_OVERFLOW_MESSAGE = "You cannot request more tokens than your context length."
TEXT_SAMPLER_ORDER_MIN_SAMPLERS = 7
TEXT_PARTIAL_SAMPLER_ORDER_MESSAGE = (
    "When sending a custom sampler order, you need to specify all possible samplers in the order"
)


def text_params_refusal(
    params: Mapping[str, Any], *, max_length: int, max_context_length: int
) -> tuple[str, str] | None:
    """Upstream's refusal of a text request's validated params, as (rc, message), else None: the
    checks of its validate_text_params, in its order (distinct stop sequences counted)."""
    if max_context_length < max_length:
        return "TokenOverflow", TEXT_TOKEN_OVERFLOW_MESSAGE
    order = params.get("sampler_order")
    if order is not None and len(set(order)) < TEXT_SAMPLER_ORDER_MIN_SAMPLERS:
        return "MissingFullSamplerOrder", TEXT_PARTIAL_SAMPLER_ORDER_MESSAGE
    stops = params.get("stop_sequence")
    if stops is not None:
        distinct = set(stops)
        if len(distinct) > TEXT_MAX_STOP_SEQUENCES:
            return "TooManyStopSequences", TEXT_TOO_MANY_STOP_SEQUENCES_MESSAGE
        if sum(map(len, distinct)) > TEXT_MAX_STOP_SEQUENCES_TOTAL_CHARS:
            return "ExcessiveStopSequence", TEXT_STOP_SEQUENCES_TOO_LONG_MESSAGE
    return None


# A user id on the wire: ASCII digits that fit a bigint (str.isdigit() also takes "²" and "١").
USER_ID_DIGITS = re.compile(r"[0-9]{1,18}")
# A priority user on a pop is upstream's "alias#id": a user id after the last "#" of an alias, which
# may itself hold "#".
PRIORITY_USERNAME = re.compile(rf".*#({USER_ID_DIGITS.pattern})", re.DOTALL)
PRIORITY_USERNAME_MESSAGE = (
    "Priority usernames need to be provided in the form of 'alias#number'. Example: 'db0#1'"
)
NO_MODELS_MESSAGE = "Unfortunately we cannot accept workers serving unrecognised models at this time"


def text_pop_refusal(
    *, models: list[str], priority_usernames: list[str], owner_alias: str
) -> tuple[str, str] | None:
    """Upstream's refusal of what a text pop declares, as (rc, message), else None: a priority user
    not given as "alias#id", no model, or a branded model ("name::alias", one "::") of another
    user's. In upstream's order (the priority users are read before the worker's models)."""
    if any(PRIORITY_USERNAME.fullmatch(alias) is None for alias in priority_usernames):
        return "InvalidPriorityUsername", PRIORITY_USERNAME_MESSAGE
    for model in models:
        parts = model.split("::")
        if len(parts) == 2 and parts[1] != owner_alias:
            return "BadRequest", f"This model can only be hosted by {parts[1]}"
    if not models:
        return "BadRequest", NO_MODELS_MESSAGE
    return None


def text_param_range_errors(params: Mapping[str, Any]) -> dict[str, str]:
    """Where `params` leave the ranges above, in the words and paths of the native text route's
    refusal ({"temperature": "Ensure this value is less than or equal to 5."}); for values a
    schema already held to their JSON type (the chat route's mapped params). Checks the numeric
    params, and stop_sequence under the chat route's mapped-stop rule (CHAT_MAPPED_*, in the text
    route's words for a list field); {} when every one is in range."""
    errors: dict[str, str] = {}
    for name, (kind, low, high) in TEXT_PARAM_RANGES.items():
        value = params.get(name)
        if value is None:
            continue
        if kind == "number":  # read as a float, as the serializer's number fields do
            try:
                value = float(value)
            except OverflowError:
                errors[name] = "Integer value too large to convert to float"
                continue
            if not math.isfinite(value):
                errors[name] = "A valid number is required."
                continue
        if value > high:
            errors[name] = f"Ensure this value is less than or equal to {high}."
        elif value < low:
            errors[name] = f"Ensure this value is greater than or equal to {low}."
    stops = params.get("stop_sequence")
    if stops is not None:
        item_errors = {}
        for index, stop in enumerate(stops):
            if stop == "":
                item_errors[f"stop_sequence[{index}]"] = "This field may not be blank."
                continue
            found = []
            if len(stop) > CHAT_MAPPED_MAX_STOP_SEQUENCE_CHARS:
                found.append(f"Ensure this field has no more than {CHAT_MAPPED_MAX_STOP_SEQUENCE_CHARS} characters.")
            if "\x00" in stop:
                found.append("Null characters are not allowed.")
            surrogate = next((c for c in stop if 0xD800 <= ord(c) <= 0xDFFF), None)
            if surrogate is not None:
                found.append(f"Surrogate characters are not allowed: U+{ord(surrogate):X}.")
            if found:
                item_errors[f"stop_sequence[{index}]"] = " ".join(found)
        if item_errors:
            errors.update(item_errors)
        elif len(stops) > CHAT_MAPPED_MAX_STOP_SEQUENCES:
            errors["stop_sequence"] = f"Ensure this field has no more than {CHAT_MAPPED_MAX_STOP_SEQUENCES} elements."
    return errors


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

# Models a text request may name. KoboldAI Lite names every listed model when its user picks
# none, so this is above any horde's model count (docs/adr/0124).
MAX_TEXT_REQUEST_MODELS = 1000

# Worker pop limits.
MAX_BRIDGE_AGENT_LENGTH = 1000
MAX_WORKER_NAME_LENGTH = 100
TEXT_POP_AMOUNT_RANGE = (1, 20)
TEXT_POP_MAX_THREADS = 50  # upstream's PopInput bound
# Upstream's log_aborted_job: more dropped jobs than this within an hour put a worker into maintenance.
ABORTED_JOBS_PER_HOUR_LIMIT = 20
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


def bridge_agent_within_limit(bridge_agent: str) -> str:
    """A bridge_agent longer than MAX_BRIDGE_AGENT_LENGTH with its program name's repeated
    "~engine" segments collapsed, as validated_bridge_name collapses them: the scribe adds "~kai"
    on every config reload, once a minute, and passes the bound after about four hours
    (docs/adr/0097). Anything else is returned as sent, for the bound to refuse."""
    if len(bridge_agent) <= MAX_BRIDGE_AGENT_LENGTH:
        return bridge_agent
    name, colon, rest = bridge_agent.partition(":")
    return _REPEATED_ENGINE.sub(r"\1", name) + colon + rest


@lru_cache(maxsize=1024)  # read on every pop; a horde sees few distinct bridge_agent strings
def is_validated_bridge(bridge_agent: str) -> bool:
    return validated_bridge_name(bridge_agent) in VALIDATED_TEXT_BRIDGES
