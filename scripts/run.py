#!/usr/bin/env python3
"""Start the horde's processes together and stop them together (`make run`).

Runs, from the project root and with the interpreter that runs this script (the venv's):

  web     python scripts/run.py web -b 127.0.0.1 -p $PORT hordesite.asgi:application
          (daphne with the web process's tweaks: see serve_web)
  celery  celery -A hordesite worker -B --loglevel=INFO   (worker with the beat scheduler)
  demo    the reference worker on its scripted backend (python -m workers.bridge --backend scripted),
          unless HORDE_DEMO_WORKER is "0"; it serves the model DEMO_MODEL ("scripted") with the key of
          the trusted user "demo-worker", made once with `manage.py horde_user create` and kept in
          var/demo-worker.key (made again when the database no longer knows it)

Ctrl-C (SIGINT) or SIGTERM stops every child with SIGTERM (their graceful shutdown), waits up to
STOP_TIMEOUT seconds (a second Ctrl-C: none), then kills what is left. If any child exits on its own, the others are stopped
too and the exit status is that child's. Migrations are not run here: `make run` runs them first.

Each child runs in its own process group, so a Ctrl-C at the terminal reaches only this launcher,
which then stops each child once (Celery would take a second SIGINT as a cold shutdown).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STOP_TIMEOUT = 20.0

# The demo worker: the reference worker on the scripted backend (no LLM). commands() adds
# --horde-url for the port; the API key goes in its environment (BRIDGE_API_KEY), not argv.
DEMO_MODEL = "scripted"
DEMO_WORKER_COMMAND: list[str] | None = [
    sys.executable, "-m", "workers.bridge",
    "--backend", "scripted",
    "--name", "demo-worker",
    "--horde-model", DEMO_MODEL,
    "--threads", "2",
]
DEMO_WORKER_KEY_FILE = Path(os.environ.get("HORDE_DEMO_WORKER_KEY_FILE") or ROOT / "var" / "demo-worker.key")
DEMO_WORKER_USER = "demo-worker"

# Exits 0 when the key in argv[1] belongs to a user of the database the horde runs on.
_KEY_CHECK = (
    "import sys; from accounts.selectors import user_get_by_api_key; "
    "sys.exit(0 if user_get_by_api_key(sys.argv[-1]) else 3)"
)


def _tool(name: str) -> str:
    """The console script from this interpreter's environment (the venv), else from PATH."""
    candidate = BIN / name
    return str(candidate) if candidate.exists() else name


def demo_worker_enabled() -> bool:
    return os.environ.get("HORDE_DEMO_WORKER", "1") != "0" and bool(DEMO_WORKER_COMMAND)


# The web process's thread switch interval, in ms (Python's default is 5): its threads mostly wait
# on sockets and run briefly between waits, and a thread whose answer arrived should not wait 5 ms
# for the interpreter (docs/deployment.md).
GIL_SWITCH_INTERVAL_MS = float(os.environ.get("HORDE_GIL_SWITCH_INTERVAL_MS") or 1.0)


def serve_web(daphne_args: list[str]) -> int:
    """daphne in this process with the web process's tweaks: the thread switch interval,
    gc.freeze() once the application is loaded, so the collector's full passes stop walking every
    module, model and URL pattern the process keeps for its lifetime, and daphne's server class
    (hordesite/web_server.py, docs/adr/0043). The rest is daphne's own command line
    (`daphne --help`)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_MS / 1000)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hordesite.settings")
    import hordesite.asgi  # noqa: F401  (loaded before the freeze; daphne finds it imported)

    gc.freeze()
    from hordesite.web_server import HordeCommandLine  # daphne without Twisted's form parsing

    HordeCommandLine().run(daphne_args)
    return 0


def commands(port: str) -> dict[str, list[str]]:
    cmds = {
        "web": [sys.executable, str(Path(__file__).resolve()), "web", "-b", "127.0.0.1", "-p", port,
                "hordesite.asgi:application"],
        "celery": [_tool("celery"), "-A", "hordesite", "worker", "-B", "--loglevel=INFO"],
    }
    if demo_worker_enabled():
        assert DEMO_WORKER_COMMAND is not None
        cmds["demo"] = [*DEMO_WORKER_COMMAND, "--horde-url", f"http://127.0.0.1:{port}"]
    return cmds


def _manage(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def demo_worker_key() -> str | None:
    """The demo worker's API key: the stored one while the database knows it, else a new user's.

    None (and a message) when no user can be made, e.g. before `manage.py migrate`.
    """
    if DEMO_WORKER_KEY_FILE.exists():
        key = DEMO_WORKER_KEY_FILE.read_text().strip()
        if key and _manage("shell", "-c", _KEY_CHECK, key).returncode == 0:
            return key
    made = _manage("horde_user", "create", DEMO_WORKER_USER, "--trusted")
    lines = made.stdout.strip().splitlines()
    if made.returncode != 0 or not lines:
        print(
            f"[run] demo: could not create the user {DEMO_WORKER_USER!r} (run `manage.py migrate`?):\n"
            f"{made.stderr.strip()[-2000:]}",
            file=sys.stderr,
            flush=True,
        )
        return None
    key = lines[-1].strip()
    DEMO_WORKER_KEY_FILE.write_text(key + "\n")
    DEMO_WORKER_KEY_FILE.chmod(0o600)
    print(f"[run] demo: created the user {DEMO_WORKER_USER!r}; its key is in {DEMO_WORKER_KEY_FILE}", file=sys.stderr)
    return key


def ensure_var_dirs() -> None:
    # The embedded default keeps everything under ./var (SQLite file, filesystem broker folders,
    # beat schedule, media); kombu's filesystem transport does not create its folders itself.
    for sub in ("", "celery-broker", "celery-processed", "media"):
        (ROOT / "var" / sub).mkdir(parents=True, exist_ok=True)


def main() -> int:
    port = os.environ.get("PORT") or "8000"
    ensure_var_dirs()
    os.chdir(ROOT)

    stopping = False
    force = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping, force
        if stopping:
            force = True  # a second Ctrl-C: do not wait for the graceful shutdown
        else:
            print(f"\n[run] {signal.Signals(signum).name}: stopping", file=sys.stderr, flush=True)
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    cmds = commands(port)
    envs: dict[str, dict[str, str]] = {}
    if "demo" in cmds:
        key = demo_worker_key()
        if key is None:
            del cmds["demo"]
        else:
            envs["demo"] = {**os.environ, "BRIDGE_API_KEY": key}

    children: dict[str, subprocess.Popen[bytes]] = {}
    for name, cmd in cmds.items():
        print(f"[run] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        children[name] = subprocess.Popen(cmd, cwd=ROOT, process_group=0, env=envs.get(name))
    print(f"[run] serving on http://127.0.0.1:{port}/ (Ctrl-C stops)", file=sys.stderr, flush=True)
    if "demo" in children:
        print(
            f"[run] demo worker serves the model {DEMO_MODEL!r} (scripted answers; HORDE_DEMO_WORKER=0 turns it off)",
            file=sys.stderr,
            flush=True,
        )

    status = 0
    while not stopping:
        for name, proc in children.items():
            rc = proc.poll()
            if rc is not None:
                print(f"[run] {name} exited with {rc}: stopping the others", file=sys.stderr, flush=True)
                status = 128 - rc if rc < 0 else (rc or 1)
                stopping = True
                break
        else:
            time.sleep(0.2)

    for proc in children.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while any(proc.poll() is None for proc in children.values()):
        if force or time.monotonic() > deadline:
            for name, proc in children.items():
                if proc.poll() is None:
                    print(f"[run] {name} still running: killing", file=sys.stderr, flush=True)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            break
        time.sleep(0.1)
    print("[run] stopped", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    if sys.argv[1:2] == ["web"]:
        sys.exit(serve_web(sys.argv[2:]))
    sys.exit(main())
