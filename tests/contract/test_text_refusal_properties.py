"""Property tests of upstream's refusals on the text routes (contract/text.py): `text_params_refusal`
(a text request's validated params, ADR 0073) and `text_pop_refusal` (what a pop declares, ADR 0077)
raise nothing for any input of the types their callers hand them, and refuse exactly upstream's
cases, in upstream's order, with its rc."""

from __future__ import annotations

import re
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.text import (
    NO_MODELS_MESSAGE,
    PRIORITY_USERNAME_MESSAGE,
    TEXT_MAX_STOP_SEQUENCES,
    TEXT_MAX_STOP_SEQUENCES_TOTAL_CHARS,
    TEXT_PARTIAL_SAMPLER_ORDER_MESSAGE,
    TEXT_SAMPLER_ORDER_MIN_SAMPLERS,
    TEXT_SAMPLER_ORDER_RANGE,
    TEXT_STOP_SEQUENCES_TOO_LONG_MESSAGE,
    TEXT_TOKEN_OVERFLOW_MESSAGE,
    TEXT_TOO_MANY_STOP_SEQUENCES_MESSAGE,
    text_params_refusal,
    text_pop_refusal,
)

PROPERTY_SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# What the serializer hands on: lengths within its bounds (and a little past, the function must not
# care), sampler orders of its range, stop sequences as non-empty strings of any characters.
lengths = st.one_of(st.integers(min_value=1, max_value=1_048_576), st.sampled_from([16, 79, 80, 81, 2048, 4096]))
sampler_orders = st.lists(
    st.integers(min_value=TEXT_SAMPLER_ORDER_RANGE[0], max_value=TEXT_SAMPLER_ORDER_RANGE[1]), max_size=14
)
stop_texts = st.text(min_size=1, max_size=40) | st.sampled_from(["\n", "You:", "x" * 1000, "x" * 2000, "😀", "::"])


@st.composite
def stop_lists(draw):
    """Around both of upstream's bounds: the distinct count near 128, the distinct total near 2,000
    characters, with repeats that upstream does not count."""
    shape = draw(st.sampled_from(["small", "count", "chars"]))
    if shape == "small":
        stops = draw(st.lists(stop_texts, max_size=6))
    elif shape == "count":
        distinct = draw(st.integers(min_value=TEXT_MAX_STOP_SEQUENCES - 2, max_value=TEXT_MAX_STOP_SEQUENCES + 2))
        stops = [f"s{index}" for index in range(distinct)]
    else:
        total = draw(
            st.integers(
                min_value=TEXT_MAX_STOP_SEQUENCES_TOTAL_CHARS - 3, max_value=TEXT_MAX_STOP_SEQUENCES_TOTAL_CHARS + 3
            )
        )
        stops = ["a" * (total - 10), "b" * 10]
    repeats = draw(st.lists(st.sampled_from(stops), max_size=200)) if stops else []
    return draw(st.permutations(stops + repeats))


params_dicts = st.fixed_dictionaries(
    {}, optional={"sampler_order": st.none() | sampler_orders, "stop_sequence": st.none() | stop_lists()}
)


# ADR 0073's table, with its numbers written out (not the module's constants): each of upstream's
# rules as its own test of the params, in upstream's order; the refusal is the first that holds.
UPSTREAM_TEXT_PARAMS_RULES = (
    ("TokenOverflow", TEXT_TOKEN_OVERFLOW_MESSAGE, lambda p, length, context: context < length),
    (
        "MissingFullSamplerOrder",
        TEXT_PARTIAL_SAMPLER_ORDER_MESSAGE,
        lambda p, length, context: p.get("sampler_order") is not None and len(Counter(p["sampler_order"])) < 7,
    ),
    (
        "TooManyStopSequences",
        TEXT_TOO_MANY_STOP_SEQUENCES_MESSAGE,
        lambda p, length, context: p.get("stop_sequence") is not None and len(Counter(p["stop_sequence"])) > 128,
    ),
    (
        "ExcessiveStopSequence",
        TEXT_STOP_SEQUENCES_TOO_LONG_MESSAGE,
        lambda p, length, context: p.get("stop_sequence") is not None
        and len("".join(Counter(p["stop_sequence"]))) > 2000,
    ),
)


def upstream_params_refusal(params, max_length, max_context_length):
    """Upstream's validate_text_params: the first of ADR 0073's rules that the params break."""
    return next(
        ((rc, message) for rc, message, broken in UPSTREAM_TEXT_PARAMS_RULES
         if broken(params, max_length, max_context_length)),
        None,
    )


def test_the_oracles_numbers_are_the_modules():
    """The oracle spells ADR 0073's numbers out; the module's constants must say the same."""
    assert (TEXT_SAMPLER_ORDER_MIN_SAMPLERS, TEXT_MAX_STOP_SEQUENCES, TEXT_MAX_STOP_SEQUENCES_TOTAL_CHARS) == (
        7, 128, 2000,
    )


@PROPERTY_SETTINGS
@given(params_dicts, lengths, lengths)
def test_text_params_refusal_refuses_exactly_upstreams_cases(params, max_length, max_context_length):
    assert text_params_refusal(params, max_length=max_length, max_context_length=max_context_length) == (
        upstream_params_refusal(params, max_length, max_context_length)
    )


@PROPERTY_SETTINGS
@given(params_dicts, lengths, st.data())
def test_text_params_refusal_counts_distinct_values_in_any_order(params, length, data):
    """Repeating or reordering stop sequences and samplers never changes the answer."""
    answer = text_params_refusal(params, max_length=length, max_context_length=length)
    shuffled = {
        key: (data.draw(st.permutations(value + value[:3])) if value is not None else None)
        for key, value in params.items()
    }
    assert text_params_refusal(shuffled, max_length=length, max_context_length=length) == answer


@PROPERTY_SETTINGS
@given(st.integers(min_value=0, max_value=TEXT_SAMPLER_ORDER_RANGE[1] + 1))
def test_a_full_sampler_order_passes_and_a_partial_one_is_refused(distinct):
    order = list(range(distinct))
    answer = text_params_refusal({"sampler_order": order}, max_length=80, max_context_length=2048)
    assert (answer is None) == (distinct >= TEXT_SAMPLER_ORDER_MIN_SAMPLERS)


# A pop's strings: any unicode, with the characters the checks split on placed in them.
pop_texts = st.one_of(
    st.text(max_size=30),
    st.builds(lambda a, b: f"{a}#{b}", st.text(max_size=12), st.text(max_size=20)),
    st.builds(lambda a, b: f"{a}::{b}", st.text(max_size=12), st.text(max_size=20)),
    st.builds(lambda a, n: f"{a}#{n}", st.text(max_size=12), st.integers(min_value=-5, max_value=10**20)),
    st.sampled_from(["", "#", "#1", "db0#1", "a#b#2", "x#", "x#abc", "x#١", "x#1\n", "a::b::c", "::", "m::"]),
)
owners = st.sampled_from(["fuzzowner#3", "db0#1", "a#b#2", "x::y#4"]) | st.builds(
    lambda a, n: f"{a}#{n}", st.text(max_size=10), st.integers(min_value=1, max_value=10**12)
)
ASCII_ID_SUFFIX = re.compile(r"#[0-9]+\Z")


def upstream_pop_refusal(models, priority_usernames, owner_alias):
    """ADR 0077: the priority users first (each an alias, a "#", then 1 to 18 ASCII digits), then a
    model branded "name::alias" (exactly one "::") of another user, then no model at all."""
    for alias in priority_usernames:
        suffix = ASCII_ID_SUFFIX.search(alias)
        if suffix is None or not 1 <= len(suffix.group()) - 1 <= 18:
            return "InvalidPriorityUsername", PRIORITY_USERNAME_MESSAGE
    for model in models:
        if model.count("::") == 1:
            brand = model.split("::")[1]
            if brand != owner_alias:
                return "BadRequest", f"This model can only be hosted by {brand}"
    if not models:
        return "BadRequest", NO_MODELS_MESSAGE
    return None


@PROPERTY_SETTINGS
@given(st.lists(pop_texts, max_size=4), st.lists(pop_texts, max_size=4), owners)
def test_text_pop_refusal_refuses_exactly_upstreams_cases(models, priority_usernames, owner_alias):
    answer = text_pop_refusal(models=models, priority_usernames=priority_usernames, owner_alias=owner_alias)
    assert answer == upstream_pop_refusal(models, priority_usernames, owner_alias)


@PROPERTY_SETTINGS
@given(
    st.lists(st.text(max_size=20).filter(lambda m: "::" not in m and not m.endswith(":")), min_size=1, max_size=4),
    owners,
    st.data(),
)
def test_a_worker_may_serve_its_own_brand_and_plain_models(models, owner_alias, data):
    """A pop's own brand (its owner's alias after the one "::") is never refused, whatever the alias holds."""
    branded = [f"{name}::{owner_alias}" for name in models if "::" not in owner_alias]
    priority = data.draw(st.lists(st.builds(lambda n: f"someone#{n}", st.integers(0, 10**18 - 1)), max_size=3))
    assert text_pop_refusal(models=models + branded, priority_usernames=priority, owner_alias=owner_alias) is None
