"""A web process stopped with SIGTERM (a deploy's restart: systemd's stop, the launcher's Ctrl-C)
answers the native requests it is serving before it exits (hordesite/web_server.py, the drain), and
the requests its OpenAI front (/v1/) is waiting on (oai/server.py, docs/adr/0076).

Without the drain daphne cancelled every request at once: a native POST whose view was running went
on to commit on its serving thread, and its client got a closed connection, so a text request
was queued (and charged) under an id its client never learnt, and a retry queued a second one. A
pop held for work was dropped the same way instead of getting its empty answer.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from decimal import Decimal

import httpx
import openai
import pytest
from django.db import connection, transaction

from accounts.models import HordeUser, KudosTransaction
from chat.models import Generation, GenerationRequest
from tests.hordesite.clone import ROOT
from tests.hordesite.test_web_processes import TEXT_MODEL, _start, _until_serving, call
from tests.hordesite.test_web_restart import CHAT_DECLARATION, CHAT_MODEL, SCRIBE_AGENT, web_env
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def _blocked_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0] > 0


def test_sigterm_answers_the_requests_in_flight_before_the_process_exits(tmp_path):
    # A held pop re-checks the queue only after the test: what ends its wait is the stop.
    env = web_env(tmp_path, HORDE_WEB_PROCESSES="1", HORDE_POP_WAIT_RECHECK_SECONDS="60")
    port, log = free_port(), tmp_path / "web.log"
    launcher = _start(env, port, log)
    try:
        _until_serving(launcher, port, log)

        def manage(*args: str) -> str:
            return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True,
                                  text=True, check=True).stdout

        requester = manage("horde_user", "create", "stop-requester", "--kudos", "1000").split()[-1]
        volunteer = manage("horde_user", "create", "stop-volunteer", "--trusted").split()[-1]
        pop_body = {"name": "stop-worker", "models": ["nobody-serves-this"], "max_length": 512,
                    "max_context_length": 4096}
        checked_in = call(http.client.HTTPConnection("127.0.0.1", port, timeout=60), "POST", "generate/text/pop",
                          pop_body, volunteer)
        assert checked_in[0] == 200 and checked_in[1]["id"] is None, checked_in

        answers: dict[str, object] = {}

        def ask(name: str, path: str, body: dict, key: str) -> None:
            try:
                answers[name] = call(http.client.HTTPConnection("127.0.0.1", port, timeout=60), "POST", path, body, key)
            except Exception as error:  # what the client sees when its connection is closed unanswered
                answers[name] = error

        held = threading.Thread(target=ask, args=("pop", "generate/text/pop", {**pop_body, "wait": 20}, volunteer))
        held.start()
        time.sleep(1.0)  # the pop is held on the event loop
        submit = threading.Thread(target=ask, args=("submit", "generate/text/async", {
            "prompt": "Stopped", "params": {"max_length": 16}, "models": [TEXT_MODEL]}, requester))
        with transaction.atomic():
            # The requester's row locked: the submit's view waits on its serving thread.
            HordeUser.objects.select_for_update().filter(username__startswith="stop-requester").get()
            submit.start()
            deadline = time.monotonic() + 20
            while not _blocked_on_a_lock():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            launcher.send_signal(signal.SIGTERM)
            time.sleep(1.0)  # the stop has begun while the view waits
        submit.join(30)
        held.join(30)

        assert isinstance(answers["submit"], tuple), answers
        status, created = answers["submit"]
        assert status == 202, created
        assert GenerationRequest.objects.filter(id=created["id"]).exists()
        assert isinstance(answers["pop"], tuple), answers
        assert answers["pop"][0] == 200 and answers["pop"][1]["id"] is None, answers
        assert launcher.wait(30) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


# --- the OpenAI front at a stop (docs/adr/0076) ----------------------------------------------------

HELLO = [{"role": "user", "content": "Hello"}]
CHAT_POP = {"models": [CHAT_MODEL], "max_length": 512, "max_context_length": 4096, "bridge_agent": SCRIBE_AGENT,
            **CHAT_DECLARATION}


def _serving(tmp_path, **values: str):
    """The launcher (one web process) on this test's database and Redis, answering; its env, port, log."""
    env = web_env(tmp_path, HORDE_WEB_PROCESSES="1", **values)
    port, log = free_port(), tmp_path / "web.log"
    launcher = _start(env, port, log)
    _until_serving(launcher, port, log)
    return launcher, env, port, log


def _users(env: dict[str, str], tag: str) -> tuple[str, str]:
    """(requester's key, a trusted volunteer's key)."""
    def create(*args: str) -> str:
        return subprocess.run([sys.executable, "manage.py", "horde_user", "create", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=True).stdout.split()[-1]

    return create(f"{tag}-requester", "--kudos", "1000"), create(f"{tag}-volunteer", "--trusted")


def _requests_of(tag: str) -> list[GenerationRequest]:
    return list(GenerationRequest.objects.filter(user__username__startswith=f"{tag}-requester").order_by("created"))


def _wait_for(check, seconds: float, log) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def _ledger(tag: str) -> list[tuple[str, Decimal]]:
    return [(t.kind, t.amount) for t in KudosTransaction.objects.filter(
        user__username__startswith=f"{tag}-requester").order_by("created")]


def _front_clients(v1: str, requester: str) -> tuple[list[threading.Thread], dict[str, object]]:
    """Started: the openai SDK's streamed and whole chat completion, and a streamed /v1/completions
    read off the wire; what each sees lands in the dict."""
    sdk = openai.OpenAI(base_url=v1, api_key=requester, max_retries=0, timeout=60)
    seen: dict[str, object] = {}

    def streamed() -> None:
        chunks = []
        try:
            for chunk in sdk.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=32, stream=True):
                chunks.append(chunk)
        except Exception as error:
            seen["stream"] = (chunks, error)

    def whole() -> None:
        try:
            seen["whole"] = sdk.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=32)
        except Exception as error:
            seen["whole"] = error

    def text_stream() -> None:
        with httpx.stream("POST", f"{v1}/completions", headers={"Authorization": f"Bearer {requester}"}, json={
                "model": CHAT_MODEL, "prompt": "Once", "max_tokens": 32, "stream": True}, timeout=60) as answer:
            try:
                seen["text"] = (answer.status_code, answer.read())
            except httpx.HTTPError as error:
                seen["text"] = (answer.status_code, error)

    clients = [threading.Thread(target=target) for target in (streamed, whole, text_stream)]
    for client in clients:
        client.start()
    return clients, seen


def _assert_stopping_answers(seen: dict[str, object], tag: str) -> None:
    """The stream's FrontStopping error event then [DONE], the whole request's 503 that the SDK
    retries, each horde request cancelled, and only the horde tax paid."""
    chunks, error = seen["stream"]
    assert chunks == [] and isinstance(error, openai.APIError), seen["stream"]
    assert error.body["code"] == "FrontStopping" and error.body["type"] == "api_error", error.body
    assert error.body["metadata"]["retry_after"] == 5 and error.body["metadata"]["request_id"]

    refused = seen["whole"]
    assert isinstance(refused, openai.InternalServerError), refused
    assert refused.status_code == 503 and refused.body["code"] == "FrontStopping", refused.body
    assert refused.response.headers["retry-after"] == "5"
    assert refused.response.headers["x-should-retry"] == "true"

    status, body = seen["text"]
    assert status == 200 and isinstance(body, bytes), seen["text"]
    events = [event for event in body.decode().split("\n\n") if event.startswith("data: ")]
    assert events[-1] == "data: [DONE]", body
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "FrontStopping", body

    rows = _requests_of(tag)
    assert [row.cancelled for row in rows] == [True, True, True], [(row.id, row.cancelled) for row in rows]
    ledger = _ledger(tag)
    assert [kind for kind, _ in ledger] == ["grant", "horde_tax", "horde_tax", "horde_tax"], ledger
    requester = HordeUser.objects.get(username__startswith=f"{tag}-requester")
    assert requester.kudos == sum(amount for _, amount in ledger) and requester.kudos_held == 0


def _check_in(port: int, volunteer: str, name: str) -> None:
    checked_in = call(http.client.HTTPConnection("127.0.0.1", port, timeout=30), "POST", "generate/text/pop",
                      {"name": name, **CHAT_POP}, volunteer)
    assert checked_in[0] == 200 and checked_in[1]["id"] is None, checked_in


def test_sigterm_answers_the_fronts_waiting_requests_and_cancels_their_horde_requests(tmp_path):
    """The front mounted in the web process: a stream sees the FrontStopping error event then
    [DONE]; a whole request gets 503 with Retry-After and x-should-retry: true (the SDK's own retry
    goes to the next process); each horde request is cancelled before its answer, and the requester
    paid only the horde tax."""
    launcher, env, port, log = _serving(tmp_path)
    try:
        requester, volunteer = _users(env, "front-stop")
        _check_in(port, volunteer, "front-stop-worker")
        clients, seen = _front_clients(f"http://127.0.0.1:{port}/v1", requester)
        _wait_for(lambda: len(_requests_of("front-stop")) == 3, 30, log)
        time.sleep(1.0)  # each waits past its first status read
        stopped_at = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 0
        # Nothing was generating: every request is answered at once, not at the drain's end.
        assert time.monotonic() - stopped_at < 5, log.read_text()[-3000:]
        for client in clients:
            client.join(30)
        _assert_stopping_answers(seen, "front-stop")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _standalone_front(tmp_path, env: dict, port: int, **values: str):
    """`python -m oai` over the web process on `port`, serving: (its process, its port, its log)."""
    front_port, front_log = free_port(), tmp_path / "front.log"
    front_env = {**env, "HORDE_OAI_NATIVE_ROOTS": f"http://127.0.0.1:{port}/api/v2", "HORDE_OAI_PORT": str(front_port),
                 **values}
    front_env.pop("DJANGO_SETTINGS_MODULE", None)
    with front_log.open("ab") as output:
        front = subprocess.Popen([sys.executable, "-m", "oai"], cwd=ROOT, env=front_env, stdout=output,
                                 stderr=subprocess.STDOUT, process_group=0)

    def front_up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{front_port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait_for(front_up, 30, front_log)
    except BaseException:
        front.kill()
        front.wait()
        raise
    return front, front_port, front_log


def test_the_standalone_front_at_sigterm_answers_as_the_mounted_one(tmp_path):
    """`python -m oai` over the web process: the same answers, cancels and kudos at its stop."""
    launcher, env, port, log = _serving(tmp_path)
    processes = [launcher]
    try:
        front, front_port, front_log = _standalone_front(tmp_path, env, port)
        processes.append(front)
        requester, volunteer = _users(env, "oai-stop")
        _check_in(port, volunteer, "oai-stop-worker")
        clients, seen = _front_clients(f"http://127.0.0.1:{front_port}/v1", requester)
        _wait_for(lambda: len(_requests_of("oai-stop")) == 3, 30, front_log)
        time.sleep(1.0)
        stopped_at = time.monotonic()
        front.send_signal(signal.SIGTERM)
        assert front.wait(30) == 0, front_log.read_text()[-3000:]
        assert time.monotonic() - stopped_at < 5, front_log.read_text()[-3000:]
        for client in clients:
            client.join(30)
        _assert_stopping_answers(seen, "oai-stop")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _stream_with_its_job_popped(
    port: int, tag: str, requester: str, volunteer: str, log
) -> tuple[http.client.HTTPConnection, dict, threading.Thread, dict[str, object]]:
    """A streamed /v1 request (its chunks, or its error, in `seen["stream"]` once its thread ends)
    whose job the worker `{tag}-worker` popped, over a connection kept alive through a stop."""
    worker = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    assert call(worker, "POST", "generate/text/pop", {"name": f"{tag}-worker", **CHAT_POP}, volunteer)[0] == 200
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=requester, max_retries=0, timeout=60)
    seen: dict[str, object] = {}

    def streamed() -> None:
        try:
            seen["stream"] = list(sdk.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=32, stream=True))
        except Exception as error:
            seen["stream"] = error

    client = threading.Thread(target=streamed)
    client.start()
    _wait_for(lambda: len(_requests_of(tag)) == 1, 30, log)
    status, job = call(worker, "POST", "generate/text/pop", {"name": f"{tag}-worker", **CHAT_POP}, volunteer)
    assert status == 200 and job["id"], job
    return worker, job, client, seen


def test_sigterm_lets_a_reply_being_generated_finish_within_the_drain(tmp_path):
    """A worker holds the job when the process is told to stop: the stream waits on, and the reply
    the worker submits during the drain (over its kept-alive connection) reaches the client whole,
    charged as any delivered reply; a request the worker has not popped is cancelled at once."""
    launcher, env, port, log = _serving(tmp_path)
    try:
        requester, volunteer = _users(env, "front-drain")
        worker, job, client, seen = _stream_with_its_job_popped(port, "front-drain", requester, volunteer, log)
        time.sleep(1.0)  # the stream waits for the worker
        stopped_at = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        submitted = call(worker, "POST", "generate/text/submit", {
            "id": job["id"], "message": {"role": "assistant", "content": "Hi there."}, "finish_reason": "stop",
            "native_finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 3, "model_id": CHAT_MODEL},
            volunteer)
        assert submitted[0] == 200 and submitted[1]["reward"] > 0, submitted
        client.join(30)
        assert launcher.wait(30) == 0
        assert time.monotonic() - stopped_at < 10, log.read_text()[-3000:]

        chunks = seen["stream"]
        assert isinstance(chunks, list), chunks
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi there."
        assert chunks[-1].choices[0].finish_reason == "stop"
        (row,) = _requests_of("front-drain")
        assert not row.cancelled
        assert [kind for kind, _ in _ledger("front-drain")] == ["grant", "horde_tax", "generation_charge"]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _generating_at_the_stop(port: int, tag: str, requester: str, volunteer: str, log, *, v1_port: int | None = None):
    """A streamed and a whole chat completion (the openai SDK, no retries) and a whole
    /v1/completions (to the front on `v1_port`, by default the web process's), each popped by a
    worker of its own: (the workers' jobs by request id, the clients, what each client sees:
    seen["stream"], seen["whole"], seen["text"])."""
    _check_in(port, volunteer, f"{tag}-worker-0")
    v1 = f"http://127.0.0.1:{v1_port or port}/v1"
    sdk = openai.OpenAI(base_url=v1, api_key=requester, max_retries=0, timeout=60)
    seen: dict[str, object] = {}

    def ask(name: str, make) -> None:
        try:
            answer = make()
            seen[name] = list(answer) if name == "stream" else answer
        except Exception as error:
            seen[name] = error

    clients = [
        threading.Thread(target=ask, args=("stream", lambda: sdk.chat.completions.create(
            model=CHAT_MODEL, messages=HELLO, max_tokens=32, stream=True))),
        threading.Thread(target=ask, args=("whole", lambda: sdk.chat.completions.create(
            model=CHAT_MODEL, messages=HELLO, max_tokens=32))),
        threading.Thread(target=ask, args=("text", lambda: sdk.completions.create(
            model=CHAT_MODEL, prompt="Once", max_tokens=32))),
    ]
    for client in clients:
        client.start()
    _wait_for(lambda: len(_requests_of(tag)) == 3, 30, log)
    jobs: dict[str, dict] = {}
    for n in range(1, 4):  # one worker per job: each holds what it popped
        status, job = call(http.client.HTTPConnection("127.0.0.1", port, timeout=30), "POST", "generate/text/pop",
                           {"name": f"{tag}-worker-{n}", **CHAT_POP}, volunteer)
        assert status == 200 and job["id"], job
        jobs[str(Generation.objects.get(pk=job["id"]).request_id)] = job
    assert len(jobs) == 3
    return jobs, clients, seen


def test_sigterm_ends_the_replies_still_generating_at_the_drains_end_unpaid(tmp_path):
    """Workers hold the jobs of a streamed and a whole chat completion and a /v1/completions, and
    submit none within the drain: at the stop's deadline the front ends each horde request as
    undelivered (docs/adr/0086): the request cancelled, its job ended cancelled and unpaid in the
    same commit, the streaming worker's lease flagged; the clients get FrontStopping (the stream's
    error event and [DONE], 503 with Retry-After for the whole ones); the requester pays the horde
    tax only, and the workers' late submits are refused AbortedGen. Before, the front sent the
    spec's cancel: the stream was settled on the 20-token floor, and the whole jobs were left
    processing, to be paid if their workers submitted before the process exited."""
    launcher, env, port, log = _serving(tmp_path)
    try:
        requester, volunteer = _users(env, "front-late")
        jobs, clients, seen = _generating_at_the_stop(port, "front-late", requester, volunteer, log)
        time.sleep(1.0)  # each waits for its worker
        stopped_at = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(30)
        answered_after = time.monotonic() - stopped_at
        assert launcher.wait(30) == 0
        # Waited for the workers (the deadline: 10 s less the cancel's 1.5 s and 0.5 s), within the drain.
        assert 6 < answered_after < 10, answered_after

        _assert_ended_unpaid(seen, "front-late")
        # The workers, on the process started in its place.
        restarted, restarted_log = _start(env, port, tmp_path / "web2.log"), tmp_path / "web2.log"
        try:
            _until_serving(restarted, port, restarted_log)
            _assert_late_workers_refused(port, "front-late", jobs, volunteer)
        finally:
            restarted.send_signal(signal.SIGTERM)
            restarted.wait(30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _assert_ended_unpaid(seen: dict[str, object], tag: str) -> None:
    """The clients answered FrontStopping, and their horde requests ended as a dead front's
    (docs/adr/0028) when the front stopped, not left to a submit: each cancelled with its job
    cancelled and unpaid, the requester charged the horde tax only."""
    error = seen["stream"]
    assert isinstance(error, openai.APIError) and error.body["code"] == "FrontStopping", error
    assert error.body["metadata"]["retry_after"] == 5 and error.body["metadata"]["request_id"]
    for name in ("whole", "text"):
        refused = seen[name]
        assert isinstance(refused, openai.InternalServerError), (name, refused)
        assert refused.status_code == 503 and refused.body["code"] == "FrontStopping", refused.body
        assert refused.response.headers["retry-after"] == "5"
        assert refused.response.headers["x-should-retry"] == "true"
    rows = _requests_of(tag)
    assert [row.cancelled for row in rows] == [True, True, True]
    generations = Generation.objects.filter(request__in=rows)
    assert sorted((g.state, g.kudos) for g in generations) == [(Generation.State.CANCELLED, 0)] * 3, [
        (g.id, g.state, g.kudos, g.settled_character_count) for g in generations]
    assert [kind for kind, _ in _ledger(tag)] == ["grant", "horde_tax", "horde_tax", "horde_tax"]


def _assert_late_workers_refused(port: int, tag: str, jobs: dict[str, dict], volunteer: str) -> None:
    """The streaming worker's next progress post is told the request is cancelled, and every late
    submit is AbortedGen; nobody is charged or paid."""
    worker = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    (streamed,) = [job for job in jobs.values() if job["payload"].get("stream_progress")]
    posted = call(worker, "POST", "generate/text/progress",
                  {"id": streamed["id"], "seq": 1, "delta": {"content": "Too late"}}, volunteer)
    assert posted[0] == 200 and posted[1]["cancelled"] is True, posted
    chat_requests = {str(row.id) for row in _requests_of(tag) if row.is_chat}
    assert len(chat_requests) == 2
    for request_id, job in jobs.items():
        if request_id in chat_requests:
            late = call(worker, "POST", "generate/text/submit", {
                "id": job["id"], "message": {"role": "assistant", "content": "Nobody reads this."},
                "finish_reason": "stop", "model_id": CHAT_MODEL}, volunteer)
        else:
            late = call(worker, "POST", "generate/text/submit",
                        {"id": job["id"], "generation": " Nobody reads this.", "state": "ok"}, volunteer)
        assert late[0] == 400 and late[1]["rc"] == "AbortedGen", (job["id"], late)
    user = HordeUser.objects.get(username__startswith=f"{tag}-requester")
    ledger = _ledger(tag)
    assert [kind for kind, _ in ledger] == ["grant", "horde_tax", "horde_tax", "horde_tax"], ledger
    assert user.kudos == sum(amount for _, amount in ledger) and user.kudos_held == 0
    assert not KudosTransaction.objects.filter(user__username__startswith=f"{tag}-volunteer").exists()


def test_the_standalone_front_with_a_known_passkey_ends_its_undelivered_requests_unpaid(tmp_path):
    """`python -m oai` over HTTP, with the passkey the horde lists (HORDE_OAI_PROXY_PASSKEY,
    HORDE_PROXY_PASSKEYS): at its stop's deadline it ends its requests still generating as the
    mounted front does, while the horde goes on serving; the workers' submits are refused at once."""
    launcher, env, port, log = _serving(tmp_path, HORDE_PROXY_PASSKEYS="stop-front-passkey")
    processes = [launcher]
    try:
        front, front_port, front_log = _standalone_front(tmp_path, env, port, HORDE_OAI_PROXY_PASSKEY="stop-front-passkey")
        processes.append(front)
        requester, volunteer = _users(env, "oai-late")
        jobs, clients, seen = _generating_at_the_stop(port, "oai-late", requester, volunteer, front_log,
                                                      v1_port=front_port)
        time.sleep(1.0)
        stopped_at = time.monotonic()
        front.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(30)
        assert 6 < time.monotonic() - stopped_at < 10
        assert front.wait(30) == 0, front_log.read_text()[-3000:]
        _assert_ended_unpaid(seen, "oai-late")
        _assert_late_workers_refused(port, "oai-late", jobs, volunteer)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_sigterm_settles_a_relayed_stream_on_what_its_client_was_sent(tmp_path):
    """A stream whose worker's progress was relayed to its client before the stop: the client
    received part of the reply, so at the deadline its request is cancelled as the spec's cancel,
    settled on what the worker posted (docs/adr/0086), not ended unpaid."""
    launcher, env, port, log = _serving(tmp_path)
    try:
        requester, volunteer = _users(env, "front-relayed")
        _check_in(port, volunteer, "front-relayed-worker")
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=requester, max_retries=0, timeout=60)
        chunks: list = []
        seen: dict[str, object] = {}

        def streamed() -> None:
            try:
                for chunk in sdk.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=32, stream=True):
                    chunks.append(chunk)
            except Exception as error:
                seen["error"] = error

        client = threading.Thread(target=streamed)
        client.start()
        _wait_for(lambda: len(_requests_of("front-relayed")) == 1, 30, log)
        worker = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        status, job = call(worker, "POST", "generate/text/pop", {"name": "front-relayed-worker", **CHAT_POP}, volunteer)
        assert status == 200 and job["id"] and job["payload"].get("stream_progress"), job
        posted = call(worker, "POST", "generate/text/progress",
                      {"id": job["id"], "seq": 1, "delta": {"content": "Hello there, "}}, volunteer)
        assert posted == (200, {"accepted_seq": 1, "cancelled": False}), posted

        def relayed() -> str:
            return "".join(c.choices[0].delta.content or "" for c in list(chunks) if c.choices)

        _wait_for(lambda: relayed() == "Hello there, ", 30, log)
        launcher.send_signal(signal.SIGTERM)
        client.join(30)
        assert launcher.wait(30) == 0

        error = seen["error"]
        assert isinstance(error, openai.APIError) and error.body["code"] == "FrontStopping", error
        assert relayed() == "Hello there, "
        (row,) = _requests_of("front-relayed")
        generation = Generation.objects.get(pk=job["id"])
        assert row.cancelled and generation.state == Generation.State.CANCELLED
        assert generation.settled_character_count == len("Hello there, ") and generation.kudos > 0
        assert [kind for kind, _ in _ledger("front-relayed")] == ["grant", "horde_tax", "generation_charge"]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
