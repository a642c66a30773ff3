"""Streaming progress: the lease written at pop, POST /api/v2/generate/text/progress (every status
of the spec's table), the lease's renewal and trust caps, its ends (submit, fault, stale abort,
cancel) and the cancel's settlement on posted content (chat_requests.md, "Streaming progress",
"Job lease", "Pricing")."""

from __future__ import annotations

import math
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accounts.models import KudosTransaction, SharedKey, hash_api_key
from chat.models import Generation, GenerationRequest
from chat.pricing import text_generation_kudos
from chat.services import progress
from chat.services.progress import JOB_LEASE_WRITE_STEP_SECONDS
from chat.services.sweeps import abort_stale_generations
from contract.chat_progress import (
    CHAT_PROGRESS_BYTES_PER_TOKEN,
    CHAT_PROGRESS_LEASE_GRACE_SECONDS,
    CHAT_PROGRESS_STREAM_TTL_SECONDS,
    MAX_CHAT_PROGRESS_ENTRIES,
    TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS,
    UNTRUSTED_TEXT_JOB_LEASE_CAP_SECONDS,
    chat_progress_stream_key,
    chat_stream_lease_key,
)
from contract.text import TEXT_JOB_LEASE_SECONDS
from tests.chat.pop_helpers import MODEL, chat_pop, queue_chat
from tests.chat.test_chat_submit import counter_points, metric_reader  # noqa: F401  (fixture)
from tests.ports import free_port
from workers.models import Worker

PROGRESS = "generate/text/progress"
CLOSED_PORT = "redis://127.0.0.1:1/0"

redis_only = pytest.mark.redis_only
# Real commits: the lease's deletion, ended markers and flags run when the transaction commits.
pytestmark = pytest.mark.django_db(transaction=True)


def post(horde, key, job_id, seq, content=None, reasoning=None, **extra):
    delta = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    return horde._call("post", PROGRESS, key, {"id": str(job_id), "seq": seq, "delta": delta, **extra})


def refused(response, status: int, rc: str):
    body = response.json()
    assert response.status_code == status, body
    assert body["rc"] == rc and body["message"], body
    return body


@pytest.fixture
def stream_redis():
    client = progress.progress_redis()
    assert client is not None
    return client


@pytest.fixture
def streamed_job(horde, make_user):
    """A streamed chat request popped by a chat worker: (requester, owner, request, job id)."""

    def make(*, trusted: bool = False, max_length: int = 512, stream: bool = True, name: str = "stream-worker"):
        requester = make_user(f"req-{uuid.uuid4().hex[:6]}", kudos=1000)
        owner = make_user(f"own-{uuid.uuid4().hex[:6]}", trusted=trusted)
        request = queue_chat(requester.user, {"stream": stream}, max_length=max_length)
        popped = chat_pop(horde, owner.key, name=name)
        assert popped.status_code == 200 and popped.json()["id"], popped.json()
        return requester, owner, request, uuid.UUID(popped.json()["id"]), popped.json()

    return make


def entries(client, request_id):
    return [
        {k.decode(): v.decode() for k, v in fields.items()}
        for _, fields in client.xrange(chat_progress_stream_key(request_id))
    ]


def lease(client, job_id):
    return {k.decode(): v.decode() for k, v in client.hgetall(chat_stream_lease_key(job_id)).items()}


# --- the lease at pop --------------------------------------------------------------------------


@redis_only
def test_pop_writes_the_lease_with_every_field(streamed_job, stream_redis):
    before = int(time.time())
    _, owner, request, job_id, body = streamed_job(trusted=True)
    after = int(time.time())
    assert body["payload"]["stream_progress"] is True and body["ttl"] == TEXT_JOB_LEASE_SECONDS
    generation = Generation.objects.get(pk=job_id)
    fields = lease(stream_redis, job_id)
    assert set(fields) == {
        "request", "worker", "model", "owner", "key", "max_bytes", "fake", "started", "job_ttl", "lease_cap", "trusted"
    }
    assert fields["request"] == str(request.pk) and fields["worker"] == str(generation.worker_id)
    assert fields["model"] == MODEL and fields["owner"] == str(owner.user.pk)
    # A SHA-256 of the stored key hash, never the key or the hash itself.
    assert fields["key"] == progress.lease_key_digest(hash_api_key(owner.key)) != owner.user.api_key_hash
    assert int(fields["max_bytes"]) == CHAT_PROGRESS_BYTES_PER_TOKEN * 512
    assert fields["fake"] == "0" and fields["trusted"] == "1"
    assert before <= int(fields["started"]) <= after
    assert int(fields["job_ttl"]) == TEXT_JOB_LEASE_SECONDS
    assert int(fields["lease_cap"]) == TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS
    expires = stream_redis.expiretime(chat_stream_lease_key(job_id))
    assert expires == int(fields["started"]) + TEXT_JOB_LEASE_SECONDS + CHAT_PROGRESS_LEASE_GRACE_SECONDS


@redis_only
def test_the_lease_at_pop_is_the_configured_job_lease(streamed_job, stream_redis, settings):
    settings.HORDE_TEXT_JOB_LEASE_SECONDS = 30
    _, _, _, job_id, body = streamed_job()
    fields = lease(stream_redis, job_id)
    assert body["ttl"] == 30 and int(fields["job_ttl"]) == 30
    row = Generation.objects.get(pk=job_id).lease_expires_at.timestamp()
    assert int(fields["started"]) <= row - 30 < int(fields["started"]) + 1
    expires = stream_redis.expiretime(chat_stream_lease_key(job_id))
    assert expires == int(fields["started"]) + 30 + CHAT_PROGRESS_LEASE_GRACE_SECONDS


@redis_only
def test_untrusted_owner_gets_the_untrusted_cap_and_unstreamed_jobs_get_no_lease(streamed_job, stream_redis):
    _, _, _, job_id, _ = streamed_job(trusted=False)
    fields = lease(stream_redis, job_id)
    assert fields["trusted"] == "0" and int(fields["lease_cap"]) == UNTRUSTED_TEXT_JOB_LEASE_CAP_SECONDS
    _, _, _, plain_id, body = streamed_job(stream=False, name="plain-worker")
    assert "stream_progress" not in body["payload"]
    assert not stream_redis.exists(chat_stream_lease_key(plain_id))


# --- accepted posts -------------------------------------------------------------------------------


@redis_only
def test_accepted_posts_are_appended_in_order_with_worker_and_model(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job()
    worker_id = str(Generation.objects.get(pk=job_id).worker_id)
    first = post(horde, owner.key, job_id, 1, "Hel")
    assert first.status_code == 200 and first.json() == {"accepted_seq": 1, "cancelled": False}
    second = post(horde, owner.key, job_id, 2, "", reasoning="thinking")
    assert second.json() == {"accepted_seq": 2, "cancelled": False}
    third = post(horde, owner.key, job_id, 3, "lo")
    assert third.json() == {"accepted_seq": 3, "cancelled": False}
    assert entries(stream_redis, request.pk) == [
        {"gen": str(job_id), "seq": "1", "content": "Hel", "worker": worker_id, "model": MODEL},
        {"gen": str(job_id), "seq": "2", "content": "", "reasoning_content": "thinking", "worker": worker_id,
         "model": MODEL},
        {"gen": str(job_id), "seq": "3", "content": "lo", "worker": worker_id, "model": MODEL},
    ]
    ttl = stream_redis.ttl(chat_progress_stream_key(request.pk))
    assert CHAT_PROGRESS_STREAM_TTL_SECONDS - 5 <= ttl <= CHAT_PROGRESS_STREAM_TTL_SECONDS
    fields = lease(stream_redis, job_id)
    assert fields["seq"] == "3" and int(fields["bytes"]) == len("Hel") + len("thinking") + len("lo")


@redis_only
def test_a_post_after_redis_lost_its_scripts_loads_the_script_again(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "Hel").status_code == 200
    stream_redis.script_flush()  # as a Redis restart does
    assert post(horde, owner.key, job_id, 2, "lo").json() == {"accepted_seq": 2, "cancelled": False}
    assert [e["content"] for e in entries(stream_redis, request.pk)] == ["Hel", "lo"]


@redis_only
def test_a_retried_post_answers_the_same_and_appends_nothing(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "A", reasoning="r").status_code == 200
    again = post(horde, owner.key, job_id, 1, "A", reasoning="r")
    assert again.status_code == 200 and again.json() == {"accepted_seq": 1, "cancelled": False}
    assert len(entries(stream_redis, request.pk)) == 1
    # The same seq with other content (or other reasoning) is out of sequence.
    for other in (post(horde, owner.key, job_id, 1, "B", reasoning="r"), post(horde, owner.key, job_id, 1, "A")):
        body = refused(other, 409, "ChatProgressOutOfSequence")
        assert body["expected_seq"] == 2
    assert len(entries(stream_redis, request.pk)) == 1


@redis_only
def test_out_of_sequence_posts_are_409_with_the_expected_seq(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job()
    assert refused(post(horde, owner.key, job_id, 2, "x"), 409, "ChatProgressOutOfSequence")["expected_seq"] == 1
    assert post(horde, owner.key, job_id, 1, "x").status_code == 200
    assert refused(post(horde, owner.key, job_id, 3, "x"), 409, "ChatProgressOutOfSequence")["expected_seq"] == 2
    assert len(entries(stream_redis, request.pk)) == 1


@redis_only
def test_empty_delta_is_bad_request_and_malformed_bodies_list_their_fields(horde, streamed_job):
    _, owner, _, job_id, _ = streamed_job()
    refused(post(horde, owner.key, job_id, 1), 400, "BadRequest")
    refused(post(horde, owner.key, job_id, 1, "", reasoning=""), 400, "BadRequest")
    malformed = horde._call("post", PROGRESS, owner.key, {"id": "nope", "seq": "1", "delta": {"content": 3}})
    assert malformed.status_code == 400
    assert malformed.json()["message"] == "Input payload validation failed"
    assert set(malformed.json()["errors"]) == {"id", "seq", "delta.content"}
    zero = horde._call("post", PROGRESS, owner.key, {"id": str(job_id), "seq": 0, "delta": {"content": "x"}})
    assert zero.status_code == 400 and set(zero.json()["errors"]) == {"seq"}


@redis_only
def test_another_key_is_wrong_credentials(horde, streamed_job, make_user, stream_redis):
    _, owner, request, job_id, _ = streamed_job()
    stranger = make_user("stranger")
    refused(post(horde, stranger.key, job_id, 1, "x"), 403, "WrongCredentials")
    refused(post(horde, None, job_id, 1, "x"), 403, "WrongCredentials")
    assert entries(stream_redis, request.pk) == []


@redis_only
def test_an_accepted_post_reads_nothing_from_postgres(horde, streamed_job):
    _, owner, _, job_id, _ = streamed_job()
    with CaptureQueriesContext(connection) as queries:
        assert post(horde, owner.key, job_id, 1, "x").status_code == 200
        assert post(horde, owner.key, job_id, 1, "x").status_code == 200  # retried: no renewal either
        refused(post(horde, owner.key, job_id, 5, "x"), 409, "ChatProgressOutOfSequence")
    statements = [q["sql"].lstrip().split()[0].upper() for q in queries.captured_queries]
    assert all(s == "UPDATE" for s in statements) and len(statements) <= 1, statements


# --- caps -----------------------------------------------------------------------------------------


@redis_only
def test_byte_cap_counts_content_and_reasoning_in_utf8(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job(max_length=16)
    cap = CHAT_PROGRESS_BYTES_PER_TOKEN * 16
    assert post(horde, owner.key, job_id, 1, "é" * 100, reasoning="r" * 50).status_code == 200  # 250 bytes
    refused(post(horde, owner.key, job_id, 2, "x" * (cap - 250 + 1)), 413, "ChatProgressCapReached")
    assert post(horde, owner.key, job_id, 2, "x" * (cap - 250)).status_code == 200
    refused(post(horde, owner.key, job_id, 3, "y"), 413, "ChatProgressCapReached")
    assert len(entries(stream_redis, request.pk)) == 2
    # Capped, the job still submits.
    submitted = horde.chat_submit(owner.key, job_id, message={"role": "assistant", "content": "done"},
                                  finish_reason="stop", model_id=MODEL)
    assert submitted.status_code == 200, submitted.json()


@redis_only
def test_entry_cap_is_a_thousand_posts(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job(max_length=512)
    for seq in range(1, MAX_CHAT_PROGRESS_ENTRIES + 1):
        answer = post(horde, owner.key, job_id, seq, "x")
        assert answer.status_code == 200, (seq, answer.json())
    refused(post(horde, owner.key, job_id, MAX_CHAT_PROGRESS_ENTRIES + 1, "x"), 413, "ChatProgressCapReached")
    assert stream_redis.xlen(chat_progress_stream_key(request.pk)) >= MAX_CHAT_PROGRESS_ENTRIES


# --- no lease ---------------------------------------------------------------------------------


@redis_only
def test_without_a_lease_the_generation_tells_aborted_from_not_streaming(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job(stream=False)
    # Stored, not faulted, no lease (not streamed): stop posting, still submit.
    refused(post(horde, owner.key, job_id, 1, "x"), 404, "ChatProgressNotStreaming")
    # Not stored (its request expired and was deleted).
    refused(post(horde, owner.key, uuid.uuid4(), 1, "x"), 404, "ChatJobAborted")
    # Another worker's job without a lease is still refused on the key.
    refused(post(horde, "not-the-key", job_id, 1, "x"), 403, "WrongCredentials")


@redis_only
def test_submitted_job_deletes_the_lease_and_keeps_the_stream(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "Hi").status_code == 200
    submitted = horde.chat_submit(owner.key, job_id, message={"role": "assistant", "content": "Hi there."},
                                  finish_reason="stop", model_id=MODEL)
    assert submitted.status_code == 200, submitted.json()
    assert not stream_redis.exists(chat_stream_lease_key(job_id))
    assert [e.get("content") for e in entries(stream_redis, request.pk)] == ["Hi"]
    refused(post(horde, owner.key, job_id, 2, "x"), 404, "ChatProgressNotStreaming")


@redis_only
def test_faulted_submit_ends_the_stream_and_aborts_later_posts(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "Hi").status_code == 200
    faulted = horde.chat_submit(owner.key, job_id, state="faulted", model_id=MODEL, fault_reason="generation_error")
    assert faulted.status_code == 200, faulted.json()
    assert entries(stream_redis, request.pk)[-1] == {"gen": str(job_id), "ended": "1"}
    assert not stream_redis.exists(chat_stream_lease_key(job_id))
    refused(post(horde, owner.key, job_id, 2, "x"), 404, "ChatJobAborted")


@redis_only
def test_a_lapsed_lease_ends_the_stream(horde, streamed_job, stream_redis, metric_reader):  # noqa: F811
    _, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "Hi").status_code == 200
    _shift_lease(stream_redis, job_id, started_ago=TEXT_JOB_LEASE_SECONDS + 1, job_ttl=TEXT_JOB_LEASE_SECONDS)
    assert abort_stale_generations() == 1
    assert entries(stream_redis, request.pk)[-1] == {"gen": str(job_id), "ended": "1"}
    assert not stream_redis.exists(chat_stream_lease_key(job_id))
    refused(post(horde, owner.key, job_id, 2, "x"), 404, "ChatJobAborted")
    assert counter_points(metric_reader, "horde.text.stale_aborts") == {
        (("horde.chat", True), ("horde.worker_trusted", False)): 1
    }


# --- renewal -------------------------------------------------------------------------------------


def _shift_lease(client, job_id, *, started_ago: int, job_ttl: int) -> int:
    """The job popped `started_ago` seconds ago with the given lease, in Redis and in PostgreSQL."""
    started = int(time.time()) - started_ago
    client.hset(chat_stream_lease_key(job_id), mapping={"started": started, "job_ttl": job_ttl})
    Generation.objects.filter(pk=job_id).update(
        lease_expires_at=datetime.fromtimestamp(started + job_ttl, tz=UTC)
    )
    return started


def _pg_deadline(job_id) -> float:
    return Generation.objects.get(pk=job_id).lease_expires_at.timestamp()


@redis_only
def test_an_appended_post_extends_the_lease_to_150_seconds_after_it(
    horde, streamed_job, stream_redis, metric_reader  # noqa: F811
):
    _, owner, _, job_id, _ = streamed_job()
    started = _shift_lease(stream_redis, job_id, started_ago=20, job_ttl=TEXT_JOB_LEASE_SECONDS)
    before = time.time()
    assert post(horde, owner.key, job_id, 1, "x").status_code == 200
    after = time.time()
    job_ttl = int(lease(stream_redis, job_id)["job_ttl"])
    assert math.ceil(before + 150 - started) <= job_ttl <= math.ceil(after + 150 - started)
    # 170 s from the pop: inside the row's step (ADR 0040), so the row keeps the lease it had.
    assert _pg_deadline(job_id) == started + TEXT_JOB_LEASE_SECONDS
    assert stream_redis.expiretime(chat_stream_lease_key(job_id)) == started + job_ttl + CHAT_PROGRESS_LEASE_GRACE_SECONDS
    assert counter_points(metric_reader, "horde.text.lease_renewals") == {
        (("horde.outcome", "granted"), ("horde.worker_trusted", False)): 1
    }
    # A retried post does not extend it.
    started = _shift_lease(stream_redis, job_id, started_ago=20, job_ttl=TEXT_JOB_LEASE_SECONDS)
    assert post(horde, owner.key, job_id, 1, "x").status_code == 200
    assert int(lease(stream_redis, job_id)["job_ttl"]) == TEXT_JOB_LEASE_SECONDS
    assert _pg_deadline(job_id) == started + TEXT_JOB_LEASE_SECONDS


@redis_only
def test_the_row_holds_the_renewed_lease_in_steps(horde, streamed_job, stream_redis):
    _, owner, _, job_id, _ = streamed_job()
    # 40 s after the pop, a post renews the lease to about 190 s: past the 180 s step, so the row
    # is written with the lease.
    started = _shift_lease(stream_redis, job_id, started_ago=40, job_ttl=TEXT_JOB_LEASE_SECONDS)
    assert post(horde, owner.key, job_id, 1, "x").status_code == 200
    job_ttl = int(lease(stream_redis, job_id)["job_ttl"])
    assert job_ttl >= 3 * JOB_LEASE_WRITE_STEP_SECONDS
    assert _pg_deadline(job_id) == started + job_ttl
    # The next posts inside the same step renew the lease in Redis only.
    _shift_lease(stream_redis, job_id, started_ago=20, job_ttl=job_ttl)
    Generation.objects.filter(pk=job_id).update(lease_expires_at=datetime.fromtimestamp(started + job_ttl, tz=UTC))
    assert post(horde, owner.key, job_id, 2, "y").json() == {"accepted_seq": 2, "cancelled": False}
    assert _pg_deadline(job_id) == started + job_ttl


@redis_only
def test_the_sweep_reads_a_streamed_jobs_lease_before_aborting_it(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "Hi").status_code == 200
    fields = lease(stream_redis, job_id)
    leased = int(fields["started"]) + int(fields["job_ttl"])
    # The row lags the lease (its step not reached) and has passed: the lease in Redis still runs.
    Generation.objects.filter(pk=job_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert abort_stale_generations() == 0
    generation = Generation.objects.get(pk=job_id)
    assert generation.state == Generation.State.PROCESSING
    assert generation.lease_expires_at.timestamp() == leased  # written from the lease
    assert post(horde, owner.key, job_id, 2, " there").json() == {"accepted_seq": 2, "cancelled": False}
    # Once the lease itself lapsed, the job is aborted.
    _shift_lease(stream_redis, job_id, started_ago=TEXT_JOB_LEASE_SECONDS + 1, job_ttl=TEXT_JOB_LEASE_SECONDS)
    assert abort_stale_generations() == 1
    assert Generation.objects.get(pk=job_id).state == Generation.State.FAULTED
    assert entries(stream_redis, request.pk)[-1] == {"gen": str(job_id), "ended": "1"}


@redis_only
def test_a_streamed_job_without_its_lease_is_aborted_a_step_after_its_row(horde, streamed_job, stream_redis):
    _, owner, _, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "Hi").status_code == 200
    stream_redis.delete(chat_stream_lease_key(job_id))  # lost with a Redis restart
    # The row may lag the lost lease by up to a step: not aborted inside it ...
    lapsed = timezone.now() - timedelta(seconds=JOB_LEASE_WRITE_STEP_SECONDS - 5)
    Generation.objects.filter(pk=job_id).update(lease_expires_at=lapsed)
    assert abort_stale_generations() == 0
    assert Generation.objects.get(pk=job_id).state == Generation.State.PROCESSING
    # ... and aborted past it.
    lapsed = timezone.now() - timedelta(seconds=JOB_LEASE_WRITE_STEP_SECONDS + 1)
    Generation.objects.filter(pk=job_id).update(lease_expires_at=lapsed)
    assert abort_stale_generations() == 1
    assert Generation.objects.get(pk=job_id).state == Generation.State.FAULTED


@redis_only
def test_the_sweep_keeps_the_step_rule_when_redis_cannot_be_read(horde, streamed_job, stream_redis, settings):
    _, owner, _, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "Hi").status_code == 200
    lapsed = timezone.now() - timedelta(seconds=JOB_LEASE_WRITE_STEP_SECONDS - 5)
    Generation.objects.filter(pk=job_id).update(lease_expires_at=lapsed)
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # every read is refused
    assert progress.leased_deadlines([job_id]) is None
    assert abort_stale_generations() == 0
    Generation.objects.filter(pk=job_id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=JOB_LEASE_WRITE_STEP_SECONDS + 1)
    )
    assert abort_stale_generations() == 1


@pytest.mark.parametrize(
    ("trusted", "cap"), [(False, UNTRUSTED_TEXT_JOB_LEASE_CAP_SECONDS), (True, TRUSTED_TEXT_JOB_LEASE_CAP_SECONDS)]
)
@redis_only
def test_renewal_stops_at_the_owner_trust_cap(
    horde, streamed_job, stream_redis, metric_reader, trusted, cap  # noqa: F811
):
    _, owner, _, job_id, _ = streamed_job(trusted=trusted)
    # Popped cap - 100 seconds ago, with 50 seconds of lease left: 150 more would pass the cap.
    started = _shift_lease(stream_redis, job_id, started_ago=cap - 100, job_ttl=cap - 50)
    assert post(horde, owner.key, job_id, 1, "x").status_code == 200
    assert int(lease(stream_redis, job_id)["job_ttl"]) == cap
    assert _pg_deadline(job_id) == started + cap
    # At the cap, posts are still accepted and leave the lease there.
    assert post(horde, owner.key, job_id, 2, "y").json() == {"accepted_seq": 2, "cancelled": False}
    assert int(lease(stream_redis, job_id)["job_ttl"]) == cap and _pg_deadline(job_id) == started + cap
    assert counter_points(metric_reader, "horde.text.lease_renewals") == {
        (("horde.outcome", "granted"), ("horde.worker_trusted", trusted)): 1,
        (("horde.outcome", "at_cap"), ("horde.worker_trusted", trusted)): 1,
    }


@redis_only
def test_a_post_after_the_lease_lapsed_is_accepted_without_renewal(horde, streamed_job, stream_redis):
    _, owner, request, job_id, _ = streamed_job()
    started = _shift_lease(stream_redis, job_id, started_ago=160, job_ttl=TEXT_JOB_LEASE_SECONDS)
    assert post(horde, owner.key, job_id, 1, "late").status_code == 200
    assert int(lease(stream_redis, job_id)["job_ttl"]) == TEXT_JOB_LEASE_SECONDS
    assert _pg_deadline(job_id) == started + TEXT_JOB_LEASE_SECONDS
    assert len(entries(stream_redis, request.pk)) == 1


# --- cancel --------------------------------------------------------------------------------------


def _cancel(horde, key, request_id):
    return horde._call("delete", f"generate/chat/status/{request_id}", key)


def _settled_kudos(request, generation, characters: int) -> Decimal:
    tokens = min(max(math.ceil(characters / 4), 20), request.max_length)
    return text_generation_kudos(
        model=generation.assigned_model, prompt=request.prompt, generation=None,
        max_length=request.max_length, owner_trusted=False, tokens=tokens,
    )


@redis_only
def test_cancel_mid_stream_settles_on_the_posted_content(horde, streamed_job, stream_redis):
    requester, owner, request, job_id, _ = streamed_job()
    content = ["Once upon a time, ", "there was a horde of workers ", "who streamed their tokens " * 5]
    for seq, part in enumerate(content, start=1):
        assert post(horde, owner.key, job_id, seq, part, reasoning="hmm" * 40).status_code == 200
    characters = len("".join(content))  # reasoning aside
    assert characters > 80  # above the 20 token floor
    before = requester.refresh().kudos
    assert _cancel(horde, requester.key, request.pk).status_code == 200
    generation = Generation.objects.get(pk=job_id)
    assert generation.state == Generation.State.CANCELLED
    assert generation.settled_character_count == characters
    assert generation.charge_basis is None and generation.finish_reason is None and generation.message is None
    kudos = _settled_kudos(request, generation, characters)
    assert generation.kudos == kudos > 0
    rows = {
        (row.user_id, row.kind): row.amount
        for row in KudosTransaction.objects.filter(generation_id=job_id)
    }
    assert rows == {(owner.user.pk, "generation_reward"): kudos, (requester.user.pk, "generation_charge"): -kudos}
    assert owner.refresh().kudos == kudos
    assert requester.refresh().kudos == before - kudos
    # The worker is paid for the partial work; it is neither a fulfilment nor a speed sample.
    worker = Worker.objects.get(pk=generation.worker_id)
    assert (worker.kudos_earned, worker.fulfilments, worker.speed_samples or []) == (kudos, 0, [])
    # The lease is flagged and kept; the stream ends the generation.
    fields = lease(stream_redis, job_id)
    assert fields["cancelled"] == "1"
    assert entries(stream_redis, request.pk)[-1] == {"gen": str(job_id), "ended": "1"}
    # The worker's next post is accepted with cancelled: true, and does not renew.
    job_ttl = fields["job_ttl"]
    assert post(horde, owner.key, job_id, 4, "more").json() == {"accepted_seq": 4, "cancelled": True}
    assert lease(stream_redis, job_id)["job_ttl"] == job_ttl
    # A late submit is aborted, and the status lists no generation for the posted content.
    late = horde.chat_submit(owner.key, job_id, message={"role": "assistant", "content": "The end."},
                             finish_reason="stop", model_id=MODEL)
    refused(late, 400, "AbortedGen")
    status = horde._call("get", f"generate/chat/status/{request.pk}", requester.key).json()
    assert status["generations"] == [] and status["done"] is True
    assert "settled_character_count" not in str(status)


@redis_only
def test_a_cancel_settlement_draws_the_shared_key_the_request_was_made_with(horde, streamed_job):
    requester, owner, request, job_id, _ = streamed_job()
    key = SharedKey.objects.create(user=requester.user, kudos=Decimal("50"))
    GenerationRequest.objects.filter(pk=request.pk).update(shared_key_id=key.pk)
    assert post(horde, owner.key, job_id, 1, "Once upon a time, " * 10).status_code == 200
    assert _cancel(horde, requester.key, request.pk).status_code == 200
    charged = Generation.objects.get(pk=job_id).kudos
    key.refresh_from_db()
    assert charged > 0 and (key.kudos, key.utilized) == (Decimal("50") - charged, charged)


@redis_only
def test_cancel_before_any_post_pays_the_floor(horde, streamed_job):
    requester, owner, request, job_id, _ = streamed_job()
    assert _cancel(horde, requester.key, request.pk).status_code == 200
    generation = Generation.objects.get(pk=job_id)
    assert generation.state == Generation.State.CANCELLED and generation.settled_character_count == 0
    assert generation.kudos == _settled_kudos(request, generation, 0) > 0
    assert KudosTransaction.objects.filter(generation_id=job_id, kind="generation_reward").get().amount == generation.kudos


@redis_only
def test_cancel_without_the_stream_entries_settles_on_the_lease_bytes(horde, streamed_job, stream_redis):
    requester, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "é" * 60, reasoning="r" * 30).status_code == 200
    stream_redis.delete(chat_progress_stream_key(request.pk))  # as after a failover that lost the key
    assert _cancel(horde, requester.key, request.pk).status_code == 200
    generation = Generation.objects.get(pk=job_id)
    # Bytes: each é counts twice, and reasoning is in.
    assert generation.settled_character_count == 60 * 2 + 30
    assert generation.kudos == _settled_kudos(request, generation, 150)


@redis_only
def test_cancel_with_redis_down_settles_on_the_floor(horde, streamed_job, settings):
    requester, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "x" * 400).status_code == 200
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = CLOSED_PORT
    assert _cancel(horde, requester.key, request.pk).status_code == 200
    generation = Generation.objects.get(pk=job_id)
    assert generation.state == Generation.State.CANCELLED and generation.settled_character_count == 0
    assert generation.kudos == _settled_kudos(request, generation, 0)


@redis_only
def test_cancel_of_an_unstreamed_request_leaves_its_job_to_submit(horde, streamed_job):
    requester, owner, request, job_id, _ = streamed_job(stream=False)
    assert _cancel(horde, requester.key, request.pk).status_code == 200
    assert Generation.objects.get(pk=job_id).state == Generation.State.PROCESSING
    submitted = horde.chat_submit(owner.key, job_id, message={"role": "assistant", "content": "Paid."},
                                  finish_reason="stop", model_id=MODEL)
    assert submitted.status_code == 200 and Generation.objects.get(pk=job_id).settled_character_count is None


# --- without Redis ---------------------------------------------------------------------------------


def test_without_redis_progress_is_unavailable(horde, make_user, settings):
    """The embedded default has no Redis: every post is 503 (and with Redis down, the same)."""
    if settings.REDIS_URL:
        settings.HORDE_CHAT_SIGNAL_REDIS_URL = CLOSED_PORT
    requester, owner = make_user("r", kudos=100), make_user("o")
    queue_chat(requester.user, {"stream": True})
    job_id = chat_pop(horde, owner.key).json()["id"]
    assert job_id
    refused(post(horde, owner.key, job_id, 1, "x"), 503, "ChatProgressUnavailable")
    # The job still submits whole.
    submitted = horde.chat_submit(owner.key, job_id, message={"role": "assistant", "content": "Whole."},
                                  finish_reason="stop", model_id=MODEL)
    assert submitted.status_code == 200, submitted.json()


def test_stream_hint_is_carried_without_redis(horde, make_user):
    requester, owner = make_user("r2", kudos=100), make_user("o2")
    queue_chat(requester.user, {"stream": True})
    assert chat_pop(horde, owner.key).json()["payload"]["stream_progress"] is True


def test_without_redis_a_streamed_job_is_aborted_when_its_row_lapses(horde, make_user, settings):
    """No stream lease without Redis: the row is the job's lease, so the step rule of ADR 0040
    (for a lease that may have run on in Redis) does not delay the abort."""
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = None
    settings.REDIS_URL = None
    requester, owner = make_user("r3", kudos=100), make_user("o3")
    queue_chat(requester.user, {"stream": True})
    job_id = chat_pop(horde, owner.key).json()["id"]
    Generation.objects.filter(pk=job_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert abort_stale_generations() == 1
    assert Generation.objects.get(pk=job_id).state == Generation.State.FAULTED


# --- races ------------------------------------------------------------------------------------------


@pytest.mark.postgres_only
@redis_only
def test_a_cancel_racing_the_submit_pays_the_job_once(horde, streamed_job, stream_redis):
    """Real connections: the cancel's settlement and the submit claim the job with one
    compare-and-set each, so the worker is paid either for the reply or for its posted content."""
    from rest_framework.test import APIClient

    from tests.conftest import Horde
    from tests.races import race

    reply = {"message": {"role": "assistant", "content": "Once upon a time, the end."}, "finish_reason": "stop",
             "model_id": MODEL}
    for round_ in range(4):
        requester, owner, request, job_id, _ = streamed_job(name=f"racer-{round_}")
        assert post(horde, owner.key, job_id, 1, "Once upon a time " * 4).status_code == 200
        cancel, submit = race([
            lambda key=requester.key, rid=request.pk: _cancel(Horde(APIClient()), key, rid),
            lambda key=owner.key, gid=job_id: Horde(APIClient()).chat_submit(key, gid, **reply),
        ])
        assert cancel.status_code == 200
        generation = Generation.objects.get(pk=job_id)
        rewards = KudosTransaction.objects.filter(generation_id=job_id, kind="generation_reward")
        assert rewards.count() == 1, (cancel.json(), submit.json())
        if submit.status_code == 200:
            assert generation.state == Generation.State.OK and generation.settled_character_count is None
        else:
            assert submit.json()["rc"] == "AbortedGen"
            assert generation.state == Generation.State.CANCELLED and generation.settled_character_count == 68
        assert rewards.get().amount == generation.kudos


@redis_only
def test_maintenance_abort_leaves_streamed_jobs_in_flight_to_settle_by_their_submits(
    horde, streamed_job, stream_redis
):
    requester, owner, request, job_id, _ = streamed_job()
    # A second job still waiting, so maintenance mode has something to abort.
    GenerationRequest.objects.filter(pk=request.pk).update(n=2, jobs_waiting=1)
    assert post(horde, owner.key, job_id, 1, "Once upon a time").status_code == 200
    from chat.services.maintenance import abort_waiting_for_maintenance

    assert abort_waiting_for_maintenance() == 1
    assert GenerationRequest.objects.get(pk=request.pk).cancelled is True
    # Not the cancel route's settlement: the lease is not flagged, no ended entry, the job still runs.
    assert "cancelled" not in lease(stream_redis, job_id)
    assert {"gen": str(job_id), "ended": "1"} not in entries(stream_redis, request.pk)
    assert Generation.objects.get(pk=job_id).state == Generation.State.PROCESSING
    assert post(horde, owner.key, job_id, 2, " there was").json() == {"accepted_seq": 2, "cancelled": False}
    submitted = horde.chat_submit(owner.key, job_id, message={"role": "assistant", "content": "The end."},
                                  finish_reason="stop", model_id=MODEL)
    assert submitted.status_code == 200 and submitted.json()["reward"] > 0
    assert Generation.objects.get(pk=job_id).settled_character_count is None


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
@redis_only
def test_a_cancel_meeting_a_lease_renewal_still_settles_the_job(horde, streamed_job, stream_redis):
    """Real connections: a progress post that renews the job lease holds the job's row for its
    UPDATE (chat.services.progress._RENEW_SQL). A cancel arriving in that instant still settles the
    job on its posted content and flags its lease, so the worker's later submit of the whole reply
    is AbortedGen and the requester is charged for the posted content only."""
    import threading

    import psycopg

    from chat.services.progress import _RENEW_SQL

    requester, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "Once upon a time " * 4).status_code == 200
    params = connection.get_connection_params()
    with psycopg.connect(host=params.get("host"), port=params.get("port"), user=params.get("user"),
                         dbname=params["dbname"]) as renewal:
        # The renewal's UPDATE, its commit 0.5 s later (a loaded database, or the post's thread
        # descheduled between its statement and its commit).
        deadline = timezone.now() + timedelta(seconds=300)
        renewal.execute(_RENEW_SQL, [deadline, job_id, Generation.State.PROCESSING, deadline])
        threading.Timer(0.5, renewal.commit).start()
        assert _cancel(horde, requester.key, request.pk).status_code == 200
    generation = Generation.objects.get(pk=job_id)
    assert generation.state == Generation.State.CANCELLED, generation.state
    assert lease(stream_redis, job_id).get("cancelled") == "1"
    late = horde.chat_submit(owner.key, job_id, message={"role": "assistant", "content": "The end. " * 200},
                             finish_reason="stop", model_id=MODEL)
    refused(late, 400, "AbortedGen")
    charges = KudosTransaction.objects.filter(generation_id=job_id, kind="generation_charge")
    assert [row.amount for row in charges] == [-generation.kudos]


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
@redis_only
def test_a_post_accepted_while_a_cancel_settles_is_in_the_settlement(horde, streamed_job, stream_redis):
    """Real connections (a soak found it): a cancel that settles a stream waits on the worker
    owner's balance while another settlement holds it. A progress post in that wait was answered
    cancelled: false, so the worker went on, yet the settlement had read the stream before it and
    paid the first post only; the worker's later submit was AbortedGen. Every post answered
    cancelled: false is the worker's posted content, and is priced."""
    import threading

    import psycopg
    from rest_framework.test import APIClient

    from tests.conftest import Horde

    requester, owner, request, job_id, _ = streamed_job()
    first, second = "a" * 400, "b" * 1200
    assert post(horde, owner.key, job_id, 1, first).json() == {"accepted_seq": 1, "cancelled": False}
    params = connection.get_connection_params()
    answers = {}
    with psycopg.connect(host=params.get("host"), port=params.get("port"), user=params.get("user"),
                         dbname=params["dbname"]) as other:
        # Another settlement holding the owner's balance (a submit of the owner's other job).
        other.execute("SELECT 1 FROM horde_users WHERE id = %s FOR NO KEY UPDATE", [owner.user.pk])

        def cancel():
            try:
                answers["cancel"] = _cancel(Horde(APIClient()), requester.key, request.pk)
            finally:
                connection.close()

        thread = threading.Thread(target=cancel)
        thread.start()
        deadline = time.monotonic() + 10
        while not other.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                " AND wait_event_type = 'Lock'").fetchone()[0]:
            assert time.monotonic() < deadline, "the cancel never waited on the balance"
            time.sleep(0.02)
        answers["post"] = post(horde, owner.key, job_id, 2, second).json()
        other.rollback()
        thread.join(30)
    assert answers["cancel"].status_code == 200
    generation = Generation.objects.get(pk=job_id)
    assert generation.state == Generation.State.CANCELLED
    if answers["post"] == {"accepted_seq": 2, "cancelled": False}:
        # Told to go on: the post is part of what the worker is paid for.
        assert generation.settled_character_count == len(first) + len(second)
    else:  # told to stop: the settlement stands on the first post
        assert answers["post"] == {"accepted_seq": 2, "cancelled": True}
        assert generation.settled_character_count == len(first)
    assert generation.kudos == _settled_kudos(request, generation, generation.settled_character_count)
    assert KudosTransaction.objects.get(generation_id=job_id, kind="generation_reward").amount == generation.kudos


@redis_only
def test_a_cancel_before_the_pop_wrote_the_lease_still_stops_the_worker(horde, streamed_job, stream_redis):
    """A soak found it: the pop commits its job in one statement and writes the stream lease after.
    A cancel in between (a front whose client left as a faulted attempt was restarted) settles the
    job on nothing posted and flags no lease, since none exists yet; the pop then writes its lease
    unflagged, so the worker's posts were answered cancelled: false while its submit would be
    AbortedGen. Here the pop's write is replayed after the cancel, as it happened. The cancel now
    leaves a flag the pop's write merges into."""
    from chat.services.progress import write_stream_leases

    requester, owner, request, job_id, _ = streamed_job()
    stream_redis.delete(chat_stream_lease_key(job_id))  # the pop has committed, not yet written it
    assert _cancel(horde, requester.key, request.pk).status_code == 200
    generation = Generation.objects.select_related("worker__owner").get(pk=job_id)
    assert generation.state == Generation.State.CANCELLED
    # The flag alone is no lease (as after a lapsed lease): the generation tells it was aborted.
    refused(post(horde, owner.key, job_id, 1, "Once upon a time"), 404, "ChatJobAborted")
    write_stream_leases(request=GenerationRequest.objects.get(pk=request.pk), generations=[generation],
                        worker=generation.worker, owner=generation.worker.owner, model=MODEL, now=timezone.now())
    answer = post(horde, owner.key, job_id, 1, "Once upon a time")
    assert answer.json() == {"accepted_seq": 1, "cancelled": True}, answer.json()
