"""The status route's queue_position and wait_time on the request's eligible workers (spec ADR
0040, "Estimate text queue wait from the request's eligible workers"): the competing requests
ahead, and the competing output ahead plus the request's own over those workers' throughput;
horde-wide when no thread is eligible."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from chat.models import GenerationRequest
from chat.selectors import snapshots
from chat.services.admission import queue_score
from tests.chat.test_free_output_allowance import MODEL, OTHER, _text_worker

LATER = timedelta(seconds=1)


def _queued(user, *, max_length: int, models=(MODEL,), is_chat: bool = False, jobs: int = 1,
            score: int = 0) -> GenerationRequest:
    """A waiting request; a higher `score` is further ahead."""
    now = timezone.now()
    return GenerationRequest.objects.create(
        user=user, is_chat=is_chat, prompt="p", max_length=max_length, max_context_length=2048, n=jobs,
        jobs_waiting=jobs, requested_models=list(models), any_model=False,
        queue_score=queue_score(score, now.timestamp()), expires_at=now + timedelta(minutes=20),
    )


def _status(horde, request: GenerationRequest) -> tuple[int, int]:
    snapshots.reset_snapshots()
    body = horde.status(request.pk).json()
    return body["queue_position"], body["wait_time"]


def test_a_request_for_an_idle_model_waits_only_for_its_own_work(horde, make_user):
    """Five 1,000-token requests for another model are ahead in the horde's queue, not on this
    request's worker: position 0, and 100 tokens at 10 tokens/s."""
    owner, backlog, requester = make_user("o"), make_user("b"), make_user("r")
    _text_worker(owner, name="mine")
    _text_worker(owner, name="theirs", models=(OTHER,))
    for _ in range(5):
        _queued(backlog.user, max_length=1000, models=(OTHER,), score=100)
    mine = _queued(requester.user, max_length=100)
    assert _status(horde, mine) == (0, 10)


def test_only_work_an_eligible_worker_could_take_competes(horde, make_user):
    """Ahead: a text request on the same model (competes), a chat request on it (the text-only
    worker does not take chat jobs), and one over the worker's max_length (it could not take it)."""
    owner, backlog, requester = make_user("o"), make_user("b"), make_user("r")
    _text_worker(owner, max_length=600)
    _queued(backlog.user, max_length=200, score=300)
    _queued(backlog.user, max_length=500, is_chat=True, score=200)
    _queued(backlog.user, max_length=1000, score=100)
    mine = _queued(requester.user, max_length=100)
    # 200 + 100 tokens at 10 tokens/s.
    assert _status(horde, mine) == (1, 30)


def test_the_eligible_workers_speed_sets_the_wait_not_the_fleets(horde, make_user):
    """A 40 tokens/s worker serves the model, a 10 tokens/s one another: 800 tokens at 40 tokens/s
    (the horde's 50 would say 16 s). A second, unmeasured worker on the model counts at 10."""
    owner, backlog, requester = make_user("o"), make_user("b"), make_user("r")
    _text_worker(owner, name="fast", speed=40.0)
    _text_worker(owner, name="other", speed=10.0, models=(OTHER,))
    _queued(backlog.user, max_length=400, score=100)
    mine = _queued(requester.user, max_length=400)
    assert _status(horde, mine) == (1, 20)
    _text_worker(owner, name="new", speed=None)
    assert _status(horde, mine) == (1, 16)  # 800 tokens at 40 + 10


def test_fewer_jobs_than_threads_use_only_the_threads_they_occupy(horde, make_user):
    """One job on a four-thread worker runs on one thread: 100 tokens at 10 tokens/s, not 40."""
    owner, requester = make_user("o"), make_user("r")
    _text_worker(owner, threads=4)
    mine = _queued(requester.user, max_length=100)
    assert _status(horde, mine) == (0, 10)
    two = _queued(requester.user, max_length=100, jobs=2)
    # Three jobs of 100 tokens on three of the four threads.
    assert _status(horde, two) == (1, 10)


def test_with_no_eligible_worker_the_figures_are_the_hordes(horde, make_user):
    """A trusted_workers request with only an untrusted worker serving its model: every request
    ahead (another model's included) at the horde's throughput."""
    owner, backlog, requester = make_user("o"), make_user("b"), make_user("r")
    _text_worker(owner, name="mine")
    _text_worker(owner, name="theirs", models=(OTHER,))
    _queued(backlog.user, max_length=300, models=(OTHER,), score=100)
    mine = _queued(requester.user, max_length=100)
    assert _status(horde, mine) == (0, 10)  # eligible: the untrusted worker serves the model
    GenerationRequest.objects.filter(pk=mine.pk).update(trusted_workers=True)
    assert _status(horde, mine) == (1, 20)  # 400 tokens at the horde's 20 tokens/s


def test_a_request_newer_than_the_snapshot_is_placed_by_its_score(horde, make_user):
    """The first polls of a new request (which the front reads to fail fast) are on its eligible
    workers too: a backlog on another model does not count, a better-scored request on its model
    does."""
    owner, backlog, requester = make_user("o"), make_user("b"), make_user("r")
    _text_worker(owner, name="mine")
    _text_worker(owner, name="theirs", models=(OTHER,))
    for _ in range(4):
        _queued(backlog.user, max_length=500, models=(OTHER,), score=100)
    _queued(backlog.user, max_length=200, score=100)
    _queued(backlog.user, max_length=900, score=-100)  # behind the new request
    snapshots.reset_snapshots()
    snapshot = snapshots.queue_snapshot()
    newer = _queued(requester.user, max_length=100)
    assert snapshots.queue_place(newer.pk) is None and snapshots.queue_snapshot() is snapshot
    body = horde.status(newer.pk).json()
    assert (body["queue_position"], body["wait_time"]) == (1, 30)


def test_a_chat_request_waits_on_its_chat_workers(api, horde, make_user):
    """A chat worker on the model and a text worker on another: the other model's text backlog is
    not ahead of the chat request."""
    from tests.chat.chat_route_helpers import chat_async

    owner, backlog, requester = make_user("o"), make_user("b"), make_user("r", kudos=1000)
    _text_worker(owner, name="chat", chat=True)
    _text_worker(owner, name="text", models=(OTHER,))
    for _ in range(3):
        _queued(backlog.user, max_length=500, models=(OTHER,), score=10**9)
    created = chat_async(api, requester.key, max_tokens=64)
    assert created.status_code == 202, created.json()
    snapshots.reset_snapshots()
    body = api.get(f"/api/v2/generate/chat/status/{created.json()['id']}").json()
    assert body["queue_position"] == 0 and body["eligible_worker_threads"] == 1
    assert body["wait_time"] == 7  # 64 tokens at 10 tokens/s


def test_one_snapshot_keeps_each_workers_positions(horde, make_user):
    owner, backlog, requester = make_user("o"), make_user("b"), make_user("r")
    _text_worker(owner)
    for _ in range(3):
        _queued(backlog.user, max_length=100, score=100)
    first, second = _queued(requester.user, max_length=100), _queued(requester.user, max_length=100)
    snapshots.reset_snapshots()
    assert horde.status(first.pk).json()["queue_position"] == 3
    snapshot = snapshots.queue_snapshot()
    assert horde.status(second.pk).json()["queue_position"] == 4
    assert snapshots.queue_snapshot() is snapshot
    assert (len(snapshot._masks.by_worker), len(snapshot._masks.by_set)) == (1, 1)


def test_jobs_and_tokens_of_any_size_are_summed_exactly(horde, make_user):
    """The sums come from bit planes of the jobs and tokens: odd sizes and several jobs a request."""
    owner, backlog, requester = make_user("o"), make_user("b"), make_user("r")
    _text_worker(owner, threads=64, max_length=4096)
    sizes = [(17, 3), (4095, 1), (1000, 7), (333, 2)]
    for max_length, jobs in sizes:
        _queued(backlog.user, max_length=max_length, jobs=jobs, score=100)
    mine = _queued(requester.user, max_length=50, jobs=5)
    jobs = sum(j for _, j in sizes) + 5
    tokens = sum(m * j for m, j in sizes) + 50 * 5
    # 18 jobs on 18 of the 64 threads at 10 tokens/s each.
    assert _status(horde, mine) == (4, -(-tokens // (10 * jobs)))


def test_a_chat_requests_slow_worker_counts_only_while_no_capable_one_is_online(api, make_user):
    """The speed gate (spec ADR 0041): 2,000 tokens outrun a 10 tokens/s worker's 150 s lease, but
    with no capable worker online it serves, and the wait is at its speed; once a 40 tokens/s worker
    is online, the wait is at that one's alone."""
    from tests.chat.chat_route_helpers import chat_async

    owner, requester = make_user("o"), make_user("r", kudos=100_000)
    _text_worker(owner, chat=True, speed=10.0)
    created = chat_async(api, requester.key, max_tokens=2000)
    assert created.status_code == 202, created.json()
    status = f"/api/v2/generate/chat/status/{created.json()['id']}"
    snapshots.reset_snapshots()
    body = api.get(status).json()
    assert (body["eligible_worker_threads"], body["queue_position"], body["wait_time"]) == (1, 0, 200)
    _text_worker(owner, chat=True, speed=40.0)  # a new serving version: the pass is made again
    snapshots.reset_snapshots()
    body = api.get(status).json()
    assert (body["eligible_worker_threads"], body["queue_position"], body["wait_time"]) == (1, 0, 50)
