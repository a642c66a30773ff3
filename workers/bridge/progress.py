"""Streamed progress: the deltas a streaming backend reads, batched and posted to
POST /api/v2/generate/text/progress (spec: chat_requests.md, "Streaming progress"; ADR 0022).

A `ProgressPoster` is the backend's `ProgressSink` for one job whose payload carries the stream
hint. It posts the first delta at once, then at most one post per `interval` with everything read
since, and whatever is left when the backend finishes (`flush`). Past half the entry cap the posts
are spaced wider (`paced_interval`), so the entries last until the longest lease's cap: only an
appended post renews the lease. Each answer decides what follows:

- 200: accepted; `cancelled: true` means stop generating and do not submit.
- 404 ChatJobAborted: stop generating, do not submit.
- 404 ChatProgressNotStreaming, 413 ChatProgressCapReached, 403, 400: stop posting, keep
  generating, submit the whole reply.
- 503 ChatProgressUnavailable (the horde's Redis): the post is sent again, at least a second
  apart, with what was read since following it; after PROGRESS_UNAVAILABLE_SECONDS without an
  answer the posts stop as above (ADR 0078).
- 409 ChatProgressOutOfSequence: the delta was not taken (a repeat of an accepted post is answered
  200), so it is sent once more with `expected_seq`; a second 409 stops the posts.
- no answer (unreachable, other 5xx, 429): the same post is sent again, unchanged, at the next
  interval, so the horde answers a repeat of what it accepted with the same body.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contract.chat_progress import (
    CHAT_PROGRESS_RENEWAL_SECONDS,
    MAX_CHAT_PROGRESS_ENTRIES,
    TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS,
    chat_progress_max_bytes,
)
from contract.text import TEXT_JOB_LEASE_SECONDS
from workers.bridge.horde import HordeClient, HordeUnavailable

# Batches about four posts a second: a reader sees text flow, the horde gets few requests.
DEFAULT_PROGRESS_INTERVAL = 0.25
# A post the horde did not answer is sent again this many times before the poster gives up.
MAX_UNANSWERED_POSTS = 3
# 503 ChatProgressUnavailable (the horde's Redis): the post is kept and sent again, at least this
# many seconds apart, for up to PROGRESS_UNAVAILABLE_SECONDS; then the posts stop (ADR 0078).
PROGRESS_UNAVAILABLE_RETRY_SECONDS = 1.0
PROGRESS_UNAVAILABLE_SECONDS = 15.0
# Posts keep the configured interval for this share of MAX_CHAT_PROGRESS_ENTRIES: a reply's start
# flows at full rate (500 entries: 125 s of posts at 0.25 s).
FULL_RATE_ENTRY_SHARE = 0.5


def paced_interval(interval: float, elapsed: float, entries_used: int) -> float:
    """Seconds from the last post to the next, the last post `elapsed` seconds into the job with
    `entries_used` entries accepted: `interval` for the first FULL_RATE_ENTRY_SHARE of the entries,
    then the time from the last post to the trusted lease cap shared among the entries left, never
    less than `interval`.

    Only an appended post renews the job lease, so the entries must last as long as the longest lease
    (TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS from the pop). When one entry is left its interval is all the
    time left, so the last entry is not posted before the cap; and the shared interval never grows,
    so past the share posts are at most 600 / 500 = 1.2 s apart (or `interval`, if wider)."""
    left = MAX_CHAT_PROGRESS_ENTRIES - entries_used
    if entries_used < FULL_RATE_ENTRY_SHARE * MAX_CHAT_PROGRESS_ENTRIES or left <= 0:
        return interval
    return max(interval, (TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS - elapsed) / left)


@dataclass
class _Post:
    seq: int
    content: str
    reasoning: str
    first_sent: float = 0.0  # the horde appends it at this send or a later one: renewed from here

    def body(self, job_id: str) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": self.content}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        return {"id": job_id, "seq": self.seq, "delta": delta}

    @property
    def size(self) -> int:
        return len(self.content.encode("utf-8")) + len(self.reasoning.encode("utf-8"))


class ProgressPoster:
    def __init__(
        self,
        horde: HordeClient,
        job_id: str,
        *,
        max_length: int,
        lease_seconds: float = TEXT_JOB_LEASE_SECONDS,
        interval: float = DEFAULT_PROGRESS_INTERVAL,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.horde = horde
        self.job_id = job_id
        self.lease_seconds = lease_seconds  # the pop's ttl
        self.interval = interval
        self.max_bytes = chat_progress_max_bytes(max_length)
        self.log = log or (lambda _message: None)
        self.clock = clock
        self.posting = True  # False once the horde said stop posting (or the caps are reached)
        self.stopped: str | None = None  # why the horde said stop generating
        self.accepted_seq = 0
        self.accepted_bytes = 0
        self.posts = 0  # requests sent, retries included
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._pending: _Post | None = None  # sent, not answered yet
        self._unanswered = 0
        self._unavailable_since: float | None = None  # the first 503 of the outage under way
        self._last_post: float | None = None
        self._lease_extension = 0.0
        self._started = clock()  # just after the pop: the cap's seconds counted from here last past it
        self._lock = threading.Lock()

    # -- ProgressSink

    def delta(self, content: str, reasoning_content: str | None = None) -> bool:
        """Buffer a delta and post when the interval has passed; False: stop generating."""
        with self._lock:
            if self.stopped:
                return False
            if not self.posting:
                return True
            if content:
                self._content.append(content)
            if reasoning_content:
                self._reasoning.append(reasoning_content)
            if self._last_post is None or self.clock() - self._last_post >= self.current_interval():
                self._post_due()
            return self.stopped is None

    def flush(self) -> bool:
        """Post what is buffered (the backend finished); False: do not submit."""
        with self._lock:
            if self.stopped:
                return False
            if self.posting:
                self._post_due()
                if self._pending is not None and self.posting and not self.stopped:
                    self._post_due()  # one more try for a post the horde did not answer
                if self._pending is None and self.posting and not self.stopped:
                    # The post just answered may have been a resent one: the text read since it
                    # went first is still buffered (_post_due sends nothing when there is none).
                    self._post_due()
            return self.stopped is None

    def lease_extension(self) -> float:
        """Seconds the renewals moved the lease past its end at pop: an appended post renews it to
        CHAT_PROGRESS_RENEWAL_SECONDS after the post, within TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS of the
        pop. The owner's trust is the horde's to know: past an untrusted owner's cap the horde answers
        ChatJobAborted, which stops the job."""
        return self._lease_extension

    def current_interval(self) -> float:
        """The seconds the next post waits after the last one (`paced_interval`)."""
        last = self.clock() if self._last_post is None else self._last_post
        interval = paced_interval(self.interval, last - self._started, self.accepted_seq)
        if self._unavailable_since is not None:  # the horde's Redis is out: a retry a second at most
            return max(interval, PROGRESS_UNAVAILABLE_RETRY_SECONDS)
        return interval

    # -- posting

    def _post_due(self) -> None:
        self._last_post = self.clock()
        if self._pending is None:
            content, reasoning = "".join(self._content), "".join(self._reasoning)
            if not content and not reasoning:
                return
            post = _Post(self.accepted_seq + 1, content, reasoning, first_sent=self._last_post)
            if post.seq > MAX_CHAT_PROGRESS_ENTRIES or self.accepted_bytes + post.size > self.max_bytes:
                self._stop_posting("the progress caps are reached")
                return
            self._content.clear()
            self._reasoning.clear()
            self._pending = post
        self._send(self._pending, resynced=False)

    def _send(self, post: _Post, *, resynced: bool) -> None:
        self.posts += 1
        try:
            status, body = self.horde.progress(post.body(self.job_id))
        except HordeUnavailable as error:
            self._unanswered += 1
            if self._unanswered >= MAX_UNANSWERED_POSTS:
                self._stop_posting(f"the horde did not answer {self._unanswered} posts ({error})")
            return  # the same post goes again at the next interval
        self._unanswered = 0
        rc = str(body.get("rc") or "")
        if status == 503 and rc == "ChatProgressUnavailable":
            # Usually a blip (the horde refuses Redis calls for a few seconds after one failed):
            # stopping for good would freeze the reader's text and hide a cancel for the whole job.
            now = self.clock()
            if self._unavailable_since is None:
                self._unavailable_since = now
            if now - self._unavailable_since >= PROGRESS_UNAVAILABLE_SECONDS:
                self._stop_posting(f"{status} {rc} for {PROGRESS_UNAVAILABLE_SECONDS:.0f} s")
            return  # the same post goes again when the retry is due
        self._unavailable_since = None
        if status == 200:
            self._accepted(post)
            if body.get("cancelled") is True:
                self.stopped = "the request was cancelled"
            return
        if status == 404 and rc == "ChatJobAborted":
            self._pending = None
            self.stopped = "the horde aborted the job (ChatJobAborted)"
            return
        expected = body.get("expected_seq")
        if status == 409 and isinstance(expected, int) and expected >= 1 and not resynced:
            # A repeat of what the horde accepted is answered 200, so this delta was not taken.
            self.accepted_seq = expected - 1
            post.seq = expected
            self._send(post, resynced=True)
            return
        if status >= 500 or status == 429:
            self._unanswered += 1
            if self._unanswered >= MAX_UNANSWERED_POSTS:
                self._stop_posting(f"{status} {rc or body.get('message') or ''}".strip())
            return
        self._stop_posting(f"{status} {rc}: {body.get('message') or ''}")

    def _accepted(self, post: _Post) -> None:
        self.accepted_seq = post.seq
        self.accepted_bytes += post.size
        self._pending = None
        # Counted from its first send, the earliest the horde can have appended (and renewed) it.
        renewed_to = min(post.first_sent + CHAT_PROGRESS_RENEWAL_SECONDS, self._started + TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS)
        self._lease_extension = max(self._lease_extension, renewed_to - (self._started + self.lease_seconds))

    def _stop_posting(self, why: str) -> None:
        self.posting = False
        self._pending = None
        self._content.clear()
        self._reasoning.clear()
        self.log(f"job {self.job_id[:8]}: progress posts stopped ({why}); the reply is still submitted whole")
