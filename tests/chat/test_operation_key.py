"""horde.operation_key: the fingerprint, a repeated key, a conflicting key, and the race of two
concurrent submits on real PostgreSQL connections."""

from __future__ import annotations

import uuid
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from accounts.models import KudosTransaction
from chat.models import GenerationRequest
from chat.services.create_chat import OPERATION_FINGERPRINT_EXCLUDED_HORDE_KEYS, map_chat_request
from contract.chat_shapes import validate_chat_request
from tests.accounts.test_shared_keys import lend
from tests.chat.chat_route_helpers import MODEL, SMALL_MODEL, chat_async, chat_body, chat_worker
from tests.races import race

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def fingerprint(**body) -> str:
    return map_chat_request(validate_chat_request(chat_body(**body))).fingerprint


# --- the fingerprint ------------------------------------------------------------------------------


def test_fingerprint_ignores_what_does_not_define_the_operation():
    base = fingerprint()
    assert fingerprint(max_tokens=512) == base  # the default, sent
    assert fingerprint(max_tokens=300) == fingerprint(max_completion_tokens=300)
    assert fingerprint(model=MODEL) == fingerprint(models=[MODEL], model=None)
    assert fingerprint(models=[MODEL, SMALL_MODEL], model=None) == fingerprint(models=[SMALL_MODEL, MODEL], model=None)
    assert fingerprint(horde={"context_fit": "truncate_oldest", "slow_workers": True}) == base
    assert fingerprint(stream=True, stream_options={"include_usage": True}, user="u", metadata={"a": "b"}) == base
    assert fingerprint(temperature=1) == fingerprint(temperature=1.0)
    excluded = {
        "availability_mode": "fail_fast",
        "dry_run": True,
        "include_reasoning": False,
        "max_kudos": 5,
        "operation_key": str(uuid.uuid4()),
    }
    assert set(excluded) == OPERATION_FINGERPRINT_EXCLUDED_HORDE_KEYS
    assert fingerprint(horde=excluded) == base
    assert fingerprint(messages=[{"role": "developer", "content": "x"}]) == fingerprint(
        messages=[{"role": "system", "content": "x"}]
    )
    # A key sent as null is one not sent (ADR 0061), inside the messages too.
    plain = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://i.example/a.png"}}]},
        {"role": "assistant", "content": "a"},
    ]
    nulls = [
        {"role": "user", "name": None, "content": [
            {"type": "image_url", "image_url": {"url": "https://i.example/a.png", "detail": None}}
        ]},
        {"role": "assistant", "content": "a", "name": None, "tool_calls": None},
    ]
    assert fingerprint(messages=nulls) == fingerprint(messages=plain)
    assert validate_chat_request(chat_body(messages=nulls)).stored_messages() == [
        plain[0], {"role": "assistant", "content": "a"}
    ]


def test_fingerprint_covers_what_defines_the_operation():
    base = fingerprint()
    others = [
        fingerprint(messages=[{"role": "user", "content": "Hello!"}]),
        fingerprint(max_tokens=300),
        fingerprint(temperature=0.5),
        fingerprint(model=SMALL_MODEL),
        fingerprint(horde={"conformance": "best_effort"}),
        fingerprint(horde={"openai_guards": True}),
        fingerprint(tools=TOOLS),
        fingerprint(tools=TOOLS, tool_choice="none"),
    ]
    assert len({base, *others}) == len(others) + 1
    assert all(len(f) == 64 for f in others)


# --- repeated and conflicting keys ----------------------------------------------------------------


@pytest.fixture
def served(make_user):
    return chat_worker(make_user("owner"))


def test_repeated_key_returns_the_first_request_without_charging(horde, make_user, served, settings):
    requester = make_user("r", kudos=10_000)
    key = str(uuid.uuid4())
    first = chat_async(horde.client, requester.key, max_tokens=1024, horde={"operation_key": key})
    assert first.status_code == 202
    kudos_after_first = requester.refresh().kudos
    held_after_first = requester.refresh().kudos_held
    again = chat_async(horde.client, requester.key, max_completion_tokens=1024, horde={"operation_key": key})
    assert again.status_code == 200
    assert again.json() == {"id": first.json()["id"], "kudos": first.json()["kudos"]}
    assert GenerationRequest.objects.count() == 1
    assert (requester.refresh().kudos, requester.refresh().kudos_held) == (kudos_after_first, held_after_first)
    # Answered before the admission flag and any availability check.
    settings.HORDE_CHAT_ADMISSION_ENABLED = False
    served.delete()
    assert chat_async(horde.client, requester.key, max_tokens=1024, horde={"operation_key": key}).status_code == 200


def test_different_request_with_the_key_conflicts(horde, make_user, served):
    requester = make_user("r")
    key = str(uuid.uuid4())
    assert chat_async(horde.client, requester.key, horde={"operation_key": key}).status_code == 202
    response = chat_async(
        horde.client, requester.key, messages=[{"role": "user", "content": "Other"}], horde={"operation_key": key}
    )
    assert response.status_code == 400
    assert response.json() == {
        "message": "The operation_key was already used for a different request: a repeated submission has to "
        "send the same request.",
        "rc": "OperationKeyConflict",
    }
    assert GenerationRequest.objects.count() == 1


def test_a_key_is_one_claim_across_the_text_and_chat_routes(horde, make_user, served):
    """The user's claim on a key is one, whichever route made it: the other route's request with the
    key is another operation (400 OperationKeyConflict), never a 500 from the unique index."""
    requester = make_user("r", kudos=1000)
    chat_key, text_key = str(uuid.uuid4()), str(uuid.uuid4())
    assert chat_async(horde.client, requester.key, horde={"operation_key": chat_key}).status_code == 202
    assert horde.text_async(requester.key, models=[MODEL], operation_key=text_key).status_code == 202
    text_on_chat_key = horde.text_async(requester.key, models=[MODEL], operation_key=chat_key)
    chat_on_text_key = chat_async(horde.client, requester.key, horde={"operation_key": text_key})
    for refused in (text_on_chat_key, chat_on_text_key):
        assert refused.status_code == 400 and refused.json()["rc"] == "OperationKeyConflict", refused.json()
    assert GenerationRequest.objects.count() == 2


def test_same_key_from_another_user_is_a_separate_claim(horde, make_user, served):
    key = str(uuid.uuid4())
    first = chat_async(horde.client, make_user("a").key, horde={"operation_key": key})
    second = chat_async(horde.client, make_user("b").key, horde={"operation_key": key})
    assert (first.status_code, second.status_code) == (202, 202)
    assert first.json()["id"] != second.json()["id"]


def test_a_key_sent_through_a_shared_key_is_claimed_for_its_owner(horde, make_user, served, settings):
    """The claim is the shared key's owner's: the owner's own key repeating the operation is
    answered with the request the shared key made, and another request with the key conflicts,
    both before anything that could refuse (the admission flag here)."""
    lender = make_user("lender", kudos=1000)
    lent = lend(horde.client, lender.key, name="Mutual Aid", kudos=100)
    assert lent.status_code == 200, lent.json()
    shared = lent.json()["id"]
    key = str(uuid.uuid4())
    first = chat_async(horde.client, shared, horde={"operation_key": key})
    assert first.status_code == 202, first.json()
    kudos_after_first = lender.refresh().kudos
    settings.HORDE_CHAT_ADMISSION_ENABLED = False
    again = chat_async(horde.client, lender.key, horde={"operation_key": key})
    assert again.status_code == 200, again.json()
    assert again.json() == {"id": first.json()["id"], "kudos": first.json()["kudos"]}
    request = GenerationRequest.objects.get()
    assert request.user_id == lender.user.pk and str(request.shared_key_id) == shared
    assert str(request.operation_key) == key
    # The shared key repeating it is answered the same way.
    through_key = chat_async(horde.client, shared, horde={"operation_key": key})
    assert through_key.status_code == 200 and through_key.json() == again.json()
    assert lender.refresh().kudos == kudos_after_first
    conflict = chat_async(
        horde.client, lender.key, messages=[{"role": "user", "content": "Other"}], horde={"operation_key": key}
    )
    assert conflict.status_code == 400
    assert conflict.json() == {
        "message": "The operation_key was already used for a different request: a repeated submission has to "
        "send the same request.",
        "rc": "OperationKeyConflict",
    }
    assert GenerationRequest.objects.count() == 1


def test_dry_run_neither_looks_up_nor_claims(horde, make_user, served):
    requester = make_user("r")
    key = str(uuid.uuid4())
    dry = chat_async(horde.client, requester.key, horde={"operation_key": key, "dry_run": True})
    assert dry.status_code == 200 and "id" not in dry.json()
    assert not GenerationRequest.objects.exists()
    real = chat_async(horde.client, requester.key, horde={"operation_key": key})
    assert real.status_code == 202
    request = GenerationRequest.objects.get()
    assert str(request.operation_key) == key and len(request.operation_fingerprint) == 64
    # A dry run with the claimed key still quotes rather than answering the claim.
    quoted = chat_async(horde.client, requester.key, horde={"operation_key": key, "dry_run": True})
    assert quoted.status_code == 200 and "id" not in quoted.json()


def test_operation_key_must_be_a_uuid(horde, make_user, served):
    response = chat_async(horde.client, make_user("r").key, horde={"operation_key": "nope"})
    assert response.status_code == 400 and response.json()["rc"] == "BadRequest"
    assert response.json()["message"].startswith("'horde.operation_key'")


# --- the race -------------------------------------------------------------------------------------


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("same_request", [True, False])
def test_two_concurrent_submits_with_one_key_create_one_request_and_one_charge(allowance_at_the_floor, make_user, same_request):
    requester = make_user("r", kudos=10_000)
    chat_worker(make_user("owner"))
    key = str(uuid.uuid4())
    def submit(index: int):
        content = "Hello" if same_request else f"Hello {index}"
        return chat_async(
            APIClient(),
            requester.key,
            max_tokens=1024,
            messages=[{"role": "user", "content": content}],
            horde={"operation_key": key},
        )

    results = race([lambda: submit(0), lambda: submit(1)])
    codes = sorted(r.status_code for r in results)
    winner = next(r for r in results if r.status_code == 202)
    loser = next(r for r in results if r is not winner)
    if same_request:
        assert codes == [200, 202]
        assert loser.json() == {"id": winner.json()["id"], "kudos": winner.json()["kudos"]}
    else:
        assert codes == [202, 400] and loser.json()["rc"] == "OperationKeyConflict"
    assert GenerationRequest.objects.count() == 1
    request = GenerationRequest.objects.get()
    assert KudosTransaction.objects.filter(kind="horde_tax").count() == 1
    user = requester.refresh()
    assert user.kudos == Decimal("9999") and user.kudos_held == request.kudos_held > 0
