"""Relayed deltas on a hung Redis (issue 13, item 4; chat_front.md, "Relayed deltas").

The horde and the front share a redis-server of the test's own, stopped with SIGSTOP in the middle
of a relayed stream: the delta reader's XREAD hangs (the spec abandons it only after
DELTA_READ_TIMEOUT_SECONDS), the worker's progress posts cannot be recorded. The client must still
get the reply within the short Redis bounds, whole when nothing was relayed yet, and otherwise the
relayed text once followed by the rest: never lost, never doubled, never waiting on the reader.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from contract.chat_progress import PROGRESS_ROUTE
from oai.deltas import DELTA_READ_TIMEOUT_SECONDS
from oai.waiter import SIGNAL_BUSY_PING_SECONDS, SIGNAL_COMMAND_TIMEOUT_SECONDS
from tests.oai.test_redis_hung_live import pointed_at  # noqa: F401  (a fixture)
from tests.oai.test_relay import _outcomes, _stream

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis_only]

# As the front's own hung-Redis test: the listener notices within a busy ping and a PONG timeout,
# and the request polls; the margin is for a loaded two-core machine.
MARGIN_SECONDS = 1.5


def _bound(settings) -> float:
    return SIGNAL_BUSY_PING_SECONDS + SIGNAL_COMMAND_TIMEOUT_SECONDS + settings.poll_seconds + MARGIN_SECONDS


def _hung_post(streaming_worker, job, seq: int, content: str) -> float:  # noqa: F811
    """A progress post while Redis is stopped: refused as unavailable, within the short timeout."""
    from django.conf import settings as django_settings

    started = time.monotonic()
    answer = streaming_worker.http.post(
        PROGRESS_ROUTE, json={"id": job["id"], "seq": seq, "delta": {"content": content}}
    )
    took = time.monotonic() - started
    assert answer.status_code == 503 and answer.json()["rc"] == "ChatProgressUnavailable", answer.text
    assert took < django_settings.HORDE_REDIS_SOCKET_TIMEOUT + 0.6, took
    return took


def test_redis_hung_after_exposure_completes_the_relayed_text_with_the_rest(
    front, requester, streaming_worker, pointed_at  # noqa: F811
):
    process, url = pointed_at
    settings = front.configure(redis_url=url, signal_recheck_seconds=5.0, signal_ping_seconds=5.0, poll_seconds=0.2)
    client = _stream(front, requester)
    job = streaming_worker.pop()
    assert job["payload"]["stream_progress"] is True
    streaming_worker.post(job, 1, "Hel")
    client.wait_contents(1)

    os.kill(process.pid, signal.SIGSTOP)
    _hung_post(streaming_worker, job, 2, "lo")
    started = time.monotonic()
    streaming_worker.submit(job, "Hello there.")
    client.finish(timeout=30)
    took = time.monotonic() - started
    assert client.status == 200
    assert client.contents() == ["Hel", "lo there."]  # the relayed text once, then the rest
    assert [c["choices"][0]["finish_reason"] for c in client.chunks()].count("stop") == 1
    assert client.events[-1] == "[DONE]" and _outcomes(front) == {"prefix": 1}
    assert took < _bound(settings) < DELTA_READ_TIMEOUT_SECONDS + settings.poll_seconds, (took, _bound(settings))


def test_redis_hung_before_any_delta_delivers_the_reply_whole(
    front, requester, streaming_worker, pointed_at  # noqa: F811
):
    process, url = pointed_at
    settings = front.configure(redis_url=url, signal_recheck_seconds=5.0, signal_ping_seconds=5.0, poll_seconds=0.2)
    client = _stream(front, requester)
    job = streaming_worker.pop()
    assert job["payload"]["stream_progress"] is True

    os.kill(process.pid, signal.SIGSTOP)
    # The first post waits out the short timeout; the next ones are refused at once, as when Redis
    # is down (the progress client is guarded as every Redis client on a request path).
    took = [_hung_post(streaming_worker, job, 1, "Hel") for _ in range(3)]
    from django.conf import settings as django_settings

    assert sum(took) < django_settings.HORDE_REDIS_SOCKET_TIMEOUT + 0.6, took
    started = time.monotonic()
    streaming_worker.submit(job, "Hello there.")
    client.finish(timeout=30)
    took = time.monotonic() - started
    assert client.status == 200
    assert client.contents() == ["Hello there."]  # whole, as a request that is not relayed
    assert client.events[-1] == "[DONE]" and _outcomes(front) == {}
    assert took < _bound(settings), (took, _bound(settings))
