"""A worker in maintenance takes its owner's requests alone (docs/adr/0083): the owner's request's
queue estimate and free output allowance count it, with only the owner's own work ahead competing
for it, and nobody else's figures change (docs/adr/0089)."""

from __future__ import annotations

from decimal import Decimal

from chat.selectors import snapshots
from tests.chat.test_free_output_allowance import _text, _text_worker
from tests.chat.test_status_queue_wait import _queued, _status


def _in_maintenance(horde, owner, worker) -> None:
    put = horde.client.put(f"/api/v2/workers/{worker.id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key)
    assert put.json() == {"maintenance": True}
    snapshots.reset_snapshots()


def test_the_owners_wait_counts_only_their_own_work_ahead_on_their_maintenance_worker(horde, make_user):
    """Three 1,000-token requests of a stranger are ahead on the model: the worker in maintenance
    will never take them, so the owner's request waits for its own 100 tokens at 10 tokens/s (it
    read 3 ahead and 310 s). The owner's own request ahead does compete."""
    owner, stranger = make_user("owner", kudos=10), make_user("stranger", kudos=1000)
    _in_maintenance(horde, owner, _text_worker(owner, name="attic"))
    for _ in range(3):
        _queued(stranger.user, max_length=1000, score=100)
    mine = _queued(owner.user, max_length=100)
    assert _status(horde, mine) == (0, 10)
    _queued(owner.user, max_length=200, score=50)
    assert _status(horde, mine) == (1, 30)
    # The stranger's request has no worker: its figures are the horde-wide ones, as before.
    theirs = _queued(stranger.user, max_length=100)
    body = horde.status(theirs.pk).json()
    assert body["is_possible"] is False and body["queue_position"] == 5


def test_beside_a_public_worker_the_owner_counts_both_and_the_stranger_only_the_public_one(horde, make_user):
    """A public worker and the owner's worker in maintenance serve the model, three 1,000-token
    requests of a stranger ahead. The owner's request: the public worker's competing work (all
    three) over both workers, (3,000 + 100) tokens at 20 tokens/s. The stranger's: the public worker
    alone (the owner's request among its work ahead), as if the worker in maintenance were offline."""
    owner, stranger, public = make_user("owner", kudos=10), make_user("stranger", kudos=1000), make_user("public")
    _text_worker(public, name="public")
    attic = _text_worker(owner, name="attic")
    for _ in range(3):
        _queued(stranger.user, max_length=1000, score=100)
    mine = _queued(owner.user, max_length=100)
    theirs = _queued(stranger.user, max_length=100)
    _in_maintenance(horde, owner, attic)
    assert _status(horde, mine) == (3, 155)
    alone = _status(horde, theirs)
    assert alone == (4, 320)  # the owner's request is ahead of it too
    attic.delete()
    snapshots.reset_snapshots()
    assert _status(horde, theirs) == alone


def test_the_owners_request_on_their_idle_maintenance_worker_gets_the_ceiling_free(horde, make_user):
    """With only their worker in maintenance serving the model, and a stranger's backlog it will
    not take, the owner's 2,048-token request is free, as on any idle worker (it was held to the
    floor: 403 KudosUpfront "over 512 tokens"). The stranger, whom no worker serves, is refused."""
    owner, stranger = make_user("owner", kudos=0), make_user("stranger", kudos=0)
    _in_maintenance(horde, owner, _text_worker(owner, name="attic"))
    rich = make_user("rich", kudos=1_000_000)
    for _ in range(3):
        _queued(rich.user, max_length=1000, score=1_000_000)
    admitted = _text(horde, owner.key, 2048)
    assert admitted.status_code == 202, admitted.json()
    assert owner.refresh().kudos_held == Decimal("0")
    refused = _text(horde, stranger.key, 2048)
    assert refused.status_code == 403 and refused.json()["rc"] == "NoEligibleWorker"


def test_the_owners_own_queue_ahead_still_sizes_their_allowance(horde, make_user):
    """Three 1,000-token requests of the owner are ahead on their worker in maintenance: 300 s at
    10 tokens/s, the floor."""
    owner = make_user("owner", kudos=0)
    _in_maintenance(horde, owner, _text_worker(owner, name="attic"))
    for _ in range(3):
        _queued(owner.user, max_length=1000, score=1_000_000)
    refused = _text(horde, owner.key, 1024)
    assert refused.status_code == 403 and "requests over 512 tokens" in refused.json()["message"], refused.json()


def test_the_owners_chat_request_waits_only_for_their_own_work_on_their_maintenance_worker(api, horde, make_user):
    """The same on the chat route: a stranger's three chat requests ahead on the model do not
    compete for the owner's chat worker in maintenance; 64 tokens at 10 tokens/s."""
    from tests.chat.chat_route_helpers import chat_async

    owner, stranger = make_user("owner", kudos=1000), make_user("stranger", kudos=1000)
    worker = _text_worker(owner, name="chatty", chat=True)
    _in_maintenance(horde, owner, worker)
    for _ in range(3):
        _queued(stranger.user, max_length=500, models=(worker.chat_model_id,), is_chat=True, score=10**9)
    created = chat_async(api, owner.key, max_tokens=64)
    assert created.status_code == 202, created.json()
    snapshots.reset_snapshots()
    body = api.get(f"/api/v2/generate/chat/status/{created.json()['id']}").json()
    assert (body["queue_position"], body["wait_time"], body["eligible_worker_threads"]) == (0, 7, 1)
