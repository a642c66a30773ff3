"""The drills' reconciliation (drills/reconcile.py, `make drill`) on a tiny scenario made through the
native routes: it counts each request's state, and it finds a request charged whose client got an
error, a lost request, a generation paid twice and a balance that left its ledger."""

from __future__ import annotations

import time
import uuid

from django.db import connection

from drills.reconcile import Call, new_tag, reconcile

MODEL = "Gryphe/MythoMax-L2-13b"


def _query(sql: str) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchall()


def _queue(horde, key: str, call: Call) -> str:
    created = horde.text_async(key, prompt=f"Drill drill-{call.tag}: once", params={"n": 1, "max_length": 64},
                               models=[MODEL])
    assert created.status_code == 202, created.content
    call.ids.add(created.json()["id"])
    return created.json()["id"]


def _serve(horde, worker_key: str) -> str:
    job = horde.pop(worker_key).json()
    assert job["id"], job
    assert horde.submit(worker_key, job["id"], " A drill reply.", state="ok").status_code == 200
    return job["id"]


def test_reconciliation_counts_states_and_finds_what_went_wrong(horde, make_user):
    requester = make_user(kudos=1000)
    volunteer = make_user(trusted=True)

    answered = Call(kind="text", tag=new_tag())
    answered_id = _queue(horde, requester.key, answered)
    generation_id = _serve(horde, volunteer.key)
    status = horde.status(answered_id).json()
    assert status["done"] and status["generations"], status
    answered.outcome, answered.answered_id = "answered", answered_id

    cancelled = Call(kind="text", tag=new_tag())
    cancelled_id = _queue(horde, requester.key, cancelled)
    assert horde.cancel(cancelled_id).status_code == 200
    cancelled.outcome = "gave up"

    waiting = Call(kind="text", tag=new_tag())
    _queue(horde, requester.key, waiting)
    unrelated = horde.text_async(requester.key, prompt="Not a drill's", params={"n": 1, "max_length": 64},
                                 models=[MODEL])
    assert unrelated.status_code == 202

    calls = [answered, cancelled, waiting]
    result = reconcile(_query, calls)
    assert result.clean, result
    assert result.summary() | {} == {
        "accepted": 3, "completed": 1, "cancelled": 1, "faulted": 0, "waiting": 1, "lost": 0,
        "double-charged": 0, "charged for nothing": 0, "held by two": 0, "balance != ledger": 0,
        "holds != open holds": 0, "wrong output": 0, "left for nobody": 0, "background unsettled": 0,
    }

    # Served and charged, but its client saw an error (an answer lost on the way): charged for nothing.
    errored = Call(kind="text", tag=new_tag(), outcome="error", errors=["status ReadTimeout"])
    _queue(horde, requester.key, errored)
    # Every queued request served: the waiting one, the unrelated one, this one.
    for _job in range(3):
        _serve(horde, volunteer.key)
    errored_generation = str(uuid.UUID(str(_query(
        "SELECT g.id FROM horde_generations g JOIN horde_requests r ON r.id = g.request_id"
        f" WHERE r.prompt LIKE '%drill-{errored.tag}%'")[0][0])))
    waiting.outcome, waiting.answered_id = "answered", next(iter(waiting.ids))
    calls.append(errored)
    result = reconcile(_query, calls)
    assert result.charged_for_nothing == [next(iter(errored.ids))]
    assert result.client_errors == {"text: status ReadTimeout": 1}
    assert not result.lost and not result.double_charged and not result.balance_mismatch

    # A request with nothing waiting, processing or finished, neither cancelled nor faulted: lost; and
    # an id a client was given that the database does not have.
    lost = Call(kind="chat", tag=new_tag())
    lost_id = _queue(horde, requester.key, lost)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE horde_requests SET jobs_waiting = 0 WHERE id = %s", [uuid.UUID(lost_id).hex
                       if connection.vendor == "sqlite" else lost_id])
    vanished = Call(kind="text", tag=new_tag(), ids={str(uuid.uuid4())})
    calls += [lost, vanished]
    result = reconcile(_query, calls)
    assert sorted(result.lost) == sorted([lost_id, next(iter(vanished.ids))])

    # A generation's reward written twice: paid twice, and the balance no longer its ledger.
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO horde_kudos_transactions (user_id, amount, kind, request_id, generation_id, created)"
            " SELECT user_id, amount, kind, request_id, generation_id, created FROM horde_kudos_transactions"
            " WHERE kind = 'generation_reward' AND generation_id = %s",
            [uuid.UUID(errored_generation).hex if connection.vendor == "sqlite" else errored_generation],
        )
    result = reconcile(_query, calls)
    assert result.double_charged == [f"generation {errored_generation}"]
    assert len(result.balance_mismatch) == 1 and result.balance_mismatch[0].startswith(f"user {volunteer.user.pk}:")
    assert not result.clean
    assert generation_id != errored_generation


def test_reconciliation_of_responses_calls(horde, make_user):
    """The /v1/responses checks: a reply read that is not its worker's, a request left queued whose
    client ended without its id, a background response not ended as its GET shows, and a cancelled
    background response paid for the job a worker held before the cancel (accepted, ADR 0102)."""
    requester = make_user(kudos=1000)
    volunteer = make_user(trusted=True)

    misread = Call(kind="resp", tag=new_tag())
    misread_id = _queue(horde, requester.key, misread)
    _serve(horde, volunteer.key)
    misread.ids.clear()  # a /v1 client never sees the request id, only the response's
    misread.outcome, misread.answered_id, misread.output = "answered", misread_id, "Not its reply."
    misread.ended_at = time.time()

    held_at_cancel = Call(kind="bg", tag=new_tag())
    held_id = _queue(horde, requester.key, held_at_cancel)
    job = horde.pop(volunteer.key).json()
    assert job["id"], job
    assert horde.cancel(held_id).status_code == 200
    held_at_cancel.cancelled_at = time.time()
    assert horde.submit(volunteer.key, job["id"], " A drill reply.", state="ok").status_code == 200
    held_at_cancel.outcome, held_at_cancel.final_status = "cancelled", "cancelled"

    left = Call(kind="resp", tag=new_tag(), outcome="error", errors=["APIConnectionError"])
    left_id = _queue(horde, requester.key, left)
    left.ids.clear()
    left.ended_at = time.time()

    unsettled = Call(kind="bg", tag=new_tag(), outcome="timeout", final_status="in_progress")
    unsettled_id = _queue(horde, requester.key, unsettled)
    unsettled.ended_at = time.time()

    result = reconcile(_query, [misread, held_at_cancel, left, unsettled])
    assert result.wrong_output == [
        f"resp {misread_id}: read 'Not its reply.', worker's [' A drill reply.']"]
    assert result.paid_at_cancel == [held_id]
    assert result.charged_for_nothing == []
    assert result.unreceivable == [left_id]
    assert result.background_unsettled == [f"{unsettled_id}: the GET after the load read in_progress"]
    assert not result.clean

    misread.output = " A drill reply."
    unsettled.final_status = "cancelled"
    assert horde.cancel(unsettled_id).status_code == 200
    assert horde.cancel(left_id).status_code == 200
    result = reconcile(_query, [misread, held_at_cancel, left, unsettled])
    assert result.clean, result
    assert result.summary()["cancelled"] == 3

    # A job popped after the cancel was answered is no held job of the cancel: charged for nothing.
    held_at_cancel.cancelled_at -= 60
    result = reconcile(_query, [misread, held_at_cancel, left, unsettled])
    assert result.charged_for_nothing == [held_id] and result.paid_at_cancel == []

    # A background response whose end its client read, its kept record then lost with Redis's data: a
    # limit (docs/adr/0107), not a finding; one whose client never read its end is a finding.
    read_then_lost = Call(kind="bg", tag=new_tag(), outcome="answered", final_status="404")
    read_id = _queue(horde, requester.key, read_then_lost)
    _serve(horde, volunteer.key)
    read_then_lost.answered_id = read_id
    never_read = Call(kind="bg", tag=new_tag(), outcome="gone", final_status="404")
    never_read_id = _queue(horde, requester.key, never_read)
    _serve(horde, volunteer.key)
    held_at_cancel.cancelled_at += 60
    result = reconcile(_query, [misread, held_at_cancel, left, unsettled, read_then_lost, never_read])
    assert result.lost_after_read == [read_id]
    assert result.background_unsettled == [f"{never_read_id}: the GET after the load read 404"]
    assert result.charged_for_nothing == [never_read_id]
    # Its reply finished before Redis lost its data (killed without persistence): a limit too (ADR
    # 0107), paid for and unreadable; a loss of Redis's data before the reply finished is no excuse.
    calls = [misread, held_at_cancel, left, unsettled, read_then_lost, never_read]
    result = reconcile(_query, calls, redis_data_lost_at=[time.time()])
    assert result.lost_before_read == [never_read_id]
    assert result.charged_for_nothing == [] and result.background_unsettled == [] and result.clean
    result = reconcile(_query, calls, redis_data_lost_at=[time.time() - 3600])
    assert result.lost_before_read == [] and result.charged_for_nothing == [never_read_id]

    # A background create answered 503 as Redis failed between its check and its record's keep, its
    # job popped in that moment and paid at the front's cancel: a limit (docs/adr/0107).
    unkept = Call(kind="bg", tag=new_tag(), outcome="error", errors=["create 503 ResponseItemsUnavailable"])
    unkept_id = _queue(horde, requester.key, unkept)
    unkept.ids.clear()  # the client was answered 503, no id
    job = horde.pop(volunteer.key).json()
    assert horde.cancel(unkept_id).status_code == 200
    assert horde.submit(volunteer.key, job["id"], " A drill reply.", state="ok").status_code == 200
    unkept.ended_at = time.time() + 0.01
    result = reconcile(_query, [unkept], only_tags={unkept.tag})
    assert result.unkept_paid == [unkept_id] and result.charged_for_nothing == [] and result.clean
    unkept.errors = ["create APIConnectionError"]
    assert reconcile(_query, [unkept], only_tags={unkept.tag}).charged_for_nothing == [unkept_id]
