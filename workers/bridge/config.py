"""The bridge's settings: every flag has a BRIDGE_* environment variable; a flag wins over it."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from contract.chat_declaration import KNOWN_IMAGE_TRANSPORTS
from contract.chat_policy import KNOWN_CHAT_DECLARATIONS
from contract.text import MAX_WORKER_NAME_LENGTH, TEXT_POP_MAX_THREADS, TEXT_POP_WAIT_MAX_SECONDS
from workers.bridge.progress import DEFAULT_PROGRESS_INTERVAL

SCRIPTED = "scripted"
BACKEND_KINDS = ("auto", "llamacpp", "vllm", "ollama", "koboldcpp", "tabbyapi", "openai")


@dataclass
class BridgeConfig:
    horde_url: str = "http://127.0.0.1:8000"
    api_key: str = ""
    worker_name: str = ""
    backend: str = SCRIPTED  # "scripted", or the backend's OpenAI base URL (http://host:port/v1)
    backend_key: str | None = None
    backend_kind: str = "auto"
    model: str | None = None  # the backend's model id; default: the first it lists
    horde_model: str | None = None  # the name declared to the horde; default: the backend model id
    threads: int = 1
    max_length: int = 512  # chat and text jobs
    max_context_length: int | None = None  # default: what the backend reports, else 4096
    # Ollama: seconds between reads of the context it holds the model with (/api/ps); 0: at start only.
    context_check_interval: float = 60.0
    # Divide a context the backend's slots may share among the jobs run at once (llama.cpp).
    context_split: bool = True
    chat_jobs: bool = True
    text_jobs: bool = True
    add_features: set[str] = field(default_factory=set)
    remove_features: set[str] = field(default_factory=set)
    image_transports: set[str] | None = None  # None: what the backend can take
    tools_max_temperature: float | None = None
    nsfw: bool = False
    pop_interval: float = 1.0  # seconds between idle pops, per thread
    pop_wait: int = 10  # seconds the horde may hold an empty pop for a job (ADR 0024); 0: never
    lease_margin: float = 5.0  # stop working on a job this long before its lease ends
    stop_grace: float = 30.0  # on SIGINT/SIGTERM, finish held jobs for this long, then fault them
    backend_timeout: float = 600.0
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL  # streamed jobs: seconds between progress posts
    max_jobs: int | None = None  # stop after this many jobs (tests, bench)
    quiet: bool = False  # no progress line per job

    @property
    def is_scripted(self) -> bool:
        return self.backend == SCRIPTED


def _env_bool(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _names(values: Sequence[str] | None) -> list[str]:
    """Comma- or space-separated names, repeatable."""
    out: list[str] = []
    for value in values or ():
        out.extend(part for part in value.replace(",", " ").split() if part)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m workers.bridge",
        description=(
            "The horde's reference worker: serves chat and text jobs from an OpenAI-compatible "
            "backend (llama.cpp server, vLLM, Ollama, koboldcpp, TabbyAPI), or from the built-in "
            "`scripted` backend (no LLM). Every option also reads BRIDGE_<OPTION> from the environment."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = BridgeConfig()
    add = parser.add_argument
    add("--horde-url", default=d.horde_url, help="the horde's root (BRIDGE_HORDE_URL)")
    add("--api-key", default=None, help="the worker owner's horde API key (BRIDGE_API_KEY)")
    add(
        "--name",
        dest="worker_name",
        default=None,
        help=f"worker name, 1 to {MAX_WORKER_NAME_LENGTH} characters (BRIDGE_WORKER_NAME); default: horde-bridge@host",
    )
    add(
        "--backend",
        default=d.backend,
        help="`scripted`, or the backend's OpenAI base URL, e.g. http://127.0.0.1:8080/v1 (BRIDGE_BACKEND)",
    )
    add("--backend-key", default=None, help="bearer key for the backend (BRIDGE_BACKEND_KEY)")
    add("--backend-kind", default=d.backend_kind, choices=BACKEND_KINDS, help="what serves the backend (BRIDGE_BACKEND_KIND)")
    add("--model", default=None, help="the backend's model id (BRIDGE_MODEL); default: the first it lists")
    add(
        "--horde-model",
        default=None,
        help="the model name declared to the horde (BRIDGE_HORDE_MODEL); default: the backend's model id "
        "(its file name when the id is a path)",
    )
    add("--threads", type=int, default=d.threads,
        help=f"jobs at once, 1 to {TEXT_POP_MAX_THREADS} (BRIDGE_THREADS); never more than the backend's slots")
    add("--max-length", type=int, default=d.max_length, help="largest reply in tokens, at least 16 (BRIDGE_MAX_LENGTH)")
    add(
        "--max-context-length",
        type=int,
        default=None,
        help="context in tokens of each job, at least 80 (BRIDGE_MAX_CONTEXT_LENGTH); default: what the backend reports "
        "(divided among --threads where the slots may share it; Ollama: the context it loaded the model with, "
        "else its smallest default), else 4096",
    )
    add(
        "--context-check-interval",
        type=float,
        default=d.context_check_interval,
        help="Ollama: seconds between reads of the context it holds the model with (/api/ps), declared on the "
        "next pop; also read after a job that faulted or was cut at its length; 0: at start only "
        "(BRIDGE_CONTEXT_CHECK_INTERVAL)",
    )
    add(
        "--no-context-split",
        dest="context_split",
        action="store_false",
        default=None,
        help="declare the context the backend reports for each job run at once instead of dividing it "
        "among them; for llama-server with --no-kv-unified, whose /props already reports a slot's own "
        "cache (BRIDGE_CONTEXT_SPLIT=0)",
    )
    add("--no-chat", dest="chat_jobs", action="store_false", default=None, help="do not take chat jobs (BRIDGE_CHAT_JOBS=0)")
    add("--no-text", dest="text_jobs", action="store_false", default=None, help="do not take text jobs (BRIDGE_TEXT_JOBS=0)")
    add(
        "--feature",
        action="append",
        default=None,
        help="declare a feature or guarantee the probe did not find, repeatable (BRIDGE_FEATURES); "
        "only declare what the backend really does",
    )
    add("--no-feature", action="append", default=None, help="withdraw a feature or guarantee (BRIDGE_NO_FEATURES)")
    add(
        "--image-transports",
        default=None,
        help="comma list of url, base64, messages_url (BRIDGE_IMAGE_TRANSPORTS); default: what the backend takes",
    )
    add("--tools-max-temperature", type=float, default=None, help="(BRIDGE_TOOLS_MAX_TEMPERATURE)")
    add("--nsfw", action="store_true", default=None, help="accept NSFW requests (BRIDGE_NSFW)")
    add("--pop-interval", type=float, default=d.pop_interval, help="seconds between idle pops (BRIDGE_POP_INTERVAL)")
    add(
        "--pop-wait",
        type=int,
        default=d.pop_wait,
        help=f"seconds an idle pop waits at the horde for a job, 0 to {TEXT_POP_WAIT_MAX_SECONDS}; 0: poll every "
        "--pop-interval (BRIDGE_POP_WAIT)",
    )
    add("--lease-margin", type=float, default=d.lease_margin, help="give a job up this long before its lease ends (BRIDGE_LEASE_MARGIN)")
    add("--stop-grace", type=float, default=d.stop_grace, help="on SIGINT/SIGTERM, seconds to finish held jobs (BRIDGE_STOP_GRACE)")
    add("--backend-timeout", type=float, default=d.backend_timeout,
        help="seconds any one read from the backend may wait, more than 0 (BRIDGE_BACKEND_TIMEOUT)")
    add(
        "--progress-interval",
        type=float,
        default=d.progress_interval,
        help="streamed jobs: seconds between progress posts, 0 to 60; 0 posts each backend delta (BRIDGE_PROGRESS_INTERVAL)",
    )
    add("--max-jobs", type=int, default=None, help="stop after this many jobs (BRIDGE_MAX_JOBS)")
    add("--quiet", action="store_true", default=None, help="no progress line per job (BRIDGE_QUIET)")
    return parser


# flag attribute -> (environment variable, converter)
_ENV: dict[str, tuple[str, object]] = {
    "horde_url": ("BRIDGE_HORDE_URL", str),
    "api_key": ("BRIDGE_API_KEY", str),
    "worker_name": ("BRIDGE_WORKER_NAME", str),
    "backend": ("BRIDGE_BACKEND", str),
    "backend_key": ("BRIDGE_BACKEND_KEY", str),
    "backend_kind": ("BRIDGE_BACKEND_KIND", str),
    "model": ("BRIDGE_MODEL", str),
    "horde_model": ("BRIDGE_HORDE_MODEL", str),
    "threads": ("BRIDGE_THREADS", int),
    "max_length": ("BRIDGE_MAX_LENGTH", int),
    "max_context_length": ("BRIDGE_MAX_CONTEXT_LENGTH", int),
    "context_check_interval": ("BRIDGE_CONTEXT_CHECK_INTERVAL", float),
    "context_split": ("BRIDGE_CONTEXT_SPLIT", _env_bool),
    "chat_jobs": ("BRIDGE_CHAT_JOBS", _env_bool),
    "text_jobs": ("BRIDGE_TEXT_JOBS", _env_bool),
    "feature": ("BRIDGE_FEATURES", lambda v: [v]),
    "no_feature": ("BRIDGE_NO_FEATURES", lambda v: [v]),
    "image_transports": ("BRIDGE_IMAGE_TRANSPORTS", str),
    "tools_max_temperature": ("BRIDGE_TOOLS_MAX_TEMPERATURE", float),
    "nsfw": ("BRIDGE_NSFW", _env_bool),
    "pop_interval": ("BRIDGE_POP_INTERVAL", float),
    "pop_wait": ("BRIDGE_POP_WAIT", int),
    "lease_margin": ("BRIDGE_LEASE_MARGIN", float),
    "stop_grace": ("BRIDGE_STOP_GRACE", float),
    "backend_timeout": ("BRIDGE_BACKEND_TIMEOUT", float),
    "progress_interval": ("BRIDGE_PROGRESS_INTERVAL", float),
    "max_jobs": ("BRIDGE_MAX_JOBS", int),
    "quiet": ("BRIDGE_QUIET", _env_bool),
}


class ConfigError(ValueError):
    pass


# Options whose value is a key: a horde key is token_urlsafe and may start with "-", which argparse
# would take for an option in `--api-key -Xq3...`.
_KEY_OPTIONS = ("--api-key", "--backend-key")


def _keys_joined(argv: Sequence[str]) -> list[str]:
    """`--api-key VALUE` as `--api-key=VALUE`, so a value that starts with "-" stays the value."""
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        value = next(args, None) if arg in _KEY_OPTIONS else None
        out.append(arg if value is None else f"{arg}={value}")
    return out


def _given_flags(argv: Sequence[str] | None) -> set[str]:
    """The options on the command line, whatever their value: one that repeats its default still
    wins over its BRIDGE_* variable."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> BridgeConfig:
    """Flags first, then BRIDGE_* variables, then the defaults."""
    environ = os.environ if environ is None else environ
    argv = _keys_joined(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    given = _given_flags(argv)
    for attr, (env, convert) in _ENV.items():
        if attr not in given and environ.get(env):
            try:
                values[attr] = convert(environ[env])  # type: ignore[operator]
            except ValueError as error:
                raise ConfigError(f"{env}: {error}") from None
    config = BridgeConfig(
        horde_url=values["horde_url"].rstrip("/"),
        api_key=values["api_key"] or "",
        worker_name=values["worker_name"] or f"horde-bridge@{socket.gethostname()}"[:MAX_WORKER_NAME_LENGTH],
        backend=values["backend"],
        backend_key=values["backend_key"],
        backend_kind=values["backend_kind"],
        model=values["model"],
        horde_model=values["horde_model"],
        threads=values["threads"],
        max_length=values["max_length"],
        max_context_length=values["max_context_length"],
        context_check_interval=values["context_check_interval"],
        context_split=values["context_split"] is not False,
        chat_jobs=values["chat_jobs"] is not False,
        text_jobs=values["text_jobs"] is not False,
        add_features=set(_names(values["feature"])),
        remove_features=set(_names(values["no_feature"])),
        image_transports=set(_names([values["image_transports"]])) if values["image_transports"] is not None else None,
        tools_max_temperature=values["tools_max_temperature"],
        nsfw=bool(values["nsfw"]),
        pop_interval=values["pop_interval"],
        pop_wait=values["pop_wait"],
        lease_margin=values["lease_margin"],
        stop_grace=values["stop_grace"],
        backend_timeout=values["backend_timeout"],
        progress_interval=values["progress_interval"],
        max_jobs=values["max_jobs"],
        quiet=bool(values["quiet"]),
    )
    validate(config)
    return config


def _is_http_url(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def validate(config: BridgeConfig) -> None:
    if not config.api_key:
        raise ConfigError("a worker needs its owner's API key: --api-key or BRIDGE_API_KEY")
    if not _is_http_url(config.horde_url):
        raise ConfigError(f"--horde-url is an http:// or https:// URL, not {config.horde_url!r}")
    if not config.is_scripted and not _is_http_url(config.backend):
        raise ConfigError(f"--backend is `scripted` or an http:// or https:// URL, not {config.backend!r}")
    # `not x > 0` also refuses nan. A 0 timeout is no "no timeout": every backend read would fail at once.
    if not config.backend_timeout > 0:
        raise ConfigError("--backend-timeout is more than 0 seconds")
    if not config.pop_interval > 0:
        raise ConfigError("--pop-interval is more than 0 seconds")
    if not config.lease_margin >= 0:
        raise ConfigError("--lease-margin is 0 or more seconds")
    if not config.stop_grace >= 0:
        raise ConfigError("--stop-grace is 0 or more seconds")
    if config.backend_kind not in BACKEND_KINDS:
        raise ConfigError(f"--backend-kind is one of {', '.join(BACKEND_KINDS)}")
    if not 1 <= config.threads <= TEXT_POP_MAX_THREADS:
        raise ConfigError(f"--threads is 1 to {TEXT_POP_MAX_THREADS}")
    if not 0 <= config.pop_wait <= TEXT_POP_WAIT_MAX_SECONDS:
        raise ConfigError(f"--pop-wait is 0 to {TEXT_POP_WAIT_MAX_SECONDS}")
    if config.max_length < 16:
        raise ConfigError("--max-length is at least 16")
    if config.max_context_length is not None and config.max_context_length < 80:
        raise ConfigError("--max-context-length is at least 80")
    if config.context_check_interval < 0:
        raise ConfigError("--context-check-interval is 0 or more seconds")
    if config.max_jobs is not None and config.max_jobs < 1:
        raise ConfigError("--max-jobs is at least 1")
    if not 0 <= config.progress_interval <= 60:
        raise ConfigError("--progress-interval is 0 to 60 seconds")
    if not config.chat_jobs and not config.text_jobs:
        raise ConfigError("--no-chat and --no-text together leave nothing to serve")
    unknown = (config.add_features | config.remove_features) - KNOWN_CHAT_DECLARATIONS
    if unknown:
        raise ConfigError(
            f"unknown feature(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(KNOWN_CHAT_DECLARATIONS))}"
        )
    if config.image_transports is not None and config.image_transports - KNOWN_IMAGE_TRANSPORTS:
        raise ConfigError(f"--image-transports takes {', '.join(sorted(KNOWN_IMAGE_TRANSPORTS))}")
    if not config.worker_name.strip() or len(config.worker_name) > MAX_WORKER_NAME_LENGTH:
        raise ConfigError(f"--name is 1 to {MAX_WORKER_NAME_LENGTH} characters")
