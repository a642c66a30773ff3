"""A request's hold is released whole once its results are in (drills/reconcile.py: a completed
request holds nothing). Found by the ledger state machine (tests/chat/test_ledger_state_machine.py):
each result released its share rounded to the cent, halves to even, so a hold of 3p + 1 (three
generations at p and the tax) released p + 0.33 three times and kept 0.01 held on a done request,
out of its requester's available kudos until the expiry sweep deleted the row."""

from __future__ import annotations

from decimal import Decimal

import pytest

from chat.models import GenerationRequest
from drills.reconcile import reconcile
from tests.test_drill_reconcile import _query

MODEL = "Gryphe/MythoMax-L2-13b"


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_a_done_request_holds_nothing(horde, make_user, n):
    requester = make_user(kudos=1000)
    volunteer = make_user()
    created = horde.text_async(
        requester.key, params={"n": n, "max_length": 64}, models=[MODEL], slow_workers=False  # held upfront
    )
    assert created.status_code == 202, created.content
    request_id = created.json()["id"]
    held = Decimal(str(created.json()["kudos"]))
    assert GenerationRequest.objects.get(pk=request_id).kudos_held == held == requester.refresh().kudos_held
    for _ in range(n):
        job = horde.pop(volunteer.key).json()
        assert job["id"], job
        assert horde.submit(volunteer.key, job["id"], "A short reply.", state="ok").status_code == 200
    assert horde.status(request_id).json()["done"] is True
    assert GenerationRequest.objects.get(pk=request_id).kudos_held == 0
    assert requester.refresh().kudos_held == 0
    assert not reconcile(_query, []).hold_mismatch
