"""horde.availability_mode: "fail_fast" past zero threads: the wait rule and the positioned read
(spec: chat_front.md, No eligible worker). The native status reports the wait from the real queue
and the eligible worker's speed (tokens per second): a request for `max_tokens` on one idle worker
of speed s waits ceil(max_tokens / s) seconds; a worker of speed 0 gives no estimate (wait_time 0,
queue_position 0), the status of a request the Horde has not placed yet."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from oai.waiter import POSITIONED_READ_WAIT_SECONDS, QUEUE_UNAVAILABLE_RETRY_AFTER_CAP_SECONDS
from tests.oai.conftest import MODEL, HordeTestWorker, wait_for

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hello?"}]
FAIL_FAST = {"horde": {"availability_mode": "fail_fast"}}



def _idle_worker(live_horde, worker_owner, *, speed: float) -> HordeTestWorker:
    """A chat worker that checked in (so it is eligible) at `speed` tokens per second, not popping
    until started."""
    worker = HordeTestWorker(live=live_horde, key=worker_owner.key)
    worker.check_in()
    _set_speed(worker, speed)
    return worker


def _set_speed(worker: HordeTestWorker, speed: float) -> None:
    from chat.selectors import snapshots
    from workers.models import Worker
    from workers.serving_version import serving_changed

    assert Worker.objects.filter(name=worker.name).update(speed=speed) == 1
    serving_changed()
    snapshots.reset_snapshots()


def _requests():
    from chat.models import GenerationRequest

    return list(GenerationRequest.objects.filter(is_chat=True))


def _finished_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "oai.requests"]


def _wait_exceeds_budget_errors(front) -> list:
    return [
        (attributes, value)
        for attributes, value in front.metrics().get("horde.oai.requests.errors", [])
        if attributes.get("horde.reason") == "wait_exceeds_budget"
    ]


def test_a_wait_over_the_cap_is_refused_with_retry_after_600(
    front, client, live_horde, worker_owner, caplog
):
    """2,000 tokens at 1 token/s: 2,000 s, over the 20 s budget; Retry-After is capped at 600."""
    _idle_worker(live_horde, worker_owner, speed=1.0)
    caplog.set_level("INFO", logger="oai.requests")
    # The SDKs ignore a Retry-After over 60 s and would retry within a second, to be refused again
    # (docs/adr/0125): x-should-retry: false, so the SDK's default two retries are not sent.
    with pytest.raises(openai.InternalServerError) as caught:
        client.with_options(max_retries=2).chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2000, extra_body=FAIL_FAST
        )
    error = caught.value
    assert (error.status_code, error.code, error.param, error.type) == (
        503,
        "queue_unavailable",
        "horde.availability_mode",
        "api_error",
    )
    assert QUEUE_UNAVAILABLE_RETRY_AFTER_CAP_SECONDS == 600
    assert error.response.headers["retry-after"] == "600"
    assert error.body["metadata"]["retry_after"] == 600
    assert error.response.headers["x-should-retry"] == "false"
    assert "1 eligible worker threads, an estimated wait of 2000 s" in error.message
    assert _wait_exceeds_budget_errors(front) == [
        (
            {
                "horde.status_code": 503,
                "horde.code": "queue_unavailable",
                "horde.streamed": False,
                "horde.reason": "wait_exceeds_budget",
            },
            1,
        )
    ]
    (line,) = _finished_lines(caplog)
    assert " status=503 code=queue_unavailable " in line and " retry_after=600 " in line
    assert " queue_reason=wait_exceeds_budget wait_time=2000 eligible_worker_threads=1 " in line
    assert line.endswith(" first_read_wait_time=2000 first_read_eligible_worker_threads=1")
    # The front cancels what it refuses.
    assert wait_for(lambda: [r.cancelled for r in _requests()] == [True], 10)


def test_a_wait_under_the_cap_is_its_own_retry_after(front, client, live_horde, worker_owner):
    """500 tokens at 10 tokens/s: 50 s, over the 20 s budget and under the cap."""
    _idle_worker(live_horde, worker_owner, speed=10.0)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=500, extra_body=FAIL_FAST)
    error = caught.value
    assert (error.status_code, error.code) == (503, "queue_unavailable")
    assert error.response.headers["retry-after"] == "50"
    assert error.body["metadata"]["retry_after"] == 50
    assert "x-should-retry" not in error.response.headers  # 50 s: the SDKs wait it out, then retry
    assert "an estimated wait of 50 s" in error.message
    assert len(_wait_exceeds_budget_errors(front)) == 1


def test_a_streamed_request_over_the_budget_is_refused_before_its_headers(
    front, requester, live_horde, worker_owner
):
    _idle_worker(live_horde, worker_owner, speed=10.0)
    response = httpx.post(
        f"{front.live.v1}/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": 500, "stream": True, **FAIL_FAST},
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=10,
    )
    assert response.status_code == 503 and response.headers["retry-after"] == "50"
    assert response.json()["error"]["code"] == "queue_unavailable"
    assert _wait_exceeds_budget_errors(front)[0][0]["horde.streamed"] is True


def test_a_request_served_within_its_budget_keeps_waiting(front, client, live_horde, worker_owner, caplog):
    """50 s fits a 300 s budget: the request is admitted and waits for the worker, which starts
    only after the first-read decision."""
    front.configure(nonstream_timeout_seconds=300.0)
    worker = _idle_worker(live_horde, worker_owner, speed=10.0)
    caplog.set_level("INFO", logger="oai.requests")
    result: dict = {}

    def call():
        try:
            result["completion"] = client.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=500, extra_body=FAIL_FAST
            )
        except openai.APIError as error:  # pragma: no cover - the assertion below reports it
            result["error"] = error

    thread = threading.Thread(target=call)
    thread.start()
    try:
        assert wait_for(_requests, 5)
        time.sleep(POSITIONED_READ_WAIT_SECONDS + 0.5)  # past any first-read decision
        assert thread.is_alive() and "error" not in result
        worker.start()
        thread.join(20)
    finally:
        worker.stop()
    assert "error" not in result, result.get("error")
    assert result["completion"].choices[0].message.content
    (line,) = _finished_lines(caplog)
    assert " status=200 code=ok " in line
    assert line.endswith(" first_read_wait_time=50 first_read_eligible_worker_threads=1")
    assert not _wait_exceeds_budget_errors(front)


def test_the_owners_request_on_their_worker_in_maintenance_waits_only_for_their_own_work(
    front, live_horde, worker_owner, make_user, caplog
):
    """The owner's only chat worker is in maintenance (ADRs 0083, 0089) with a stranger's three
    500-token requests ahead: the worker takes none of them, so the owner's 100 tokens wait 10 s at
    10 tokens/s and fit the 20 s budget (the status read 160 s and the front refused with 503)."""
    from chat.selectors import snapshots
    from tests.chat.test_status_queue_wait import _queued
    from workers.models import Worker
    from workers.serving_version import serving_changed

    worker = _idle_worker(live_horde, worker_owner, speed=10.0)
    assert Worker.objects.filter(name=worker.name).update(maintenance=True) == 1
    serving_changed()
    stranger = make_user(f"stranger-{worker.name[-6:]}", kudos=100_000)
    for _ in range(3):
        _queued(stranger.user, max_length=500, models=(MODEL,), is_chat=True, score=10**9)
    snapshots.reset_snapshots()
    caplog.set_level("INFO", logger="oai.requests")
    result: dict = {}
    sdk = openai.OpenAI(base_url=front.live.v1, api_key=worker_owner.key, max_retries=0, timeout=30)

    def call():
        try:
            result["completion"] = sdk.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=100, extra_body=FAIL_FAST
            )
        except openai.APIError as error:  # pragma: no cover - the assertion below reports it
            result["error"] = error

    thread = threading.Thread(target=call)
    thread.start()
    try:
        assert wait_for(lambda: [r for r in _requests() if r.user_id == worker_owner.user.pk], 5)
        time.sleep(POSITIONED_READ_WAIT_SECONDS + 0.5)  # past any first-read decision
        assert thread.is_alive() and "error" not in result, result.get("error")
        worker.start()
        thread.join(20)
    finally:
        worker.stop()
        sdk.close()
    assert "error" not in result, result.get("error")
    assert result["completion"].choices[0].message.content
    (line,) = _finished_lines(caplog)
    assert line.endswith(" first_read_wait_time=10 first_read_eligible_worker_threads=1"), line
    assert not _wait_exceeds_budget_errors(front)


def _later_reads(front) -> int:
    """Status reads after the first (recheck with the completion signal, poll without it)."""
    wakes = front.metrics().get("horde.oai.wakes", [])
    return sum(v for a, v in wakes if a["horde.wake_source"] in ("recheck", "poll"))


def test_an_unpositioned_status_is_read_again_until_the_positioned_read_wait(
    front, requester, live_horde, worker_owner, caplog
):
    """Speed 0: every status reads wait_time 0 and queue_position 0. The front reads again every
    signal_recheck_seconds (0.5 s; poll_seconds without the signal) for POSITIONED_READ_WAIT_SECONDS after the first read, then the
    latest reading decides: admitted, so a stream's headers go out only then, and the request is
    served."""
    worker = _idle_worker(live_horde, worker_owner, speed=0.0)
    caplog.set_level("INFO", logger="oai.requests")
    body = {"model": MODEL, "messages": USER, "max_tokens": 500, "stream": True, **FAIL_FAST}
    started = time.monotonic()
    try:
        with httpx.stream(
            "POST",
            f"{front.live.v1}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {requester.key}"},
            timeout=20,
        ) as response:
            opened = time.monotonic() - started
            assert response.status_code == 200
            # The first read, then reads at least 0.5 s apart until 2 s after it.
            assert POSITIONED_READ_WAIT_SECONDS <= opened < POSITIONED_READ_WAIT_SECONDS + 1.5, opened
            assert _later_reads(front) >= 3
            worker.start()
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        worker.stop()
    assert events[-1] == "data: [DONE]" and '"finish_reason":"stop"' in events[-2]
    (line,) = _finished_lines(caplog)
    assert " status=200 code=ok " in line
    assert line.endswith(" first_read_wait_time=0 first_read_eligible_worker_threads=1")


def test_the_first_positioned_status_decides(front, client, live_horde, worker_owner):
    """The first read carries no queue information; once the worker's speed is known, a later read
    within the positioned-read wait reports 2,000 s and refuses the request."""
    worker = _idle_worker(live_horde, worker_owner, speed=0.0)
    result: dict = {}

    def call():
        try:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2000, extra_body=FAIL_FAST)
        except openai.APIStatusError as error:
            result["error"] = error

    thread = threading.Thread(target=call)
    thread.start()
    immediate = wait_for(
        lambda: any(a["horde.wake_source"] == "immediate" for a, _ in front.metrics().get("horde.oai.wakes", [])),
        5,
    )
    assert immediate, "the first status read was not made"
    assert thread.is_alive(), result.get("error")  # the unpositioned first read did not decide
    _set_speed(worker, 1.0)
    thread.join(10)
    error = result["error"]
    assert (error.status_code, error.code) == (503, "queue_unavailable")
    assert error.response.headers["retry-after"] == "600"
    assert "an estimated wait of 2000 s" in error.message
    assert _later_reads(front) >= 1
    assert len(_wait_exceeds_budget_errors(front)) == 1
