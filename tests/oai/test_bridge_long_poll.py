"""The reference worker long-polls (ADR 0024): an idle bridge whose next poll is half a minute away
takes a request as it arrives, through daphne's hot route layer."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.bridge.conftest import LiveHorde as BridgeHorde
from tests.bridge.conftest import running_bridge
from workers.bridge.scripted import ScriptedBackend

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _no_recheck(settings):
    settings.HORDE_POP_WAIT_RECHECK_SECONDS = 60.0


def test_an_idle_bridge_takes_a_request_as_it_arrives(live_horde, make_user):
    owner = make_user(f"lp-bridge-{uuid.uuid4().hex[:6]}", trusted=True)
    requester = make_user(f"lp-bridge-req-{uuid.uuid4().hex[:6]}", kudos=10_000)
    horde = BridgeHorde(live_horde.url, owner.key, requester.key)
    with running_bridge(horde, ScriptedBackend(), pop_interval=30.0, pop_wait=5) as (_, out):
        time.sleep(0.3)  # the thread's second pop is held at the horde
        started = time.monotonic()
        request_id = horde.chat(messages=[{"role": "user", "content": "Hi"}])
        status = horde.wait(request_id, timeout=10)
        elapsed = time.monotonic() - started
    assert status["done"], status
    assert status["generations"][0]["message"]["content"] == "Scripted reply to: Hi"
    assert elapsed < 2.0, out.text()  # polling alone would pop again 30 s after the first
    horde.client.close()
