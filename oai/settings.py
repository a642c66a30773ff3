"""The front's settings: read from the environment by one reader, `load_settings`, in both the mounted
(the horde's web process serves /v1/) and the standalone (`python -m oai`) deployments. Every variable
is listed in docs/configuration.md ("The OpenAI front")."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import environ

from contract.chat_limits import MAX_CHAT_BODY_BYTES
from contract.chat_signal import CHAT_SIGNAL_DB
from contract.env import SettingsEnv
from contract.front_lease import FRONT_LEASE_MAX_SECONDS, FRONT_LEASE_RENEW_SECONDS, FRONT_LEASE_TTL_SECONDS


def _reader(env: Mapping[str, str]) -> environ.Env:
    """django-environ's reader over `env`: the front casts a variable with the same calls as the
    horde's settings (hordesite/settings.py), so it reads the same on both sides (booleans:
    true/on/ok/y/yes/1, or a non-zero number, are true, anything else, an empty value included,
    false; an empty number is an error, as it is for the horde; lists are comma-separated)."""
    reader = SettingsEnv()
    reader.ENVIRON = env
    return reader


def _roots(value: list[str]) -> list[str]:
    return [item.strip().rstrip("/") for item in value if item.strip()]


@dataclass(frozen=True)
class TelemetrySettings:
    """OpenTelemetry and Pyroscope, with the Flask application's variables (upstream
    horde/telemetry.py), for every process of the horde: the web process, the Celery worker and
    `python -m oai` (oai.telemetry, docs/adr/0075)."""

    enabled: bool = False
    sdk_disabled: bool = False
    # OTEL_SERVICE_NAME; empty: the process's own (horde-web, horde-celery, horde-oai).
    service_name: str = ""
    # DEPLOYMENT_ENVIRONMENT; empty: unset (telemetry says "development" unless
    # OTEL_RESOURCE_ATTRIBUTES names one).
    deployment_environment: str = ""
    # The head sampling ratio of root spans, 0 to 1 (OTEL_TRACES_SAMPLER_ARG), unless
    # OTEL_TRACES_SAMPLER names a sampler for the SDK to build.
    traces_sample_ratio: float = 1.0
    traces_sampler: str = ""
    pyroscope_enabled: bool = False
    pyroscope_server_address: str = "http://localhost:4040"
    pyroscope_tenant_id: str | None = None
    # HORDE_TELEMETRY_STOP_SECONDS: the longest a clean stop waits for the last export of all the
    # providers together (a collector that is down or hangs would otherwise hold it for each
    # exporter's own timeout and retries; docs/adr/0088).
    stop_seconds: float = 5.0


@dataclass(frozen=True)
class FrontSettings:
    # The native API: one or more roots ending in /api/v2, tried in turn on a connection failure.
    native_roots: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000/api/v2"])
    native_timeout_seconds: float = 10.0
    native_max_connections: int = 200
    # Mounted in the horde's web process: call its native API in process (no TCP round trip) rather
    # than over HTTP to native_roots. load_settings turns it on when HORDE_OAI_NATIVE_ROOTS is unset.
    native_in_process: bool = False
    # Redis for the completion signal; None: waits poll the status route.
    redis_url: str | None = None
    stream_redis_db: int = CHAT_SIGNAL_DB
    # Budgets and the wait.
    nonstream_timeout_seconds: float = 300.0
    stream_timeout_seconds: float = 600.0
    fail_fast_grace_seconds: float = 20.0
    signal_recheck_seconds: float = 5.0
    poll_seconds: float = 1.0
    signal_ping_seconds: float = 5.0
    keepalive_seconds: float = 10.0
    # Relay the deltas of a streamed request with tools under tool_choice auto, none or absent; off:
    # such a request is delivered whole, as chat_front.md says (ADR 0098).
    relay_with_tools: bool = False
    # How long the output items of a Responses API reply stay referable by id (item_reference;
    # oai.response_items, ADR 0101); 0 keeps none.
    response_items_seconds: int = 21_600
    # Cancels.
    cancel_timeout_seconds: float = 1.5
    cancel_retry_seconds: float = 30.0
    cancel_max_connections: int = 20
    # The front lease on every request it waits for (contract.front_lease); 0 takes none.
    front_lease_seconds: int = FRONT_LEASE_TTL_SECONDS
    front_lease_renew_seconds: float = FRONT_LEASE_RENEW_SECONDS
    # Admission.
    max_body_bytes: int = MAX_CHAT_BODY_BYTES
    body_read_timeout_seconds: float = 30.0
    max_inflight: int = 2000
    max_inflight_per_source: int = 50
    trusted_proxy_count: int = 0
    allow_anonymous: bool = True
    # Rate limits (docs/adr/0015): the passkey the horde knows this front by (HORDE_PROXY_PASSKEYS),
    # sent with each submit's client address; and how long a submit may wait out the horde's
    # short-window rate limit before its 429 reaches the client.
    proxy_passkey: str = ""
    rate_limit_wait_seconds: float = 5.0
    # Standalone process.
    host: str = "127.0.0.1"
    port: int = 8001
    # Telemetry (off by default): oai.telemetry, for this and every other process of the horde.
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    log_level: str = "INFO"


# Any of these set turns telemetry on unless HORDE_TELEMETRY_ENABLED (or HORDE_OAI_TELEMETRY_ENABLED)
# says otherwise, as the Flask application's telemetry_enabled does.
OTLP_ENDPOINT_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)


def _sample_ratio(value: str) -> float:
    """OTEL_TRACES_SAMPLER_ARG as the Flask application reads it: a number clamped to 0..1, and 1
    (everything) when it is not a number."""
    try:
        ratio = float(value)
    except ValueError:
        return 1.0
    if math.isnan(ratio):
        return 1.0
    return max(0.0, min(1.0, ratio))


# The switch of every process's telemetry, and the front's name for it, still read (docs/adr/0075).
TELEMETRY_SWITCH = "HORDE_TELEMETRY_ENABLED"
FRONT_TELEMETRY_SWITCH = "HORDE_OAI_TELEMETRY_ENABLED"
TELEMETRY_STOP_SECONDS = "HORDE_TELEMETRY_STOP_SECONDS"


def load_telemetry_settings(env: Mapping[str, str] | None = None) -> TelemetrySettings:
    """The one reader of the telemetry variables, for every process (read once, at its start).
    HORDE_TELEMETRY_ENABLED decides, or HORDE_OAI_TELEMETRY_ENABLED, its older name, when it alone is
    set; both set and disagreeing is refused (ImproperlyConfigured) rather than one silently
    winning. Neither set (or empty): on when an OTLP endpoint is."""
    env = os.environ if env is None else env
    read = _reader(env)
    switches = {name: read.bool(name) for name in (TELEMETRY_SWITCH, FRONT_TELEMETRY_SWITCH) if env.get(name)}
    if len(set(switches.values())) > 1:
        raise environ.ImproperlyConfigured(
            f"{TELEMETRY_SWITCH} and {FRONT_TELEMETRY_SWITCH} disagree: set one (docs/configuration.md)"
        )
    if switches:
        enabled = next(iter(switches.values()))
    else:
        enabled = any(env.get(name) for name in OTLP_ENDPOINT_VARIABLES)
    stop_seconds = read.float(TELEMETRY_STOP_SECONDS, default=5.0)
    if stop_seconds <= 0:  # a stop must have a bound
        raise environ.ImproperlyConfigured(f"{TELEMETRY_STOP_SECONDS} must be a number of seconds above 0")
    return TelemetrySettings(
        enabled=enabled,
        sdk_disabled=read.bool("OTEL_SDK_DISABLED", default=False),
        service_name=read.str("OTEL_SERVICE_NAME", default="").strip(),
        deployment_environment=read.str("DEPLOYMENT_ENVIRONMENT", default=""),
        traces_sample_ratio=_sample_ratio(read.str("OTEL_TRACES_SAMPLER_ARG", default="1.0")),
        traces_sampler=read.str("OTEL_TRACES_SAMPLER", default=""),
        pyroscope_enabled=read.bool("PYROSCOPE_ENABLED", default=False),
        pyroscope_server_address=read.str("PYROSCOPE_SERVER_ADDRESS", default="http://localhost:4040"),
        pyroscope_tenant_id=read.str("PYROSCOPE_TENANT_ID", default="") or None,
        stop_seconds=stop_seconds,
    )


# The front's intervals that pace a loop, and its bounds on a native call and a cancel: each must be
# above 0 (a zero bound would send a call and give it no time to answer).
SECONDS_ABOVE_ZERO = (
    "HORDE_OAI_SIGNAL_RECHECK_SECONDS",
    "HORDE_OAI_POLL_SECONDS",
    "HORDE_OAI_SIGNAL_PING_SECONDS",
    "HORDE_OAI_KEEPALIVE_SECONDS",
    "HORDE_OAI_CANCEL_RETRY_SECONDS",
    "HORDE_OAI_FRONT_LEASE_RENEW_SECONDS",
    "HORDE_OAI_NATIVE_TIMEOUT_SECONDS",
    "HORDE_OAI_CANCEL_TIMEOUT_SECONDS",
)


def load_settings(env: Mapping[str, str] | None = None) -> FrontSettings:
    """The one reader of the front's environment."""
    env = os.environ if env is None else env
    read = _reader(env)
    port = read.str("PORT", default="") or "8000"
    redis_url = read.str("HORDE_OAI_REDIS_URL", default=None)
    if redis_url is None:  # unset: the horde's own Redis, where the completion signal is published
        redis_url = read.str("HORDE_CHAT_SIGNAL_REDIS_URL", default="") or read.str("REDIS_URL", default="")
    for name in SECONDS_ABOVE_ZERO:  # a zero would spin a loop: a waiter, a stream's keepalive, the retries
        if not read.float(name, default=1.0) > 0:  # nan too
            raise environ.ImproperlyConfigured(f"{name} must be a number of seconds above 0")
    # The horde takes a lease of 1 to FRONT_LEASE_MAX_SECONDS and ignores any other (no lease at all).
    front_lease_seconds = read.int("HORDE_OAI_FRONT_LEASE_SECONDS", default=FRONT_LEASE_TTL_SECONDS)
    if not 0 <= front_lease_seconds <= FRONT_LEASE_MAX_SECONDS:
        raise environ.ImproperlyConfigured(
            f"HORDE_OAI_FRONT_LEASE_SECONDS must be 0 (no lease) to {FRONT_LEASE_MAX_SECONDS}, not {front_lease_seconds}"
        )
    return FrontSettings(
        # Empty: the default root, as unset.
        native_roots=(
            _roots(read.list("HORDE_OAI_NATIVE_ROOTS", default=[])) or [f"http://127.0.0.1:{port}/api/v2"]
        ),
        native_timeout_seconds=read.float("HORDE_OAI_NATIVE_TIMEOUT_SECONDS", default=10.0),
        native_max_connections=read.int("HORDE_OAI_NATIVE_MAX_CONNECTIONS", default=200, minimum=1),
        native_in_process=read.bool(
            "HORDE_OAI_NATIVE_IN_PROCESS", default=env.get("HORDE_OAI_NATIVE_ROOTS") in (None, "")
        ),
        redis_url=redis_url or None,
        stream_redis_db=read.int("HORDE_OAI_STREAM_REDIS_DB", default=CHAT_SIGNAL_DB, minimum=0),
        nonstream_timeout_seconds=read.float("HORDE_OAI_NONSTREAM_TIMEOUT_SECONDS", default=300.0, above=0),
        stream_timeout_seconds=read.float("HORDE_OAI_STREAM_TIMEOUT_SECONDS", default=600.0, above=0),
        fail_fast_grace_seconds=read.float("HORDE_OAI_FAIL_FAST_GRACE_SECONDS", default=20.0, minimum=0),
        signal_recheck_seconds=read.float("HORDE_OAI_SIGNAL_RECHECK_SECONDS", default=5.0),
        poll_seconds=read.float("HORDE_OAI_POLL_SECONDS", default=1.0),
        signal_ping_seconds=read.float("HORDE_OAI_SIGNAL_PING_SECONDS", default=5.0),
        keepalive_seconds=read.float("HORDE_OAI_KEEPALIVE_SECONDS", default=10.0),
        relay_with_tools=read.bool("HORDE_OAI_RELAY_WITH_TOOLS", default=False),
        response_items_seconds=read.int("HORDE_OAI_RESPONSE_ITEMS_SECONDS", default=21_600, minimum=0),
        cancel_timeout_seconds=read.float("HORDE_OAI_CANCEL_TIMEOUT_SECONDS", default=1.5),
        cancel_retry_seconds=read.float("HORDE_OAI_CANCEL_RETRY_SECONDS", default=30.0),
        cancel_max_connections=read.int("HORDE_OAI_CANCEL_MAX_CONNECTIONS", default=20, minimum=1),
        front_lease_seconds=front_lease_seconds,
        front_lease_renew_seconds=read.float(
            "HORDE_OAI_FRONT_LEASE_RENEW_SECONDS", default=FRONT_LEASE_RENEW_SECONDS
        ),
        max_body_bytes=read.int("HORDE_OAI_MAX_BODY_BYTES", default=MAX_CHAT_BODY_BYTES, minimum=1),
        body_read_timeout_seconds=read.float("HORDE_OAI_BODY_READ_TIMEOUT_SECONDS", default=30.0, above=0),
        max_inflight=read.int("HORDE_OAI_MAX_INFLIGHT", default=2000, minimum=1),
        max_inflight_per_source=read.int("HORDE_OAI_MAX_INFLIGHT_PER_SOURCE", default=50, minimum=1),
        trusted_proxy_count=read.int("HORDE_OAI_TRUSTED_PROXY_COUNT", default=0, minimum=0),
        allow_anonymous=read.bool("HORDE_OAI_ALLOW_ANONYMOUS", default=True),
        # Rate limits.
        proxy_passkey=read.str("HORDE_OAI_PROXY_PASSKEY", default="").strip(),
        rate_limit_wait_seconds=read.float("HORDE_OAI_RATE_LIMIT_WAIT_SECONDS", default=5.0, minimum=0),
        host=read.str("HORDE_OAI_HOST", default="") or "127.0.0.1",
        port=read.int("HORDE_OAI_PORT", default=8001),
        telemetry=load_telemetry_settings(env),
        log_level=read.str("LOG_LEVEL", default="INFO"),
    )
