"""PostgreSQL connections lost or the server unreachable, on the live daphne server (issue 13,
item 3; docs/adr/0018).

Lost: the server side of every pooled connection is ended with pg_terminate_backend from a
separate connection, as a restart does; the next requests must succeed, each run again once on a
fresh connection, never 500. Unreachable: the same, with the server's address pointed at a closed
loopback port for new connections, so the probe fails; every native call must answer 503
DatabaseUnavailable with Retry-After at once, the OpenAI front 503 in its own shape, and the horde
must serve again once the server is back.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest
from django.db import connection

from tests.oai.conftest import MODEL, _restore_anonymous_user
from tests.ports import free_port

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

BRIDGE = "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"
QUICK_SECONDS = 1.5


def terminate_other_backends() -> int:
    """Ends every other session of the test database; returns how many."""
    params = connection.settings_dict
    with psycopg.connect(
        host=params["HOST"] or "127.0.0.1",
        port=params["PORT"] or 5432,
        user=params["USER"],
        password=params["PASSWORD"] or None,
        dbname=params["NAME"],
        autocommit=True,
    ) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return sum(1 for (ended,) in rows if ended)


@pytest.fixture
def loop_calls(live_horde, make_user):
    """The calls of a requester and a worker, each returning (response, seconds)."""
    from hordesite import db_guard

    db_guard.forget_unavailable()
    _restore_anonymous_user()
    api = f"{live_horde.url}/api/v2"
    requester = make_user("db-requester", kudos=10_000)
    owner = make_user("db-worker-owner", trusted=True)
    worker = f"db-worker-{uuid.uuid4().hex[:6]}"
    text = {"prompt": "Once upon a time", "params": {"n": 1, "max_length": 80}, "models": [MODEL]}
    pop = {"name": worker, "models": [MODEL], "max_length": 512, "max_context_length": 4096, "bridge_agent": BRIDGE}
    first = httpx.post(f"{api}/generate/text/async", json=text, headers={"apikey": requester.key}, timeout=30)
    assert first.status_code == 202, first.text
    request_id = first.json()["id"]

    def timed(method: str, path: str, **kwargs):
        started = time.monotonic()
        response = httpx.request(method, api + path, timeout=60, **kwargs)
        return response, time.monotonic() - started

    calls = {
        "text async": lambda: timed("POST", "/generate/text/async", json=text, headers={"apikey": requester.key}),
        "pop": lambda: timed("POST", "/generate/text/pop", json=pop, headers={"apikey": owner.key}),
        "text status": lambda: timed("GET", f"/generate/text/status/{request_id}"),
        "chat status": lambda: timed("GET", f"/generate/chat/status/{uuid.uuid4()}"),
        "workers": lambda: timed("GET", "/workers"),
    }
    yield calls
    db_guard.forget_unavailable()


def _warm_pool(calls, width: int = 8) -> None:
    """Concurrent calls, so the pool holds several connections."""
    with ThreadPoolExecutor(width) as pool:
        list(pool.map(lambda _: calls["text status"](), range(width * 3)))


EXPECTED_OK = {"text async": 202, "pop": 200, "text status": 200, "chat status": 404, "workers": 200}


def test_requests_after_every_backend_was_terminated_succeed(loop_calls):
    _warm_pool(loop_calls)
    assert terminate_other_backends() >= 2  # the server's pooled connections, and this thread's
    connection.close()  # this thread's was ended too
    # One after another: each may meet a dead pooled connection first.
    for _round in range(3):
        for name, call in loop_calls.items():
            response, _took = call()
            assert response.status_code == EXPECTED_OK[name], (name, response.status_code, response.text[:300])
    # At once, after another termination: several requests meet dead connections together.
    _warm_pool(loop_calls)
    assert terminate_other_backends() >= 2
    connection.close()
    lock = threading.Lock()
    statuses: list[tuple[str, int]] = []

    def run(name: str) -> None:
        response, _took = loop_calls[name]()
        with lock:
            statuses.append((name, response.status_code))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(run, [name for name in loop_calls for _ in range(3)]))
    assert all(code == EXPECTED_OK[name] for name, code in statuses), statuses


def test_an_unreachable_database_answers_503_with_retry_after_at_once(loop_calls, settings, front, make_user):
    settings.HORDE_DATABASE_UNAVAILABLE_SECONDS = 1.0
    _warm_pool(loop_calls)
    params = connection.settings_dict
    real_port = params["PORT"]
    try:
        params["PORT"] = str(free_port())  # new connections (the probe's) are refused
        terminate_other_backends_on(real_port)
        connection.close()
        for _round in range(3):
            for name, call in loop_calls.items():
                response, took = call()
                assert response.status_code == 503, (name, response.status_code, response.text[:300])
                assert response.json() == {
                    "message": "The database is unavailable; try again shortly.",
                    "rc": "DatabaseUnavailable",
                }
                assert int(response.headers["Retry-After"]) >= 1
                assert took < QUICK_SECONDS, (name, took)
            # The health probe too: at once, not after the pool's timeout.
            started = time.monotonic()
            health = httpx.get(f"{front.live.url}/healthz", timeout=60)
            assert health.status_code == 503 and health.json()["database"] == "unreachable", health.text
            assert time.monotonic() - started < QUICK_SECONDS
            time.sleep(0.4)  # across the unavailable window: later calls probe again, and fail
        # The front in the same process: 503 in OpenAI's shape, with the horde's Retry-After.
        started = time.monotonic()
        answer = httpx.post(
            f"{front.live.v1}/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]},
            headers={"Authorization": "Bearer 0000000000"},
            timeout=60,
        )
        assert answer.status_code == 503, answer.text[:300]
        assert answer.json()["error"]["code"] == "DatabaseUnavailable"
        assert int(answer.headers["Retry-After"]) >= 1
        assert time.monotonic() - started < QUICK_SECONDS + 1
    finally:
        params["PORT"] = real_port
    # Back: after the window the first request probes, succeeds, and the horde serves again.
    time.sleep(settings.HORDE_DATABASE_UNAVAILABLE_SECONDS + 0.2)
    for name, call in loop_calls.items():
        response, _took = call()
        assert response.status_code == EXPECTED_OK[name], (name, response.status_code, response.text[:300])


def terminate_other_backends_on(port: str | int) -> int:
    params = connection.settings_dict
    with psycopg.connect(
        host=params["HOST"] or "127.0.0.1",
        port=port or 5432,
        user=params["USER"],
        password=params["PASSWORD"] or None,
        dbname=params["NAME"],
        autocommit=True,
    ) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return sum(1 for (ended,) in rows if ended)


# --- a connection lost in the middle of a request ------------------------------------------------


@pytest.fixture
def terminate_at():
    """terminate_at(fragment): the first statement whose text holds `fragment`, on any connection
    of the live server, finds its server session ended (pg_terminate_backend from another
    connection, waiting until the backend is gone) just before it is sent, as a restart ends it."""
    from django.db.backends.signals import connection_created

    wrappers: list = []
    installed: list = []

    def arm(fragment: str) -> threading.Event:
        fired = threading.Event()

        def wrapper(execute, sql, params, many, context):
            if not fired.is_set() and fragment in str(sql):
                fired.set()
                _terminate(context["connection"].connection.info.backend_pid)
            return execute(sql, params, many, context)

        wrappers.append(wrapper)
        return fired

    def install(sender, connection, **kwargs):
        for wrapper in wrappers:
            if wrapper not in connection.execute_wrappers:
                connection.execute_wrappers.append(wrapper)
                installed.append((connection, wrapper))

    connection_created.connect(install, weak=False)
    yield arm
    connection_created.disconnect(install)
    for wrapped, wrapper in installed:
        if wrapper in wrapped.execute_wrappers:
            wrapped.execute_wrappers.remove(wrapper)


def _terminate(pid: int) -> None:
    params = connection.settings_dict
    with psycopg.connect(
        host=params["HOST"] or "127.0.0.1",
        port=params["PORT"] or 5432,
        user=params["USER"],
        password=params["PASSWORD"] or None,
        dbname=params["NAME"],
        autocommit=True,
    ) as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone() == (True,)


def _assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, (response.status_code, response.text[:500])
    assert response.json() == {"message": "The database is unavailable; try again shortly.", "rc": "DatabaseUnavailable"}
    assert int(response.headers["Retry-After"]) >= 1


def test_a_connection_lost_inside_a_transaction_answers_503_and_writes_nothing(live_horde, make_user, terminate_at):
    """The text request's creation transaction loses its connection after its first statements
    completed: Django's atomic block takes a fresh connection when it restores autocommit, so the
    one the view ends with looks healthy; the answer is still the 503, never a 500, and the request
    is not run again (it may have written)."""
    from accounts.models import HordeUser
    from chat.models import GenerationRequest
    from hordesite import db_guard

    db_guard.forget_unavailable()
    _restore_anonymous_user()
    requester = make_user("db-mid-requester", kudos=10_000)
    text = {"prompt": "Once upon a time", "params": {"n": 1, "max_length": 80}, "models": [MODEL]}
    url = f"{live_horde.url}/api/v2/generate/text/async"
    before = HordeUser.objects.values_list("kudos", "kudos_held").get(pk=requester.user.pk)

    fired = terminate_at('INSERT INTO "horde_requests"')
    response = httpx.post(url, json=text, headers={"apikey": requester.key}, timeout=60)
    assert fired.is_set()
    _assert_unavailable(response)
    assert not GenerationRequest.objects.filter(user_id=requester.user.pk).exists()
    assert HordeUser.objects.values_list("kudos", "kudos_held").get(pk=requester.user.pk) == before

    again = httpx.post(url, json=text, headers={"apikey": requester.key}, timeout=60)
    assert again.status_code == 202, again.text
    assert GenerationRequest.objects.filter(user_id=requester.user.pk).count() == 1


def test_a_connection_lost_under_a_statement_that_commits_alone_is_not_run_again(
    live_horde, make_user, terminate_at
):
    """The text submit's single statement (autocommit) loses its connection: it may have committed
    before the answer was lost, so the submit answers 503 and is not run again by the horde; the
    worker's own retry is answered from the database, and the job is paid once."""
    from accounts.models import KudosTransaction
    from chat.models import Generation
    from hordesite import db_guard

    db_guard.forget_unavailable()
    _restore_anonymous_user()
    api = f"{live_horde.url}/api/v2"
    requester = make_user("db-submit-requester", kudos=10_000)
    owner = make_user("db-submit-owner", trusted=True)
    pop = {
        "name": f"db-submit-worker-{uuid.uuid4().hex[:6]}",
        "models": [MODEL],
        "max_length": 512,
        "max_context_length": 4096,
        "bridge_agent": BRIDGE,
    }
    text = {"prompt": "Once upon a time", "params": {"n": 1, "max_length": 80}, "models": [MODEL]}
    queued = httpx.post(f"{api}/generate/text/async", json=text, headers={"apikey": requester.key}, timeout=30)
    assert queued.status_code == 202, queued.text
    job = httpx.post(f"{api}/generate/text/pop", json=pop, headers={"apikey": owner.key}, timeout=30).json()
    assert job.get("id"), job
    submit = {"id": job["id"], "generation": "There was a horde.", "state": "ok"}

    fired = terminate_at("UPDATE horde_generations")
    response = httpx.post(f"{api}/generate/text/submit", json=submit, headers={"apikey": owner.key}, timeout=60)
    assert fired.is_set()
    _assert_unavailable(response)
    assert Generation.objects.get(pk=job["id"]).state == Generation.State.PROCESSING  # it did not commit

    again = httpx.post(f"{api}/generate/text/submit", json=submit, headers={"apikey": owner.key}, timeout=60)
    assert again.status_code == 200 and again.json()["reward"] > 0, again.text
    assert Generation.objects.get(pk=job["id"]).state == Generation.State.OK
    assert KudosTransaction.objects.filter(generation_id=job["id"], user_id=owner.user.pk).count() == 1


def test_a_chat_submit_losing_its_connection_inside_its_settlement_answers_503(live_horde, make_user, terminate_at):
    """The chat submit's settlement transaction (the drill's second 500): 503, the job still
    processing; the worker's re-sent submit is paid once."""
    from accounts.models import KudosTransaction
    from chat.models import Generation
    from hordesite import db_guard
    from tests.oai.conftest import HordeTestWorker

    db_guard.forget_unavailable()
    _restore_anonymous_user()
    api = f"{live_horde.url}/api/v2"
    requester = make_user("db-chat-requester", kudos=10_000)
    owner = make_user("db-chat-owner", trusted=True)
    worker = HordeTestWorker(live=live_horde, key=owner.key)
    worker.check_in()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}
    queued = httpx.post(f"{api}/generate/chat/async", json=body, headers={"apikey": requester.key}, timeout=30)
    assert queued.status_code == 202, queued.text
    job = httpx.post(f"{api}/generate/text/pop", json=worker.pop_body(), headers={"apikey": owner.key}, timeout=30).json()
    assert job.get("id"), job
    submit = {
        "id": job["id"],
        "model_id": MODEL,
        "message": {"role": "assistant", "content": "Hello there."},
        "finish_reason": "stop",
    }

    fired = terminate_at("FOR NO KEY UPDATE")  # the settlement statement's lock of its request
    response = httpx.post(f"{api}/generate/text/submit", json=submit, headers={"apikey": owner.key}, timeout=60)
    assert fired.is_set()
    _assert_unavailable(response)
    assert Generation.objects.get(pk=job["id"]).state == Generation.State.PROCESSING

    again = httpx.post(f"{api}/generate/text/submit", json=submit, headers={"apikey": owner.key}, timeout=60)
    assert again.status_code == 200 and again.json()["reward"] > 0, again.text
    assert Generation.objects.get(pk=job["id"]).state == Generation.State.OK
    assert KudosTransaction.objects.filter(generation_id=job["id"], user_id=owner.user.pk).count() == 1
