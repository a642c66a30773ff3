"""The web process's tweaks (thread switch interval, gc.freeze(), daphne without Twisted's form
parsing) are the launcher's: importing the ASGI application leaves Python's defaults,
`scripts/run.py web` applies them before daphne runs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.hordesite.clone import ROOT, clean_env, clone_like_copy, run_python
from tests.ports import free_port

SHOW = "import gc, sys; {}; print(sys.getswitchinterval(), gc.get_freeze_count())"


def test_importing_the_application_changes_no_process_setting():
    shown = run_python(ROOT, clean_env(DJANGO_SETTINGS_MODULE="hordesite.settings"), "-c", SHOW.format("import hordesite.asgi"))
    assert shown.returncode == 0, shown.stderr
    interval, frozen = shown.stdout.split()
    assert float(interval) == 0.005 and int(frozen) == 0


def test_the_launcher_sets_them_before_daphne():
    # serve_web with daphne's --help: the tweaks are applied, then daphne's command line exits.
    code = "\n".join(
        [
            "import gc, runpy, sys",
            "serve_web = runpy.run_path('scripts/run.py')['serve_web']",
            "try:",
            "    serve_web(['--help'])",
            "except SystemExit:",
            "    pass",
            "print(sys.getswitchinterval(), gc.get_freeze_count())",
        ]
    )
    shown = run_python(ROOT, clean_env(HORDE_GIL_SWITCH_INTERVAL_MS="2"), "-c", code)
    assert shown.returncode == 0, shown.stderr
    interval, frozen = shown.stdout.split()[-2:]
    assert float(interval) == 0.002 and int(frozen) > 0


def test_the_launchers_daphne_hands_a_multipart_post_to_the_api(tmp_path):
    """Stock daphne lets Twisted parse a POST declared multipart and answers a body it cannot parse
    with a bare 400; the launcher's daphne (hordesite/web_server.py) gives it to the route, which
    answers its JSON 415 with the CORS headers (docs/adr/0043)."""
    clone = clone_like_copy(tmp_path / "clone")
    port = free_port()
    log = tmp_path / "web.log"
    with log.open("w") as output:
        web = subprocess.Popen(
            [sys.executable, "scripts/run.py", "web", "-b", "127.0.0.1", "-p", str(port), "hordesite.asgi:application"],
            cwd=clone, env=clean_env(), stdout=output, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert web.poll() is None, log.read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the web process did not listen"
                time.sleep(0.1)
        response = httpx.post(
            f"http://127.0.0.1:{port}/api/v2/generate/text/pop",
            content=b"not a multipart body",
            headers={"Content-Type": "multipart/form-data; boundary=xyz", "apikey": "any-key-at-all"},
            timeout=10,
        )
    finally:
        web.terminate()
        web.wait(20)
    assert response.status_code == 415
    assert response.headers["content-type"] == "application/json"
    assert response.headers["access-control-allow-origin"] == "*"
    assert response.json()["rc"] == "BadRequest" and "multipart/form-data" in response.json()["message"]


def test_the_demo_worker_setting_reads_booleans_as_every_setting_does():
    code = "import runpy; print(runpy.run_path('scripts/run.py')['demo_worker_enabled']())"
    shown = {
        value: run_python(ROOT, clean_env(**({} if value is None else {"HORDE_DEMO_WORKER": value})), "-c", code)
        for value in (None, "", "false", "0", "off", "true", "1", "2", "Ok")
    }
    assert {value: run.stdout.strip() for value, run in shown.items()} == {
        None: "True", "": "True", "false": "False", "0": "False", "off": "False", "true": "True", "1": "True",
        "2": "True", "Ok": "True",  # a non-zero integer is true, as env.bool reads it
    }, {value: run.stderr for value, run in shown.items()}


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_launchers_processes_stop_when_the_launcher_is_killed(tmp_path):
    """A launcher killed without its cleanup (SIGKILL, the OOM killer) takes its processes with it:
    left running, the web process would keep the port, so the next `make run` fails with "Address
    already in use", and an orphaned Celery and demo worker would keep serving beside the new ones."""
    clone = clone_like_copy(tmp_path / "clone")
    port = free_port()
    env = clean_env(PORT=str(port))
    migrated = run_python(clone, env, "manage.py", "migrate", "--noinput", "-v0")
    assert migrated.returncode == 0, migrated.stderr
    log = tmp_path / "run.log"
    with log.open("w") as output:
        launcher = subprocess.Popen(
            [sys.executable, "scripts/run.py"], cwd=clone, env=env, stdout=output, stderr=subprocess.STDOUT,
            process_group=0,
        )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while True:
            assert launcher.poll() is None, log.read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the web process did not listen"
                time.sleep(0.2)
        # Web, Celery and the demo worker, which starts once the web process answers.
        while len(children := _children(launcher.pid)) < 3:
            assert launcher.poll() is None and time.monotonic() < deadline, (children, log.read_text())
            time.sleep(0.2)
        assert len(children) == 3, children
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 45  # their graceful shutdown, on a loaded 2-core box
        while any(_running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in children if _running(pid)] == [], log.read_text()[-3000:]
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in children:  # each is the leader of its own process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_ctrl_c_lets_the_demo_worker_submit_the_job_it_holds(tmp_path):
    """The demo worker stops before the web process: the job it holds at a Ctrl-C is submitted and
    its request answered, instead of its submits failing against a stopped web process until the
    launcher kills it (a Ctrl-C that took STOP_TIMEOUT seconds and lost the job)."""
    clone = clone_like_copy(tmp_path / "clone")
    port = free_port()
    env = clean_env(PORT=str(port))
    migrated = run_python(clone, env, "manage.py", "migrate", "--noinput", "-v0")
    assert migrated.returncode == 0, migrated.stderr
    made = run_python(clone, env, "manage.py", "horde_user", "create", "asker", "--kudos", "100")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().splitlines()[-1]
    url = f"http://127.0.0.1:{port}/api/v2"
    log = tmp_path / "run.log"
    with log.open("w") as output:
        launcher = subprocess.Popen(
            [sys.executable, "scripts/run.py"], cwd=clone, env=env, stdout=output, stderr=subprocess.STDOUT,
            process_group=0,
        )
    database = sqlite3.connect(clone / "var" / "horde.sqlite3")
    try:
        deadline = time.monotonic() + 90
        while True:  # up once the demo worker has declared its model
            assert launcher.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                models = httpx.get(f"{url}/status/models?type=text", timeout=2)
                if any(model.get("name") == "scripted" for model in models.json()):
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        queued = httpx.post(
            f"{url}/generate/chat/async",
            json={"model": "scripted", "messages": [{"role": "user", "content": "Hi [scripted:sleep=3]"}], "horde": {}},
            headers={"apikey": key},
            timeout=10,
        )
        assert queued.status_code == 202, queued.text
        deadline = time.monotonic() + 30
        while database.execute("SELECT count(*) FROM horde_generations WHERE state = 'processing'").fetchone()[0] == 0:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    shown = log.read_text()
    assert launcher.returncode == 0, shown[-3000:]
    assert "still running: killing" not in shown, shown[-3000:]
    assert database.execute("SELECT state FROM horde_generations").fetchall() == [("ok",)], shown[-3000:]


@pytest.mark.parametrize(("args", "code"), [(["--help"], 0), (["-h"], 0), (["--port", "9000"], 2)])
def test_arguments_other_than_web_print_the_usage_and_start_nothing(args, code):
    """`scripts/run.py --help` started the whole stack on port 8000; now it answers with the usage."""
    done = run_python(ROOT, clean_env(PORT="1"), "scripts/run.py", *args, timeout=30)
    assert done.returncode == code, done.stderr
    assert "usage: scripts/run.py" in (done.stdout if code == 0 else done.stderr)
    assert "[run]" not in done.stdout + done.stderr  # no child was started
