"""OpenTelemetry and Pyroscope for every process of the horde (docs/adr/0075): the web process
(scripts/run.py web, with the front mounted at /v1/), each Celery worker process (hordesite.celery)
and the standalone front (`python -m oai`). One set-up, the same variables (oai.settings.
load_telemetry_settings), a default service name per kind of process.

Called once per process at its start, after any fork: the SDK's providers hold export threads and a
random service.instance.id, which a forked child must not share with its parent. Off (the default),
nothing here is imported beyond this module, and every instrument stays the API's no-op.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from oai.settings import TelemetrySettings

FRONT_SERVICE_NAME = "horde-oai"
DEFAULT_DEPLOYMENT_ENVIRONMENT = "development"  # the Flask application's
log = logging.getLogger("oai")


@dataclass
class ProcessTelemetry:
    """How to stop the providers this process configured, for its stop's flush (no `global`)."""

    stops: list[Callable[[], Any]] = field(default_factory=list)
    pid: int | None = None  # the process whose providers these are
    # The longest the stop waits for all the providers' last exports (HORDE_TELEMETRY_STOP_SECONDS).
    stop_seconds: float = 5.0

    def running(self) -> bool:
        return bool(self.stops) and self.pid == os.getpid()

    def shutdown(self) -> None:
        """Export what was recorded since the last export, and stop the export threads, waiting at
        most stop_seconds: each exporter's own timeout and retries (10 s and up, one after the
        other) would otherwise hold a stop for as long as a collector is down or hangs. What is not
        exported by then is dropped, and the process goes on stopping. Once: a second call (the
        atexit fallback after the process's own stop) finds nothing to do."""
        stops, self.stops = self.stops, []
        if self.pid != os.getpid() or not stops:
            return  # a forked child's copies: the parent's to export, under the parent's id
        last_exports = threading.Thread(target=_stop_each, args=(stops,), name="telemetry-stop", daemon=True)
        last_exports.start()
        last_exports.join(self.stop_seconds)
        if last_exports.is_alive():
            log.warning(
                "telemetry: the last export did not finish within %g s (HORDE_TELEMETRY_STOP_SECONDS): "
                "is the OTLP collector down? What it held is dropped",
                self.stop_seconds,
            )


def _stop_each(stops: list[Callable[[], Any]]) -> None:
    for stop in stops:
        try:
            stop()
        except Exception:
            log.exception("telemetry: a provider's shutdown failed")


process_telemetry = ProcessTelemetry()


def configure_telemetry(
    settings: TelemetrySettings, *, default_service_name: str, metric_readers: Sequence[Any] = ()
) -> bool:
    """OpenTelemetry (traces and metrics, with the front's histogram views, and the front's
    finished-request line as logs) when telemetry is enabled and OTEL_SDK_DISABLED is not; Pyroscope
    when PYROSCOPE_ENABLED is true, also with the SDK disabled. The variables, resource attributes
    and sampling are the Flask application's (upstream horde/telemetry.py), with
    `default_service_name` unless OTEL_SERVICE_NAME sets another. `metric_readers` are added to the
    OTLP exporter's (tests read the provider with an in-memory reader). Returns whether
    OpenTelemetry is on. Once per process: a second call while this process's providers run (Celery's
    solo pool signals both a worker's and a pool process's start) changes nothing."""
    if process_telemetry.running():
        return True
    service_name = settings.service_name or default_service_name
    sdk_on = settings.enabled and not settings.sdk_disabled
    span_processors = start_pyroscope(settings, service_name=service_name, span_profiles=sdk_on)
    if not sdk_on:
        return False
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    from oai import asgi
    from oai import metrics as front_metrics

    resource = telemetry_resource(settings, service_name=service_name)
    readers: list[Any] = list(metric_readers)
    # A root span is kept with the ratio's probability; a child follows its parent's decision.
    # OTEL_TRACES_SAMPLER, when set, is the SDK's to build (sampler None); else the ratio's sampler.
    sampler = None if settings.traces_sampler else ParentBasedTraceIdRatio(settings.traces_sample_ratio)
    # The providers' own atexit hooks are off: the process's stop flushes them (process_telemetry),
    # with atexit as the fallback, so each is shut down once.
    tracer_provider = TracerProvider(resource=resource, sampler=sampler, shutdown_on_exit=False)
    for processor in span_processors:
        tracer_provider.add_span_processor(processor)
    try:  # the OTLP exporters are optional: without them the SDK records and exports nothing
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    except ImportError:
        log.warning("opentelemetry-exporter-otlp-proto-http is not installed: telemetry is recorded but not exported")
    meter_provider = MeterProvider(
        resource=resource, metric_readers=readers, views=front_metrics.histogram_views(), shutdown_on_exit=False
    )
    metrics.set_meter_provider(meter_provider)
    trace.set_tracer_provider(tracer_provider)
    asgi.set_tracer(trace.get_tracer("horde.oai"))
    logger_provider = _logger_provider(resource)
    bridge_request_log(logger_provider)
    # The meter provider last: its shutdown collects once more, after the spans' and logs' flush.
    # All three within the stop's bound (ProcessTelemetry.shutdown).
    process_telemetry.pid = os.getpid()
    process_telemetry.stop_seconds = settings.stop_seconds
    process_telemetry.stops = [
        tracer_provider.shutdown,
        logger_provider.shutdown,
        lambda: meter_provider.shutdown(timeout_millis=settings.stop_seconds * 1000),
    ]
    atexit.unregister(process_telemetry.shutdown)  # registered once, however often a test configures
    atexit.register(process_telemetry.shutdown)
    return True


def shutdown_telemetry() -> None:
    """At a process's clean stop: the last metrics, spans and logs exported (bounded)."""
    process_telemetry.shutdown()


def telemetry_resource(settings: TelemetrySettings, *, service_name: str) -> Any:
    """The resource the Flask application's Logfire set-up gives its telemetry: the service name,
    the deployment environment (DEPLOYMENT_ENVIRONMENT) and an id of this process; the SDK adds
    OTEL_RESOURCE_ATTRIBUTES."""
    from opentelemetry.sdk.resources import Resource

    attributes = {"service.name": service_name, "service.instance.id": uuid.uuid4().hex}
    if settings.deployment_environment:
        attributes["deployment.environment.name"] = settings.deployment_environment
    # The default environment only where neither DEPLOYMENT_ENVIRONMENT nor OTEL_RESOURCE_ATTRIBUTES
    # names one: a merged resource's attributes win over the one it is merged into.
    return Resource({"deployment.environment.name": DEFAULT_DEPLOYMENT_ENVIRONMENT}).merge(Resource.create(attributes))


def start_pyroscope(settings: TelemetrySettings, *, service_name: str, span_profiles: bool) -> list[Any]:
    """Pyroscope, as the Flask application starts it, when PYROSCOPE_ENABLED is true: the service
    name as the application name, PYROSCOPE_SERVER_ADDRESS, PYROSCOPE_TENANT_ID and the environment
    tag. Returns the span processor that links spans to profiles when `span_profiles` (the SDK is
    on) and pyroscope.otel is installed. A failure is logged, never raised: profiling is not worth
    the process."""
    if not settings.pyroscope_enabled:
        return []
    try:
        import pyroscope

        pyroscope.configure(
            application_name=service_name,
            server_address=settings.pyroscope_server_address,
            tags={"environment": settings.deployment_environment or DEFAULT_DEPLOYMENT_ENVIRONMENT},
            tenant_id=settings.pyroscope_tenant_id,
        )
    except ImportError:
        log.warning("PYROSCOPE_ENABLED is set but the pyroscope package is not installed: profiling is off")
        return []
    except Exception:
        log.exception("Pyroscope could not be started: profiling is off")
        return []
    if not span_profiles:
        return []
    try:
        from pyroscope.otel import PyroscopeSpanProcessor

        return [PyroscopeSpanProcessor()]
    except ImportError:
        log.warning("pyroscope-otel is not installed: spans are not linked to profiles")
    except Exception:
        log.exception("Pyroscope's span processor could not be made: spans are not linked to profiles")
    return []


def _logger_provider(resource: Any) -> Any:
    from opentelemetry._logs import set_logger_provider
    from opentelemetry.sdk._logs import LoggerProvider

    provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
    # Without the OTLP exporters nothing is exported; configure_telemetry already warned.
    with contextlib.suppress(ImportError):
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

        provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter()))
    set_logger_provider(provider)
    return provider


def bridge_request_log(logger_provider: Any) -> None:
    """The finished-request line to OpenTelemetry logs, its fields (the record's extra) as the log
    record's attributes (spec: Finished-request log line)."""
    from opentelemetry.sdk._logs import LoggingHandler

    from oai.trace import REQUEST_LOG_NAME

    request_log = logging.getLogger(REQUEST_LOG_NAME)
    if not any(isinstance(h, LoggingHandler) for h in request_log.handlers):
        request_log.addHandler(LoggingHandler(logger_provider=logger_provider))
