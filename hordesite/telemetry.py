"""Telemetry of the horde's own processes (docs/adr/0075): the web process, set up by the launcher
(scripts/run.py serve_daphne) after the application is loaded, and each Celery process that runs
tasks (hordesite.celery's signals). The set-up is the front's (oai.telemetry), so the web process
exports chat/metrics.py's instruments and the mounted front's alike, with the front's histogram
views. Nothing is set up at import: tests and other programs that import hordesite.asgi or
hordesite.celery configure no provider."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from oai.settings import TelemetrySettings, load_telemetry_settings
from oai.telemetry import configure_telemetry, shutdown_telemetry

WEB_SERVICE_NAME = "horde-web"
CELERY_SERVICE_NAME = "horde-celery"

# The telemetry variables, read once as the process starts (hordesite imports this module through
# hordesite.celery): a contradiction among them stops it there (docs/configuration.md, Telemetry).
# A Celery pool process inherits what its worker read.
TELEMETRY_SETTINGS = load_telemetry_settings()


def start_web_telemetry(
    settings: TelemetrySettings | None = None, *, metric_readers: Sequence[Any] = ()
) -> bool:
    """At a web process's start: its providers (service name horde-web unless OTEL_SERVICE_NAME
    sets another), and the mounted front's native calls as client spans. Returns whether
    OpenTelemetry is on."""
    on = configure_telemetry(
        settings or TELEMETRY_SETTINGS, default_service_name=WEB_SERVICE_NAME, metric_readers=metric_readers
    )
    if on:
        from oai import state as front_state

        front_state.configure_front(propagate=True)
    return on


def start_celery_telemetry(settings: TelemetrySettings | None = None) -> bool:
    """In a Celery process that runs tasks, before its first task (a prefork child, after its fork;
    or the worker itself under a pool without children, after it forked its embedded beat):
    service name horde-celery unless OTEL_SERVICE_NAME sets another."""
    return configure_telemetry(settings or TELEMETRY_SETTINGS, default_service_name=CELERY_SERVICE_NAME)


class _CeleryTelemetryStart:
    """The process whose Celery telemetry was started (its pid), so that each task's check costs a
    comparison: a forked child has another pid and starts its own."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.lock = threading.Lock()  # the threads pool's first tasks may start together

    def once(self) -> None:
        if self.pid == os.getpid():
            return
        with self.lock:
            if self.pid != os.getpid():
                start_celery_telemetry()
                self.pid = os.getpid()


_celery_start = _CeleryTelemetryStart()


def start_celery_telemetry_once() -> None:
    """start_celery_telemetry in this process, unless it already ran here (hordesite.celery calls it
    before each task)."""
    _celery_start.once()


def stop_telemetry() -> None:
    """At a clean stop: the last metrics and spans exported (bounded; nothing when telemetry is off)."""
    shutdown_telemetry()
