"""The reference worker long-polls (ADR 0024): an idle bridge whose next poll is half a minute away
takes a request as it arrives, through daphne's hot route layer."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from contract.text import TEXT_POP_WAIT_MAX_SECONDS
from tests.bridge.conftest import LiveHorde as BridgeHorde
from tests.bridge.conftest import running_bridge
from tests.bridge.processes import checked_in_bridge_process, signal_and_wait
from tests.oai.conftest import wait_for
from tests.oai.test_pop_long_poll import pops_served
from workers.bridge.scripted import ScriptedBackend

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _no_recheck(settings):
    settings.HORDE_POP_WAIT_RECHECK_SECONDS = 60.0


def test_an_idle_bridge_takes_a_request_as_it_arrives(live_horde, make_user):
    owner = make_user(f"lp-bridge-{uuid.uuid4().hex[:6]}", trusted=True)
    requester = make_user(f"lp-bridge-req-{uuid.uuid4().hex[:6]}", kudos=10_000)
    horde = BridgeHorde(live_horde.url, owner.key, requester.key)
    bridge_run = running_bridge(horde, ScriptedBackend(), pop_interval=30.0, pop_wait=TEXT_POP_WAIT_MAX_SECONDS)
    with pops_served() as pops, bridge_run as (_, out):
        # The thread's second pop is held at the horde: its check-in, then the held pop's two runs.
        assert wait_for(lambda: len(pops) >= 3, 15), out.text()
        started = time.monotonic()
        request_id = horde.chat(messages=[{"role": "user", "content": "Hi"}])
        status = horde.wait(request_id, timeout=40)
        elapsed = time.monotonic() - started
    assert status["done"], status
    assert status["generations"][0]["message"]["content"] == "Scripted reply to: Hi"
    # Woken: the held pop would have answered at its wait's end (20 s), polling alone 30 s after it.
    assert elapsed < TEXT_POP_WAIT_MAX_SECONDS / 2, out.text()
    horde.client.close()


def test_a_stopped_bridge_ends_its_held_pop_at_once_and_is_handed_nothing(live_horde, make_user):
    """A stop while the horde holds the bridge's pop: the pop ends (the horde sees the worker gone),
    the bridge stops well inside its stop grace, and a request made after it waits for another
    worker rather than being handed to the one that stopped."""
    owner = make_user(f"lp-stop-{uuid.uuid4().hex[:6]}", trusted=True)
    requester = make_user(f"lp-stop-req-{uuid.uuid4().hex[:6]}", kudos=10_000)
    horde = BridgeHorde(live_horde.url, owner.key, requester.key)
    bridge_run = running_bridge(
        horde, ScriptedBackend(), pop_interval=30.0, pop_wait=TEXT_POP_WAIT_MAX_SECONDS, stop_grace=20.0
    )
    with pops_served() as pops, bridge_run as (bridge, out):
        # The thread's next pop is held at the horde: its check-in, then the held pop's two runs.
        assert wait_for(lambda: len(pops) >= 3, 15), out.text()
        started = time.monotonic()
        bridge.request_stop()
    stopped_in = time.monotonic() - started  # running_bridge joins the bridge's thread
    # At once: not at the held pop's end (20 s) nor the stop grace's (20 s).
    assert stopped_in < TEXT_POP_WAIT_MAX_SECONDS / 2, (stopped_in, out.text())
    assert "horde unreachable" not in out.text()
    assert bridge.stats.ok == 0 and bridge.stats.faulted == 0
    time.sleep(0.3)  # a pop the horde still held would take the request below
    request_id = horde.chat(messages=[{"role": "user", "content": "Hi"}])
    time.sleep(1.0)
    status = horde.chat_status(request_id)
    assert status["waiting"] == 1 and status["processing"] == 0, status
    horde.client.close()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_idle_bridge_process_stops_on_a_signal_at_once(live_horde, make_user, stop):
    """`python -m workers.bridge`, idle with its pop held: Ctrl-C (or the service manager's SIGTERM)
    stops it at once, not at the end of the held pop or the stop grace."""
    owner = make_user(f"lp-sig-{uuid.uuid4().hex[:6]}", trusted=True)
    requester = make_user(f"lp-sig-req-{uuid.uuid4().hex[:6]}", kudos=10_000)
    horde = BridgeHorde(live_horde.url, owner.key, requester.key)
    wait = str(TEXT_POP_WAIT_MAX_SECONDS)
    with checked_in_bridge_process(horde, "scripted", "--pop-wait", wait, "--stop-grace", "20") as proc:
        time.sleep(1.0)  # past the check-in pop: the next one is held
        output, stopped_in = signal_and_wait(proc, stop, timeout=20)
    assert proc.returncode == 0, output
    assert f"{stop.name}: stopping" in output and "horde unreachable" not in output
    assert stopped_in < TEXT_POP_WAIT_MAX_SECONDS / 2, (stopped_in, output)  # not at the held pop's end
    horde.client.close()
