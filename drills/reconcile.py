"""The drills' reconciliation: what the database says against what the clients saw (issue 13).

Plain SQL through a `query(sql) -> rows` callable (a psycopg connection in the drills, Django's
cursor in the suite), aggregated here, so it reads any horde database the same way. Every client
call puts a tag (`drill-<12 hex>`) in its prompt; the requests carrying it are that call's, whether
the client learnt their id or not (a `/v1` call never sees a request id unless answered).
"""

from __future__ import annotations

import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal

TAG = re.compile(r"drill-([0-9a-f]{12})")
FINISHED = ("ok", "censored", "csam")
SETTLING_KINDS = ("generation_reward", "generation_charge")


def new_tag() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class Call:
    """One client call as the client saw it."""

    kind: str  # text | chat | v1 | opkey
    tag: str
    ids: set[str] = field(default_factory=set)  # request ids the client was given
    answered_id: str | None = None  # the request whose answer the client read
    outcome: str = "pending"  # answered | error | faulted | gave up | pending
    errors: list[str] = field(default_factory=list)


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

    @property
    def clean(self) -> bool:
        return not (self.lost or self.conflicting_states or self.double_charged or self.two_workers
                    or self.charged_for_nothing or self.balance_mismatch or self.hold_mismatch)

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
        }


def reconcile(
    query: Callable[[str], Iterable[tuple]], calls: Iterable[Call], *, only_tags: set[str] | None = None
) -> Reconciliation:
    """`only_tags`: count only the requests of these calls (drills sharing one database); the
    ledger, balance and hold checks read every row either way."""
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
        requests[_uuid(rid)] = {
            "user": user_id, "n": n, "cancelled": bool(cancelled), "faulted": bool(faulted),
            "waiting": jobs_waiting, "held": _kudos(held), "tags": _tags(prompt, messages),
        }
    generations = defaultdict(Counter)  # request -> state counts
    for request_id, state in query("SELECT request_id, state FROM horde_generations"):
        generations[_uuid(request_id)][state] += 1
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
        if rid in settled:
            answered = any(by_tag.get(tag) and by_tag[tag].answered_id == rid for tag in row["tags"])
            if not answered:
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

    for user_id, kudos, held in query("SELECT id, kudos, kudos_held FROM horde_users"):
        if _kudos(kudos) != ledger_sum[user_id]:
            result.balance_mismatch.append(f"user {user_id}: kudos {kudos}, ledger {ledger_sum[user_id]}")
        if _kudos(held) != open_holds[user_id]:
            result.hold_mismatch.append(f"user {user_id}: held {held}, requests hold {open_holds[user_id]}")
    return result
