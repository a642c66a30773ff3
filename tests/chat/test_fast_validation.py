"""The canonical validation of the worker routes' bodies and of the text request agrees with their
DRF serializers (hypothesis), and the bodies real clients send take it."""

from __future__ import annotations

import math
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.fields import BooleanField

from chat.api import serializers as s
from chat.api import submit_serializers as cs
from chat.api.fast_validation import canonical_validated_data
from contract.text import TEXT_BOOLEAN_PARAMS, TEXT_PARAM_RANGES
from tests.chat.test_text_request_types import SILLYTAVERN_PARAMS

# Values near and across each field's bounds, of the right JSON type and of others.
texts = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", " ", "  name  ", "a\x00b", "\ud800", "x" * 100, "x" * 101, "x" * 256, "ok"]),
)
integers = st.one_of(
    st.integers(min_value=-5, max_value=25),
    st.sampled_from([0, 1, 16, 20, 21, 80, 1_048_576, 1_048_577, -(2**63), 2**63 - 1, 2**63, -(2**63) - 1]),
)
scalars = st.one_of(texts, integers, st.booleans(), st.none(), st.floats(allow_nan=False), st.just("12"))
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.lists(texts, max_size=3),
    st.just(["m"] * 101),
    st.dictionaries(st.text(max_size=5), scalars, max_size=2),
)

POP_KEYS = list(s.TextPopInputSerializer._declared_fields)
TEXT_KEYS = list(s.TextAsyncInputSerializer._declared_fields)
PARAM_KEYS = list(s.TextParamsSerializer._declared_fields)
SUBMIT_KEYS = list(s.TextSubmitInputSerializer._declared_fields)


def uuids():
    return st.one_of(st.uuids().map(str), st.uuids().map(lambda u: u.hex), st.uuids().map(lambda u: f"{{{u}}}"))


def bodies(keys, special):
    return st.fixed_dictionaries(
        {},
        optional={key: special.get(key, values) for key in keys} | {"unknown": values},
    )


pop_bodies = bodies(
    POP_KEYS,
    {
        "name": texts,
        "models": st.one_of(st.lists(texts, max_size=4), values),
        "priority_usernames": st.one_of(
            st.lists(st.one_of(texts, st.sampled_from(["db0#1", "#", "x#", " ", "a#b#2"])), max_size=3), values
        ),
        "amount": integers,
        # Upstream's thread bound (1 to 50, ADR 0077) and either side of it.
        "threads": st.one_of(integers, st.sampled_from([0, 1, 49, 50, 51, 100, 101])),
        "nsfw": st.one_of(st.booleans(), values),
    },
)
submit_bodies = bodies(
    [*SUBMIT_KEYS, "message", "model_id"],
    {
        "id": st.one_of(uuids(), values),
        "state": st.one_of(st.sampled_from(["ok", "censored", "faulted", "csam", "bad", ""]), values),
        "seed": integers,
        "gen_metadata": st.one_of(st.just([]), st.just([{"type": "censorship", "value": "csam"}]), values),
        "generation": texts,
    },
)


def near(low, high):
    """Numbers at, inside and across a param's bounds, as integers and floats, and the overflows."""
    return st.one_of(
        st.sampled_from([low, high, low - 1, high + 1, float(low), float(high), (low + high) / 2, high + 0.5]),
        st.integers(min_value=int(low) - 2, max_value=int(high) + 2),
        st.floats(min_value=low - 1, max_value=high + 1),
        st.sampled_from([float("inf"), -float("inf"), 2**1100, -(2**1100), 1e308]),
    )


def inside(kind, low, high):
    if kind == "integer":
        return st.integers(min_value=low, max_value=high)
    return st.one_of(st.integers(min_value=math.ceil(low), max_value=math.floor(high)), st.floats(min_value=low, max_value=high))


BOOLEAN_PARAMS = [k for k, f in s.TextParamsSerializer._declared_fields.items() if type(f).__name__ == "StrictBooleanField"]
BOOLEAN_KEYS = [k for k, f in s.TextAsyncInputSerializer._declared_fields.items() if type(f).__name__ == "StrictBooleanField"]
names = st.text(min_size=1, max_size=20).filter(lambda t: t.strip() and "\x00" not in t)

# Bodies the serializer takes (each value of its JSON type and inside its bounds), so the agreement
# is checked on bodies the canonical path takes too; then the same with one value changed to
# anything, at or across a bound or of another type.
valid_params = st.fixed_dictionaries(
    {},
    optional={
        **{name: inside(kind, low, high) for name, (kind, low, high) in TEXT_PARAM_RANGES.items()},
        **{name: st.booleans() for name in BOOLEAN_PARAMS},
        "sampler_order": st.lists(st.integers(min_value=0, max_value=10), max_size=8),
        # Blank stops are dropped by both paths (ADR 0072); the count and length bounds are
        # upstream's refusals after validation (contract.text.text_params_refusal).
        "stop_sequence": st.lists(st.one_of(names, st.sampled_from(["", "\n", "You:"])), max_size=6),
    },
)
valid_text_bodies = st.fixed_dictionaries(
    {"prompt": names},
    optional={
        **{name: st.booleans() for name in BOOLEAN_KEYS},
        "params": valid_params,
        "softprompt": st.one_of(names, st.none()),
        "models": st.lists(names, max_size=3),
        "workers": st.lists(uuids(), max_size=3),
        "operation_key": st.one_of(uuids(), st.none()),
        "style": st.text(min_size=3, max_size=20).filter(lambda t: "\x00" not in t),
        "webhook": names,
        "proxied_account": names,
    },
)
edges = st.one_of(
    values,
    *(near(low, high) for _, low, high in TEXT_PARAM_RANGES.values()),
    st.lists(st.integers(min_value=-1, max_value=11), max_size=3),
    st.just(["x"] * 33),
    st.just([None]),
)


def changed(body: dict, key: str, value) -> dict:
    if key.startswith("params."):
        return {**body, "params": {**(body.get("params") or {}), key.removeprefix("params."): value}}
    return {**body, key: value}


perturbed_text_bodies = st.builds(
    changed, valid_text_bodies, st.sampled_from([*TEXT_KEYS, *(f"params.{k}" for k in PARAM_KEYS)]), edges
)
text_bodies = st.one_of(valid_text_bodies, perturbed_text_bodies, bodies(TEXT_KEYS, {"params": st.one_of(
    bodies(PARAM_KEYS, {}), values)}))


def agrees(serializer_class, body) -> None:
    fast = canonical_validated_data(serializer_class, body)
    if fast is None:
        return
    serializer = serializer_class(data=body)
    assert serializer.is_valid(), (body, serializer.errors)
    assert fast == dict(serializer.validated_data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pop_bodies)
def test_pop_bodies_validate_as_drf_validates_them(body):
    agrees(s.TextPopInputSerializer, body)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(submit_bodies)
def test_submit_bodies_validate_as_drf_validates_them(body):
    agrees(s.TextSubmitInputSerializer, body)
    agrees(cs.SubmitIdSerializer, body)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text_bodies)
def test_text_request_bodies_validate_as_drf_validates_them(body):
    agrees(s.TextAsyncInputSerializer, body)
    if isinstance(body.get("params"), dict):
        agrees(s.TextParamsSerializer, body["params"])


def test_the_bodies_text_clients_send_take_the_canonical_path():
    lite = {  # KoboldAI Lite's horde request: its sampler params and an empty worker list
        "prompt": "You: Hi\nKoboldAI:",
        "params": {
            "n": 1, "max_context_length": 4096, "max_length": 240, "rep_pen": 1.07, "temperature": 0.7,
            "top_p": 0.92, "top_k": 100, "top_a": 0, "typical": 1, "tfs": 1, "rep_pen_range": 360,
            "rep_pen_slope": 0.7, "sampler_order": [6, 0, 1, 3, 4, 2, 5], "use_default_badwordsids": False,
            "stop_sequence": ["You:", "\nYou "], "min_p": 0, "dynatemp_range": 0, "dynatemp_exponent": 1,
            "smoothing_factor": 0,
        },
        "models": ["koboldcpp/Mistral-7B"],
        "workers": [],
    }
    sillytavern = {"prompt": "User: Hi\nAssistant:", "params": SILLYTAVERN_PARAMS, "trusted_workers": False,
                   "models": ["koboldcpp/Mistral-7B"]}
    bare = {"prompt": "Once upon a time"}
    for body in (lite, sillytavern, bare):
        validated = canonical_validated_data(s.TextAsyncInputSerializer, body)
        serializer = s.TextAsyncInputSerializer(data=body)
        assert serializer.is_valid(), serializer.errors
        assert validated == dict(serializer.validated_data)
    assert canonical_validated_data(s.TextAsyncInputSerializer, bare)["params"] == {}
    assert canonical_validated_data(s.TextAsyncInputSerializer, bare)["max_length"] == serializer.validated_data["max_length"]
    # A value the serializer refuses or would coerce, or a key it alone checks, goes to it.
    assert canonical_validated_data(s.TextAsyncInputSerializer, {**lite, "params": {"max_length": 80.0}}) is None
    assert canonical_validated_data(s.TextAsyncInputSerializer, {**lite, "params": {"temperature": "0.7"}}) is None
    assert canonical_validated_data(s.TextAsyncInputSerializer, {**bare, "extra_source_images": [{}]}) is None


def test_the_bodies_workers_send_take_the_canonical_path():
    pop = {
        "name": "My Worker",
        "models": ["koboldcpp/Mistral-7B"],
        "max_length": 512,
        "max_context_length": 4096,
        "priority_usernames": [],
        "nsfw": True,
        "bridge_agent": "AI Horde Worker reGen:9.0.2:https://github.com/Haidra-Org/horde-worker-reGen",
        "threads": 1,
        "softprompts": [],
        "amount": 1,
    }
    validated = canonical_validated_data(s.TextPopInputSerializer, pop)
    serializer = s.TextPopInputSerializer(data=pop)
    assert serializer.is_valid() and validated == dict(serializer.validated_data)
    job_id = str(uuid.uuid4())
    submit = {"id": job_id, "generation": " A reply. ", "state": "ok", "seed": 12, "gen_metadata": []}
    assert canonical_validated_data(s.TextSubmitInputSerializer, submit) == {
        "id": uuid.UUID(job_id), "generation": " A reply. ", "state": "ok", "seed": 12, "gen_metadata": [],
    }
    # A value DRF would coerce ("512") or refuse goes to the serializer.
    assert canonical_validated_data(s.TextPopInputSerializer, {**pop, "max_length": "512"}) is None
    assert canonical_validated_data(s.TextPopInputSerializer, {**pop, "amount": 21}) is None


def test_the_text_params_serializer_declares_the_contracts_booleans_and_ranges():
    """contract.text is the one list the front forwards from and the native route validates by."""
    fields = s.TextParamsSerializer().fields
    assert sorted(name for name, field in fields.items() if isinstance(field, BooleanField)) == sorted(
        TEXT_BOOLEAN_PARAMS
    )
    assert set(TEXT_PARAM_RANGES) <= set(fields)
