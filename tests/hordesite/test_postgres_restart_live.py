"""A PostgreSQL of the test's own, restarted and stopped under a running web process (issue 13,
item 3; docs/adr/0018).

The test makes a cluster in a temporary folder (initdb, as the postgres user when run as root),
serves it on a free loopback port, migrates a database on it and starts daphne serving
hordesite.asgi against it in a subprocess. Then `pg_ctl restart -m fast`: the pooled connections
die, and the next requests must succeed. Then `pg_ctl stop -m fast`: every native call must answer
503 DatabaseUnavailable with Retry-After within a second or so, not wait out the pool. Started
again, the horde serves again without a restart of its own. The machine's shared PostgreSQL is
never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.ports import free_port

pytestmark = pytest.mark.postgres_only

ROOT = Path(__file__).resolve().parents[2]
QUICK_SECONDS = 1.5
MODEL = "Gryphe/MythoMax-L2-13b"


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / name).exists():
            return str(folder / name)
    return None


class OwnPostgres:
    def __init__(self, folder: Path, port: int):
        self.folder, self.port = folder, port
        self.data = folder / "data"
        self.as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def run(self, *args: str) -> None:
        subprocess.run([*self.as_postgres, *args], check=True, capture_output=True, timeout=120)

    def pg_ctl(self, *args: str) -> None:
        # -l: the server's output goes to its log, not to the pipes this call waits on.
        self.run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "log"), "-w", "-t", "60", *args)

    def start(self) -> None:
        self.pg_ctl("-o", f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def create(self) -> None:
        if self.as_postgres:
            shutil.chown(self.folder, "postgres")
        self.run(_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self.start()

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/horde"


@pytest.fixture(scope="module")
def horde_on_own_postgres():
    if not (_bin("initdb") and _bin("pg_ctl")):
        pytest.fail("initdb and pg_ctl are needed for this test")
    folder = Path(tempfile.mkdtemp(prefix="horde-own-pg-"))
    folder.chmod(0o755)
    postgres = OwnPostgres(folder, free_port())
    postgres.create()
    web = None
    try:
        postgres.run(_bin("createdb") or "createdb", "-h", "127.0.0.1", "-p", str(postgres.port), "-U", "postgres", "horde")
        env = {
            **os.environ,
            "DATABASE_URL": postgres.url,
            "REDIS_URL": "",
            "CELERY_BROKER_URL": "",
            "DJANGO_SETTINGS_MODULE": "hordesite.settings",
            "HORDE_TEXT_ASYNC_RATE_LIMITS": "10000/second",
            "HORDE_API_KEY_RATE_LIMITS": "10000/second",
            "HORDE_DATABASE_UNAVAILABLE_SECONDS": "1",
        }
        subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True, timeout=300)
        keys = {}
        for name, flags in (("requester", ["--kudos", "10000"]), ("worker-owner", ["--trusted"])):
            out = subprocess.run(
                [sys.executable, "manage.py", "horde_user", "create", f"{name}-{uuid.uuid4().hex[:4]}", *flags],
                cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=120,
            )
            keys[name] = out.stdout.strip().splitlines()[-1]
        port = free_port()
        log = open(folder / "daphne.log", "wb")  # noqa: SIM115  (closed with the process)
        web = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "hordesite.asgi:application"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}/api/v2"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/status/heartbeat", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert web.poll() is None and time.monotonic() < deadline, (folder / "daphne.log").read_text()[-3000:]
            time.sleep(0.2)
        yield postgres, url, keys
    finally:
        if web is not None:
            web.terminate()
            web.wait(20)
        with contextlib.suppress(subprocess.CalledProcessError):
            postgres.pg_ctl("-m", "immediate", "stop")
        shutil.rmtree(folder, ignore_errors=True)


def _calls(url: str, keys: dict[str, str], request_id: str):
    text = {"prompt": "Once upon a time", "params": {"n": 1, "max_length": 80}, "models": [MODEL]}
    pop = {
        "name": f"own-pg-worker-{keys['worker-owner'][:4]}",
        "models": [MODEL],
        "max_length": 512,
        "max_context_length": 4096,
        "bridge_agent": "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp",
    }
    return {
        "text async": (202, lambda: httpx.post(f"{url}/generate/text/async", json=text, headers={"apikey": keys["requester"]}, timeout=60)),
        "pop": (200, lambda: httpx.post(f"{url}/generate/text/pop", json=pop, headers={"apikey": keys["worker-owner"]}, timeout=60)),
        "text status": (200, lambda: httpx.get(f"{url}/generate/text/status/{request_id}", timeout=60)),
        "workers": (200, lambda: httpx.get(f"{url}/workers", timeout=60)),
    }


def test_restart_then_stop_then_start(horde_on_own_postgres):
    postgres, url, keys = horde_on_own_postgres
    first = httpx.post(
        f"{url}/generate/text/async",
        json={"prompt": "Hi", "params": {"n": 1, "max_length": 80}, "models": [MODEL]},
        headers={"apikey": keys["requester"]},
        timeout=60,
    )
    assert first.status_code == 202, first.text
    calls = _calls(url, keys, first.json()["id"])
    for expected, call in calls.values():
        assert call().status_code == expected

    # Restarted: the pool's connections died with the old server; no request may fail for it.
    postgres.pg_ctl("-m", "fast", "restart")
    for _round in range(3):
        for name, (expected, call) in calls.items():
            response = call()
            assert response.status_code == expected, (name, response.status_code, response.text[:300])

    # Stopped: quick 503s with Retry-After, in the native shape.
    postgres.pg_ctl("-m", "fast", "stop")
    stopped = time.monotonic()
    while time.monotonic() - stopped < 4:
        for name, (_expected, call) in calls.items():
            started = time.monotonic()
            response = call()
            took = time.monotonic() - started
            assert response.status_code == 503, (name, response.status_code, response.text[:300])
            assert response.json()["rc"] == "DatabaseUnavailable" and int(response.headers["Retry-After"]) >= 1
            assert took < QUICK_SECONDS, (name, took)

    # Started again: served again, by the same web process.
    postgres.start()
    time.sleep(1.2)  # past the unavailable window
    for name, (expected, call) in calls.items():
        response = call()
        assert response.status_code == expected, (name, response.status_code, response.text[:300])


CELERY_SUCCEEDED = re.compile(rb"Task chat\.tasks\.\w+\[[^]]+\] succeeded")


def test_a_restart_costs_the_celery_worker_no_sweep(horde_on_own_postgres, tmp_path):
    """The Celery worker keeps its connection pool from one sweep to the next (docs/adr/0093), so a
    restart leaves it dead connections: the next sweeps must still succeed. The worker is paused
    across the restart (SIGSTOP), so that no sweep is in flight when the server goes: what is
    tested is the pool's dead connections, not a sweep cut in the middle."""
    postgres, _url, _keys = horde_on_own_postgres
    env = {
        **os.environ,
        "DATABASE_URL": postgres.url,
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
        "DJANGO_SETTINGS_MODULE": "hordesite.settings",
        "CELERY_BEAT_SCHEDULE_FILENAME": str(tmp_path / "celerybeat-schedule"),
        "HORDE_SWEEP_INTERVAL_SECONDS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    log = tmp_path / "celery.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "hordesite", "worker", "-B", "--concurrency=1", "--loglevel=INFO"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0,
        )

    def sweeps_succeeded(count: int) -> int:
        deadline = time.monotonic() + 90
        while (done := len(CELERY_SUCCEEDED.findall(log.read_bytes()))) < count:
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        return done

    try:
        before = sweeps_succeeded(6)
        os.killpg(worker.pid, signal.SIGSTOP)
        try:
            postgres.pg_ctl("-m", "fast", "restart")
        finally:
            os.killpg(worker.pid, signal.SIGCONT)
        sweeps_succeeded(before + 8)
        assert b"raised unexpected" not in log.read_bytes(), log.read_text()[-4000:]
    finally:
        worker.send_signal(signal.SIGTERM)  # the main process only, as systemd's KillMode=mixed does
        try:
            worker.wait(60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
