"""End to end: `make run`'s processes (scripts/run.py: daphne, Celery, the demo worker) answer a
chat request with the demo worker's scripted reply: on the native route, and through the OpenAI
front at /v1 with the openai client, whole and streamed, woken by the completion signal in process
(no Redis; ADR 0054).

The processes run on a free port with their own SQLite database file, so they do not touch the
test database.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = "scripted"  # scripts/run.py DEMO_MODEL
FRONT_POLL_SECONDS = 30

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class MakeRun:
    url: str
    key: str  # a requester's
    env: dict[str, str]  # the processes' environment (their database, the demo worker's key file)
    demo_key_file: Path
    log: Path  # what the launcher and its children printed


@pytest.fixture(scope="module")
def make_run(tmp_path_factory) -> Iterator[MakeRun]:
    """scripts/run.py (what `make run` starts after migrating) on a free port."""
    tmp_path = tmp_path_factory.mktemp("make-run")
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'run.sqlite3'}",
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
        "PORT": str(port),
        "PYTHONUNBUFFERED": "1",
        "HORDE_DEMO_WORKER_KEY_FILE": str(tmp_path / "demo-worker.key"),  # not the checkout's var/
        # A front wait that polls would read again only after this: a reply within it was woken
        # by the horde's completion signal, handed over in process without Redis (ADR 0054).
        "HORDE_OAI_POLL_SECONDS": str(FRONT_POLL_SECONDS),
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
        yield MakeRun(url, key, env, Path(env["HORDE_DEMO_WORKER_KEY_FILE"]), log_path)
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


def test_the_demo_worker_starts_once_the_web_process_answers(make_run):
    """A newcomer's first `make run` shows no failure: the demo worker is started after the web
    process answers, so its first calls never meet a port that is not served yet."""
    printed = make_run.log.read_text()
    assert "[bridge]" in printed
    assert "horde unreachable" not in printed, printed
    assert printed.index("[run] serving on") < printed.index(" -m workers.bridge ")


def test_make_run_demo_worker_answers_a_native_chat_request(make_run):
    url, key = make_run.url, make_run.key
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

    url, key = make_run.url, make_run.key
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    started = time.monotonic()
    completion = client.chat.completions.create(
        model=DEMO_MODEL, messages=[{"role": "user", "content": "Hello, horde"}], max_tokens=64
    )
    assert completion.choices[0].message.content == "Scripted reply to: Hello, horde"
    assert completion.choices[0].finish_reason == "stop"
    # Woken by the completion signal in process, not by the next poll (ADR 0054).
    assert time.monotonic() - started < FRONT_POLL_SECONDS / 3

    started = time.monotonic()
    chunks = list(
        client.chat.completions.create(
            model=DEMO_MODEL, messages=[{"role": "user", "content": "Hello again"}], max_tokens=64, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Scripted reply to: Hello again"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert time.monotonic() - started < FRONT_POLL_SECONDS / 3


def test_a_second_make_run_finds_the_demo_workers_user_by_its_stored_key(make_run):
    """Started again on the same database, the launcher reuses the demo worker's user: a new user
    would not own the registered worker `demo-worker`, whose pops would then be refused."""
    stored = make_run.demo_key_file.read_text().strip()
    again = subprocess.run(
        [sys.executable, "-c", "import runpy; print(runpy.run_path('scripts/run.py')['demo_worker_key']())"],
        cwd=ROOT, env=make_run.env, capture_output=True, text=True, check=True,
    )
    assert again.stdout.strip() == stored, again.stderr
    assert "created the user" not in again.stderr
    count = subprocess.run(
        [sys.executable, "manage.py", "shell", "--no-imports", "-c",
         "from accounts.models import HordeUser; print(HordeUser.objects.filter(username='demo-worker').count())"],
        cwd=ROOT, env=make_run.env, capture_output=True, text=True, check=True,
    )
    assert count.stdout.strip() == "1"


def test_a_make_run_without_the_key_file_renews_the_demo_workers_owner_key(make_run, tmp_path):
    """The key file is gone (deleted, or another checkout made the database): the owner of the
    worker `demo-worker` gets a new key rather than a second user being made, whose pops under that
    name would be refused. Run on a copy of the database, so the running demo worker keeps its key."""
    import sqlite3

    source = sqlite3.connect(make_run.env["DATABASE_URL"].removeprefix("sqlite:///"))
    copy = sqlite3.connect(tmp_path / "copy.sqlite3")
    source.backup(copy)
    source.close()
    copy.close()
    env = {**make_run.env, "DATABASE_URL": f"sqlite:///{tmp_path / 'copy.sqlite3'}",
           "HORDE_DEMO_WORKER_KEY_FILE": str(tmp_path / "missing.key")}
    again = subprocess.run(
        [sys.executable, "-c", "import runpy; print(runpy.run_path('scripts/run.py')['demo_worker_key']())"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True,
    )
    renewed = again.stdout.strip()
    assert renewed not in ("", "None") and renewed != make_run.demo_key_file.read_text().strip(), again.stderr
    assert (tmp_path / "missing.key").read_text().strip() == renewed
    assert "gave the owner of the worker 'demo-worker' a new key" in again.stderr
    owner = subprocess.run(
        [sys.executable, "manage.py", "shell", "--no-imports", "-c",
         "import os; from accounts.models import HordeUser, hash_api_key; from workers.models import Worker; "
         "print(Worker.objects.get(name='demo-worker').owner.api_key_hash == hash_api_key(os.environ['K']), "
         "HordeUser.objects.filter(username='demo-worker').count())"],
        cwd=ROOT, env={**env, "K": renewed}, capture_output=True, text=True, check=True,
    )
    assert owner.stdout.split() == ["True", "1"]


README = ROOT / "README.md"
README_URL = "http://127.0.0.1:8000"  # where the README's examples reach `make run`


def _readme_blocks(section: str, language: str) -> list[str]:
    """The code blocks of one README section, as written."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(rf"```{language}\n(.*?)```", text[start:end if end != -1 else None], re.S)


def _spaced(text: str) -> str:
    """JSON as the README writes it (`"a": 1, "b"`) and as the horde sends it (`"a":1,"b"`) alike."""
    return re.sub(r"([:,]) ", r"\1", text)


def test_the_readme_openai_examples_run_as_written(make_run):
    """README, "Chat through the OpenAI front": its curl examples answer what their comments show,
    and every print of its Python examples prints what its comment starts with, against `make run`."""
    section = "Chat through the OpenAI front"
    env = {**make_run.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    shell = "\n".join(_readme_blocks(section, "sh")).replace(README_URL, make_run.url)
    ran = subprocess.run(["bash", "-euo", "pipefail", "-c", shell], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    shown = re.findall(r"^# \.\.\. (.+?) \.\.\.?$", shell, re.M)
    assert len(shown) == 2  # the chat completion's message, the text completion's text
    for fragment in shown:
        assert _spaced(fragment.rstrip(",")) in _spaced(ran.stdout), (fragment, ran.stdout)

    python = "\n".join(_readme_blocks(section, "python"))
    expected = re.findall(r"^print\(.*\)\s+# (.+)$", python, re.M)
    program = "import os\nKEY = os.environ['KEY']\n" + python.replace(README_URL, make_run.url)
    ran = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env={**env, "KEY": make_run.key},
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    printed = ran.stdout.splitlines()
    assert len(printed) == len(expected) >= 5, (printed, expected)
    for line, comment in zip(printed, expected, strict=True):
        # The whole comment, or it and a note in brackets: a print cut short (an empty output_text) fails.
        assert re.fullmatch(re.escape(line) + r"( \(.+\))?", comment), (line, comment)
