"""A stopping front's cancel of a request it cannot deliver (docs/adr/0086): `Horde-Front-Undelivered:
stopping` on the native cancel ends the request as a dead front's (its job in flight unpaid, the late
submit AbortedGen, nobody charged but the horde tax), and only for a front the horde knows by its
proxy passkey, for a request leased under the front id it sends. Anyone else sending the header,
the requester first of all, gets the spec's cancel: the job in flight submits and is paid as usual,
so the header is no way to free output. Through the native routes, on the embedded database and on
PostgreSQL alike."""

from __future__ import annotations

import pytest

from accounts.models import KudosTransaction
from chat.models import Generation, GenerationRequest
from contract.front_lease import (
    FRONT_ID_HEADER,
    FRONT_UNDELIVERED_HEADER,
    FRONT_UNDELIVERED_VALUE,
    new_front_id,
)
from contract.rate_limits import PROXY_PASSKEY_HEADER
from tests.chat.chat_route_helpers import MODEL
from tests.chat.test_dead_front import (
    CHAT_DECLARATION,
    FRONT_KEY,
    _late_submit_ends_unpaid,
    _queued_and_popped,
    charges,
    chat_async,
)

PASSKEY = "the-fronts-passkey"


def meta(header: str) -> str:
    return "HTTP_" + header.upper().replace("-", "_")


def undelivered_cancel(horde, kind: str, request_id: str, *, front_id: str, passkey: str | None, key: str | None = None):
    headers = {meta(FRONT_UNDELIVERED_HEADER): FRONT_UNDELIVERED_VALUE, meta(FRONT_ID_HEADER): front_id}
    if passkey is not None:
        headers[meta(PROXY_PASSKEY_HEADER)] = passkey
    if key is not None:
        headers["HTTP_APIKEY"] = key
    route = "text" if kind == "text" else "chat"
    answer = horde.client.delete(f"/api/v2/generate/{route}/status/{request_id}", **headers)
    assert answer.status_code == 200, answer.content
    return answer


@pytest.fixture
def known_front(settings):
    settings.HORDE_PROXY_PASSKEYS = [PASSKEY]


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_known_fronts_undelivered_cancel_ends_its_job_unpaid(horde, make_user, known_front, kind):
    requester = make_user("r", kudos=1000)
    owner = make_user("owner", trusted=True)
    front = new_front_id()  # this process: a live front, which the dead-front rule would never cancel
    created, job = _queued_and_popped(horde, requester, owner, front, kind)
    taxed = requester.refresh().kudos
    undelivered_cancel(horde, kind, created, front_id=front, passkey=PASSKEY)
    generation = Generation.objects.get(pk=job["id"])
    assert generation.state == Generation.State.CANCELLED and generation.kudos == 0
    _late_submit_ends_unpaid(horde, requester, owner, created, job, kind)
    assert requester.refresh().kudos == taxed  # the horde tax of the submit, nothing for the generation
    assert not KudosTransaction.objects.filter(user=owner.user).exists()


@pytest.mark.parametrize(
    ("kind", "who"),
    [
        ("text", "the requester, without a passkey"),
        ("chat", "the requester, without a passkey"),
        ("chat", "an unknown passkey"),
        ("text", "a known front, for another front's request"),
        ("chat", "a known front, for another front's request"),
    ],
)
def test_anyone_else_asking_gets_the_specs_cancel_and_the_job_is_paid(horde, make_user, known_front, kind, who):
    """The requester knows its request's id and could send the header and even its front id (it
    chose them at the submit): without the passkey the cancel is the spec's, the job in flight
    submits and is paid, and the requester is charged for the reply it receives."""
    requester = make_user("r", kudos=1000)
    owner = make_user("owner", trusted=True)
    front = new_front_id()
    created, job = _queued_and_popped(horde, requester, owner, front, kind)
    taxed = requester.refresh().kudos
    if who == "the requester, without a passkey":
        undelivered_cancel(horde, kind, created, front_id=front, passkey=None, key=requester.key)
    elif who == "an unknown passkey":
        undelivered_cancel(horde, kind, created, front_id=front, passkey="guessed", key=requester.key)
    else:
        undelivered_cancel(horde, kind, created, front_id=new_front_id(), passkey=PASSKEY)
    request = GenerationRequest.objects.get(pk=created)
    assert request.cancelled and request.front_lease_expires_at is not None  # the spec's cancel, lease kept
    assert Generation.objects.get(pk=job["id"]).state == Generation.State.PROCESSING
    if kind == "text":
        submitted = horde.submit(owner.key, job["id"], " Paid as usual.")
    else:
        submitted = horde.chat_submit(
            owner.key, job["id"], model_id=MODEL, message={"role": "assistant", "content": "Paid as usual."},
            finish_reason="stop",
        )
    assert submitted.status_code == 200 and submitted.json()["reward"] > 0, submitted.content
    assert Generation.objects.get(pk=job["id"]).state == Generation.State.OK
    assert requester.refresh().kudos < taxed and charges() == 2


def test_a_background_request_named_without_a_lease_ends_unpaid_at_its_fronts_undelivered_cancel(
    horde, make_user, known_front
):
    """A background response's request is submitted under the front's id without a lease (nobody
    waits on it): the front that could not keep its record, so nobody can read its reply, ends it as
    undelivered (docs/adr/0110). Another front's id still gets the spec's cancel."""
    requester = make_user("r", kudos=1000)
    owner = make_user("owner", trusted=True)
    front = new_front_id()
    assert horde.pop(owner.key, models=[MODEL], **CHAT_DECLARATION).json()["id"] is None
    created = chat_async(horde.client, requester.key, **{FRONT_KEY: front}).json()["id"]
    job = horde.pop(owner.key, models=[MODEL], **CHAT_DECLARATION).json()
    assert job["id"] and GenerationRequest.objects.get(pk=created).front_lease_expires_at is None
    taxed = requester.refresh().kudos
    undelivered_cancel(horde, "chat", created, front_id=new_front_id(), passkey=PASSKEY)
    assert Generation.objects.get(pk=job["id"]).state == Generation.State.PROCESSING  # not this front's
    undelivered_cancel(horde, "chat", created, front_id=front, passkey=PASSKEY)
    _late_submit_ends_unpaid(horde, requester, owner, created, job, "chat")
    assert requester.refresh().kudos == taxed
    assert not KudosTransaction.objects.filter(user=owner.user).exists()
