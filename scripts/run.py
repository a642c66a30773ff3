#!/usr/bin/env python3
"""Start the horde's processes together and stop them together (`make run`).

Runs, from the project root and with the interpreter that runs this script (the venv's):

  web     python scripts/run.py web -b 127.0.0.1 -p $PORT hordesite.asgi:application
          (daphne with the web process's tweaks: see serve_daphne; HORDE_WEB_PROCESSES of them on
          the one port: see supervise_web)
  celery  celery -A hordesite worker -B --loglevel=INFO   (worker with the beat scheduler)
  demo    the reference worker on its scripted backend (python -m workers.bridge --backend scripted),
          unless HORDE_DEMO_WORKER is "0"; it serves the model DEMO_MODEL ("scripted") with the key of
          the trusted user "demo-worker", made once with `manage.py horde_user create` and kept in
          var/demo-worker.key (when the database no longer knows that key, the owner of the worker
          "demo-worker" gets a new one with `manage.py worker_owner_key`, or a user is made again);
          started once the web process answers (WEB_READY_SECONDS at most)

Ctrl-C (SIGINT) or SIGTERM stops the children with SIGTERM (their graceful shutdown), the demo
worker first, so that the jobs it holds are submitted while the web process still runs (up to
DEMO_STOP_TIMEOUT seconds), then the web process and Celery (up to STOP_TIMEOUT seconds); a second
Ctrl-C waits for none; what is left is killed. If any child exits on its own, the others are stopped
too and the exit status is that child's. Migrations are not run here: `make run` runs them first.

Each child runs in its own process group, so a Ctrl-C at the terminal reaches only this launcher,
which then stops each child once (Celery would take a second SIGINT as a cold shutdown). A launcher
killed without its cleanup (SIGKILL, the OOM killer) still stops them: each gets SIGTERM when the
launcher dies (Linux's parent-death signal), so no orphan keeps the port for the next `make run`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STOP_TIMEOUT = 20.0
# The demo worker's share of a stop (stop_children): its scripted jobs take well under a second
# unless a request asked it to sleep.
DEMO_STOP_TIMEOUT = 10.0

# The demo worker: the reference worker on the scripted backend (no LLM). commands() adds
# --horde-url for the port; the API key goes in its environment (BRIDGE_API_KEY), not argv.
DEMO_MODEL = "scripted"
DEMO_WORKER_NAME = "demo-worker"
DEMO_WORKER_COMMAND: list[str] | None = [
    sys.executable, "-m", "workers.bridge",
    "--backend", "scripted",
    "--name", DEMO_WORKER_NAME,
    "--horde-model", DEMO_MODEL,
    "--threads", "2",
]
DEMO_WORKER_KEY_FILE = Path(os.environ.get("HORDE_DEMO_WORKER_KEY_FILE") or ROOT / "var" / "demo-worker.key")
DEMO_WORKER_USER = "demo-worker"

# Exits 0 when the key in HORDE_DEMO_WORKER_KEY is a user's, KEY_UNKNOWN when it is no one's. (The
# key goes in the environment: `manage.py shell -c` takes no arguments after the code.)
KEY_UNKNOWN = 3
# `manage.py worker_owner_key`'s exit when no worker has the name (workers/management/commands).
NO_SUCH_WORKER = 3
_KEY_CHECK = (
    "import os, sys; from accounts.selectors import user_get_by_api_key; "
    f"sys.exit(0 if user_get_by_api_key(os.environ['HORDE_DEMO_WORKER_KEY']) else {KEY_UNKNOWN})"
)


def _tool(name: str) -> str:
    """The console script from this interpreter's environment (the venv), else from PATH."""
    candidate = BIN / name
    return str(candidate) if candidate.exists() else name


def demo_worker_enabled() -> bool:
    # django-environ's booleans, as every other setting reads them (a non-zero integer, true, yes, on...); unset or
    # empty keeps the default.
    import environ

    raw = os.environ.get("HORDE_DEMO_WORKER", "").strip()
    return (not raw or bool(environ.Env.parse_value(raw, bool))) and bool(DEMO_WORKER_COMMAND)


# The web process's thread switch interval, in ms (Python's default is 5): its threads mostly wait
# on sockets and run briefly between waits, and a thread whose answer arrived should not wait 5 ms
# for the interpreter (docs/deployment.md). HORDE_GIL_SWITCH_INTERVAL_MS, read by serve_web.
DEFAULT_GIL_SWITCH_INTERVAL_MS = 1.0


def gil_switch_interval_ms() -> float:
    """HORDE_GIL_SWITCH_INTERVAL_MS (unset or empty: the default), a number of milliseconds above 0;
    anything else is an ImproperlyConfigured naming it."""
    from django.core.exceptions import ImproperlyConfigured

    raw = os.environ.get("HORDE_GIL_SWITCH_INTERVAL_MS", "").strip()
    if not raw:
        return DEFAULT_GIL_SWITCH_INTERVAL_MS
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"HORDE_GIL_SWITCH_INTERVAL_MS {raw!r} is not a number (milliseconds)") from None
    if not value > 0:  # also nan; sys.setswitchinterval refuses 0 and less
        raise ImproperlyConfigured(f"HORDE_GIL_SWITCH_INTERVAL_MS must be above 0, not {raw} (milliseconds)")
    return value


def serve_web(daphne_args: list[str]) -> int:
    """The web process: one daphne here, or, with HORDE_WEB_PROCESSES above 1, that many on one
    port under this process (supervise_web)."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hordesite.settings")
    listen, rest = _split_listen_args(daphne_args)
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    from oai.settings import load_settings

    # Every setting the web process runs on is read before it serves: one it cannot use stops it
    # here with its message, the mounted front's (/v1/) included, which its first request would
    # otherwise read and answer 500 to every /v1/ request (hordesite/asgi.py reads them again).
    try:
        # Before the settings, which load the .env file into the environment: it does not set this.
        switch_interval_ms = gil_switch_interval_ms()
        processes = settings.HORDE_WEB_PROCESSES
        load_settings()
    except ImproperlyConfigured as exc:
        print(f"[web] {exc}", file=sys.stderr, flush=True)
        return 2
    # A process the supervisor started on its socket (--fd) serves it alone.
    if listen.file_descriptor is None and processes > 1:
        if listen.host is None or listen.port is None or listen.unix_socket or listen.endpoint:
            print("[web] HORDE_WEB_PROCESSES above 1 serves one TCP port: give -b HOST -p PORT "
                  "(no -u, --fd or -e)", file=sys.stderr, flush=True)
            return 2
        return supervise_web(processes, listen.host, listen.port, rest)
    return serve_daphne(daphne_args, switch_interval_ms)


def serve_daphne(daphne_args: list[str], switch_interval_ms: float = DEFAULT_GIL_SWITCH_INTERVAL_MS) -> int:
    """daphne in this process with the web process's tweaks: the thread switch interval,
    gc.freeze() once the application is loaded, so the collector's full passes stop walking every
    module, model and URL pattern the process keeps for its lifetime, daphne's server class
    (hordesite/web_server.py, docs/adr/0043), and the process's telemetry, flushed when daphne
    stops (hordesite/telemetry.py). The rest is daphne's own command line (`daphne --help`)."""
    sys.setswitchinterval(switch_interval_ms / 1000)
    import hordesite.asgi  # noqa: F401  (loaded before the freeze; daphne finds it imported)
    from hordesite.telemetry import start_web_telemetry, stop_telemetry

    # This process's own providers (each of HORDE_WEB_PROCESSES is a process started afresh, not a
    # fork): off unless telemetry is enabled (docs/adr/0075).
    start_web_telemetry()
    gc.freeze()
    from hordesite.web_server import HordeCommandLine  # daphne without Twisted's form parsing

    try:
        HordeCommandLine().run(daphne_args)
    finally:
        stop_telemetry()  # after the drain (ADR 0080): what the last requests recorded is exported
    return 0


def _split_listen_args(daphne_args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """daphne's listening options (as daphne's command line spells them), and the other arguments
    in their order."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("-b", "--bind", dest="host")
    parser.add_argument("-p", "--port", type=int)
    parser.add_argument("-u", "--unix-socket", dest="unix_socket")
    parser.add_argument("--fd", type=int, dest="file_descriptor")
    parser.add_argument("-e", "--endpoint", action="append")
    return parser.parse_known_args(daphne_args)


# A web process that exits within this many seconds of its start counts as failing to start;
# after WEB_START_FAILURES of those in a row the supervisor gives up (a bad setting, a broken
# deploy) instead of starting processes for ever.
WEB_START_SECONDS = 10.0
WEB_START_FAILURES = 3


def _reuseport_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(socket.SOMAXCONN)
    return sock


def _signal_on_parent_death(signum: int, parent: int) -> None:
    """In a child before it runs: `signum` when its parent dies (Linux's PR_SET_PDEATHSIG), or at
    once when the parent already died between the fork and this call."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signum)


def _die_with_parent(parent: int) -> None:
    """In a web process before it runs: SIGKILL when the supervisor dies, so that a supervisor
    killed without its cleanup leaves no process holding the port."""
    _signal_on_parent_death(signal.SIGKILL, parent)


def _stop_with_parent(parent: int) -> None:
    """In a child of main() before it runs: SIGTERM, its graceful shutdown, when the launcher dies
    without stopping it (SIGKILL, the OOM killer). Orphaned, the web process would keep the port
    (the next `make run` fails with "Address already in use") and Celery with beat and the demo
    worker would keep serving beside the next run's."""
    _signal_on_parent_death(signal.SIGTERM, parent)


def supervise_web(processes: int, host: str, port: int, daphne_args: list[str]) -> int:
    """`processes` daphne processes on one port, each on its own listening socket bound with
    SO_REUSEPORT, so the kernel spreads new connections over them (docs/adr/0046).

    The sockets are this process's: a web process that dies is started again on its socket, and
    the connections the kernel queued on it meanwhile wait instead of being refused. SIGTERM or
    SIGINT stops every web process with SIGTERM (daphne's graceful shutdown) and waits up to
    STOP_TIMEOUT (a second signal: no wait). Each web process runs in its own process group (a
    Ctrl-C at the terminal reaches only this one, which stops each once) and is killed if this
    process dies.
    """
    if ":" in host:  # daphne adopts a descriptor as IPv4 (its fd endpoint takes no address family)
        print("[web] HORDE_WEB_PROCESSES above 1 listens on an IPv4 address", file=sys.stderr, flush=True)
        return 2
    try:
        # A plain bind first: SO_REUSEPORT alone would let this launcher share a port that another
        # horde (the same user's) is serving, splitting its connections between the two.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
            port = probe.getsockname()[1]  # port 0: every socket on the port the probe got
        sockets = [_reuseport_socket(host, port) for _ in range(processes)]
    except OSError as exc:
        print(f"[web] cannot listen on {host}:{port}: {exc}", file=sys.stderr, flush=True)
        return 2

    stopping = force = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping, force
        force = stopping  # a second signal: do not wait for the graceful shutdown
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    def start(sock: socket.socket) -> subprocess.Popen[bytes]:
        fd = sock.fileno()
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "web", "--fd", str(fd), *daphne_args],
            cwd=ROOT, pass_fds=(fd,), process_group=0, preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )

    running = {index: (start(sock), time.monotonic()) for index, sock in enumerate(sockets)}
    print(f"[web] {processes} processes on http://{host}:{port}/ (pids "
          f"{', '.join(str(proc.pid) for proc, _ in running.values())})", file=sys.stderr, flush=True)
    status, quick_failures = 0, 0
    while not stopping:
        for index, (proc, started) in running.items():
            rc = proc.poll()
            if rc is None:
                continue
            quick_failures = quick_failures + 1 if time.monotonic() - started < WEB_START_SECONDS else 0
            if quick_failures >= WEB_START_FAILURES:
                print(f"[web] process {proc.pid} exited with {rc} at its start, {quick_failures} times "
                      "in a row: stopping", file=sys.stderr, flush=True)
                status, stopping = (128 - rc if rc < 0 else rc or 1), True
                break
            running[index] = (start(sockets[index]), time.monotonic())
            print(f"[web] process {proc.pid} exited with {rc}: started {running[index][0].pid} "
                  "on its socket", file=sys.stderr, flush=True)
        else:
            time.sleep(0.2)

    for proc, _ in running.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while any(proc.poll() is None for proc, _ in running.values()):
        if force or time.monotonic() > deadline:
            for proc, _ in running.values():
                if proc.poll() is None:
                    print(f"[web] process {proc.pid} still running: killing", file=sys.stderr, flush=True)
                    proc.kill()
                    proc.wait()
            break
        time.sleep(0.1)
    return status


# How long the launcher waits for the web process's first answer before it starts the demo worker
# anyway (which then retries on its own).
WEB_READY_SECONDS = 60.0


def wait_until_serving(port: str, web: subprocess.Popen[bytes], stopping: Callable[[], bool]) -> bool:
    """True once the web process answers an HTTP request on `port` (any status: /healthz may say
    the sweeps have not run yet); False if it exits, the launcher is stopping, or WEB_READY_SECONDS pass."""
    deadline = time.monotonic() + WEB_READY_SECONDS
    while web.poll() is None and not stopping() and time.monotonic() < deadline:
        connection = http.client.HTTPConnection("127.0.0.1", int(port), timeout=2)
        try:
            connection.request("GET", "/healthz")
            connection.getresponse().read()
            return True
        except (OSError, http.client.HTTPException):
            time.sleep(0.1)
        finally:
            connection.close()
    return False


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


def _manage(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, capture_output=True, text=True, check=False, env=env
    )


def demo_worker_key() -> str | None:
    """The demo worker's API key: the stored one while the database knows it; else a new key for
    the user that owns the worker `demo-worker` (a lost key file, or a database another checkout
    made: a new user's pops under that name would be refused); else a new user's.

    None (and a message) when no key can be had, e.g. before `manage.py migrate`.
    """
    if DEMO_WORKER_KEY_FILE.exists():
        key = DEMO_WORKER_KEY_FILE.read_text().strip()
        if key:
            checked = _manage("shell", "--no-imports", "-c", _KEY_CHECK, env={**os.environ, "HORDE_DEMO_WORKER_KEY": key})
            if checked.returncode == 0:
                return key
            if checked.returncode != KEY_UNKNOWN:  # not an answer about the key: make no second user
                return _no_key(f"could not check the stored key in {DEMO_WORKER_KEY_FILE}", checked)
    renewed = _manage("worker_owner_key", DEMO_WORKER_NAME, "--owner-username", DEMO_WORKER_USER)
    if renewed.returncode == 0:
        return _store_key(renewed, f"gave the owner of the worker {DEMO_WORKER_NAME!r} a new key")
    if renewed.returncode != NO_SUCH_WORKER:
        return _no_key(f"could not renew the key of the worker {DEMO_WORKER_NAME!r}'s owner", renewed)
    made = _manage("horde_user", "create", DEMO_WORKER_USER, "--trusted")
    if made.returncode != 0:
        return _no_key(f"could not create the user {DEMO_WORKER_USER!r} (run `manage.py migrate`?)", made)
    return _store_key(made, f"created the user {DEMO_WORKER_USER!r}")


def _no_key(why: str, ran: subprocess.CompletedProcess[str]) -> None:
    print(f"[run] demo: {why}:\n{ran.stderr.strip()[-2000:]}", file=sys.stderr, flush=True)
    return None


def _store_key(ran: subprocess.CompletedProcess[str], done: str) -> str | None:
    """The key a command printed on its last line, kept in the key file."""
    lines = ran.stdout.strip().splitlines()
    if not lines:
        return _no_key(f"{done}, but printed no key", ran)
    key = lines[-1].strip()
    DEMO_WORKER_KEY_FILE.write_text(key + "\n")
    DEMO_WORKER_KEY_FILE.chmod(0o600)
    print(f"[run] demo: {done}; its key is in {DEMO_WORKER_KEY_FILE}", file=sys.stderr, flush=True)
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

    def start(name: str) -> None:
        print(f"[run] {name}: {' '.join(cmds[name])}", file=sys.stderr, flush=True)
        children[name] = subprocess.Popen(
            cmds[name], cwd=ROOT, process_group=0, env=envs.get(name),
            preexec_fn=functools.partial(_stop_with_parent, os.getpid()),
        )

    for name in [name for name in cmds if name != "demo"]:
        start(name)
    # The demo worker starts once the web process answers: started with it, its first calls met a
    # port not served yet ("horde unreachable" at every start) and its backoff delayed its pops.
    if wait_until_serving(port, children["web"], lambda: stopping):
        print(f"[run] serving on http://127.0.0.1:{port}/ (Ctrl-C stops)", file=sys.stderr, flush=True)
    elif not stopping and children["web"].poll() is None:
        print(f"[run] the web process does not answer after {WEB_READY_SECONDS:.0f} s", file=sys.stderr, flush=True)
    if "demo" in cmds and not stopping and children["web"].poll() is None:
        start("demo")
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

    for names, timeout in STOP_STAGES:
        stop_children({name: proc for name, proc in children.items() if name in names}, timeout, lambda: force)
    print("[run] stopped", file=sys.stderr, flush=True)
    return status


# The demo worker stops first, while the web process still takes its submits: the jobs it holds
# are submitted and reach the clients waiting for them, instead of failing against a stopped web
# process until the demo worker is killed. Then the web process and Celery, together.
STOP_STAGES: tuple[tuple[tuple[str, ...], float], ...] = (
    (("demo",), DEMO_STOP_TIMEOUT),
    (("web", "celery"), STOP_TIMEOUT),
)


def stop_children(children: dict[str, subprocess.Popen[bytes]], timeout: float, force: Callable[[], bool]) -> None:
    """SIGTERM to each child still running, then wait up to `timeout` seconds (none once `force`
    says so: a second Ctrl-C) and kill what is left."""
    for proc in children.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(proc.poll() is None for proc in children.values()):
        if force() or time.monotonic() > deadline:
            for name, proc in children.items():
                if proc.poll() is None:
                    print(f"[run] {name} still running: killing", file=sys.stderr, flush=True)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            break
        time.sleep(0.1)


USAGE = """usage: scripts/run.py            the web process, Celery with beat and the demo worker (PORT, default 8000)
       scripts/run.py web ARGS   the web process alone: daphne's arguments, tuned (docs/deployment.md)"""


if __name__ == "__main__":
    if sys.argv[1:2] == ["web"]:
        sys.exit(serve_web(sys.argv[2:]))
    if sys.argv[1:]:
        # Anything else (--help included) starts nothing: the whole stack on port 8000 is no answer to it.
        help_asked = sys.argv[1] in ("-h", "--help")
        print(USAGE, file=sys.stdout if help_asked else sys.stderr)
        sys.exit(0 if help_asked else 2)
    sys.exit(main())
