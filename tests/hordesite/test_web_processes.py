"""More than one web process on one port (HORDE_WEB_PROCESSES, scripts/run.py supervise_web,
docs/adr/0046-web-processes-on-one-port.md): the launcher binds one SO_REUSEPORT socket per process,
a process learns of another's writes through PostgreSQL and Redis, a killed process is started
again on its socket without a refused connection, and a stop ends them all.

Each test starts the real launcher on this test's database and Redis, and finds which process
serves a connection from the kernel's socket tables, so a test can hold a pop in one process and
make the request it waits for in the other.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.hordesite.clone import ROOT, clean_env, run_python
from tests.hordesite.test_web_restart import TEXT_MODEL, web_env
from tests.ports import free_port

LAUNCH = [sys.executable, "scripts/run.py", "web"]


def live(test):
    """A test of the launcher on this test's PostgreSQL and Redis (more than one process needs both)."""
    for mark in (pytest.mark.django_db(transaction=True), pytest.mark.redis_only, pytest.mark.postgres_only):
        test = mark(test)
    return test


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child that has exited but was not reaped yet is a zombie: not serving.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _tcp_sockets(port: int) -> list[tuple[str, int, str]]:
    """(state, remote port, inode link) of every loopback TCP socket on the local `port`, from the
    kernel's table (state "0A": listening)."""
    sockets = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port:
            sockets.append((fields[3], int(fields[2].rsplit(":", 1)[1], 16), f"socket:[{fields[9]}]"))
    return sockets


def _holder(links: set[str], pids: list[int]) -> int | None:
    """The process among `pids` holding one of the sockets `links`."""
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) in links:
                    return pid
            except OSError:
                continue
    return None


def _accepting_pid(port: int, client_port: int, pids: list[int]) -> int | None:
    """The process holding the server side of the connection from client_port to port."""
    return _holder({link for _, remote, link in _tcp_sockets(port) if remote == client_port}, pids)


def _listening(port: int, pid: int) -> bool:
    """The process `pid` holds its listening socket (connections the kernel gives it wait there
    until its daphne serves them)."""
    return _holder({link for state, _, link in _tcp_sockets(port) if state == "0A"}, [pid]) == pid


@dataclass
class WebProcesses:
    launcher: subprocess.Popen[bytes]
    port: int
    env: dict[str, str]
    log: Path

    def children(self) -> list[int]:
        return _children(self.launcher.pid)

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def connection_to(self, pid: int) -> http.client.HTTPConnection:
        """A kept-alive connection that the process `pid` accepted (new connections until one is)."""
        for _ in range(200):
            conn = self.connection()
            assert call(conn, "GET", "status/heartbeat")[0] == 200
            if _accepting_pid(self.port, conn.sock.getsockname()[1], self.children()) == pid:
                return conn
            conn.close()
        raise AssertionError(f"no connection of 200 reached process {pid}")

    def manage(self, *args: str) -> str:
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, check=True
        ).stdout


def call(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None = None,
         key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["apikey"] = key
    conn.request(method, f"/api/v2/{path}", body=json.dumps(body) if body is not None else None, headers=headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"null")


def _start(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as output:
        return subprocess.Popen(
            [*LAUNCH, "-b", "127.0.0.1", "-p", str(port), "hordesite.asgi:application"],
            cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, process_group=0,
        )


def _until_serving(launcher: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Until the launcher's web process answers the heartbeat on `port` (at most 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if call(http.client.HTTPConnection("127.0.0.1", port, timeout=5), "GET", "status/heartbeat")[0] == 200:
                return
        except OSError:
            pass
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


@pytest.fixture
def web_processes(tmp_path) -> Iterator[WebProcesses]:
    # A held pop re-checks the queue only after the test is over: what wakes it is the signal.
    env = web_env(tmp_path, HORDE_WEB_PROCESSES="2", HORDE_POP_WAIT_RECHECK_SECONDS="60")
    port, log = free_port(), tmp_path / "web.log"
    launcher = _start(env, port, log)
    web = WebProcesses(launcher, port, env, log)
    try:
        deadline = time.monotonic() + 60
        while len(web.children()) < 2 or not all(_listening(port, pid) for pid in web.children()):
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield web
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_more_than_one_web_process_needs_postgres_and_redis(tmp_path):
    for processes in ("2", "0"):
        started = run_python(
            ROOT, clean_env(HORDE_WEB_PROCESSES=processes),
            *LAUNCH[1:], "-b", "127.0.0.1", "-p", str(free_port()), "hordesite.asgi:application",
        )
        assert started.returncode == 2, started.stderr
        expected = "needs DATABASE_URL (PostgreSQL) and REDIS_URL" if processes == "2" else "at least 1"
        assert expected in started.stderr


@live
def test_a_pop_held_in_one_process_takes_the_request_made_in_the_other(web_processes):
    requester = web_processes.manage("horde_user", "create", "mp-requester", "--kudos", "1000").split()[-1]
    volunteer = web_processes.manage("horde_user", "create", "mp-volunteer", "--trusted").split()[-1]
    first, second = web_processes.children()
    popping, asking = web_processes.connection_to(first), web_processes.connection_to(second)

    pop_body = {"name": "mp-worker", "models": [TEXT_MODEL], "max_length": 512, "max_context_length": 4096}
    assert call(popping, "POST", "generate/text/pop", pop_body, volunteer)[1]["id"] is None  # checked in
    held: dict = {}

    def hold() -> None:
        started = time.monotonic()
        held["answer"] = call(popping, "POST", "generate/text/pop", {**pop_body, "wait": 20}, volunteer)
        held["seconds"] = time.monotonic() - started

    holder = threading.Thread(target=hold)
    holder.start()
    time.sleep(1.0)  # the pop is held in the first process (warm: it served the check-in)
    status, created = call(asking, "POST", "generate/text/async",
                           {"prompt": "Once", "params": {"max_length": 16}, "models": [TEXT_MODEL]}, requester)
    assert status == 202, created
    holder.join(30)

    status, job = held["answer"]
    assert status == 200 and job["id"] and job["payload"]["prompt"] == "Once", job
    assert held["seconds"] < 10, held  # woken by the second process's signal, not by a re-check or the bound
    status, submitted = call(popping, "POST", "generate/text/submit",
                             {"id": job["id"], "generation": " upon a time.", "state": "ok"}, volunteer)
    assert status == 200 and submitted["reward"] > 0, submitted
    status, done = call(asking, "GET", f"generate/text/status/{created['id']}")
    assert status == 200 and done["done"] is True
    assert [g["text"] for g in done["generations"]] == [" upon a time."]


@live
def test_a_killed_web_process_is_replaced_on_its_socket_and_no_connection_is_refused(web_processes):
    first, second = web_processes.children()
    os.kill(first, signal.SIGKILL)
    # Fresh connections while it is replaced: those the kernel gives its socket wait in its queue.
    answered = []
    for _ in range(30):
        conn = web_processes.connection()
        answered.append(call(conn, "GET", "status/heartbeat")[0])
        conn.close()
    assert answered == [200] * 30

    replaced = web_processes.children()
    assert second in replaced and first not in replaced and len(replaced) == 2
    new = next(pid for pid in replaced if pid != second)
    deadline = time.monotonic() + 60
    while not _listening(web_processes.port, new):
        assert time.monotonic() < deadline, web_processes.log.read_text()
        time.sleep(0.2)
    assert call(web_processes.connection_to(new), "GET", "status/heartbeat")[0] == 200
    log = web_processes.log.read_text()
    assert f"exited with -9: started {new} on its socket" in log
    # The processes share the launcher's output: each log line names the process that wrote it.
    assert f"[{new}] INFO daphne.server Listening on TCP address 127.0.0.1:{web_processes.port}" in log, log

    # SIGTERM stops them all (daphne's graceful shutdown) and frees the port.
    web_processes.launcher.send_signal(signal.SIGTERM)
    assert web_processes.launcher.wait(30) == 0
    assert not _alive(second) and not _alive(new)
    with pytest.raises(ConnectionRefusedError):
        web_processes.connection().connect()


@live
def test_a_second_launcher_does_not_share_the_port_and_the_processes_die_with_a_killed_launcher(web_processes):
    # SO_REUSEPORT would let a second horde of the same user split this one's connections.
    second = run_python(ROOT, web_processes.env, *LAUNCH[1:], "-b", "127.0.0.1", "-p", str(web_processes.port),
                        "hordesite.asgi:application")
    assert second.returncode == 2 and "cannot listen on 127.0.0.1" in second.stderr, second.stderr

    children = web_processes.children()
    os.kill(web_processes.launcher.pid, signal.SIGKILL)
    web_processes.launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, "a web process outlived its launcher"
        time.sleep(0.1)
    with pytest.raises(ConnectionRefusedError):
        web_processes.connection().connect()


@live
def test_processes_that_cannot_start_stop_the_launcher_instead_of_looping(tmp_path):
    started = run_python(ROOT, web_env(tmp_path, HORDE_WEB_PROCESSES="2"), *LAUNCH[1:], "-b", "127.0.0.1",
                         "-p", str(free_port()), "no_such_module:application", timeout=120)
    assert started.returncode != 0
    assert "at its start, 3 times in a row: stopping" in started.stderr, started.stderr[-3000:]


@live
def test_more_than_one_web_process_listens_on_one_ipv4_port_only(tmp_path):
    env = web_env(tmp_path, HORDE_WEB_PROCESSES="2")
    for listen, expected in (
        (["-b", "::1", "-p", str(free_port())], "listens on an IPv4 address"),
        (["-u", str(tmp_path / "web.sock")], "serves one TCP port"),
        (["-b", "127.0.0.1", "-p", str(free_port()), "-e", "tcp:port=0"], "serves one TCP port"),
    ):
        started = run_python(ROOT, env, *LAUNCH[1:], *listen, "hordesite.asgi:application")
        assert started.returncode == 2 and expected in started.stderr, (listen, started.stderr)
