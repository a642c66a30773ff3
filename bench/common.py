"""What every benchmark starts with: the repository on the import path, its paths and interpreter,
the environment its web process runs with, and a fresh database and Redis database, migrated.

A bench script runs as `python bench/<name>.py`, so this folder is first on sys.path and
`from common import ...` finds this module; importing it puts the repository root next, for the
benches that import the apps (after prepare(), which sets Django up).

The database is dropped and recreated (its name may not be `postgres` or a template; a sqlite:///
file is deleted) and the Redis database flushed (never database 0): benches get their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse, urlunparse

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DAPHNE = str(Path(sys.executable).with_name("daphne"))

if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

# A deployment's settings (DATABASE_URL set, DEBUG off) need both (docs/configuration.md).
BENCH_SECRET_KEY = "bench-only-secret-key-not-for-production-0123456789"
BENCH_ALLOWED_HOSTS = "127.0.0.1,localhost"


def web_pids(pid: int) -> list[int]:
    """The processes serving for the web process `pid`: itself, or with HORDE_WEB_PROCESSES above 1
    the launcher's children (docs/adr/0046)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    pids = [int(child) for child in children.read_text().split()] if children.exists() else []
    return pids or [pid]


def server_env(database_url: str, redis_url: str, **settings: str) -> dict[str, str]:
    """This process's environment with the settings a bench's web process (and this process, after
    prepare()) runs with; `settings` add to or override them (rate limits, front options...)."""
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="hordesite.settings",
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        CELERY_BROKER_URL=redis_url,
        HORDE_MAINTENANCE="false",
        DEBUG="false",
        SECRET_KEY=os.environ.get("SECRET_KEY") or BENCH_SECRET_KEY,
        ALLOWED_HOSTS=os.environ.get("ALLOWED_HOSTS") or BENCH_ALLOWED_HOSTS,
        LOG_LEVEL="WARNING",
        PYTHONUNBUFFERED="1",
    )
    env.update(settings)
    return env


def recreate_database(database_url: str) -> None:
    import psycopg
    from psycopg import sql

    parts = urlparse(database_url)
    if parts.scheme == "sqlite":
        Path(parts.path).unlink(missing_ok=True)
        return
    name = parts.path.lstrip("/")
    if not name or name in ("postgres", "template0", "template1"):
        raise SystemExit(f"refusing to recreate database {name!r}: give the bench its own database")
    admin_url = urlunparse(parts._replace(scheme="postgresql", path="/postgres"))
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def flush_redis(redis_url: str) -> None:
    import redis

    parts = urlparse(redis_url)
    if parts.path.strip("/") in ("", "0"):
        raise SystemExit("refusing to flush Redis database 0: give the bench its own database (e.g. /14)")
    redis.Redis.from_url(redis_url).flushdb()


def migrate(env: dict[str, str]) -> None:
    subprocess.run([PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)


def prepare(env: dict[str, str], *, django: bool = True, note: str = "") -> None:
    """Run from the repository root under `env` (the web process's settings), on a recreated
    database and a flushed Redis database, migrated; then set Django up in this process (the
    fill and the checks read the database through the apps) unless `django` is false."""
    os.chdir(ROOT)
    os.environ.update(env)
    database_url, redis_url = env["DATABASE_URL"], env["REDIS_URL"]
    print(f"database {database_url} (recreated), redis {redis_url} (flushed){note}", flush=True)
    recreate_database(database_url)
    flush_redis(redis_url)
    migrate(env)
    if django:
        import django as django_module

        django_module.setup()
