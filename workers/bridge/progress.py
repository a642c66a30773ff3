"""Streamed progress: the deltas a streaming backend reads, batched and posted to
POST /api/v2/generate/text/progress (spec: chat_requests.md, "Streaming progress"; ADR 0022).

A `ProgressPoster` is the backend's `ProgressSink` for one job whose payload carries the stream
hint. It posts the first delta at once, then at most one post per `interval` with everything read
since, and whatever is left when the backend finishes (`flush`). Each answer decides what follows:

- 200: accepted; `cancelled: true` means stop generating and do not submit.
- 404 ChatJobAborted: stop generating, do not submit.
- 404 ChatProgressNotStreaming, 413 ChatProgressCapReached, 403, 400, 503 ChatProgressUnavailable:
  stop posting, keep generating, submit the whole reply.
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

from contract.chat_progress import MAX_CHAT_PROGRESS_ENTRIES, chat_progress_max_bytes
from workers.bridge.horde import HordeClient, HordeUnavailable

# Batches about four posts a second: a reader sees text flow, the horde gets few requests.
DEFAULT_PROGRESS_INTERVAL = 0.25
# A post the horde did not answer is sent again this many times before the poster gives up.
MAX_UNANSWERED_POSTS = 3


@dataclass
class _Post:
    seq: int
    content: str
    reasoning: str

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
        interval: float = DEFAULT_PROGRESS_INTERVAL,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.horde = horde
        self.job_id = job_id
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
        self._last_post: float | None = None
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
            if self._last_post is None or self.clock() - self._last_post >= self.interval:
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
            return self.stopped is None

    # -- posting

    def _post_due(self) -> None:
        self._last_post = self.clock()
        if self._pending is None:
            content, reasoning = "".join(self._content), "".join(self._reasoning)
            if not content and not reasoning:
                return
            post = _Post(self.accepted_seq + 1, content, reasoning)
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
            if rc == "ChatProgressUnavailable" or self._unanswered >= MAX_UNANSWERED_POSTS:
                self._stop_posting(f"{status} {rc or body.get('message') or ''}".strip())
            return
        self._stop_posting(f"{status} {rc}: {body.get('message') or ''}")

    def _accepted(self, post: _Post) -> None:
        self.accepted_seq = post.seq
        self.accepted_bytes += post.size
        self._pending = None

    def _stop_posting(self, why: str) -> None:
        self.posting = False
        self._pending = None
        self._content.clear()
        self._reasoning.clear()
        self.log(f"job {self.job_id[:8]}: progress posts stopped ({why}); the reply is still submitted whole")
