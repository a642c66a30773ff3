"""A web process killed (`kill -9`) while its mounted front waits for 8 requests (issue 13, item 1):
while it lives, its front leases keep every request through the sweeps; once it is dead, the sweep
cancels all 8, and after the restart no worker is handed any of them and nobody is charged for a
reply no client could receive (docs/adr/0020-front-lease.md). With a lease far longer than the test,
the killed process's requests are cancelled all the same: the restarted process refuses the held
job's submit and the sweep cancels the rest, because the front named its process beside the lease
and that process is gone (docs/adr/0028-dead-front-requests.md).

The web process is a real daphne subprocess on the test database, as in
tests/hordesite/test_web_restart.py: on PostgreSQL with Redis its front renews the leases in Redis, on
the embedded SQLite file (no Redis) through its status reads.
"""

from __future__ import annotations

import threading
import time
from decimal import Decimal

import httpx
import pytest

from tests.hordesite.test_web_restart import (
    CHAT_DECLARATION,
    CHAT_MODEL,
    SCRIBE_AGENT,
    WebProcess,
    web_env,
)
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TEXT_MODEL = "koboldcpp/Llama-3-8B"
LEASE_SECONDS = 2


def _web_process(tmp_path, lease_seconds: int):
    env = web_env(
        tmp_path,
        HORDE_TEXT_ASYNC_RATE_LIMITS="1000/second",
        HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP="1000/second",
        # Short leases, so the test waits seconds, not the default 30 s.
        HORDE_OAI_FRONT_LEASE_SECONDS=str(lease_seconds),
        HORDE_OAI_FRONT_LEASE_RENEW_SECONDS="0.5",
        HORDE_OAI_FAIL_FAST_GRACE_SECONDS="120",
        HORDE_OAI_NONSTREAM_TIMEOUT_SECONDS="120",
        HORDE_OAI_STREAM_TIMEOUT_SECONDS="120",
    )
    process = WebProcess(env, free_port(), tmp_path / "daphne.log")
    process.start()
    return process


@pytest.fixture
def web(tmp_path):
    process = _web_process(tmp_path, LEASE_SECONDS)
    yield process
    if process.proc and process.proc.poll() is None:
        process.kill()


@pytest.fixture
def long_leased_web(tmp_path):
    process = _web_process(tmp_path, 600)  # never lapses within the test
    yield process
    if process.proc and process.proc.poll() is None:
        process.kill()


def _front_request(url: str, key: str, index: int, errors: list) -> None:
    """One OpenAI client's request; it never gets an answer (the process dies under it)."""
    if index % 2:
        path, body = "/v1/chat/completions", {"model": CHAT_MODEL, "messages": [{"role": "user", "content": f"Hi {index}"}]}
    else:
        # Over the free output floor: the request holds its quote, which the cancel must release.
        path, body = "/v1/completions", {"model": TEXT_MODEL, "prompt": f"Story {index}:", "max_tokens": 1024}
    if index in (2, 3):
        body["stream"] = True
    try:
        response = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        errors.append(response.status_code)
    except httpx.HTTPError as error:
        errors.append(type(error).__name__)


def test_a_dead_fronts_requests_are_cancelled_by_the_sweep_and_never_charged(web):
    from accounts.models import HordeUser, KudosTransaction
    from chat.models import Generation, GenerationRequest
    from chat.services.admission import HORDE_TAX
    from chat.services.front_lease import cancel_lapsed_front_leases

    requester_key = web.manage("horde_user", "create", "dead-front-requester", "--kudos", "1000").strip().splitlines()[-1]
    volunteer_key = web.manage("horde_user", "create", "dead-front-volunteer", "--trusted").strip().splitlines()[-1]
    native = httpx.Client(base_url=web.url, timeout=30)
    chat_pop = {"name": "dead-front-chat", "models": [CHAT_MODEL], "max_length": 512, "max_context_length": 4096,
                "bridge_agent": SCRIBE_AGENT, **CHAT_DECLARATION}
    # The chat worker declares first, so the chat requests have an online worker; it pops nothing yet.
    assert native.post("generate/text/pop", json=chat_pop, headers={"apikey": volunteer_key}).json()["id"] is None
    requester = HordeUser.objects.get(username="dead-front-requester")
    kudos_before = requester.kudos

    root = f"http://127.0.0.1:{web.port}"
    answers: list = []
    clients = [threading.Thread(target=_front_request, args=(root, requester_key, i, answers)) for i in range(8)]
    for thread in clients:
        thread.start()
    deadline = time.monotonic() + 30
    while GenerationRequest.objects.filter(front_lease_expires_at__isnull=False).count() < 8:
        assert time.monotonic() < deadline, web.log.read_text()[-3000:]
        time.sleep(0.1)

    requester.refresh_from_db()
    assert requester.kudos_held > 0
    # Alive: several lease lengths pass, the sweep runs, and nothing is cancelled.
    for _ in range(6):
        time.sleep(LEASE_SECONDS / 2)
        assert cancel_lapsed_front_leases() == 0
    assert not GenerationRequest.objects.filter(cancelled=True).exists()
    assert answers == []  # every client is still waiting

    web.kill()
    for thread in clients:
        thread.join(10)
    assert len(answers) == 8 and 200 not in answers  # no client received a reply
    time.sleep(LEASE_SECONDS + 0.5)
    assert cancel_lapsed_front_leases() == 8
    assert GenerationRequest.objects.filter(cancelled=True, jobs_waiting=0).count() == 8

    web.start()
    text_pop = {"name": "dead-front-text", "models": [TEXT_MODEL], "max_length": 512, "max_context_length": 4096,
                "bridge_agent": SCRIBE_AGENT}
    for body in (chat_pop, text_pop):
        assert native.post("generate/text/pop", json=body, headers={"apikey": volunteer_key}).json()["id"] is None
    assert not Generation.objects.exists()
    requester.refresh_from_db()
    assert requester.kudos_held == Decimal("0")
    assert requester.kudos == kudos_before - 8 * HORDE_TAX  # the submits' tax, and no generation charged
    assert not KudosTransaction.objects.filter(kind=KudosTransaction.Kind.GENERATION_CHARGE).exists()
    assert cancel_lapsed_front_leases() == 0  # each handled once


def test_a_killed_web_process_s_requests_are_cancelled_before_their_lease_lapses(long_leased_web):
    """kill -9 of the web process with a job held by a worker and a request queued, restarted at
    once: the held job's submit to the new process is AbortedGen, the sweep cancels the queued one
    though its 600 s lease is far from lapsed, and nobody is charged or paid."""
    from accounts.models import HordeUser, KudosTransaction
    from chat.models import Generation, GenerationRequest
    from chat.services.admission import HORDE_TAX
    from chat.services.front_lease import cancel_lapsed_front_leases

    web = long_leased_web
    requester_key = web.manage("horde_user", "create", "killed-requester", "--kudos", "1000").strip().splitlines()[-1]
    volunteer_key = web.manage("horde_user", "create", "killed-volunteer", "--trusted").strip().splitlines()[-1]
    native = httpx.Client(base_url=web.url, timeout=30)
    requester = HordeUser.objects.get(username="killed-requester")
    kudos_before = requester.kudos
    root = f"http://127.0.0.1:{web.port}"
    answers: list = []
    clients = [threading.Thread(target=_front_request, args=(root, requester_key, i, answers)) for i in (0, 4)]
    for thread in clients:
        thread.start()
    deadline = time.monotonic() + 30
    while GenerationRequest.objects.filter(front_lease_expires_at__isnull=False).count() < 2:
        assert time.monotonic() < deadline, web.log.read_text()[-3000:]
        time.sleep(0.1)
    assert set(GenerationRequest.objects.values_list("front_id", flat=True)) == {
        GenerationRequest.objects.values_list("front_id", flat=True).first()
    }  # one process, one front id
    text_pop = {"name": "killed-text", "models": [TEXT_MODEL], "max_length": 1024, "max_context_length": 4096,
                "bridge_agent": SCRIBE_AGENT}
    held = native.post("generate/text/pop", json=text_pop, headers={"apikey": volunteer_key}).json()
    assert held["id"], held

    web.kill()
    for thread in clients:
        thread.join(10)
    assert len(answers) == 2 and 200 not in answers
    web.start()
    late = native.post("generate/text/submit", json={"id": held["id"], "generation": " Nobody reads this."},
                       headers={"apikey": volunteer_key})
    assert late.status_code == 400 and late.json()["rc"] == "AbortedGen"
    assert cancel_lapsed_front_leases() == 1  # the queued one; the held one's submit cancelled its own
    assert GenerationRequest.objects.filter(cancelled=True, jobs_waiting=0).count() == 2
    assert native.post("generate/text/pop", json=text_pop, headers={"apikey": volunteer_key}).json()["id"] is None
    assert Generation.objects.get(pk=held["id"]).state == Generation.State.CANCELLED
    requester.refresh_from_db()
    assert requester.kudos_held == Decimal("0")
    assert requester.kudos == kudos_before - 2 * HORDE_TAX
    kinds = (KudosTransaction.Kind.GENERATION_CHARGE, KudosTransaction.Kind.GENERATION_REWARD)
    assert not KudosTransaction.objects.filter(kind__in=kinds).exists()
