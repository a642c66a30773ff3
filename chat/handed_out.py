"""The text jobs this process handed out, kept until their submit.

A text submit needs the generation, its request and its worker: exactly the rows the pop that
handed the job out had just read or written. The pop leaves them here, and the submit takes them
instead of reading them back (PostgreSQL's one-statement submit; a submit that reaches another
process, or comes after a restart, reads them as before).

Nothing a submit decides rests on this copy alone: its compare-and-set (`state = processing`) is
checked by the statement that stores the result, so a job cancelled, faulted or already submitted
meanwhile is refused as before. What the copy supplies is what does not change while a job is out:
the request's prompt, budgets, quote and requester, the job's model and start, the worker's id and
owner. The worker's speed samples are read by the statement itself, from the row it updates.
"""

from __future__ import annotations

import time
from uuid import UUID

from chat.models import Generation
from contract.text import TEXT_JOB_LEASE_SECONDS

# A bound on memory, far above what one process hands out in a lease (clearing only costs reads).
_MAX_JOBS = 100_000


class HandedOutJobs:
    def __init__(self) -> None:
        self._jobs: dict[UUID, tuple[float, Generation]] = {}

    def remember(self, generations: list[Generation]) -> None:
        """Generations just handed out, each with its request and worker (owner_id set) attached."""
        if len(self._jobs) + len(generations) > _MAX_JOBS:
            self._jobs.clear()
        now = time.monotonic()
        for generation in generations:
            self._jobs[generation.pk] = (now, generation)

    def take(self, generation_id: UUID) -> Generation | None:
        """The job as handed out, once; None when this process did not hand it out within its lease."""
        hit = self._jobs.pop(generation_id, None)
        if hit is None or time.monotonic() - hit[0] >= TEXT_JOB_LEASE_SECONDS:
            return None
        return hit[1]

    def clear(self) -> None:
        self._jobs.clear()


handed_out = HandedOutJobs()
