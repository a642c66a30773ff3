"""The free output allowance (chat_requests.md, "Free output allowance"): the ceiling while the queue
ahead of a request on its eligible workers clears within a minute, the floor from five minutes (and
with no eligible worker), a straight line between; what competes, and at what speed."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from chat.models import GenerationRequest
from chat.selectors import snapshots
from chat.selectors.allowance import QueueWait, free_output_allowance
from chat.services.admission import queue_score
from tests.chat.chat_route_helpers import chat_async, chat_worker
from tests.chat.test_chat_submit import metric_reader  # noqa: F401  (fixture)
from workers.models import Worker

MODEL = "Gryphe/MythoMax-L2-13b"
OTHER = "koboldcpp/Marx-3B-V3"


@pytest.mark.parametrize(
    ("seconds", "allowance"),
    [(None, 512), (0.0, 4096), (60.0, 4096), (180.0, 2304), (299.0, 527), (300.0, 512), (5000.0, 512)],
)
def test_the_allowance_slides_from_the_ceiling_to_the_floor(seconds, allowance):
    wait = None if seconds is None else QueueWait(seconds=seconds, eligible_threads=1)
    assert free_output_allowance(wait) == allowance


def _text_worker(owner, *, name="w", speed: float | None = 10.0, threads: int = 1, max_length: int = 4096,
                 chat: bool = False, models=(MODEL,)) -> Worker:
    worker = chat_worker(owner, model=models[0], threads=threads) if chat else Worker.objects.create(
        name=name, owner=owner.user, served_models=list(models), max_length=max_length, max_context_length=8192,
        threads=threads, bridge_agent="KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp",
        last_check_in=timezone.now(),
    )
    Worker.objects.filter(pk=worker.pk).update(speed=speed, max_length=max_length, max_context_length=8192)
    from workers.serving_version import serving_changed

    serving_changed()
    return worker


def _queued(user, *, max_length: int, jobs: int = 1, is_chat: bool = False, models=(MODEL,)) -> GenerationRequest:
    now = timezone.now()
    request = GenerationRequest.objects.create(
        user=user, is_chat=is_chat, prompt="p", max_length=max_length, max_context_length=2048, n=jobs,
        jobs_waiting=jobs, requested_models=list(models), any_model=False,
        queue_score=queue_score(0, now.timestamp()), expires_at=now + timedelta(minutes=20),
    )
    snapshots.reset_snapshots()
    return request


def _text(horde, key, max_length: int, **body):
    params = {"max_length": max_length, "max_context_length": max(2048, max_length)}
    return horde.text_async(key, models=[MODEL], params=params, **body)


def test_an_idle_fleet_serves_up_to_the_ceiling_free(horde, make_user):
    _text_worker(make_user("o"))
    poor = make_user("poor", kudos=0)
    free = _text(horde, poor.key, 4096)
    assert free.status_code == 202, free.json()
    assert poor.refresh().kudos_held == Decimal("0")


def test_the_queue_ahead_on_the_eligible_workers_sizes_the_allowance(horde, make_user):
    """Three 1,000-token jobs ahead on one 10 tokens/s worker: 300 s, the floor. Two threads halve
    it only when there are jobs for both: 150 s, 2,752 tokens."""
    owner, poor = make_user("o"), make_user("poor", kudos=0)
    worker = _text_worker(owner)
    backlog = make_user("b")
    for _ in range(3):
        _queued(backlog.user, max_length=1000)
    refused = _text(horde, poor.key, 1024)
    assert refused.status_code == 403 and refused.json()["rc"] == "KudosUpfront"
    assert "requests over 512 tokens" in refused.json()["message"]
    Worker.objects.filter(pk=worker.pk).update(threads=2)
    from workers.serving_version import serving_changed

    serving_changed()
    # 3,000 tokens / (20 tokens/s x min(3, 2)/2) = 150 s: 4096 - 3584 x 90/240 = 2752.
    refused = _text(horde, poor.key, 3000)
    assert "requests over 2752 tokens" in refused.json()["message"], refused.json()
    assert _text(horde, poor.key, 2752).status_code == 202


def test_only_the_work_queued_ahead_of_the_request_counts(horde, make_user):
    """The same backlog behind a requester whose kudos queue it first: nothing ahead, the ceiling,
    and no hold (at the floor a request of 1,024 tokens would hold its kudos)."""
    _text_worker(make_user("o"))
    backlog, rich = make_user("b"), make_user("rich", kudos=1_000_000)
    for _ in range(3):
        _queued(backlog.user, max_length=1000)
    admitted = _text(horde, rich.key, 1024)
    assert admitted.status_code == 202, admitted.json()
    assert rich.refresh().kudos_held == Decimal("0")
    poor = make_user("poor", kudos=0)
    assert _text(horde, poor.key, 1024).json()["rc"] == "KudosUpfront"  # behind the backlog


def test_only_work_an_eligible_worker_could_take_competes(horde, make_user):
    """A chat request on the model (the worker takes no chat jobs), another model's request and a
    request over the worker's max_length do not count against a text request."""
    owner, poor, backlog = make_user("o"), make_user("poor", kudos=0), make_user("b")
    _text_worker(owner, max_length=2048)
    _queued(backlog.user, max_length=2000, jobs=5, is_chat=True)
    _queued(backlog.user, max_length=2000, jobs=5, models=(OTHER,))
    _queued(backlog.user, max_length=3000, jobs=5)
    assert _text(horde, poor.key, 2048).status_code == 202  # nothing ahead: the ceiling
    _queued(backlog.user, max_length=2000, jobs=2)  # 4,000 tokens at 10/s: 400 s
    refused = _text(horde, poor.key, 1024)
    assert refused.status_code == 403 and "requests over 512 tokens" in refused.json()["message"]


def test_an_unmeasured_worker_counts_at_ten_tokens_a_second(horde, make_user):
    owner, poor, backlog = make_user("o"), make_user("poor", kudos=0), make_user("b")
    _text_worker(owner, speed=None)
    _queued(backlog.user, max_length=1800)  # 180 s at 10 tokens/s: 2304
    assert "requests over 2304 tokens" in _text(horde, poor.key, 2400).json()["message"]


def test_a_downgrade_lowers_to_the_allowance(horde, make_user):
    owner, poor, backlog = make_user("o"), make_user("poor", kudos=0), make_user("b")
    _text_worker(owner)
    _queued(backlog.user, max_length=1800)
    lowered = _text(horde, poor.key, 3000, allow_downgrade=True)
    assert lowered.status_code == 202
    assert "downgraded to 2304 tokens" in lowered.json()["message"]
    assert GenerationRequest.objects.get(pk=lowered.json()["id"]).max_length == 2304


def test_a_chat_request_is_sized_by_the_chat_workers_queue(horde, make_user):
    owner, poor, backlog = make_user("o"), make_user("poor", kudos=0), make_user("b")
    worker = chat_worker(owner, max_length=4096)
    Worker.objects.filter(pk=worker.pk).update(speed=10.0)
    from workers.serving_version import serving_changed

    serving_changed()
    assert chat_async(horde.client, poor.key, max_tokens=4096).status_code == 202  # idle: the ceiling
    _queued(backlog.user, max_length=3000, is_chat=True)  # 300 s
    refused = chat_async(horde.client, poor.key, max_tokens=1024)
    assert refused.status_code == 403 and refused.json()["rc"] == "KudosUpfront"
    assert "requests over 512 tokens" in refused.json()["message"]


def test_the_wait_the_allowance_was_sized_by_is_recorded(horde, make_user, metric_reader):  # noqa: F811
    from tests.chat.test_admission import _points

    owner, backlog = make_user("o"), make_user("b")
    _queued(backlog.user, max_length=1000)
    assert _text(horde, None, 80).status_code == 202  # no eligible worker: not recorded
    assert _points(metric_reader, "horde.text.free_allowance.estimated_wait_seconds") == {}
    _text_worker(owner)
    snapshots.reset_snapshots()
    # 1,000 + 80 tokens ahead at 10 tokens/s.
    assert _text(horde, None, 80).status_code == 202
    assert _text(horde, None, 80, dry_run=True).status_code == 200  # a dry run is not recorded
    points = _points(metric_reader, "horde.text.free_allowance.estimated_wait_seconds")
    key = tuple(sorted({"horde.chat": False, "horde.requester": "anonymous"}.items()))
    assert list(points) == [key] and points[key].count == 1 and points[key].sum == pytest.approx(108.0)


def test_a_refusal_not_about_length_says_why(horde, make_user, settings):
    """Excluding slow workers, or listing workers under HORDE_UPFRONT_KUDOS_ON_WORKERLIST, holds the
    kudos of a request well under the allowance: the message names that cause, not a length."""
    worker = _text_worker(make_user("o"))
    poor = make_user("poor", kudos=0)
    slow = _text(horde, poor.key, 100, slow_workers=False)
    assert slow.status_code == 403 and slow.json()["message"].startswith(
        "A request that excludes slow workers needs its client to already have the required kudos."
    )
    settings.HORDE_UPFRONT_KUDOS_ON_WORKERLIST = True
    listed = _text(horde, poor.key, 100, workers=[str(worker.id)])
    assert listed.status_code == 403 and listed.json()["message"].startswith(
        "A request that lists workers needs its client to already have the required kudos."
    )
    chat_worker(make_user("c"))
    chat = chat_async(horde.client, poor.key, max_tokens=100, horde={"slow_workers": False})
    assert chat.status_code == 403 and "excludes slow workers" in chat.json()["message"]


def test_a_creation_refused_before_its_decision_records_no_wait(horde, make_user, metric_reader):  # noqa: F811
    """The allowance is measured before the images are loaded: an unreadable image refuses the
    request after it, and neither the decision nor the wait is recorded."""
    import base64

    from tests.chat.test_admission import _points

    chat_worker(make_user("o"), image_transports=["base64"])
    unreadable = "data:image/png;base64," + base64.b64encode(b"not a picture").decode()
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": unreadable}}]}
    requester = make_user("r", kudos=1000)
    assert chat_async(horde.client, requester.key, messages=[image], max_tokens=64).status_code == 400
    assert chat_async(horde.client, requester.key, max_tokens=64).status_code == 202
    decisions = _points(metric_reader, "horde.text.free_allowance.decisions")
    waits = _points(metric_reader, "horde.text.free_allowance.estimated_wait_seconds")
    assert sum(p.value for p in decisions.values()) == 1 == sum(p.count for p in waits.values())
