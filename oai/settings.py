"""The front's settings: read from the environment by one reader, `load_settings`, in both the mounted
(the horde's web process serves /v1/) and the standalone (`python -m oai`) deployments. Every variable
is listed in docs/configuration.md ("The OpenAI front")."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import environ

from contract.chat_limits import MAX_CHAT_BODY_BYTES
from contract.front_lease import FRONT_LEASE_RENEW_SECONDS, FRONT_LEASE_TTL_SECONDS


# Values are cast by django-environ, as the horde's settings are (hordesite/settings.py), so a
# variable reads the same on both sides (booleans: true/on/ok/y/yes/1, or a non-zero number, are
# true, anything else, an empty value included, false). An empty number or list counts as unset.
def _value(env: Mapping[str, str], name: str, cast: type, default):
    raw = env.get(name)
    return default if raw in (None, "") else environ.Env.parse_value(raw, cast)


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    return default if raw is None else environ.Env.parse_value(raw, bool)


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    return _value(env, name, float, default)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    return _value(env, name, int, default)


def _list(env: Mapping[str, str], name: str, default: list[str]) -> list[str]:
    items = _value(env, name, list, default)
    return [item.strip().rstrip("/") for item in items if item.strip()]


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
    stream_redis_db: int = 7
    # Budgets and the wait.
    nonstream_timeout_seconds: float = 300.0
    stream_timeout_seconds: float = 600.0
    fail_fast_grace_seconds: float = 20.0
    signal_recheck_seconds: float = 5.0
    poll_seconds: float = 1.0
    signal_ping_seconds: float = 5.0
    keepalive_seconds: float = 10.0
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
    # Telemetry (off by default).
    telemetry_enabled: bool = False
    otel_sdk_disabled: bool = False
    service_name: str = "horde-oai"
    pyroscope_enabled: bool = False


def load_settings(env: Mapping[str, str] | None = None) -> FrontSettings:
    """The one reader of the front's environment."""
    env = os.environ if env is None else env
    port = env.get("PORT") or "8000"
    redis_url = env.get("HORDE_OAI_REDIS_URL")
    if redis_url is None:  # unset: the horde's own Redis, where the completion signal is published
        redis_url = env.get("HORDE_CHAT_SIGNAL_REDIS_URL") or env.get("REDIS_URL") or ""
    return FrontSettings(
        native_roots=_list(env, "HORDE_OAI_NATIVE_ROOTS", [f"http://127.0.0.1:{port}/api/v2"]),
        native_timeout_seconds=_float(env, "HORDE_OAI_NATIVE_TIMEOUT_SECONDS", 10.0),
        native_max_connections=_int(env, "HORDE_OAI_NATIVE_MAX_CONNECTIONS", 200),
        native_in_process=_bool(
            env, "HORDE_OAI_NATIVE_IN_PROCESS", env.get("HORDE_OAI_NATIVE_ROOTS") in (None, "")
        ),
        redis_url=redis_url or None,
        stream_redis_db=_int(env, "HORDE_OAI_STREAM_REDIS_DB", 7),
        nonstream_timeout_seconds=_float(env, "HORDE_OAI_NONSTREAM_TIMEOUT_SECONDS", 300.0),
        stream_timeout_seconds=_float(env, "HORDE_OAI_STREAM_TIMEOUT_SECONDS", 600.0),
        fail_fast_grace_seconds=_float(env, "HORDE_OAI_FAIL_FAST_GRACE_SECONDS", 20.0),
        signal_recheck_seconds=_float(env, "HORDE_OAI_SIGNAL_RECHECK_SECONDS", 5.0),
        poll_seconds=_float(env, "HORDE_OAI_POLL_SECONDS", 1.0),
        signal_ping_seconds=_float(env, "HORDE_OAI_SIGNAL_PING_SECONDS", 5.0),
        keepalive_seconds=_float(env, "HORDE_OAI_KEEPALIVE_SECONDS", 10.0),
        cancel_timeout_seconds=_float(env, "HORDE_OAI_CANCEL_TIMEOUT_SECONDS", 1.5),
        cancel_retry_seconds=_float(env, "HORDE_OAI_CANCEL_RETRY_SECONDS", 30.0),
        cancel_max_connections=_int(env, "HORDE_OAI_CANCEL_MAX_CONNECTIONS", 20),
        front_lease_seconds=_int(env, "HORDE_OAI_FRONT_LEASE_SECONDS", FRONT_LEASE_TTL_SECONDS),
        front_lease_renew_seconds=_float(env, "HORDE_OAI_FRONT_LEASE_RENEW_SECONDS", FRONT_LEASE_RENEW_SECONDS),
        max_body_bytes=_int(env, "HORDE_OAI_MAX_BODY_BYTES", MAX_CHAT_BODY_BYTES),
        body_read_timeout_seconds=_float(env, "HORDE_OAI_BODY_READ_TIMEOUT_SECONDS", 30.0),
        max_inflight=_int(env, "HORDE_OAI_MAX_INFLIGHT", 2000),
        max_inflight_per_source=_int(env, "HORDE_OAI_MAX_INFLIGHT_PER_SOURCE", 50),
        trusted_proxy_count=_int(env, "HORDE_OAI_TRUSTED_PROXY_COUNT", 0),
        allow_anonymous=_bool(env, "HORDE_OAI_ALLOW_ANONYMOUS", True),
        # Rate limits.
        proxy_passkey=(env.get("HORDE_OAI_PROXY_PASSKEY") or "").strip(),
        rate_limit_wait_seconds=_float(env, "HORDE_OAI_RATE_LIMIT_WAIT_SECONDS", 5.0),
        host=env.get("HORDE_OAI_HOST") or "127.0.0.1",
        port=_int(env, "HORDE_OAI_PORT", 8001),
        telemetry_enabled=_bool(env, "HORDE_OAI_TELEMETRY_ENABLED", False),
        otel_sdk_disabled=_bool(env, "OTEL_SDK_DISABLED", False),
        service_name=env.get("OTEL_SERVICE_NAME") or "horde-oai",
        pyroscope_enabled=_bool(env, "PYROSCOPE_ENABLED", False),
    )
