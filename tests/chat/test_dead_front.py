"""A dead front's requests (docs/adr/0028-dead-front-requests.md): a front names its process beside
its lease; once that process is gone (here a real child process, killed), its requests are
cancelled at the next sweep though their lease has not lapsed, and a worker's submit for one of
them is refused AbortedGen: nobody is charged for a reply no client can receive. A live front, an
unnamed one and one on another host are left to the lease. Through the native routes, on the
embedded database without Redis and on PostgreSQL with Redis alike."""

from __future__ import annotations

import subprocess
import sys
import uuid
from decimal import Decimal

import pytest

from accounts.models import KudosTransaction
from chat.models import Generation, GenerationRequest
from chat.services.front_lease import cancel_lapsed_front_leases
from contract.front_lease import FRONT_ID_HEADER, FRONT_LEASE_HEADER, front_process_gone, new_front_id
from tests.chat.chat_route_helpers import CHAT_ASYNC, MODEL, chat_body, chat_worker
from tests.hordesite.test_web_restart import CHAT_DECLARATION

LEASE_KEY = f"HTTP_{FRONT_LEASE_HEADER.upper().replace('-', '_')}"
FRONT_KEY = f"HTTP_{FRONT_ID_HEADER.upper().replace('-', '_')}"


@pytest.fixture
def dead_front():
    """A front id of a process that ran on this host and was killed (kill -9)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    front_id = new_front_id(child.pid)
    assert "/" in front_id and not front_process_gone(front_id)  # alive, it is not gone
    child.kill()
    child.wait()
    assert front_process_gone(front_id)
    return front_id


def leased(front_id: str | None, seconds: int = 600) -> dict:
    headers = {LEASE_KEY: str(seconds)}
    if front_id is not None:
        headers[FRONT_KEY] = front_id
    return headers


def text_async(horde, key: str, headers: dict, max_length: int = 64):
    body = {"prompt": "Once upon a time", "params": {"max_length": max_length}, "models": [MODEL]}
    return horde.client.post("/api/v2/generate/text/async", body, format="json", HTTP_APIKEY=key, **headers)


def chat_async(client, key: str, **headers):
    return client.post(CHAT_ASYNC, chat_body(), format="json", HTTP_APIKEY=key, **headers)


def charges() -> int:
    kinds = (KudosTransaction.Kind.GENERATION_CHARGE, KudosTransaction.Kind.GENERATION_REWARD)
    return KudosTransaction.objects.filter(kind__in=kinds).count()


def test_the_front_id_is_stored_with_a_lease_or_on_a_chat_request(horde, make_user, dead_front):
    """A text request's; a chat request's without one too (a background response's, docs/adr/0110),
    which a dead front does not cancel: only a lease asks for that."""
    requester = make_user("r", kudos=1000)
    chat_worker(make_user("owner"))
    alive = new_front_id()
    with_lease = text_async(horde, requester.key, leased(alive)).json()["id"]
    without_lease = text_async(horde, requester.key, {FRONT_KEY: alive}).json()["id"]
    malformed = text_async(horde, requester.key, {**leased(None), FRONT_KEY: "front; rm -rf /"}).json()["id"]
    chat = chat_async(horde.client, requester.key, **leased(dead_front)).json()["id"]
    background = chat_async(horde.client, requester.key, **{FRONT_KEY: dead_front}).json()["id"]
    fronts = dict(GenerationRequest.objects.values_list("id", "front_id"))
    assert fronts[uuid.UUID(with_lease)] == alive
    assert fronts[uuid.UUID(without_lease)] is None and fronts[uuid.UUID(malformed)] is None
    assert fronts[uuid.UUID(chat)] == dead_front and fronts[uuid.UUID(background)] == dead_front
    assert cancel_lapsed_front_leases() == 1  # the leased chat request; the background one runs on
    assert not GenerationRequest.objects.get(pk=background).cancelled


def test_the_sweep_cancels_a_dead_fronts_requests_before_their_lease_lapses(horde, make_user, dead_front):
    requester = make_user("r", kudos=1000)
    chat_worker(make_user("owner"))
    dead_text = text_async(horde, requester.key, leased(dead_front), max_length=1024).json()["id"]
    dead_chat = chat_async(horde.client, requester.key, **leased(dead_front)).json()["id"]
    live = text_async(horde, requester.key, leased(new_front_id())).json()["id"]
    unnamed = text_async(horde, requester.key, leased(None)).json()["id"]
    elsewhere_id = f"{uuid.uuid4().hex}/another-host/{uuid.uuid4()}/4026531836/1/1"
    elsewhere = text_async(horde, requester.key, leased(elsewhere_id)).json()["id"]
    assert requester.refresh().kudos_held > 0
    kudos = requester.refresh().kudos

    assert cancel_lapsed_front_leases() == 2
    rows = {str(r.id): r for r in GenerationRequest.objects.all()}
    assert rows[dead_text].cancelled and rows[dead_chat].cancelled
    assert rows[dead_text].front_lease_expires_at is None and rows[dead_text].jobs_waiting == 0
    assert not any(rows[r].cancelled for r in (live, unnamed, elsewhere))
    user = requester.refresh()
    assert (user.kudos, user.kudos_held) == (kudos, Decimal("0"))
    assert horde.status(dead_text).json()["done"] is True
    assert horde.client.get(f"/api/v2/generate/chat/status/{dead_chat}").json()["done"] is True
    assert cancel_lapsed_front_leases() == 0  # each handled once
    assert charges() == 0


def _queued_and_popped(horde, requester, owner, front_id: str, kind: str) -> tuple[str, dict]:
    """A text or chat request made through `front_id`'s lease, and its job popped: (request id, job)."""
    if kind == "text":
        created = text_async(horde, requester.key, leased(front_id)).json()["id"]
        job = horde.pop(owner.key, models=[MODEL]).json()
    else:  # the worker declares first, so the request finds an online worker
        assert horde.pop(owner.key, models=[MODEL], **CHAT_DECLARATION).json()["id"] is None
        created = chat_async(horde.client, requester.key, **leased(front_id)).json()["id"]
        job = horde.pop(owner.key, models=[MODEL], **CHAT_DECLARATION).json()
    assert job["id"], job
    return created, job


def _late_submit_ends_unpaid(horde, requester, owner, created: str, job: dict, kind: str) -> None:
    """The worker's submit is AbortedGen, its job ends unpaid, the request is cancelled and nobody
    is charged or paid."""
    kudos = requester.refresh().kudos
    if kind == "text":
        late = horde.submit(owner.key, job["id"], " Nobody reads this.")
    else:
        late = horde.chat_submit(
            owner.key, job["id"], model_id=MODEL, message={"role": "assistant", "content": "Nobody reads this."},
            finish_reason="stop",
        )
    assert late.status_code == 400 and late.json()["rc"] == "AbortedGen", late.content
    generation = Generation.objects.get(pk=job["id"])
    assert generation.state == Generation.State.CANCELLED and generation.kudos == 0
    request = GenerationRequest.objects.get(pk=created)
    assert request.cancelled and request.front_lease_expires_at is None
    assert requester.refresh().kudos == kudos and requester.refresh().kudos_held == 0
    assert charges() == 0


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_job_in_flight_for_a_dead_front_is_refused_at_submit_and_nobody_pays(horde, make_user, dead_front, kind):
    """The submit itself finds the front gone (a restarted web process serves the held job's submit
    before any sweep): the request is cancelled, the job ends unpaid, the submit is AbortedGen."""
    requester = make_user("r", kudos=1000)
    owner = make_user("owner", trusted=True)
    created, job = _queued_and_popped(horde, requester, owner, dead_front, kind)
    _late_submit_ends_unpaid(horde, requester, owner, created, job, kind)
    assert cancel_lapsed_front_leases() == 0


def test_the_sweep_ends_a_dead_fronts_job_in_flight_unpaid(horde, make_user, dead_front):
    requester = make_user("r", kudos=1000)
    owner = make_user("owner", trusted=True)
    created = text_async(horde, requester.key, leased(dead_front)).json()["id"]
    job = horde.pop(owner.key, models=[MODEL]).json()
    assert cancel_lapsed_front_leases() == 1
    assert Generation.objects.get(pk=job["id"]).state == Generation.State.CANCELLED
    late = horde.submit(owner.key, job["id"], " Late.")
    assert late.status_code == 400 and late.json()["rc"] == "AbortedGen"
    assert GenerationRequest.objects.get(pk=created).cancelled
    assert charges() == 0


def test_a_live_fronts_job_submits_and_is_paid(horde, make_user):
    requester = make_user("r", kudos=1000)
    owner = make_user("owner", trusted=True)
    created = text_async(horde, requester.key, leased(new_front_id())).json()["id"]
    job = horde.pop(owner.key, models=[MODEL]).json()
    assert cancel_lapsed_front_leases() == 0
    assert horde.submit(owner.key, job["id"], " The end.").status_code == 200
    assert not GenerationRequest.objects.get(pk=created).cancelled
    assert charges() > 0


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_job_of_a_request_cancelled_before_its_front_died_is_refused_at_submit_and_nobody_pays(
    horde, make_user, dead_front, kind
):
    """The front cancelled its request (a stop, a client gone) and its process exited before the
    worker's submit: the job in flight ends unpaid and the submit is AbortedGen, as for a request
    whose front died first, not DuplicateGen with the job left processing."""
    requester = make_user("r", kudos=1000)
    owner = make_user("owner", trusted=True)
    created, job = _queued_and_popped(horde, requester, owner, dead_front, kind)
    route = "text" if kind == "text" else "chat"
    cancelled = horde.client.delete(f"/api/v2/generate/{route}/status/{created}", HTTP_APIKEY=requester.key)
    assert cancelled.status_code == 200, cancelled.content
    _late_submit_ends_unpaid(horde, requester, owner, created, job, kind)
    assert horde.client.get(f"/api/v2/generate/{route}/status/{created}").json()["done"] is True


def test_a_job_of_a_request_faulted_before_its_front_died_is_refused_at_submit_and_nobody_pays(horde, make_user):
    """A text request of two jobs whose other job faulted past the limit (the request faulted, one
    job still in flight) and whose front then died: nobody can receive that job's reply, so it ends
    unpaid and its submit is AbortedGen, as for a cancelled request. Before, the submit was answered
    DuplicateGen with the job left processing and the lease cleared, so the worker's retry was paid
    and the requester charged for a reply no client could receive."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        front_id = new_front_id(child.pid)
        requester = make_user("r", kudos=1000)
        owner = make_user("owner", trusted=True)
        body = {"prompt": "Once upon a time", "params": {"max_length": 64, "n": 2}, "models": [MODEL]}
        created = horde.client.post(
            "/api/v2/generate/text/async", body, format="json", HTTP_APIKEY=requester.key, **leased(front_id)
        ).json()["id"]
        kept = horde.pop(owner.key, models=[MODEL]).json()
        assert kept["id"], kept
        for _ in range(3):  # FAULTED_GENERATIONS_LIMIT (2) exceeded: the request faults
            job = horde.pop(owner.key, models=[MODEL]).json()
            assert job["id"], job
            assert horde.submit(owner.key, job["id"], "", state="faulted").status_code == 200
        assert GenerationRequest.objects.get(pk=created).faulted
    finally:
        child.kill()
        child.wait()
    assert front_process_gone(front_id)
    kudos = requester.refresh().kudos
    for _ in range(2):  # the submit, then the worker's retry
        late = horde.submit(owner.key, kept["id"], " Nobody reads this.")
        assert late.status_code == 400 and late.json()["rc"] == "AbortedGen", late.content
    generation = Generation.objects.get(pk=kept["id"])
    assert generation.state == Generation.State.CANCELLED and generation.kudos == 0
    assert requester.refresh().kudos == kudos and requester.refresh().kudos_held == 0
    assert charges() == 0
    assert GenerationRequest.objects.get(pk=created).faulted
