"""The quote a request's creation returns bounds what it is charged (ADR 0004; the spec's max_kudos
check "is conservative"), at any max_length, for an unknown model too (docs/adr/0090). Found by the
ledger state machine (tests/chat/test_ledger_state_machine.py): below 38 tokens an unknown model's
untrusted rate, the context multiplier flat, is dearer than the trusted per-token rate the quote
assumed, and a 16-token request quoted 0.52 was charged 1.21."""

from __future__ import annotations

from decimal import Decimal

import pytest

from accounts.models import KudosTransaction
from tests.chat.chat_route_helpers import chat_async, chat_worker

UNKNOWN = "example/not-in-the-reference-7b"
TAX = Decimal("1")


def _charged(request_id: str) -> Decimal:
    rows = KudosTransaction.objects.filter(request_id=request_id, kind=KudosTransaction.Kind.GENERATION_CHARGE)
    return -sum((row.amount for row in rows), Decimal("0"))


@pytest.mark.parametrize("trusted", [False, True])
@pytest.mark.parametrize("max_length", [16, 37, 38, 64])
def test_an_unknown_text_models_charge_stays_within_its_quote(horde, make_user, trusted, max_length):
    requester = make_user(kudos=100)
    owner = make_user(trusted=trusted)
    created = horde.text_async(requester.key, params={"n": 1, "max_length": max_length}, models=[UNKNOWN])
    assert created.status_code == 202, created.content
    job = horde.pop(owner.key, models=[UNKNOWN]).json()
    assert job["id"], job
    # A full-length reply: the dearest a generation can be.
    assert horde.submit(owner.key, job["id"], "word " * max_length, state="ok").status_code == 200
    quote = Decimal(str(created.json()["kudos"])) - TAX
    charged = _charged(created.json()["id"])
    assert Decimal("0") < charged <= quote, (charged, quote)
    if not trusted and max_length < 38:
        assert charged == quote  # the untrusted owner's flat rate is the dearer one here
    dry = horde.text_async(requester.key, params={"n": 2, "max_length": max_length}, models=[UNKNOWN], dry_run=True)
    assert Decimal(str(dry.json()["kudos"])) - TAX >= 2 * charged


def test_an_unknown_chat_models_charge_stays_within_its_quote(horde, make_user):
    requester = make_user(kudos=100)
    owner = make_user()
    chat_worker(owner, model=UNKNOWN)
    created = chat_async(horde.client, requester.key, model=UNKNOWN, max_tokens=16)
    assert created.status_code == 202, created.content
    job = horde.pop(
        owner.key, name=owner.user.username, models=[UNKNOWN], chat_jobs=True,
        chat_features=["prompt_overflow_refused"], chat_limits={"max_context_length": 8192, "max_length": 2048},
        model_id=UNKNOWN,
    ).json()
    assert job["id"], job
    submitted = horde.chat_submit(
        owner.key, job["id"], message={"role": "assistant", "content": "Hi."}, finish_reason="stop", model_id=UNKNOWN
    )
    assert submitted.status_code == 200, submitted.content
    quote = Decimal(str(created.json()["kudos"])) - TAX
    charged = _charged(created.json()["id"])
    assert Decimal("0") < charged == quote, (charged, quote)
