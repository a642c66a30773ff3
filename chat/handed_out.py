"""The text jobs this process handed out, kept until their submit.

A text submit needs the generation, its request and its worker: exactly the rows the pop that
handed the job out had just read or written. The pop leaves them here, and the submit takes them
instead of reading them back (PostgreSQL's one-statement submit; a submit that reaches another
process, comes after a restart, or finds its job evicted reads them as before).

Nothing a submit decides rests on this copy alone: its compare-and-set (`state = processing`) is
checked by the statement that stores the result, so a job cancelled, faulted or already submitted
meanwhile is refused as before. What the copy supplies is what does not change while a job is out:
the request's prompt, budgets, quote and requester, the job's model and start, the worker's id and
owner. The worker's speed samples are read by the statement itself, from the row it updates.
"""

from __future__ import annotations

import threading
import time
from uuid import UUID

from django.conf import settings

from chat.models import Generation

# Memory bounds: jobs kept, and prompt characters kept (the prompt is most of a job's size; a
# job evicted or never kept only costs its submit one read).
HANDED_OUT_MAX_JOBS = 50_000
HANDED_OUT_MAX_PROMPT_CHARS = 64 * 1024 * 1024
# A job with a longer prompt is not kept (it would push out many others).
HANDED_OUT_MAX_JOB_PROMPT_CHARS = 1024 * 1024


class HandedOutJobs:
    def __init__(
        self,
        *,
        max_jobs: int = HANDED_OUT_MAX_JOBS,
        max_chars: int = HANDED_OUT_MAX_PROMPT_CHARS,
        max_job_chars: int = HANDED_OUT_MAX_JOB_PROMPT_CHARS,
    ):
        self.max_jobs = max_jobs
        self.max_chars = max_chars
        self.max_job_chars = max_job_chars
        # In the order handed out, so the oldest are first to go.
        self._jobs: dict[UUID, tuple[float, int, Generation]] = {}
        self._chars = 0
        self._lock = threading.Lock()

    def remember(self, generations: list[Generation]) -> None:
        """Generations just handed out, each with its request and worker (owner_id set) attached."""
        now = time.monotonic()
        with self._lock:
            for generation in generations:
                size = len(generation.request.prompt or "")
                if size > self.max_job_chars:
                    continue
                self._jobs[generation.pk] = (now, size, generation)
                self._chars += size
            self._evict(now)

    def _evict(self, now: float) -> None:
        while self._jobs:
            oldest = next(iter(self._jobs))
            at, size, _ = self._jobs[oldest]
            over = len(self._jobs) > self.max_jobs or self._chars > self.max_chars
            if not over and now - at < settings.HORDE_TEXT_JOB_LEASE_SECONDS:
                return
            del self._jobs[oldest]
            self._chars -= size

    def take(self, generation_id: UUID) -> Generation | None:
        """The job as handed out, once; None when this process did not hand it out within its lease."""
        with self._lock:
            hit = self._jobs.pop(generation_id, None)
            if hit is None:
                return None
            self._chars -= hit[1]
        at, _, generation = hit
        return generation if time.monotonic() - at < settings.HORDE_TEXT_JOB_LEASE_SECONDS else None

    def __len__(self) -> int:
        return len(self._jobs)

    def clear(self) -> None:
        with self._lock:
            self._jobs.clear()
            self._chars = 0


handed_out = HandedOutJobs()
