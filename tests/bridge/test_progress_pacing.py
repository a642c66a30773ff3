"""The reference worker paces its progress posts against the entry cap (ADR 0022, "Pacing against
the entry cap"): the configured interval for a reply's start, then the entries left spread over the
time left to the trusted lease cap, so a job that generates for the whole lease keeps renewing it.
The bridge's own pacing, without a horde: its posts go to a closed port and count as unanswered."""

from __future__ import annotations

import pytest

from contract.chat_progress import (
    CHAT_PROGRESS_RENEWAL_SECONDS,
    MAX_CHAT_PROGRESS_ENTRIES,
    TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS,
)
from workers.bridge.horde import HordeClient
from workers.bridge.progress import DEFAULT_PROGRESS_INTERVAL, ProgressPoster, paced_interval

CLOSED_HORDE = "http://127.0.0.1:1"


def test_the_start_of_a_reply_keeps_the_configured_interval():
    assert paced_interval(0.25, 0.0, 0) == 0.25
    assert paced_interval(0.25, 124.75, 499) == 0.25  # the first half of the entries
    assert paced_interval(0.0, 3.0, 499) == 0.0  # 0: each backend delta is posted
    # Then the time left to the cap over the entries left: 475 s / 500 entries.
    assert paced_interval(0.25, 125.0, 500) == pytest.approx(0.95)
    assert paced_interval(0.25, 599.0, 999) == pytest.approx(1.0)  # the last entry waits for the cap
    # Never below the configured interval, nor negative past the cap.
    assert paced_interval(2.0, 125.0, 500) == 2.0
    assert paced_interval(0.25, 700.0, 900) == 0.25


@pytest.mark.parametrize("interval", [DEFAULT_PROGRESS_INTERVAL, 0.0, 0.1])
@pytest.mark.parametrize("token_gap", [0.01, 0.05])
def test_a_continuous_reply_keeps_posting_until_the_trusted_lease_cap(interval, token_gap):
    """A backend sending a delta every `token_gap` seconds from the pop on; a post is sent whenever
    the paced interval has passed since the last one (the first delta at once), as the poster does."""
    tick, last, sent = 0, None, []
    while len(sent) < MAX_CHAT_PROGRESS_ENTRIES:
        tick += 1
        now = tick * token_gap
        if last is None or now - last >= paced_interval(interval, last, len(sent)) - 1e-9:
            sent.append(now)
            last = now
    assert sent[-1] >= TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS  # the last entry: not before the cap
    # Posts are never far apart, so every appended post renews the lease well inside its 150 s.
    gaps = [b - a for a, b in zip(sent, sent[1:], strict=False)]
    widest = TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS / (MAX_CHAT_PROGRESS_ENTRIES / 2)  # 1.2 s
    assert max(gaps) <= widest + token_gap + 1e-6
    assert max(gaps) < CHAT_PROGRESS_RENEWAL_SECONDS
    # The start of the reply flows at the configured interval (rounded up to the backend's deltas).
    assert max(gaps[: MAX_CHAT_PROGRESS_ENTRIES // 2 - 1]) <= max(interval, token_gap) + token_gap + 1e-6
    if interval == DEFAULT_PROGRESS_INTERVAL:
        # 500 entries at 0.25 s take 125 s; the other 500 share the 475 s left: 0.95 s apart.
        assert sent[MAX_CHAT_PROGRESS_ENTRIES // 2 - 1] == pytest.approx(125.0, abs=0.5)
        assert gaps[MAX_CHAT_PROGRESS_ENTRIES // 2] == pytest.approx(0.95, abs=2 * token_gap)


def test_the_poster_waits_the_paced_interval_between_posts():
    now = [0.0]
    horde = HordeClient(CLOSED_HORDE, "key")
    try:
        poster = ProgressPoster(horde, "job", max_length=4096, clock=lambda: now[0])
        assert poster.current_interval() == DEFAULT_PROGRESS_INTERVAL
        poster.accepted_seq = MAX_CHAT_PROGRESS_ENTRIES // 2  # half the entries used, 125 s in
        now[0] = 125.0
        assert poster.current_interval() == pytest.approx(0.95)
        assert poster.delta("a") is True and poster.posts == 1  # the first delta at once
        now[0] = 125.5
        assert poster.delta("b") is True and poster.posts == 1  # 0.5 s: more than 0.25, less than 0.95
        now[0] = 126.0
        assert poster.delta("c") is True and poster.posts == 2  # the unanswered post goes again
    finally:
        horde.close()


def test_at_the_entry_cap_the_poster_stops_posting_and_generation_goes_on():
    horde = HordeClient(CLOSED_HORDE, "key")
    try:
        poster = ProgressPoster(horde, "job", max_length=4096, interval=0)
        poster.accepted_seq = MAX_CHAT_PROGRESS_ENTRIES
        assert poster.delta("more") is True  # True: keep generating
        assert not poster.posting and poster.posts == 0
        assert poster.delta("still more") is True and poster.flush() is True  # True: submit
    finally:
        horde.close()
