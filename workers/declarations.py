"""Chat declarations as bitmasks, so eligibility tests "every required value is declared" in SQL
on PostgreSQL and SQLite alike: required & ~declared == 0."""

from __future__ import annotations

from collections.abc import Iterable

from contract.chat_policy import ChatFeature, ChatGuarantee

# Append-only: a value's bit never changes, as a declaration value never changes meaning.
CHAT_DECLARATION_BITS: dict[str, int] = {
    value: 1 << index
    for index, value in enumerate(
        [
            ChatFeature.SEED,
            ChatFeature.REASONING_EFFORT,
            ChatFeature.PRESENCE_PENALTY,
            ChatFeature.FREQUENCY_PENALTY,
            ChatFeature.VISION,
            ChatFeature.TOOLS,
            ChatFeature.JSON_OBJECT,
            ChatFeature.JSON_SCHEMA,
            ChatFeature.TOOLS_WITH_RESPONSE_FORMAT,
            ChatGuarantee.TOOL_CHOICE_ENFORCED,
            ChatGuarantee.SINGLE_TOOL_CALL_ENFORCED,
            ChatGuarantee.STRUCTURED_OUTPUT_ENFORCED,
            ChatGuarantee.PROMPT_OVERFLOW_REFUSED,
        ]
    )
}
ALL_CHAT_DECLARATIONS_MASK = sum(CHAT_DECLARATION_BITS.values())


def declaration_mask(values: Iterable[str]) -> int:
    """The bitmask of the recognised values; unknown values are ignored, as on pop."""
    return sum(CHAT_DECLARATION_BITS.get(str(value), 0) for value in set(values))
