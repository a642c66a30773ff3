"""Jobs a pop took for a worker that left before the answer was sent go back to the queue at once
(chat.services.pop.popped_jobs_give_back; the serving layer calls it, tests/oai/test_pop_worker_gone.py
drives that over HTTP): the generations go as if never handed out, the request waits again and a
streamed job's lease goes with it. A job its worker already submitted stays as it is."""

from __future__ import annotations

import pytest

from chat.models import Generation, GenerationRequest
from chat.services.pop import popped_jobs_give_back
from contract.chat_progress import chat_stream_lease_key
from tests.chat.pop_helpers import MODEL, chat_pop
from tests.chat.test_progress import stream_redis, streamed_job  # noqa: F401  (fixtures)
from workers.models import Worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.redis_only
def test_a_streamed_job_given_back_waits_again_without_its_lease(horde, streamed_job, stream_redis):  # noqa: F811
    _, owner, request, job_id, _ = streamed_job()
    assert stream_redis.exists(chat_stream_lease_key(job_id))
    assert popped_jobs_give_back(generation_ids=[job_id]) == 1
    assert not Generation.objects.filter(pk=job_id).exists()
    assert GenerationRequest.objects.get(pk=request.pk).jobs_waiting == 1
    assert not stream_redis.exists(chat_stream_lease_key(job_id))
    worker = Worker.objects.get(name="stream-worker")
    assert (worker.aborted_jobs, worker.fulfilments) == (0, 0)  # it never had the job
    again = chat_pop(horde, owner.key, name="stream-worker")
    assert again.json()["id"] not in (None, str(job_id))
    assert str(Generation.objects.get(pk=again.json()["id"]).request_id) == str(request.pk)
    assert popped_jobs_give_back(generation_ids=[job_id]) == 0  # once


def test_a_job_its_worker_submitted_is_not_given_back(horde, streamed_job):  # noqa: F811
    _, owner, request, job_id, _ = streamed_job(stream=False)
    submitted = horde.chat_submit(owner.key, job_id, message={"role": "assistant", "content": "Hi there."},
                                  finish_reason="stop", model_id=MODEL)
    assert submitted.status_code == 200, submitted.json()
    assert popped_jobs_give_back(generation_ids=[job_id]) == 0
    assert Generation.objects.get(pk=job_id).state == Generation.State.OK
    assert GenerationRequest.objects.get(pk=request.pk).jobs_waiting == 0
