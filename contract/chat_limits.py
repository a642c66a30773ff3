"""Chat request limits and defaults shared by the native route, the OpenAI front and workers.

Names and values are the spec's (chat_requests.md, chat_front.md). Pure Python, no imports of
the project.
"""

from __future__ import annotations

from types import MappingProxyType

KIB = 1024
MIB = 1024 * KIB

# Request body.
MAX_CHAT_BODY_BYTES = 36 * MIB  # 25 MiB of images as base64 (~33.3 MiB) + 1 MiB text + JSON
MAX_CHAT_MESSAGE_COUNT = 1024
MAX_CHAT_TEXT_BYTES = 1 * MIB  # UTF-8 of every text, plus history tool call names and arguments
MAX_CHAT_MODEL_COUNT = 5

# Token limit: max_tokens / max_completion_tokens map to the text max_length.
MIN_CHAT_MAX_TOKENS = 16  # the native text API's minimum generation length
# The horde's character-based token estimate (pricing, context sizing): a token is about four characters.
CHARS_PER_TOKEN_ESTIMATE = 4
MAX_CHAT_MAX_TOKENS = 16384
CHAT_MAX_TOKENS_DEFAULT = 512  # OpenAI clients usually omit it; the text default of 80 is too short

# Tools and structured output.
MAX_CHAT_TOOL_COUNT = 128
MAX_CHAT_TOOL_SPEC_BYTES = 256 * KIB  # compact JSON of tools, tool_choice and response_format
MAX_CHAT_SCHEMA_NESTING = 10  # levels below the root, OpenAI's limit for strict schemas
MAX_CHAT_TOOL_NAME_LENGTH = 64
TOOL_NAME_PATTERN = rf"^[A-Za-z0-9_-]{{1,{MAX_CHAT_TOOL_NAME_LENGTH}}}$"
MAX_CHAT_TOOL_CALL_COUNT = 128  # per assistant message and per reply
MAX_CHAT_TOOL_CALL_ID_LENGTH = 256
MIN_CHAT_TOOL_CALL_ID_LENGTH = 1

# Images (the source image caps of image requests; totals keep the extra source image costs).
MAX_CHAT_IMAGE_COUNT = 20
MAX_CHAT_IMAGE_BYTES = 5 * MIB
MAX_CHAT_IMAGE_TOTAL_BYTES = 25 * MIB  # trusted users and patrons; every request at parse
MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED = 5 * MIB
MAX_CHAT_IMAGE_PIXELS = 3072 * 3072  # read from the header, before decoding
# A stored image: RGB (RGBA flattened onto white), longest side at most this, JPEG at this quality.
CHAT_IMAGE_MAX_SIDE = 2048
CHAT_IMAGE_JPEG_QUALITY = 90
# An image part's url in a stored request: this scheme and the key it is stored under.
CHAT_IMAGE_REFERENCE_PREFIX = "horde-r2://"
# The horde's bound on fetching a request's image URLs, all of them (every hop, headers and body):
# a submit with URL images may take this long more, which the front's wait for the submit allows
# for. One bound for the request, not one per image, so 20 slow hosts cannot hold a web thread for
# 20 times as long (docs/adr/0069).
CHAT_IMAGE_FETCH_TOTAL_SECONDS = 15.0
# A presigned image URL in a job lives the job's TTL, and at least this long.
MIN_CHAT_IMAGE_URL_SECONDS = 600
# An offloaded request's messages object: its key's suffix, and its URL's lifetime (the worker
# fetches right after its pop; a short life limits the replay of a leaked URL).
CHAT_MESSAGES_OBJECT_SUFFIX = "_chat_messages.json"
CHAT_MESSAGES_URL_SECONDS = 120
CHAT_IMAGE_PLACEHOLDER = "[image]"  # an image part in the flattened prompt
CHAT_IMAGE_PROMPT_TOKENS = 512  # what koboldcpp's worker adds per image in its own estimate

# Structured submit.
MAX_CHAT_NATIVE_FINISH_REASON_LENGTH = 32
MAX_CHAT_REPORTED_TOKENS = 10_000_000
MAX_CHAT_FAULT_REASON_LENGTH = 1000

# The OpenAI front only: more stop sequences are refused there with OpenAI's message.
MAX_CHAT_STOP_SEQUENCES = 4

# OpenAI's sampling ranges, inclusive; the front bounds requests to them.
OPENAI_SAMPLING_RANGES: MappingProxyType[str, tuple[float, float]] = MappingProxyType(
    {
        "temperature": (0.0, 2.0),
        "top_p": (0.0, 1.0),
        "frequency_penalty": (-2.0, 2.0),
        "presence_penalty": (-2.0, 2.0),
    }
)

# The native route's penalty range (the text params bound temperature and top_p).
CHAT_PENALTY_RANGE = (-2.0, 2.0)
# A seed is a 64-bit signed integer, as OpenAI types it (and backends read it: llama.cpp, vLLM).
CHAT_SEED_MIN = -(2**63)
CHAT_SEED_MAX = 2**63 - 1

# Every sampling field a chat job carries; the client's value or this default, so a worker's
# own defaults never apply to a chat job.
CHAT_SAMPLING_DEFAULTS: MappingProxyType[str, float] = MappingProxyType(
    {
        "temperature": 1.0,
        "top_p": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "rep_pen": 1.0,
        "top_k": 0,
        "min_p": 0.0,
    }
)
