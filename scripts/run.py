#!/usr/bin/env python3
"""Start the horde's processes together and stop them together (`make run`).

Runs, from the project root and with the interpreter that runs this script (the venv's):

  web     daphne -b 127.0.0.1 -p $PORT hordesite.asgi:application
  celery  celery -A hordesite worker -B --loglevel=INFO   (worker with the beat scheduler)
  demo    the demo worker, when DEMO_WORKER_COMMAND is set and HORDE_DEMO_WORKER is not "0"

Ctrl-C (SIGINT) or SIGTERM stops every child with SIGTERM (their graceful shutdown), waits up to
STOP_TIMEOUT seconds (a second Ctrl-C: none), then kills what is left. If any child exits on its own, the others are stopped
too and the exit status is that child's. Migrations are not run here: `make run` runs them first.

Each child runs in its own process group, so a Ctrl-C at the terminal reaches only this launcher,
which then stops each child once (Celery would take a second SIGINT as a cold shutdown).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STOP_TIMEOUT = 20.0

# Placeholder for a later issue: the command line of the demo worker process (a list of
# arguments, e.g. [sys.executable, "-m", "..."]). While it is None no demo worker is started,
# whatever HORDE_DEMO_WORKER says.
DEMO_WORKER_COMMAND: list[str] | None = None


def _tool(name: str) -> str:
    """The console script from this interpreter's environment (the venv), else from PATH."""
    candidate = BIN / name
    return str(candidate) if candidate.exists() else name


def commands(port: str) -> dict[str, list[str]]:
    cmds = {
        "web": [_tool("daphne"), "-b", "127.0.0.1", "-p", port, "hordesite.asgi:application"],
        "celery": [_tool("celery"), "-A", "hordesite", "worker", "-B", "--loglevel=INFO"],
    }
    if os.environ.get("HORDE_DEMO_WORKER", "1") != "0" and DEMO_WORKER_COMMAND:
        cmds["demo"] = list(DEMO_WORKER_COMMAND)
    return cmds


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

    children: dict[str, subprocess.Popen[bytes]] = {}
    for name, cmd in commands(port).items():
        print(f"[run] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        children[name] = subprocess.Popen(cmd, cwd=ROOT, process_group=0)
    print(f"[run] serving on http://127.0.0.1:{port}/ (Ctrl-C stops)", file=sys.stderr, flush=True)

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
    sys.exit(main())
