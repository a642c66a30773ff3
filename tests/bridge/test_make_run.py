"""End to end: `make run`'s processes (scripts/run.py: daphne, Celery, the demo worker) answer a
chat request with the demo worker's scripted reply: on the native route, and through the OpenAI
front at /v1 with the openai client.

The processes run on a free port with their own SQLite database file, so they do not touch the
test database.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = "scripted"  # scripts/run.py DEMO_MODEL

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def make_run(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """scripts/run.py (what `make run` starts after migrating) on a free port: (root URL, a requester key)."""
    tmp_path = tmp_path_factory.mktemp("make-run")
    port = _free_port()
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'run.sqlite3'}",
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
        "PORT": str(port),
        "PYTHONUNBUFFERED": "1",
        "HORDE_DEMO_WORKER_KEY_FILE": str(tmp_path / "demo-worker.key"),  # not the checkout's var/
    }
    env.pop("HORDE_DEMO_WORKER", None)

    def manage(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=True
        ).stdout

    manage("migrate", "--noinput", "-v0")
    key = manage("horde_user", "create", "e2e-requester", "--kudos", "1000").strip().splitlines()[-1]
    log_path = tmp_path / "run.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "scripts/run.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        process_group=0,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # daphne, Celery and the demo worker on a loaded 2-core CI box
        while True:  # up once the demo worker has declared its model
            try:
                models = httpx.get(f"{url}/api/v2/status/models?type=text&chat=true", timeout=2)
                if models.status_code == 200 and any(m.get("name") == DEMO_MODEL for m in models.json()):
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        yield url, key
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    assert proc.returncode == 0, log_path.read_text()
    assert "[bridge] summary:" in log_path.read_text()


def test_make_run_demo_worker_answers_a_native_chat_request(make_run):
    url, key = make_run
    with httpx.Client(base_url=f"{url}/api/v2/", headers={"apikey": key}, timeout=10) as client:
        created = client.post(
            "generate/chat/async",
            json={"model": DEMO_MODEL, "messages": [{"role": "user", "content": "Hello, horde"}], "max_tokens": 64},
        )
        assert created.status_code == 202, created.text
        deadline = time.monotonic() + 30
        while not (status := client.get(f"generate/chat/status/{created.json()['id']}").json())["done"]:
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
    assert status["generations"][0]["message"]["content"] == "Scripted reply to: Hello, horde"
    assert status["generations"][0]["worker_name"] == "demo-worker"


def test_make_run_answers_the_openai_client(make_run):
    import openai

    url, key = make_run
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    completion = client.chat.completions.create(
        model=DEMO_MODEL, messages=[{"role": "user", "content": "Hello, horde"}], max_tokens=64
    )
    assert completion.choices[0].message.content == "Scripted reply to: Hello, horde"
    assert completion.choices[0].finish_reason == "stop"
