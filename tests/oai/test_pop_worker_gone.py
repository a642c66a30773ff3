"""A pop whose worker leaves before its answer is sent hands out nothing for good: the jobs it took go
back to the queue at once (hordesite/wsgi_pool.py, chat.services.pop.popped_jobs_give_back), not
when their leases lapse minutes later, also when daphne ends the request of a worker long gone while its
pop still runs; a pop whose worker left before a thread took it is not run.
Over HTTP against daphne, with a worker that closes its connection as a killed process does.

To make the worker leave while its pop runs, another connection holds the worker's row: the pop's
statement takes its job and then waits at its commit, where the deferred foreign key reads that row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import psycopg
import pytest
from django.core.wsgi import get_wsgi_application
from django.db import connection

from chat.models import Generation, GenerationRequest
from hordesite.db_guard import retrying_wsgi
from hordesite.wsgi_pool import PooledWSGI
from tests.oai.test_pop_long_poll import plain_pop, pop_body, queue_text
from workers.models import Worker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]


@pytest.fixture
def people(make_user):
    return make_user(f"wg-owner-{uuid.uuid4().hex[:6]}"), make_user(f"wg-req-{uuid.uuid4().hex[:6]}", kudos=10_000)


def open_pop(url: str, key: str, body: dict[str, Any]) -> socket.socket:
    """A pop sent on a connection of its own, left unread (closing it is the worker leaving)."""
    address = urlparse(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=10)
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /api/v2/generate/text/pop HTTP/1.1\r\nHost: horde\r\nContent-Type: application/json\r\n"
        + f"apikey: {key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


@contextlib.contextmanager
def worker_row_held(name: str) -> Iterator[psycopg.Connection]:
    """The worker's row locked by another connection: a pop of this worker that takes a job waits
    at its commit until the block ends (or the connection's rollback)."""
    worker_id = Worker.objects.get(name=name).pk
    params = connection.get_connection_params()
    with psycopg.connect(
        host=params.get("host"), port=params.get("port"), user=params.get("user"), dbname=params["dbname"]
    ) as holder:
        holder.execute("SELECT 1 FROM horde_workers WHERE id = %s FOR UPDATE", (worker_id,))
        yield holder
        holder.rollback()


def blocked_pops(holder: psycopg.Connection, count: int = 1) -> None:
    """Wait until `count` pops wait at their commit for a held row (PostgreSQL's own view; its
    snapshot of the activity is dropped each time, as the holder reads it inside its transaction)."""

    def waiting() -> int:
        holder.execute("SELECT pg_stat_clear_snapshot()")
        return holder.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()[0]

    eventually(lambda: waiting() >= count)


def eventually(check: Callable[[], bool], seconds: float = 30.0) -> None:
    # Generous: it returns as soon as the check holds, and a loaded CI box is slow.
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


class _LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def back_in_the_queue(request_id: str) -> bool:
    return (
        GenerationRequest.objects.get(pk=request_id).jobs_waiting == 1
        and not Generation.objects.filter(request_id=request_id).exists()
    )


def back_in_the_queue_from_a_thread(request_id: str) -> bool:
    try:
        return back_in_the_queue(request_id)
    finally:
        connection.close()  # this thread's own connection: back to the pool


def assert_taken_by_another_worker(url: str, key: str, request_id: str) -> None:
    """Another worker's pop gets the job, as a worker popping every second would: within a few
    pops (once, in a loaded run of the whole suite, the first pop after the job came back was empty)."""
    other = pop_body(f"wg-other-{uuid.uuid4().hex[:6]}")
    deadline = time.monotonic() + 10
    while (job_id := (taken := plain_pop(url, key, other)[0]).json()["id"]) is None:
        state = GenerationRequest.objects.filter(pk=request_id).values("jobs_waiting", "faulted", "cancelled").first()
        taken_by = list(Generation.objects.filter(request_id=request_id).values_list("worker__name", flat=True))
        assert time.monotonic() < deadline, (taken.json(), state, taken_by)
        time.sleep(0.25)
    assert str(Generation.objects.get(pk=job_id).request_id) == request_id


def test_a_pop_whose_worker_left_while_it_took_a_job_gives_the_job_back(live_horde, people, caplog):
    owner, requester = people
    name = f"wg-{uuid.uuid4().hex[:6]}"
    plain_pop(live_horde.url, owner.key, pop_body(name))  # registered
    request_id, _ = queue_text(live_horde.url, requester.key)
    caplog.set_level(logging.INFO, logger="hordesite.wsgi_pool")
    with worker_row_held(name) as holder:
        pop = open_pop(live_horde.url, owner.key, pop_body(name))
        blocked_pops(holder)  # the pop took the job and waits at its commit
        pop.close()  # the worker is gone
        time.sleep(0.3)  # the server sees it leave
    eventually(lambda: back_in_the_queue(request_id))
    eventually(lambda: "gave back 1 job(s) of a pop whose worker left" in caplog.text)  # logged once it is done
    assert_taken_by_another_worker(live_horde.url, owner.key, request_id)


def test_a_held_pop_whose_worker_left_as_it_was_woken_gives_the_job_back(live_horde, people, caplog):
    owner, requester = people
    name = f"wg-held-{uuid.uuid4().hex[:6]}"
    plain_pop(live_horde.url, owner.key, pop_body(name))  # registered, its empty answer remembered
    caplog.set_level(logging.INFO, logger="hordesite.wsgi_pool")
    pop = open_pop(live_horde.url, owner.key, pop_body(name, wait=10))
    time.sleep(0.3)  # held: nothing to take yet
    with worker_row_held(name) as holder:
        request_id, _ = queue_text(live_horde.url, requester.key)  # wakes the held pop
        blocked_pops(holder)  # the woken pop took the job and waits at its commit
        pop.close()
        time.sleep(0.3)
    eventually(lambda: back_in_the_queue(request_id))
    eventually(lambda: "gave back 1 job(s) of a pop whose worker left" in caplog.text)  # logged once it is done
    assert_taken_by_another_worker(live_horde.url, owner.key, request_id)


def test_a_pop_whose_worker_left_before_a_thread_took_it_is_not_run(live_horde, people, settings):
    owner, requester = people
    blockers = [f"wg-busy-{i}-{uuid.uuid4().hex[:6]}" for i in range(settings.HORDE_WEB_THREADS)]
    for name in blockers:
        plain_pop(live_horde.url, owner.key, pop_body(name))  # registered
    requests = [queue_text(live_horde.url, requester.key)[0] for _ in blockers]
    late = f"wg-late-{uuid.uuid4().hex[:6]}"
    with contextlib.ExitStack() as held:
        holders = [held.enter_context(worker_row_held(name)) for name in blockers]
        busy = [open_pop(live_horde.url, owner.key, pop_body(name)) for name in blockers]
        blocked_pops(holders[0], len(blockers))  # every serving thread runs a pop that waits at its commit
        queued = open_pop(live_horde.url, owner.key, pop_body(late))  # waits for a thread
        time.sleep(0.2)
        queued.close()
        time.sleep(0.3)
    for sock in busy:  # the busy workers stayed: each gets its job
        sock.settimeout(10)
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        sock.close()
    eventually(lambda: Generation.objects.filter(request_id__in=requests).count() == len(blockers))
    time.sleep(0.3)
    # The late pop never ran: its worker did not even check in (a first pop registers it).
    assert not Worker.objects.filter(name=late).exists()


def test_a_pop_still_running_when_daphne_ends_its_request_gives_its_job_back(live_horde, people, caplog):
    """daphne cancels the request of a client gone longer than its application_close_timeout (10 s),
    here at once: the pop behind the lock runs on, and its job goes back when it is done."""
    caplog.set_level(logging.INFO, logger="hordesite.wsgi_pool")
    gave_back = _LogLines()  # the logger does not propagate to caplog's handler
    logging.getLogger("hordesite.wsgi_pool").addHandler(gave_back)
    owner, requester = people
    name = f"wg-cancel-{uuid.uuid4().hex[:6]}"
    plain_pop(live_horde.url, owner.key, pop_body(name))  # registered
    request_id, _ = queue_text(live_horde.url, requester.key)
    layer = PooledWSGI(retrying_wsgi(get_wsgi_application()), threads=2)
    payload = json.dumps(pop_body(name)).encode()
    scope = {
        "type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/api/v2/generate/text/pop", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"horde"), (b"apikey", owner.key.encode()), (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 40000), "server": ("horde", 80),
    }
    sent: list[dict] = []

    async def scenario(holder: psycopg.Connection) -> bool:
        pending = [{"type": "http.request", "body": payload, "more_body": False}]

        async def receive() -> dict:
            if pending:
                return pending.pop(0)
            await asyncio.Event().wait()  # the client never tells; daphne's cancel does
            return {}

        async def send(message: dict) -> None:
            sent.append(message)

        request = asyncio.ensure_future(layer(scope, receive, send))
        await asyncio.to_thread(blocked_pops, holder)  # the pop took the job and waits at its commit
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        holder.rollback()  # the lock goes: the pop commits, its answer goes nowhere
        deadline = time.monotonic() + 30  # returns at once when back; a loaded box is slow
        while time.monotonic() < deadline:
            # The give-back's log line first: until the pop's commit lands, the queue reads as before
            # the pop took the job (a loaded box once read it so, and closed the layer too early).
            given_back = any("gave back 1 job(s)" in line for line in gave_back.lines)
            if given_back and await asyncio.to_thread(back_in_the_queue_from_a_thread, request_id):
                return True
            await asyncio.sleep(0.05)
        return False

    try:
        with worker_row_held(name) as holder:
            assert asyncio.run(scenario(holder))
    finally:
        layer.close()
        logging.getLogger("hordesite.wsgi_pool").removeHandler(gave_back)
    assert sent == []
    assert_taken_by_another_worker(live_horde.url, owner.key, request_id)
