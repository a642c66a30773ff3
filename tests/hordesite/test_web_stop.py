"""A web process stopped with SIGTERM (a deploy's restart: systemd's stop, the launcher's Ctrl-C)
answers the native requests it is serving before it exits (hordesite/web_server.py, the drain).

Without the drain daphne cancelled every request at once: a native POST whose view was running went
on to commit on its serving thread, and its client got a closed connection, so a text request
was queued (and charged) under an id its client never learnt, and a retry queued a second one. A
pop held for work was dropped the same way instead of getting its empty answer.
"""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
import threading
import time

import pytest
from django.db import connection, transaction

from accounts.models import HordeUser
from chat.models import GenerationRequest
from tests.hordesite.clone import ROOT
from tests.hordesite.test_web_processes import TEXT_MODEL, _start, call
from tests.hordesite.test_web_restart import _free_port, web_env

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def _blocked_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0] > 0


def test_sigterm_answers_the_requests_in_flight_before_the_process_exits(tmp_path):
    # A held pop re-checks the queue only after the test: what ends its wait is the stop.
    env = web_env(tmp_path, HORDE_WEB_PROCESSES="1", HORDE_POP_WAIT_RECHECK_SECONDS="60")
    port, log = _free_port(), tmp_path / "web.log"
    launcher = _start(env, port, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if call(http.client.HTTPConnection("127.0.0.1", port, timeout=5), "GET", "status/heartbeat")[0] == 200:
                    break
            except OSError:
                pass
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

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
