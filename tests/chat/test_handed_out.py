"""The memory of handed-out text jobs: each taken once, bounded by jobs, prompt size and lease."""

from __future__ import annotations

import uuid

from chat import handed_out as module
from chat.handed_out import HandedOutJobs
from chat.models import Generation, GenerationRequest


def _job(prompt: str = "A prompt.") -> Generation:
    return Generation(id=uuid.uuid4(), request=GenerationRequest(prompt=prompt))


def test_a_job_is_taken_once():
    jobs = HandedOutJobs()
    job = _job()
    jobs.remember([job])
    assert jobs.take(job.pk) is job
    assert jobs.take(job.pk) is None
    assert jobs.take(uuid.uuid4()) is None


def test_the_oldest_jobs_go_past_the_job_bound():
    jobs = HandedOutJobs(max_jobs=3)
    handed = [_job() for _ in range(5)]
    for job in handed:
        jobs.remember([job])
    assert len(jobs) == 3
    assert [jobs.take(job.pk) for job in handed] == [None, None, *handed[2:]]


def test_the_oldest_jobs_go_past_the_prompt_bound():
    jobs = HandedOutJobs(max_chars=250)
    handed = [_job("p" * 100) for _ in range(4)]
    jobs.remember(handed[:2])
    jobs.remember(handed[2:])
    assert [jobs.take(job.pk) for job in handed] == [None, None, *handed[2:]]


def test_a_job_with_a_prompt_over_the_job_bound_is_not_kept_and_evicts_nothing():
    jobs = HandedOutJobs(max_chars=1000, max_job_chars=200)
    small, big = _job("p" * 100), _job("p" * 201)
    jobs.remember([small, big])
    assert jobs.take(big.pk) is None
    assert jobs.take(small.pk) is small


def test_a_job_past_its_lease_is_not_given(monkeypatch, settings):
    lease = settings.HORDE_TEXT_JOB_LEASE_SECONDS
    jobs = HandedOutJobs()
    now = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    stale, fresh = _job(), _job()
    jobs.remember([stale])
    now[0] += lease - 1
    jobs.remember([fresh])
    now[0] += 2
    assert jobs.take(stale.pk) is None
    assert jobs.take(fresh.pk) is fresh
    # Remembering sweeps what outlived its lease.
    late = _job()
    jobs.remember([late])
    now[0] += lease
    jobs.remember([_job()])
    assert len(jobs) == 1
