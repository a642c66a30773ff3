"""Nothing charged for nothing (issue 13, item 1; docs/adr/0020-front-lease.md), against the live horde:
a submit the front gives up on is found by its operation key and cancelled; a request whose front
lease is no longer renewed is cancelled by the sweep; a live front's requests never are, whether it
renews in Redis or through its status reads."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from decimal import Decimal

import openai
import pytest

from tests.oai.conftest import MODEL, HordeTestWorker, ScribeTextWorker, wait_for
from tests.oai.test_text_completions import PROMPT, delaying_proxy  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hello?"}]
ASYNC_LINE = {"chat": b"POST /api/v2/generate/chat/async", "text": b"POST /api/v2/generate/text/async"}


def _create(client, route: str, **extra):
    if route == "chat":
        return client.chat.completions.create(model=MODEL, messages=USER, **extra)
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, **extra)


def _idle_worker(live_horde, worker_owner, route: str) -> HordeTestWorker | ScribeTextWorker:
    """A chat or text worker that checked in (the model is served) and does not pop until started."""
    kind = HordeTestWorker if route == "chat" else ScribeTextWorker
    worker = kind(live=live_horde, key=worker_owner.key)
    worker.check_in()
    return worker



def _charges() -> int:
    from accounts.models import KudosTransaction

    return KudosTransaction.objects.filter(kind=KudosTransaction.Kind.GENERATION_CHARGE).count()


def _assert_settled_as_a_cancel(requester, kudos_before: Decimal) -> None:
    """One request, cancelled with nothing handed out: the requester paid its submit's horde tax and
    nothing else, holds nothing, and the ledger has no generation charge."""
    from chat.models import Generation, GenerationRequest
    from chat.services.admission import HORDE_TAX

    request = GenerationRequest.objects.get()
    assert request.cancelled and request.jobs_waiting == 0 and request.kudos_held == 0
    assert not Generation.objects.exists()
    user = requester.refresh()
    assert (user.kudos, user.kudos_held) == (kudos_before - HORDE_TAX, Decimal("0"))
    assert _charges() == 0


@pytest.mark.parametrize("route", ["chat", "text"])
def test_a_given_up_submit_is_found_by_its_operation_key_and_cancelled(
    front, client, requester, delaying_proxy, live_horde, worker_owner, route  # noqa: F811
):
    """The submit's answer and its re-send's answer are both lost: before the front answers 502 it
    sends the submit once more, learns the request the horde holds for the key, and cancels it."""
    from chat.models import GenerationRequest

    worker = _idle_worker(live_horde, worker_owner, route)
    kudos = requester.refresh().kudos
    proxy = delaying_proxy({ASYNC_LINE[route]: 3.0}, times={ASYNC_LINE[route]: 2})
    front.configure(native_roots=[proxy.root], native_timeout_seconds=1.0)
    with pytest.raises(openai.InternalServerError) as caught:
        _create(client, route)
    assert caught.value.status_code == 502 and caught.value.code == "HordeUnavailable"
    assert caught.value.body["metadata"] == {"submit_outcome": "unknown"}
    # Cancelled before the client had its answer.
    _assert_settled_as_a_cancel(requester, kudos)
    assert GenerationRequest.objects.get().operation_key is not None
    metrics = front.metrics()
    assert [v for _, v in metrics["horde.oai.submit.outcome_unknown"]] == [1]
    assert ({"horde.outcome": "acknowledged"}, 1) in metrics["horde.oai.cancels"]
    # The worker, popping now, gets nothing of it.
    worker.start()
    try:
        time.sleep(1.0)
        assert worker.jobs == []
    finally:
        worker.stop()
    _assert_settled_as_a_cancel(requester, kudos)


@pytest.mark.parametrize("front_redis", [pytest.param(True, marks=pytest.mark.redis_only), False])
def test_a_given_up_submit_the_front_never_learns_of_is_cancelled_by_the_sweep(
    front, client, requester, delaying_proxy, front_redis  # noqa: F811
):
    """Every answer of the text submit route is lost: the front cannot find the request, and its
    lease, taken with the submit and never renewed, lapses; the sweep cancels it."""
    from django.conf import settings

    from chat.models import GenerationRequest
    from chat.services.front_lease import cancel_lapsed_front_leases

    kudos = requester.refresh().kudos
    proxy = delaying_proxy({ASYNC_LINE["text"]: 3.0})
    front.configure(
        native_roots=[proxy.root],
        native_timeout_seconds=1.0,
        front_lease_seconds=1,
        front_lease_renew_seconds=0.3,
        redis_url=settings.REDIS_URL if front_redis else None,
    )
    with pytest.raises(openai.InternalServerError) as caught:
        _create(client, "text")
    assert caught.value.body["metadata"] == {"submit_outcome": "unknown"}
    request = GenerationRequest.objects.get()
    assert not request.cancelled and request.front_lease_expires_at is not None
    wait_for(lambda: GenerationRequest.objects.get().front_lease_expires_at < _now(), 5)
    time.sleep(0.1)
    assert cancel_lapsed_front_leases() == 1
    _assert_settled_as_a_cancel(requester, kudos)


def _now():
    from django.utils import timezone

    return timezone.now()


@pytest.mark.parametrize(
    "renewal", [pytest.param("redis", marks=pytest.mark.redis_only), "status_in_process", "status_over_http"]
)
@pytest.mark.parametrize("route", ["chat", "text"])
def test_a_live_front_keeps_its_requests_past_many_lease_lengths(
    front, client, requester, live_horde, worker_owner, route, renewal
):
    """Two-second leases renewed every 0.3 s (in Redis, or without it through the status reads, in
    process or over HTTP through the hot route layer): the sweep, run every 0.2 s for 4.5 s, cancels
    nothing, and the reply is then delivered and paid. (A one-second lease lapsed once on a box at
    load 7: a renewal's read can wait that long for a core.)"""
    from django.conf import settings

    from chat.models import GenerationRequest
    from chat.services.front_lease import cancel_lapsed_front_leases

    front_redis = renewal == "redis"
    transport = {"native_roots": [f"{live_horde.url}/api/v2"]} if renewal == "status_over_http" else {}
    front.configure(
        front_lease_seconds=2,
        front_lease_renew_seconds=0.3,
        fail_fast_grace_seconds=30.0,
        redis_url=settings.REDIS_URL if front_redis else None,
        **transport,
    )
    worker = _idle_worker(live_horde, worker_owner, route)
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(_create(client, route)))
    thread.start()
    assert wait_for(lambda: GenerationRequest.objects.exists(), 5)
    first_expiry = GenerationRequest.objects.get().front_lease_expires_at
    cancelled = 0
    deadline = time.monotonic() + 4.5
    while time.monotonic() < deadline:
        cancelled += cancel_lapsed_front_leases()
        time.sleep(0.2)
    assert cancelled == 0
    request = GenerationRequest.objects.get()
    assert not request.cancelled
    if not front_redis:  # renewed on the row by the status reads (the sweeps above found it live
        # each time); with Redis, the row takes the key's expiry only when a sweep finds it lapsed.
        # Measured against the first expiry, not the clock: a loaded box may delay the last renewal.
        assert request.front_lease_expires_at >= first_expiry + timedelta(seconds=3)
    worker.start()
    try:
        thread.join(15)
    finally:
        worker.stop()
    assert len(answers) == 1 and answers[0].choices
    assert _charges() == 1
    leases = front.state().leases
    if front_redis:  # renewed in Redis (the sweep carried each key's expiry over to the row)
        assert leases is not None and leases.healthy
    else:  # renewed by the status reads' header alone
        assert leases is None
