"""What every benchmark starts with: the repository on the import path, its paths and interpreter,
the environment its web process runs with, a fresh database and Redis database, migrated, and the
web process itself (`Server`, run inside `serving`).

A bench script runs as `python bench/<name>.py`, so this folder is first on sys.path and
`from common import ...` finds this module; importing it puts the repository root next, for the
benches that import the apps (after prepare(), which sets Django up).

The database is dropped and recreated (its name may not be `postgres` or a template; a sqlite:///
file is deleted) and the Redis database flushed (never database 0): benches get their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse, urlunparse

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DAPHNE = str(Path(sys.executable).with_name("daphne"))
# The web process as `make run` starts it: the launcher's tweaks (switch interval, gc.freeze()).
WEB = [PYTHON, str(ROOT / "scripts" / "run.py"), "web"]

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


def manage(env: dict[str, str], *argv: str) -> str:
    """`manage.py *argv` under `env`; its standard output."""
    return subprocess.run(
        [PYTHON, "manage.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout


def create_user_key(env: dict[str, str], username: str, *flags: str) -> str:
    """A new user's API key (`manage.py horde_user create`, which prints it last)."""
    return manage(env, "horde_user", "create", username, *flags).strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """daphne as a child process in its own process group; stopped on exit and on Ctrl-C."""

    def __init__(self, port: int, env: dict[str, str], log_path: Path):
        self.port = port
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115  (kept open for the child's lifetime)
        self.proc = subprocess.Popen(
            [*WEB, "-b", "127.0.0.1", "-p", str(self.port), "hordesite.asgi:application"],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60.0, *, announce: bool = True) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                raise SystemExit(f"daphne exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if (
                    httpx.get(f"http://127.0.0.1:{self.port}/api/v2/status/heartbeat", timeout=2).status_code
                    == 200
                ):
                    if announce:
                        print(f"daphne pid {self.proc.pid} on port {self.port} (log {self.log_path})", flush=True)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise SystemExit(
            f"daphne did not answer on port {self.port} within {timeout:.0f}s; see {self.log_path}"
        )

    def leave_running(self) -> None:
        """Detach the running daphne (a bench's --keep-server): stop() and serving() leave it."""
        if self.proc and self.proc.poll() is None:
            print(f"daphne left running: pid {self.proc.pid} (kill -- -{self.proc.pid})")
        self.proc = None

    def stop(self) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


@contextlib.contextmanager
def serving(*servers: Server) -> Iterator[None]:
    """Start the servers; stop them on leaving, on SIGTERM (exit 128 + 15) and on Ctrl-C (exit 130)."""

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    try:
        for server in servers:
            server.start()
        yield
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        for server in servers:
            server.stop()
