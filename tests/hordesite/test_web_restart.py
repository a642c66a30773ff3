"""A web process killed with jobs held (`kill -9`): after the restart, the held jobs' submits are
accepted, each request ends done, and the kudos are settled once (issue 13, item 6).

The web process is a real daphne subprocess on the test database (PostgreSQL with Redis, or the
embedded SQLite file): the pop's in-process memory of handed-out jobs dies with it, so the submits
after the restart take the path that reads the jobs back from the database.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.db import connection

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TEXT_MODEL = "koboldcpp/Llama-3-8B"
CHAT_MODEL = "Gryphe/MythoMax-L2-13b"
SCRIBE_AGENT = "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"
CHAT_DECLARATION = {
    "chat_jobs": True,
    "model_id": CHAT_MODEL,
    "chat_limits": {"max_context_length": 8192, "max_length": 1024},
    "chat_features": ["prompt_overflow_refused", "tool_choice_enforced", "structured_output_enforced"],
    "image_transports": [],
}

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _database_url(tmp_path: Path) -> str:
    """The URL of the database this test runs on, for the subprocess."""
    params = connection.settings_dict
    if connection.vendor == "postgresql":
        user, host, port = params["USER"] or "postgres", params["HOST"] or "127.0.0.1", params["PORT"] or 5432
        return f"postgres://{user}@{host}:{port}/{params['NAME']}"
    path = params["NAME"]
    if not path or str(path).startswith(("file:", ":memory:")):
        pytest.fail("the embedded pass needs a file test database (tests/oai/conftest.py sets one)")
    return f"sqlite:///{path}"


def web_env(tmp_path: Path, **values: str) -> dict[str, str]:
    """The environment of a web process on this test's database and Redis (values: more settings)."""
    return {
        **os.environ,
        "DATABASE_URL": _database_url(tmp_path),
        "REDIS_URL": settings.REDIS_URL or "",
        "CELERY_BROKER_URL": "",
        "PYTHONUNBUFFERED": "1",
        **values,
    }


class WebProcess:
    def __init__(self, env: dict[str, str], port: int, log: Path):
        self.env, self.port, self.log = env, port, log
        self.url = f"http://127.0.0.1:{port}/api/v2/"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [str(Path(sys.executable).parent / "daphne"), "-b", "127.0.0.1", "-p", str(self.port),
                "hordesite.asgi:application"]

    def start(self) -> None:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            self.command(), cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "status/heartbeat", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def manage(self, *args: str) -> str:
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, check=True
        ).stdout


class LaunchedWeb(WebProcess):
    """The web process as `make run` starts it (scripts/run.py web: daphne with HordeServer), its
    access log on its standard output."""

    def command(self) -> list[str]:
        return [sys.executable, "scripts/run.py", "web", "-b", "127.0.0.1", "-p", str(self.port),
                "hordesite.asgi:application"]


@pytest.fixture
def web(tmp_path) -> Iterator[WebProcess]:
    process = WebProcess(web_env(tmp_path), free_port(), tmp_path / "daphne.log")
    process.start()
    yield process
    if process.proc and process.proc.poll() is None:
        process.kill()


def _post(client: httpx.Client, path: str, key: str, body: dict) -> httpx.Response:
    return client.post(path, json=body, headers={"apikey": key})


def _kudos(client: httpx.Client, key: str) -> float:
    return client.get("find_user", headers={"apikey": key}).json()["kudos"]


def test_jobs_held_across_a_killed_web_process_are_accepted_after_the_restart(web):
    requester = web.manage("horde_user", "create", "restart-requester", "--kudos", "1000").strip().splitlines()[-1]
    volunteer = web.manage("horde_user", "create", "restart-volunteer", "--trusted").strip().splitlines()[-1]
    client = httpx.Client(base_url=web.url, timeout=30)

    text_ids = []
    for n in range(3):
        created = _post(client, "generate/text/async", requester, {
            "prompt": f"Story {n}:", "params": {"n": 1, "max_length": 80}, "models": [TEXT_MODEL]})
        assert created.status_code == 202, created.text
        text_ids.append(created.json()["id"])
        time.sleep(1.05)  # the per-address limit on request creation (2 per second)
    # The chat worker declares first, so the chat request has an online worker.
    pop_body = {"models": [CHAT_MODEL], "max_length": 512, "max_context_length": 4096,
                "bridge_agent": SCRIBE_AGENT, **CHAT_DECLARATION}
    assert _post(client, "generate/text/pop", volunteer, {"name": "restart-chat", **pop_body}).json()["id"] is None
    chat = _post(client, "generate/chat/async", requester, {
        "model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64})
    assert chat.status_code == 202, chat.text
    chat_id = chat.json()["id"]
    before = _kudos(client, requester)

    text_jobs = []
    for n in range(3):
        job = _post(client, "generate/text/pop", volunteer, {
            "name": f"restart-text-{n}", "models": [TEXT_MODEL], "max_length": 512, "max_context_length": 4096,
            "bridge_agent": SCRIBE_AGENT}).json()
        assert job["id"], job
        text_jobs.append(job["id"])
    chat_job = _post(client, "generate/text/pop", volunteer, {"name": "restart-chat", **pop_body}).json()
    assert chat_job["id"], chat_job

    web.kill()
    web.start()

    rewards = []
    for job_id in text_jobs:
        submitted = _post(client, "generate/text/submit", volunteer, {"id": job_id, "generation": " Once.", "state": "ok"})
        assert submitted.status_code == 200, submitted.text
        rewards.append(submitted.json()["reward"])
    submitted = _post(client, "generate/text/submit", volunteer, {
        "id": chat_job["id"], "message": {"role": "assistant", "content": "Hi there."},
        "finish_reason": "stop", "native_finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 3,
        "model_id": CHAT_MODEL})
    assert submitted.status_code == 200, submitted.text
    rewards.append(submitted.json()["reward"])
    assert all(reward > 0 for reward in rewards)

    # A second submit of the same job is refused: paid once.
    again = _post(client, "generate/text/submit", volunteer, {"id": text_jobs[0], "generation": " Twice.", "state": "ok"})
    assert again.status_code == 400 and again.json()["rc"] == "DuplicateGen", again.text

    for request_id in text_ids:
        status = client.get(f"generate/text/status/{request_id}").json()
        assert status["done"] is True and status["finished"] == 1, status
    status = client.get(f"generate/chat/status/{chat_id}").json()
    assert status["done"] is True and status["finished"] == 1, status
    assert _kudos(client, volunteer) >= sum(rewards) - 1e-6
    assert _kudos(client, requester) <= before
