"""The horde's one lock order (docs/adr/0068-one-lock-order.md): whatever settles or faults a job
locks its rows as the job, its request, its worker, then the balances by id. Two such writes may
wait on each other but never deadlock. Each test holds one row from a connection of its own and
asks PostgreSQL, with NOWAIT probes, which rows the write waiting on it already holds. A deadlock
met anyway answers 503 DatabaseConflict with Retry-After, and the retry is paid once."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import HordeUser, KudosTransaction
from chat.models import Generation, GenerationRequest
from chat.services.sweeps import abort_stale_generations
from tests.chat.test_progress import post, streamed_job  # noqa: F401  (fixture)
from tests.conftest import Horde
from tests.oai.test_pop_worker_gone import eventually
from workers.models import Worker

MODEL = "Gryphe/MythoMax-L2-13b"

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def _connect() -> psycopg.Connection:
    params = connection.get_connection_params()
    return psycopg.connect(
        host=params.get("host"), port=params.get("port"), user=params.get("user"), dbname=params["dbname"]
    )


def _waiting_on_a_lock(holder: psycopg.Connection) -> bool:
    holder.execute("SELECT pg_stat_clear_snapshot()")
    return holder.execute(
        "SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone()[0]


def _locked(prober: psycopg.Connection, rows: dict[str, tuple[str, Any]]) -> set[str]:
    """The named rows some other transaction holds for a write (the foreign key checks' shared
    locks aside)."""
    held = set()
    for name, (table, pk) in rows.items():
        try:
            with prober.transaction():
                prober.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR NO KEY UPDATE NOWAIT", (pk,))
        except psycopg.errors.LockNotAvailable:
            held.add(name)
    return held


class Write:
    """A write run on a thread of its own (its own database connection), as a request of its own."""

    def __init__(self, action: Callable[[], Any]):
        self.outcome: list[Any] = []

        def run() -> None:
            try:
                self.outcome.append(action())
            finally:
                connection.close()

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def result(self) -> Any:
        self.thread.join(30)
        assert not self.thread.is_alive() and self.outcome, "the write did not finish"
        return self.outcome[0]


@contextmanager
def holding(table: str, pk: Any) -> Iterator[psycopg.Connection]:
    """A transaction of its own holding one row as an UPDATE of it would; rolled back on leaving."""
    with _connect() as holder:
        holder.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR NO KEY UPDATE", (pk,))
        try:
            yield holder
        finally:
            holder.rollback()


def held_while_it_waits(hold: tuple[str, Any], rows: dict[str, tuple[str, Any]], action: Callable[[], Any]):
    """(the rows the write holds while it waits on `hold`, the write's result once `hold` is let go)."""
    with _connect() as prober:
        prober.autocommit = True
        with holding(*hold) as holder:
            write = Write(action)
            eventually(lambda: _waiting_on_a_lock(holder))
            held = _locked(prober, rows)
        return held, write.result()


def _text_job(make_user, *, physically_reversed: bool = False):
    """(requester, owner, job id) of a popped text job. With `physically_reversed` the owner has the
    lower id and the row stored after the requester's, so a scan of both balances in physical
    order meets them against id order."""
    if physically_reversed:
        owner, requester = make_user("owner"), make_user("requester", kudos=1000)
    else:
        requester, owner = make_user("requester", kudos=1000), make_user("owner")
    horde = Horde(APIClient())
    assert horde.text_async(requester.key, models=[MODEL], params={"n": 2}).status_code == 202
    job = horde.pop(owner.key).json()
    assert job["id"], job
    if physically_reversed:
        # An indexed column changed twice: the row's last version is stored after the requester's
        # and indexed anew (an update that keeps the indexed columns leaves the index at the first).
        hashed = HordeUser.objects.get(pk=owner.user.pk).api_key_hash
        HordeUser.objects.filter(pk=owner.user.pk).update(api_key_hash="0" * 64)
        HordeUser.objects.filter(pk=owner.user.pk).update(api_key_hash=hashed)
        assert owner.user.pk < requester.user.pk
        assert _in_physical_order(owner.user.pk, requester.user.pk) == [requester.user.pk, owner.user.pk]
    return requester, owner, job["id"]


def _in_physical_order(*user_ids: int) -> list[int]:
    """The balances as a bitmap scan meets them (the rows' order on disk)."""
    with _connect() as reader:
        reader.execute("SET enable_indexscan = off")
        reader.execute("SET enable_seqscan = off")
        placeholders = " OR ".join(["id = %s"] * len(user_ids))
        return [row[0] for row in reader.execute(f"SELECT id FROM horde_users WHERE {placeholders}", user_ids)]


def _rows(requester, owner, job_id) -> dict[str, tuple[str, Any]]:
    generation = Generation.objects.get(pk=job_id)
    return {
        "job": ("horde_generations", job_id),
        "request": ("horde_requests", generation.request_id),
        "worker": ("horde_workers", generation.worker_id),
        "requester": ("horde_users", requester.user.pk),
        "owner": ("horde_users", owner.user.pk),
    }


def _submit(owner, job_id, **body) -> Callable[[], Any]:
    return lambda: Horde(APIClient()).submit(owner.key, job_id, "A reply of a few words.", **body)


def _unpriced(job_id) -> None:
    """A job popped before prices were stored: its submit goes the read path (chat.services.submit._settle)."""
    Generation.objects.filter(pk=job_id).update(price_rate=None)


def _lapsed(job_id) -> None:
    Generation.objects.filter(pk=job_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


WRITES = {
    # path: (prepare the job, the write)
    "priced submit": (lambda job_id: None, lambda owner, job_id: _submit(owner, job_id)),
    "unpriced submit": (_unpriced, lambda owner, job_id: _submit(owner, job_id)),
    "fault submit": (lambda job_id: None, lambda owner, job_id: _submit(owner, job_id, state="faulted")),
    "stale abort": (_lapsed, lambda owner, job_id: abort_stale_generations),
}


@pytest.mark.parametrize("path", list(WRITES))
def test_a_write_waiting_on_its_worker_holds_its_job_and_request_and_no_balance(make_user, path):
    requester, owner, job_id = _text_job(make_user)
    prepare, write = WRITES[path]
    prepare(job_id)
    rows = _rows(requester, owner, job_id)
    held, result = held_while_it_waits(rows.pop("worker"), rows, write(owner, job_id))
    assert held == {"job", "request"}
    assert result == 1 if path == "stale abort" else result.status_code == 200
    assert Generation.objects.get(pk=job_id).state == ("faulted" if "fault" in path or "stale" in path else "ok")


@pytest.mark.parametrize("path", ["priced submit", "unpriced submit"])
def test_a_settlement_takes_both_balances_by_id_whatever_their_rows_order(make_user, path):
    requester, owner, job_id = _text_job(make_user, physically_reversed=True)
    prepare, write = WRITES[path]
    prepare(job_id)
    rows = _rows(requester, owner, job_id)
    # The owner's balance, first by id and last on disk: the submit waits on it holding no other.
    held, result = held_while_it_waits(rows.pop("owner"), rows, write(owner, job_id))
    assert held == {"job", "request", "worker"}
    reward = Decimal(str(result.json()["reward"]))
    assert reward > 0
    assert HordeUser.objects.get(pk=owner.user.pk).kudos == reward


def test_the_submit_statement_takes_both_balances_by_id_on_a_plan_in_physical_order(make_user):
    """The same on the plan PostgreSQL may pick for a larger table (a bitmap scan, which meets rows
    in their physical order), forced on a connection of the test's own."""
    from chat.sql import priced_text_submit

    requester, owner, job_id = _text_job(make_user, physically_reversed=True)
    rows = _rows(requester, owner, job_id)
    statement, params = priced_text_submit(
        generation_id=job_id, owner_id=owner.user.pk, state="ok", text="A reply.", seed=0, gen_metadata="[]",
        tokens=3, charged=True, processing=Generation.State.PROCESSING, now=timezone.now(),
    )

    def submit_on_a_bitmap_plan() -> Any:
        with _connect() as submitter:
            submitter.execute("SET enable_indexscan = off")
            submitter.execute("SET enable_seqscan = off")
            return submitter.execute(statement, params).fetchone()

    held, row = held_while_it_waits(rows.pop("owner"), rows, submit_on_a_bitmap_plan)
    assert held == {"job", "request", "worker"}
    assert row is not None and HordeUser.objects.get(pk=owner.user.pk).kudos == row[1] > 0


@pytest.mark.redis_only
def test_a_cancel_settling_a_stream_takes_its_workers_before_any_balance(horde, streamed_job):  # noqa: F811
    requester, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "Once upon a time, " * 10).status_code == 200
    rows = _rows(requester, owner, job_id)
    cancel = lambda: Horde(APIClient())._call("delete", f"generate/chat/status/{request.pk}", requester.key)  # noqa: E731
    # Its request held first, its job claimed, then its worker: the requester's hold is released
    # after, so neither balance is held while it waits.
    held, result = held_while_it_waits(rows.pop("worker"), rows, cancel)
    assert held == {"job", "request"}
    assert result.status_code == 200
    generation = Generation.objects.get(pk=job_id)
    assert generation.state == Generation.State.CANCELLED and generation.kudos > 0
    assert HordeUser.objects.get(pk=owner.user.pk).kudos == generation.kudos
    assert Worker.objects.get(pk=generation.worker_id).kudos_earned == generation.kudos


def test_a_submit_a_deadlock_rolls_back_answers_503_and_its_retry_is_paid_once(make_user):
    """A lock taken against the order (here by hand) still meets a submit: PostgreSQL rolls the
    submit back, which answers 503 DatabaseConflict with Retry-After, and the worker's retry is
    stored and paid once."""
    requester, owner, job_id = _text_job(make_user)
    rows = _rows(requester, owner, job_id)
    before = {pk: HordeUser.objects.get(pk=pk).kudos for pk in (requester.user.pk, owner.user.pk)}
    with holding(*rows["worker"]) as holder:
        # The holder checks for a deadlock long after the submit does, so the submit is the one
        # PostgreSQL rolls back.
        holder.execute("SET deadlock_timeout = '30s'")
        submit = Write(_submit(owner, job_id))
        eventually(lambda: _waiting_on_a_lock(holder))
        holder.execute("SELECT 1 FROM horde_requests WHERE id = %s FOR NO KEY UPDATE", (rows["request"][1],))
        refused = submit.result()
    assert refused.status_code == 503, refused.json()
    assert refused.json() == {
        "message": "The request met another at the database and was rolled back; please try again.",
        "rc": "DatabaseConflict",
    }
    assert refused["Retry-After"] == "1"
    assert Generation.objects.get(pk=job_id).state == Generation.State.PROCESSING
    assert not KudosTransaction.objects.filter(generation_id=job_id).exists()

    retried = Horde(APIClient()).submit(owner.key, job_id, "A reply of a few words.")
    assert retried.status_code == 200
    reward = Decimal(str(retried.json()["reward"]))
    assert Generation.objects.get(pk=job_id).state == Generation.State.OK
    assert sorted(KudosTransaction.objects.filter(generation_id=job_id).values_list("amount", flat=True)) == [
        -reward,
        reward,
    ]
    assert HordeUser.objects.get(pk=owner.user.pk).kudos == before[owner.user.pk] + reward
    assert HordeUser.objects.get(pk=requester.user.pk).kudos == before[requester.user.pk] - reward
    assert GenerationRequest.objects.get(pk=rows["request"][1]).jobs_waiting == 1


def test_the_expiry_sweep_takes_a_requests_jobs_before_the_request(make_user):
    from chat.services.sweeps import expire_requests

    requester, owner, job_id = _text_job(make_user)
    rows = _rows(requester, owner, job_id)
    GenerationRequest.objects.filter(pk=rows["request"][1]).update(expires_at=timezone.now() - timedelta(seconds=1))
    # A submit holding its job: the sweep waits for it before it holds the request.
    held, expired = held_while_it_waits(rows.pop("job"), rows, expire_requests)
    assert held == set()
    assert expired == 1 and not GenerationRequest.objects.filter(pk=rows["request"][1]).exists()


def test_a_sweep_rolled_back_by_a_deadlock_leaves_that_job_to_its_next_run(make_user):
    """The stale sweep meets a lock taken against the order (here by hand): PostgreSQL rolls its
    abort of that job back, and the sweep goes on with the other jobs instead of failing the run."""
    first_requester, owner, first_job = _text_job(make_user)
    second_requester = make_user("second requester", kudos=1000)
    horde = Horde(APIClient())
    assert horde.pop(owner.key).json()["id"]  # the first request's other job, left in flight
    second_request = horde.text_async(second_requester.key, models=[MODEL]).json()["id"]
    second_job = horde.pop(owner.key).json()["id"]
    assert Generation.objects.get(pk=second_job).request_id == uuid.UUID(second_request)
    for job_id in (first_job, second_job):
        _lapsed(job_id)
    rows = _rows(first_requester, owner, first_job)
    with holding(*rows["request"]) as holder:
        holder.execute("SET deadlock_timeout = '30s'")  # the sweep is the one rolled back
        sweep = Write(abort_stale_generations)
        eventually(lambda: _waiting_on_a_lock(holder))
        holder.execute("SELECT 1 FROM horde_generations WHERE id = %s FOR NO KEY UPDATE", (first_job,))
        aborted = sweep.result()
    assert aborted == 1
    assert Generation.objects.get(pk=second_job).state == Generation.State.FAULTED
    assert Generation.objects.get(pk=first_job).state == Generation.State.PROCESSING
    assert abort_stale_generations() == 1  # the next run
    assert Generation.objects.get(pk=first_job).state == Generation.State.FAULTED


def _lapse_front_lease(request_id) -> Callable[[], Any]:
    from chat.services.front_lease import cancel_lapsed_front_leases

    GenerationRequest.objects.filter(pk=request_id).update(front_lease_expires_at=timezone.now() - timedelta(seconds=1))
    return cancel_lapsed_front_leases


@pytest.mark.redis_only
@pytest.mark.parametrize("path", ["route", "lapsed front lease"])
def test_a_cancel_settling_a_stream_takes_its_jobs_before_the_request(horde, streamed_job, path):  # noqa: F811
    """A cancel waits on a job some other write holds (a progress post renewing its lease, or a
    submit that next waits on the request) holding nothing, and settles the job once it may."""
    requester, owner, request, job_id, _ = streamed_job()
    assert post(horde, owner.key, job_id, 1, "Once upon a time, " * 10).status_code == 200
    rows = _rows(requester, owner, job_id)
    if path == "route":
        cancel = lambda: Horde(APIClient())._call("delete", f"generate/chat/status/{request.pk}", requester.key)  # noqa: E731
    else:
        cancel = _lapse_front_lease(request.pk)
    held, _ = held_while_it_waits(rows.pop("job"), rows, cancel)
    assert held == set()
    generation = Generation.objects.get(pk=job_id)
    assert generation.state == Generation.State.CANCELLED and generation.kudos > 0
    assert HordeUser.objects.get(pk=owner.user.pk).kudos == generation.kudos
