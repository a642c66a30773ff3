"""The lease capacity rule at pop (chat_requests.md "Job lease", spec ADR 0041): a chat request over
a worker's capacity, floor(speed * (150 - 30)) tokens, goes to it only while no capable worker is
online; legacy text requests are offered whatever their length; the pop query and the Python twin
agree; pops by a worker whose capacity is below its declared chat output are counted."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from django.utils import timezone

from chat.models import Generation, GenerationRequest
from chat.selectors.availability import chat_request_availability
from chat.selectors.queue import chat_capacity_refusal, text_worker_lease_capacity
from chat.services.pop_cache import queue_grew
from tests.chat.pop_helpers import ALL_GUARANTEES, MODEL, chat_pop
from tests.chat.pop_helpers import queue_chat as _queue_chat
from tests.chat.test_chat_submit import counter_points, metric_reader  # noqa: F401  (fixture)
from workers.models import Worker
from workers.services import worker_rows


def queue_chat(*args, **kwargs) -> GenerationRequest:
    """A queued chat request, announced as the creation route does (remembered empty pops end)."""
    request = _queue_chat(*args, **kwargs)
    queue_grew()
    return request


def _register(horde, key: str, name: str, *, speed: float | None, **pop) -> Worker:
    """A chat worker registered by its first pop (empty: nothing is queued yet) with a measured speed."""
    first = chat_pop(horde, key, name=name, **pop)
    assert first.status_code == 200 and first.json()["id"] is None, first.json()
    Worker.objects.filter(name=name).update(speed=speed)
    worker_rows.forget(name)  # the process's copy of the row: read the speed afresh
    return Worker.objects.select_related("owner").get(name=name)


def test_capacity_is_the_speed_over_the_lease_after_preparation():
    assert text_worker_lease_capacity(None) == 1200  # unmeasured: 10 tokens/s
    assert text_worker_lease_capacity(4.0) == 480
    assert text_worker_lease_capacity(4.27) == 512


def test_a_slow_worker_is_refused_a_chat_request_a_capable_worker_can_take(horde, make_user):
    requester, slow_owner, fast_owner = make_user("r", kudos=1000), make_user("s"), make_user("f")
    slow = _register(horde, slow_owner.key, "slow", speed=2.0)  # capacity 240
    fast = _register(horde, fast_owner.key, "fast", speed=None, threads=2)  # unmeasured: 1200
    request = queue_chat(requester.user, max_length=512)
    assert chat_capacity_refusal(slow, request) == "lease_speed"
    assert chat_capacity_refusal(fast, request) is None
    # Availability counts the fast worker's two threads, not the slow one's.
    assert chat_request_availability(request, created=True).eligible_worker_threads == 2
    assert chat_pop(horde, slow_owner.key, name="slow").json()["id"] is None
    job = chat_pop(horde, fast_owner.key, name="fast").json()
    assert job["id"] and Generation.objects.get(pk=job["id"]).worker_id == fast.id
    # Within the slow worker's capacity, it takes the request.
    small = queue_chat(requester.user, max_length=200)
    assert chat_capacity_refusal(slow, small) is None
    assert chat_pop(horde, slow_owner.key, name="slow").json()["id"] in {
        str(g.id) for g in Generation.objects.filter(request=small)
    }


@pytest.mark.parametrize("why", ["offline", "maintenance", "small_limits", "missing_feature", "tools_temperature"])
def test_a_faster_worker_that_cannot_serve_it_does_not_block_the_slow_one(horde, make_user, why):
    requester, slow_owner, fast_owner = make_user("r", kudos=1000), make_user("s"), make_user("f")
    slow_features = ["prompt_overflow_refused", "tool_choice_enforced", "structured_output_enforced", "tools"]
    slow = _register(horde, slow_owner.key, "slow", speed=2.0, features=slow_features)
    pop = {}
    if why == "small_limits":
        pop["limits"] = {"max_context_length": 8192, "max_length": 256}
    if why == "missing_feature":
        pop["features"] = ["prompt_overflow_refused", "tool_choice_enforced", "structured_output_enforced"]
    if why == "tools_temperature":  # applies at most 0.5 with tools: refused the request's 0.9
        pop["features"] = slow_features
        pop["limits"] = {"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 0.5}
    _register(horde, fast_owner.key, "fast", speed=None, **pop)
    if why == "offline":
        Worker.objects.filter(name="fast").update(last_check_in=timezone.now() - timedelta(seconds=301))
    if why == "maintenance":
        Worker.objects.filter(name="fast").update(maintenance=True)
    body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    if why == "tools_temperature":
        body["temperature"] = 0.9
    request = queue_chat(requester.user, body if why in ("missing_feature", "tools_temperature") else None, max_length=512)
    assert chat_capacity_refusal(slow, request) is None
    popped = chat_pop(horde, slow_owner.key, name="slow", features=slow_features).json()
    assert popped["id"] and Generation.objects.get(pk=popped["id"]).request_id == request.id


@pytest.mark.parametrize("why", ["ignored", "not_listed", "untrusted", "unvalidated", "paused", "no_image_transport"])
def test_a_faster_worker_the_request_excludes_does_not_block_the_slow_one(horde, make_user, why):
    """ADR 0041's capable worker passes the request's own restrictions (rule 4) too: a faster worker
    it excludes, by its worker list, trust or backend, cannot take it, so the slow one does."""
    requester = make_user("r", kudos=1000)
    slow_owner, fast_owner = make_user("s", trusted=True), make_user("f")
    vision = ["vision", *ALL_GUARANTEES]
    body = None
    if why == "no_image_transport":
        image = {"type": "image_url", "image_url": {"url": "https://example.org/cat.png"}}
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]}
    slow_pop = {"transports": ["url"], "features": vision}
    fast_pop = dict(slow_pop)
    if why == "unvalidated":
        fast_pop["bridge_agent"] = "Unlisted Bridge:1:https://example.org"
    if why == "no_image_transport":
        fast_pop["transports"] = []
    slow = _register(horde, slow_owner.key, "slow", speed=2.0, **slow_pop)  # capacity 240
    fast = _register(horde, fast_owner.key, "fast", speed=None, **fast_pop)  # capacity 1200
    if why == "paused":
        Worker.objects.filter(name="fast").update(paused=True)
    options = {
        "ignored": {"ignore": [fast.id]},
        "not_listed": {"only": [slow.id]},
        "untrusted": {"trusted_workers": True},
        "unvalidated": {"validated_backends": True},
    }.get(why, {})
    request = queue_chat(requester.user, body, max_length=512, **options)
    assert chat_capacity_refusal(slow, request, {slow.id} if why == "not_listed" else {fast.id}) is None
    availability = chat_request_availability(request, created=True)
    assert availability.is_possible and availability.eligible_worker_threads == 1
    popped = chat_pop(horde, slow_owner.key, name="slow", **slow_pop).json()
    assert popped["id"] and Generation.objects.get(pk=popped["id"]).request_id == request.id


def test_the_gate_measures_against_the_configured_lease(horde, make_user, settings):
    """HORDE_TEXT_JOB_LEASE_SECONDS is the base lease the capacity is measured in: at 330 seconds a
    2 tokens/s worker finishes 600 tokens, and takes the 512-token request before a faster one."""
    settings.HORDE_TEXT_JOB_LEASE_SECONDS = 330
    requester, slow_owner, fast_owner = make_user("r", kudos=1000), make_user("s"), make_user("f")
    slow = _register(horde, slow_owner.key, "slow", speed=2.0)
    _register(horde, fast_owner.key, "fast", speed=None)
    assert text_worker_lease_capacity(2.0) == 600
    request = queue_chat(requester.user, max_length=512)
    assert chat_capacity_refusal(slow, request) is None
    popped = chat_pop(horde, slow_owner.key, name="slow").json()
    assert popped["id"] and Generation.objects.get(pk=popped["id"]).request_id == request.id
    assert popped["ttl"] == 330


def test_legacy_text_requests_are_offered_whatever_their_length(horde, make_user):
    requester, slow_owner, fast_owner = make_user("r", kudos=1000), make_user("s"), make_user("f")
    _register(horde, fast_owner.key, "fast", speed=None, models=[MODEL])
    slow = _register(horde, slow_owner.key, "slow", speed=2.0, models=[MODEL])
    queued = horde.text_async(requester.key, models=[MODEL], params={"max_length": 512})
    assert queued.status_code == 202, queued.json()
    text = GenerationRequest.objects.get(pk=queued.json()["id"])
    assert chat_capacity_refusal(slow, text) is None
    job = chat_pop(horde, slow_owner.key, name="slow", models=[MODEL]).json()
    assert job["id"] and "chat" not in job


def test_pops_of_a_worker_capped_below_its_declared_output_are_counted(
    horde, make_user, metric_reader  # noqa: F811
):
    slow_owner, fast_owner = make_user("s"), make_user("f")
    _register(horde, slow_owner.key, "slow", speed=2.0)  # 240 < declared 1024
    _register(horde, fast_owner.key, "fast", speed=None)  # 1200 >= 1024
    counted_at_registration = counter_points(metric_reader, "horde.pop.lease_capacity_limited")
    chat_pop(horde, slow_owner.key, name="slow")
    chat_pop(horde, fast_owner.key, name="fast")
    chat_pop(horde, slow_owner.key, name="slow")
    before = counted_at_registration.get((("horde.gentype", "text"),), 0)
    assert counter_points(metric_reader, "horde.pop.lease_capacity_limited") == {
        (("horde.gentype", "text"),): before + 2
    }


# --- the shadow of legacy text (and of chat jobs served over capacity) -------------------------------


def _histogram_counts(reader, name: str) -> dict[tuple, int]:
    data = reader.get_metrics_data()
    counts: dict[tuple, int] = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        counts[tuple(sorted(point.attributes.items()))] = point.count
    return counts


SHADOW = {"horde.chat": False, "horde.size_bucket": "<=512", "horde.worker_trusted": False}


def _key(**extra) -> tuple:
    return tuple(sorted({**SHADOW, **extra}.items()))


def test_legacy_job_over_capacity_is_marked_and_its_completion_counted(
    horde, make_user, metric_reader, caplog  # noqa: F811
):
    requester, slow_owner = make_user("r", kudos=1000), make_user("s")
    slow = _register(horde, slow_owner.key, "slow", speed=2.0, models=[MODEL])  # capacity 240
    queued = horde.text_async(requester.key, models=[MODEL], params={"max_length": 512})
    assert queued.status_code == 202, queued.json()
    queue_grew()
    with caplog.at_level(logging.INFO, logger="chat.gate_shadow"):
        job = chat_pop(horde, slow_owner.key, name="slow", models=[MODEL]).json()
    assert Generation.objects.get(pk=job["id"]).over_capacity_at_assignment is True
    # "an INFO log line records the generation, request and worker ids with the max_length,
    # capacity and speed"
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("horde.gate_shadow.assignment ")]
    assert line == (
        f"horde.gate_shadow.assignment generation={job['id']} request={queued.json()['id']} "
        f"worker={slow.pk} max_length=512 capacity=240 speed=2.0"
    )
    assert counter_points(metric_reader, "horde.text.gate_shadow.assignments") == {_key(): 1}
    assert horde.submit(slow_owner.key, job["id"], "Once upon a time.").status_code == 200
    assert counter_points(metric_reader, "horde.text.gate_shadow.outcomes") == {_key(**{"horde.outcome": "completed"}): 1}
    assert _histogram_counts(metric_reader, "horde.text.gate_shadow.service_seconds") == {_key(): 1}


def test_jobs_within_capacity_are_not_recorded(horde, make_user, metric_reader):  # noqa: F811
    requester, owner = make_user("r", kudos=1000), make_user("o")
    _register(horde, owner.key, "steady", speed=None, models=[MODEL])
    queued = horde.text_async(requester.key, models=[MODEL], params={"max_length": 512})
    assert queued.status_code == 202
    queue_grew()
    job = chat_pop(horde, owner.key, name="steady", models=[MODEL]).json()
    assert Generation.objects.get(pk=job["id"]).over_capacity_at_assignment is False
    assert horde.submit(owner.key, job["id"], "Fine.").status_code == 200
    assert counter_points(metric_reader, "horde.text.gate_shadow.assignments") == {}
    assert counter_points(metric_reader, "horde.text.gate_shadow.outcomes") == {}


def test_chat_job_over_capacity_counts_its_fault_once_and_a_lapsed_one_as_aborted(
    horde, make_user, metric_reader  # noqa: F811
):
    from chat.services.sweeps import abort_stale_generations

    requester, slow_owner = make_user("r", kudos=1000), make_user("s")
    _register(horde, slow_owner.key, "slow", speed=2.0)  # the only chat worker: it is served anyway
    queue_chat(requester.user, max_length=512)
    job = chat_pop(horde, slow_owner.key, name="slow").json()
    assert job["id"] and Generation.objects.get(pk=job["id"]).over_capacity_at_assignment is True
    fault = {"state": "faulted", "model_id": MODEL}
    assert horde.chat_submit(slow_owner.key, job["id"], **fault).status_code == 200
    assert horde.chat_submit(slow_owner.key, job["id"], **fault).status_code == 400  # already faulted
    chat = {"horde.chat": True}
    assert counter_points(metric_reader, "horde.text.gate_shadow.outcomes") == {
        _key(**chat, **{"horde.outcome": "faulted"}): 1
    }
    # The job went back to the queue; its next assignment lapses.
    again = chat_pop(horde, slow_owner.key, name="slow").json()
    assert again["id"]
    Generation.objects.filter(pk=again["id"]).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert abort_stale_generations() == 1
    assert counter_points(metric_reader, "horde.text.gate_shadow.outcomes") == {
        _key(**chat, **{"horde.outcome": "faulted"}): 1,
        _key(**chat, **{"horde.outcome": "aborted"}): 1,
    }
    assert counter_points(metric_reader, "horde.text.gate_shadow.assignments") == {_key(**chat): 2}


@pytest.mark.postgres_only
def test_a_worker_whose_speed_moved_pops_with_its_new_capacity_on_the_same_compiled_statement(horde, make_user):
    from chat.services.pop import _pop_statement

    requester, slow_owner, fast_owner = make_user("r", kudos=1000), make_user("s"), make_user("f")
    _pop_statement.cache_clear()
    slow = _register(horde, slow_owner.key, "slow", speed=2.0)  # capacity 240
    _register(horde, fast_owner.key, "fast", speed=None)  # unmeasured: 1200
    request = queue_chat(requester.user, max_length=512)
    assert chat_pop(horde, slow_owner.key, name="slow").json()["id"] is None
    # Its speed moves (as with every job it finishes): capacity 600, and the request is its own.
    Worker.objects.filter(pk=slow.pk).update(speed=5.0)
    worker_rows.forget("slow")
    queue_grew()  # the remembered empty pop: a new capacity is not an addition to the queue
    job = chat_pop(horde, slow_owner.key, name="slow").json()
    assert job["id"] and Generation.objects.get(pk=job["id"]).request_id == request.pk
    # Two workers, two speeds, one declaration: the statement was compiled once.
    assert _pop_statement.cache_info().currsize == 1


# Chat limits that admit 2,048 tokens, above an unmeasured worker's capacity (1,200).
LONG = {"max_context_length": 8192, "max_length": 4096}


def test_a_worker_read_before_its_speed_was_measured_is_not_refused_in_favour_of_itself(horde, make_user):
    """A process's copy of a worker (its pop's row, the status's online workers) can predate its
    first measured speed by a few seconds: with that copy's capacity below the request's length, the
    capable worker the rule finds online is the worker itself, and it must not lose the job to
    itself. Another capable worker online still takes precedence."""
    requester, owner, other_owner = make_user("r", kudos=1000), make_user("w"), make_user("o")
    worker = _register(horde, owner.key, "measured", speed=None, limits=LONG)  # this process's copy: 1200
    request = queue_chat(requester.user, max_length=2048)
    # Its first jobs are measured by a submit in another process: the row now says 900 tokens/s.
    Worker.objects.filter(pk=worker.pk).update(speed=900.0)
    stale = worker  # read before the measurement, as the snapshot and the pop's row cache hold it
    assert text_worker_lease_capacity(stale.speed) < request.max_length
    assert chat_capacity_refusal(stale, request) is None
    assert chat_request_availability(request, created=True).eligible_worker_threads == 1
    job = chat_pop(horde, owner.key, name="measured", limits=LONG).json()  # its cached row says 1200 too
    assert job["id"] and Generation.objects.get(pk=job["id"]).request_id == request.pk

    # With another capable worker online, the copy's capacity still yields to it.
    other = _register(horde, other_owner.key, "other", speed=900.0, limits=LONG)
    second = queue_chat(requester.user, max_length=2048)
    assert chat_capacity_refusal(stale, second) == "lease_speed"
    assert chat_capacity_refusal(other, second) is None
