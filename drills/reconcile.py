"""The drills' reconciliation: what the database says against what the clients saw (issue 13).

Plain SQL through a `query(sql) -> rows` callable (a psycopg connection in the drills, Django's
cursor in the suite), aggregated here, so it reads any horde database the same way. Every client
call puts a tag (`drill-<12 hex>`) in its prompt; the requests carrying it are that call's, whether
the client learnt their id or not (a `/v1` call never sees a request id unless answered).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal

TAG = re.compile(r"drill-([0-9a-f]{12})")
FINISHED = ("ok", "censored", "csam")
SETTLING_KINDS = ("generation_reward", "generation_charge")


def new_tag() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class Call:
    """One client call as the client saw it."""

    kind: str  # text | chat | v1 | opkey | resp (/v1/responses) | bg (/v1/responses, background)
    tag: str
    ids: set[str] = field(default_factory=set)  # request ids the client was given
    answered_id: str | None = None  # the request whose answer the client read
    outcome: str = "pending"  # answered | error | faulted | gave up | cancelled | pending
    errors: list[str] = field(default_factory=list)
    output: str | None = None  # the reply's text the client read (/v1/responses), checked against the worker's
    ended_at: float | None = None  # epoch seconds: when the client's call ended
    cancelled_at: float | None = None  # epoch seconds: a background response's cancel, when answered
    cancel_tries: int = 0
    final_status: str | None = None  # a background response's status read after the load ended (or "404")

    @property
    def front(self) -> bool:
        """A /v1 call whose request lives while its client waits (front lease, ADR 0020)."""
        return self.kind in ("v1", "resp")


def _uuid(value) -> str:
    return str(uuid.UUID(str(value)))


def _kudos(value) -> Decimal:
    # Two places, as the columns; SQLite hands them back as floats.
    return Decimal(str(value)).quantize(Decimal("0.01"))


def _tags(*texts) -> set[str]:
    found: set[str] = set()
    for text in texts:
        if text:
            found.update(TAG.findall(str(text)))
    return found


def _reply_text(message, text) -> str:
    """A finished generation's reply: a chat job's message content, or a text job's text."""
    if message:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            return str(json.loads(message).get("content") or "")
    return text or ""


def _epoch(value) -> float:
    if isinstance(value, str):  # SQLite
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


# A job popped before the cancel's answer may have been held before its native cancel (the client
# knows no closer bound); clocks of one machine, a little slack for the answer's own write.
CANCEL_GRACE_SECONDS = 0.2
BACKGROUND_ENDS = ("completed", "incomplete", "failed", "cancelled")


def _settle_background(call: Call, requests: dict, generations: dict, result: Reconciliation) -> None:
    """A background response the client saw created ends in a terminal status that its request's
    state bears out, read by GET after the load (ADR 0102)."""
    (rid,) = call.ids
    row = requests.get(rid)
    status = call.final_status
    finished = sum(generations[rid][s] for s in FINISHED) if row else 0
    if status == "404" and rid in result.lost_before_read:
        return  # a limit, counted where it was found (reconcile)
    if status == "404" and call.outcome in ("answered", "cancelled", "faulted"):
        # Its client read how it ended, then Redis lost the kept record (restarted without its data:
        # kept responses live in Redis, ADR 0101); nothing was run or charged for nobody.
        result.lost_after_read.append(rid)
    elif status not in BACKGROUND_ENDS:
        result.background_unsettled.append(f"{rid}: the GET after the load read {status}")
    elif row is None:
        if status != "failed":  # a request the horde no longer has is failed (ADR 0102)
            result.background_unsettled.append(f"{rid}: {status}, its request gone")
    elif status in ("completed", "incomplete") and not finished:
        result.background_unsettled.append(f"{rid}: {status} without a finished generation")
    elif status == "cancelled" and not row["cancelled"]:
        result.background_unsettled.append(f"{rid}: cancelled, its request not")
    elif status == "failed" and not row["faulted"]:
        result.background_unsettled.append(f"{rid}: failed, its request not faulted")


@dataclass
class Reconciliation:
    accepted: int = 0
    states: Counter = field(default_factory=Counter)  # completed / cancelled / faulted / waiting / lost
    lost: list[str] = field(default_factory=list)
    conflicting_states: list[str] = field(default_factory=list)
    double_charged: list[str] = field(default_factory=list)
    two_workers: list[str] = field(default_factory=list)
    charged_for_nothing: list[str] = field(default_factory=list)
    balance_mismatch: list[str] = field(default_factory=list)
    hold_mismatch: list[str] = field(default_factory=list)
    client_errors: Counter = field(default_factory=Counter)
    details: dict[str, str] = field(default_factory=dict)  # request id -> what its client saw
    # /v1/responses (ADRs 0101-0103):
    wrong_output: list[str] = field(default_factory=list)  # a reply read that is not its worker's
    unreceivable: list[str] = field(default_factory=list)  # queued or held, its client gone without its id
    background_unsettled: list[str] = field(default_factory=list)  # created, not ended as the GET shows
    # Accepted, not findings: a cancelled background response whose job a worker held before the
    # cancel is paid for that job (ADR 0102, the native cancel's rule, ADR 0020).
    paid_at_cancel: list[str] = field(default_factory=list)
    # A limit, not a finding: a background response whose end its client read, its kept record then
    # lost with Redis's data (docs/adr/0107).
    lost_after_read: list[str] = field(default_factory=list)
    # A limit too: a background response whose reply finished before Redis lost its data, its client
    # not having read it yet: paid for and unreadable (docs/adr/0107).
    lost_before_read: list[str] = field(default_factory=list)
    # A limit: a background create answered 503 because Redis failed between its check and its
    # record's keep, whose job a worker popped in that moment, paid at the front's cancel (ADR 0107);
    # since ADR 0110 only where the horde grants the front no undelivered cancel (no known passkey).
    unkept_paid: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.conflicting_states or self.double_charged or self.two_workers
                    or self.charged_for_nothing or self.balance_mismatch or self.hold_mismatch
                    or self.wrong_output or self.unreceivable or self.background_unsettled)

    def summary(self) -> dict:
        return {
            "accepted": self.accepted,
            "completed": self.states["completed"],
            "cancelled": self.states["cancelled"],
            "faulted": self.states["faulted"],
            "waiting": self.states["waiting"],
            "lost": len(self.lost),
            "double-charged": len(self.double_charged),
            "charged for nothing": len(self.charged_for_nothing),
            "held by two": len(self.two_workers),
            "balance != ledger": len(self.balance_mismatch),
            "holds != open holds": len(self.hold_mismatch),
            "wrong output": len(self.wrong_output),
            "left for nobody": len(self.unreceivable),
            "background unsettled": len(self.background_unsettled),
        }


def reconcile(
    query: Callable[[str], Iterable[tuple]],
    calls: Iterable[Call],
    *,
    only_tags: set[str] | None = None,
    redis_data_lost_at: Iterable[float] = (),
) -> Reconciliation:
    """`only_tags`: count only the requests of these calls (drills sharing one database); the
    ledger, balance and hold checks read every row either way. `redis_data_lost_at`: when the
    drill's Redis lost its data (killed without persistence), epoch seconds."""
    redis_data_lost_at = list(redis_data_lost_at)
    calls = list(calls)
    result = Reconciliation()
    by_tag = {call.tag: call for call in calls}
    for call in calls:
        for error in call.errors:
            result.client_errors[f"{call.kind}: {error}"] += 1

    requests = {}
    for rid, user_id, n, cancelled, faulted, jobs_waiting, held, prompt, messages in query(
        "SELECT id, user_id, n, cancelled, faulted, jobs_waiting, kudos_held, prompt, CAST(messages AS TEXT)"
        " FROM horde_requests"
    ):
        in_order = TAG.findall(f"{prompt or ''} {messages or ''}")
        requests[_uuid(rid)] = {
            "user": user_id, "n": n, "cancelled": bool(cancelled), "faulted": bool(faulted),
            "waiting": jobs_waiting, "held": _kudos(held), "tags": _tags(prompt, messages),
            # Its own call's tag: the last one (a continuation's earlier turns come first).
            "own": in_order[-1] if in_order else None,
        }
    generations = defaultdict(Counter)  # request -> state counts
    replies: dict[str, list[str]] = defaultdict(list)  # request -> its finished generations' texts
    popped: dict[str, list[float]] = defaultdict(list)  # request -> its paid generations' pops (epoch)
    last_finished: dict[str, float] = {}  # request -> its last finished generation's end (epoch)
    for request_id, state, message, text, created, kudos, finished_at in query(
        "SELECT request_id, state, CAST(message AS TEXT), text, created, kudos, finished_at FROM horde_generations"
    ):
        generations[_uuid(request_id)][state] += 1
        if state in FINISHED:
            replies[_uuid(request_id)].append(_reply_text(message, text))
            if finished_at is not None:
                ended = _epoch(finished_at)
                last_finished[_uuid(request_id)] = max(ended, last_finished.get(_uuid(request_id), ended))
        if kudos and _kudos(kudos) > 0:
            popped[_uuid(request_id)].append(_epoch(created))
    ledger_sum: dict[int, Decimal] = defaultdict(Decimal)
    settled: set[str] = set()
    paid_rows = Counter()  # (generation, kind) -> rows
    for user_id, amount, kind, request_id, generation_id in query(
        "SELECT user_id, amount, kind, request_id, generation_id FROM horde_kudos_transactions"
    ):
        ledger_sum[user_id] += _kudos(amount)
        if kind in SETTLING_KINDS and request_id is not None:
            settled.add(_uuid(request_id))
            paid_rows[(_uuid(generation_id) if generation_id else None, kind)] += 1

    open_holds: dict[int, Decimal] = defaultdict(Decimal)
    paid_twice_generations = {gen for (gen, _kind), rows in paid_rows.items() if rows > 1}
    for rid, row in requests.items():
        open_holds[row["user"]] += row["held"]
        if not row["tags"] or (only_tags is not None and not row["tags"] & only_tags):
            continue  # not a drill client's request (or another drill's)
        result.accepted += 1
        states = generations[rid]
        finished = sum(states[s] for s in FINISHED)
        if row["cancelled"] and row["faulted"]:
            result.conflicting_states.append(rid)
        if row["cancelled"]:
            state = "cancelled"
        elif row["faulted"]:
            state = "faulted"
        elif finished >= row["n"]:
            state = "completed"
        elif row["waiting"] > 0 or states["processing"]:
            state = "waiting"
        else:
            state = "lost"
            result.lost.append(rid)
        result.states[state] += 1
        if state in ("cancelled", "faulted", "completed") and row["held"]:
            result.hold_mismatch.append(f"request {rid} {state} still holds {row['held']}")
        if finished > row["n"]:
            result.double_charged.append(rid)
        if finished + states["processing"] > row["n"]:
            result.two_workers.append(rid)
        own = by_tag.get(row["own"])  # the call that made it (a continuation carries earlier tags too)
        if state == "waiting" and own is not None and own.ended_at is not None and rid not in own.ids \
                and own.answered_id != rid:
            # Still queued or held, and its client ended without its id: nobody can receive it.
            result.unreceivable.append(rid)
            result.details[rid] = f"{own.kind} call, client {own.outcome}"
        if rid in settled:
            answered = any(by_tag.get(tag) and by_tag[tag].answered_id == rid for tag in row["tags"])
            if not answered and own is not None and own.kind == "bg" and row["cancelled"] \
                    and own.cancelled_at is not None and popped[rid] \
                    and max(popped[rid]) <= own.cancelled_at + CANCEL_GRACE_SECONDS:
                result.paid_at_cancel.append(rid)  # its job was held before the cancel (ADR 0102)
            elif not answered and own is not None and own.kind == "bg" and not own.ids and row["cancelled"] \
                    and any(e.startswith("create 503 ResponseItemsUnavailable") for e in own.errors) \
                    and own.ended_at is not None and popped[rid] and max(popped[rid]) <= own.ended_at:
                # Redis failed between the create's check and its record's keep (ADR 0107): the
                # front's cancel, the native one, pays the job a worker popped in between.
                result.unkept_paid.append(rid)
            elif not answered and own is not None and own.kind == "bg" and own.final_status == "404" \
                    and rid in last_finished and any(last_finished[rid] <= lost for lost in redis_data_lost_at):
                # Its reply finished (and was kept) before Redis lost its data, its client not having
                # read it yet: paid for and unreadable, a limit of a Redis without persistence (ADR 0107).
                result.lost_before_read.append(rid)
            elif not answered:
                result.charged_for_nothing.append(rid)
                seen = [f"{by_tag[t].kind} call, client {by_tag[t].outcome}" for t in row["tags"] if t in by_tag]
                result.details[rid] = "; ".join(seen) or "no client call"
    for gen in paid_twice_generations:
        result.double_charged.append(f"generation {gen}")
    # A client given an id whose request is gone was lost too (the drills never expire requests).
    for call in calls:
        for rid in call.ids:
            if rid not in requests:
                result.lost.append(rid)
                result.states["lost"] += 1
                result.accepted += 1
    for call in calls:
        # A reply read (/v1/responses) is its worker's: the text of the answered request's generation.
        if call.output is not None and call.answered_id and call.output not in replies.get(call.answered_id, []):
            result.wrong_output.append(
                f"{call.kind} {call.answered_id}: read {call.output!r}, worker's {replies.get(call.answered_id)}")
        if call.kind == "bg" and call.ids:
            _settle_background(call, requests, generations, result)

    for user_id, kudos, held in query("SELECT id, kudos, kudos_held FROM horde_users"):
        if _kudos(kudos) != ledger_sum[user_id]:
            result.balance_mismatch.append(f"user {user_id}: kudos {kudos}, ledger {ledger_sum[user_id]}")
        if _kudos(held) != open_holds[user_id]:
            result.hold_mismatch.append(f"user {user_id}: held {held}, requests hold {open_holds[user_id]}")
    return result
