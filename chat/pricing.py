"""The upstream text kudos formula, in one place."""

from __future__ import annotations

import math
from collections.abc import Mapping
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from chat.model_reference import is_known_text_model, text_model_multiplier
from contract.chat_verify import chat_output_tokens
from contract.chat_verify import chat_reply_characters as _chat_reply_characters
from contract.text import TEXT_KUDOS_MIN_TOKENS

CONTEXT_MULTIPLIER_MIN = 0.1
CONTEXT_MULTIPLIER_MAX = 30.0
# An unknown model served by a trusted owner is paid as a 2.7B model.
UNKNOWN_MODEL_TRUSTED_PARAMETERS = 2.7


def things_count(text: str | None, max_length: int) -> int:
    """Tokens a text is counted as: a quarter of its characters, at least 20, at most max_length."""
    if text is None:
        return 0
    return min(max(math.ceil(len(text) / 4), TEXT_KUDOS_MIN_TOKENS), max_length)


def context_multiplier(prompt: str, max_length: int, *, prompt_tokens: int | None = None) -> float:
    """The price's context factor. `prompt_tokens`: a chat request's estimate, which counts each
    image part (spec: Flattened prompt); else a quarter of the prompt's characters."""
    # Upstream measures the prompt with the same capped count, so it never exceeds max_length.
    if prompt_tokens is None:
        context = things_count(prompt, max_length)
    else:
        context = min(max(prompt_tokens, TEXT_KUDOS_MIN_TOKENS), max_length)
    multiplier = 1.2 + 2.2 ** math.log2(context / 1024)
    return min(max(multiplier, CONTEXT_MULTIPLIER_MIN), CONTEXT_MULTIPLIER_MAX)


# A chat generation's charge_basis: the Horde prices the output it measures (the spec's ADR 0027), never a
# worker-reported token count.
CHAT_CHARGE_BASIS_OUTPUT_ESTIMATE = "output_estimate"


def chat_reply_characters(message: Mapping[str, Any]) -> int:
    """Characters of a chat reply that are charged, rewarded and timed: content, reasoning, and each
    tool call's function name and arguments (generation holds the content alone)."""
    return _chat_reply_characters(message)


def chat_charge_basis() -> str:
    """The one place a chat generation's charge basis is decided."""
    return CHAT_CHARGE_BASIS_OUTPUT_ESTIMATE


def chat_things_count(message: Mapping[str, Any], max_length: int) -> int:
    """A chat reply's token count for the formula and the speed sample: its characters / 4, rounded
    up, at least TEXT_KUDOS_MIN_TOKENS, at most the requested max_length."""
    return chat_output_tokens(chat_reply_characters(message), max_length)


def model_kudos_factors(model: str, owner_trusted: bool) -> tuple[float, float]:
    """(per token, flat): what one generation of `model` earns, before the context multiplier.
    A known model pays per token with its parameter bonus; an unknown one pays a trusted owner as
    a 2.7B model and an untrusted one the context multiplier alone."""
    if not is_known_text_model(model):
        return (UNKNOWN_MODEL_TRUSTED_PARAMETERS / 100, 0.0) if owner_trusted else (0.0, 1.0)
    multiplier = text_model_multiplier(model)
    parameter_bonus = (max(multiplier, 13) / 13) ** 0.20
    return parameter_bonus * multiplier / 100, 0.0


def kudos_amount(value: float) -> Decimal:
    """Kudos to the cent, rounded as PostgreSQL rounds a double cast to numeric (15 significant
    digits, halves away from zero), so the submit's statement and this module agree to the cent."""
    cents = Decimal(f"{value:.15g}").quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    return Decimal(str(float(cents)))


def text_generation_kudos(
    *,
    model: str,
    prompt: str,
    generation: str | None,
    max_length: int,
    owner_trusted: bool,
    tokens: int | None = None,
    context: float | None = None,
) -> Decimal:
    """What a worker earns for one text generation (and what its requester is charged).

    `tokens` overrides the count taken from `generation`: a chat reply is priced by
    chat_things_count, which counts reasoning and tool calls beside the content. The text submit's
    statement computes the same from the rate its pop stored (chat/services/pop.py). `context`:
    the request's stored factor (kudos_context), else it is taken from `prompt`.
    """
    ctx = context if context is not None else context_multiplier(prompt, max_length)
    if tokens is None:
        tokens = things_count(generation, max_length)
    per_token, flat = model_kudos_factors(model, owner_trusted)
    return kudos_amount(tokens * (ctx * per_token) + ctx * flat)


def text_request_quote(
    *, models: list[str], prompt: str, max_length: int, n: int, prompt_tokens: int | None = None
) -> Decimal:
    """The kudos a request is expected to cost: n full-length generations at the first model
    (`prompt_tokens`: as context_multiplier).

    The quote assumes full-length replies at the dearer of the two owners' rates, so it bounds the
    charge. A known model's rate ignores trust. An unknown model pays a trusted owner per token
    and an untrusted one a flat context multiplier, dearer below 38 tokens (docs/adr/0090).
    """
    model = models[0] if models else ""
    context = context_multiplier(prompt, max_length, prompt_tokens=prompt_tokens)
    per_generation = max(
        text_generation_kudos(
            model=model,
            prompt=prompt,
            generation="x" * (max_length * 4),
            max_length=max_length,
            owner_trusted=trusted,
            context=context,
        )
        for trusted in (True, False)
    )
    return per_generation * n
