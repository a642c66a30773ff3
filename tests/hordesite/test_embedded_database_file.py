"""The embedded default's SQLite file, out of reach: a request answers 503 DatabaseUnavailable with
Retry-After (as a lost PostgreSQL does), never a 500, and the horde serves again once the file is
back. A real web process (`scripts/run.py web`) on its own database file, whose folder the test
moves away and back.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.hordesite.test_web_restart import LaunchedWeb
from tests.ports import free_port

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Horde:
    url: str
    key: str
    folder: Path  # holds the database file


@pytest.fixture(scope="module")
def horde(tmp_path_factory) -> Iterator[Horde]:
    tmp_path = tmp_path_factory.mktemp("embedded-file")
    folder = tmp_path / "db"
    folder.mkdir()
    web = LaunchedWeb(
        {
            **os.environ,
            "DATABASE_URL": f"sqlite:///{folder / 'horde.sqlite3'}",
            "REDIS_URL": "",
            "CELERY_BROKER_URL": "",
            "PYTHONUNBUFFERED": "1",
            "HORDE_API_KEY_CACHE_SECONDS": "0",
        },
        free_port(),
        tmp_path / "web.log",
    )
    web.manage("migrate", "--noinput", "-v0")
    key = web.manage("horde_user", "create", "file-requester", "--kudos", "1000").strip().splitlines()[-1]
    web.start()
    try:
        yield Horde(url=f"http://127.0.0.1:{web.port}", key=key, folder=folder)
    finally:
        web.kill()


def _ask(horde: Horde) -> httpx.Response:
    return httpx.post(
        f"{horde.url}/api/v2/generate/text/async",
        headers={"apikey": horde.key, "Client-Agent": "file-test:1:test"},
        json={"prompt": "Once upon a time", "params": {"max_length": 16}, "models": ["any-model"]},
        timeout=30,
    )


def _requests_stored(folder: Path) -> int:
    with sqlite3.connect(folder / "horde.sqlite3") as db:
        return db.execute("select count(*) from horde_requests").fetchone()[0]


def test_a_database_file_out_of_reach_answers_503_and_the_horde_serves_again(horde: Horde) -> None:
    first = _ask(horde)
    assert first.status_code == 202, first.text
    request_id = first.json()["id"]

    away = horde.folder.with_name("db-away")
    horde.folder.rename(away)
    try:
        refused = _ask(horde)
        status = httpx.get(f"{horde.url}/api/v2/generate/text/status/{request_id}", timeout=30)
    finally:
        away.rename(horde.folder)

    for answer in (refused, status):
        assert answer.status_code == 503, answer.text
        assert answer.json() == {"message": "The database is unavailable; try again shortly.", "rc": "DatabaseUnavailable"}
        assert int(answer.headers["Retry-After"]) >= 1

    again = _ask(horde)
    assert again.status_code == 202, again.text
    read = httpx.get(f"{horde.url}/api/v2/generate/text/status/{request_id}", timeout=30)
    assert read.status_code == 200 and read.json()["done"] is False
    assert _requests_stored(horde.folder) == 2  # the refused one wrote nothing
