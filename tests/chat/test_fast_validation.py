"""The worker routes' canonical validation agrees with their DRF serializers (hypothesis)."""

from __future__ import annotations

import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chat.api import serializers as s
from chat.api import submit_serializers as cs
from chat.api.fast_validation import canonical_validated_data

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
        "priority_usernames": st.one_of(st.lists(texts, max_size=3), values),
        "amount": integers,
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
