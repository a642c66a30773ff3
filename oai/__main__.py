"""`python -m oai`: the front alone, as its own ASGI process (daphne) against the configured native
roots, with its telemetry set-up and /healthz. Settings: oai.settings (docs/configuration.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
from typing import Any

from oai.settings import FrontSettings, load_settings

FRONT_SERVICE_NAME = "horde-oai"
DEFAULT_DEPLOYMENT_ENVIRONMENT = "development"  # the Flask application's
log = logging.getLogger("oai")


def configure_telemetry(settings: FrontSettings) -> bool:
    """OpenTelemetry (traces and metrics, with the front's histogram views) when telemetry is
    enabled (HORDE_OAI_TELEMETRY_ENABLED, or an OTLP endpoint configured) and OTEL_SDK_DISABLED is
    not; Pyroscope when PYROSCOPE_ENABLED is true, also with the SDK disabled. The variables,
    resource attributes and sampling are the Flask application's (upstream horde/telemetry.py), with
    the service name horde-oai unless OTEL_SERVICE_NAME sets another. Returns whether OpenTelemetry
    is on."""
    sdk_on = settings.telemetry_enabled and not settings.otel_sdk_disabled
    span_processors = start_pyroscope(settings, span_profiles=sdk_on)
    if not sdk_on:
        return False
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    from oai import asgi
    from oai import metrics as front_metrics

    resource = telemetry_resource(settings)
    readers: list[Any] = []
    # A root span is kept with the ratio's probability; a child follows its parent's decision.
    # OTEL_TRACES_SAMPLER, when set, is the SDK's to build (sampler None); else the ratio's sampler.
    sampler = None if settings.traces_sampler else ParentBasedTraceIdRatio(settings.traces_sample_ratio)
    tracer_provider = TracerProvider(resource=resource, sampler=sampler)
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
        log.warning("opentelemetry-exporter-otlp is not installed: telemetry is recorded but not exported")
    metrics.set_meter_provider(
        MeterProvider(resource=resource, metric_readers=readers, views=front_metrics.histogram_views())
    )
    trace.set_tracer_provider(tracer_provider)
    asgi.set_tracer(trace.get_tracer("horde.oai"))
    bridge_request_log(_logger_provider(resource))
    return True


def telemetry_resource(settings: FrontSettings) -> Any:
    """The resource the Flask application's Logfire set-up gives its telemetry: the service name,
    the deployment environment (DEPLOYMENT_ENVIRONMENT) and an id of this process; the SDK adds
    OTEL_RESOURCE_ATTRIBUTES."""
    from opentelemetry.sdk.resources import Resource

    attributes = {"service.name": settings.service_name or FRONT_SERVICE_NAME, "service.instance.id": uuid.uuid4().hex}
    if settings.deployment_environment:
        attributes["deployment.environment.name"] = settings.deployment_environment
    # The default environment only where neither DEPLOYMENT_ENVIRONMENT nor OTEL_RESOURCE_ATTRIBUTES
    # names one: a merged resource's attributes win over the one it is merged into.
    return Resource({"deployment.environment.name": DEFAULT_DEPLOYMENT_ENVIRONMENT}).merge(Resource.create(attributes))


def start_pyroscope(settings: FrontSettings, *, span_profiles: bool) -> list[Any]:
    """Pyroscope, as the Flask application starts it, when PYROSCOPE_ENABLED is true: the front's
    service name as the application name, PYROSCOPE_SERVER_ADDRESS, PYROSCOPE_TENANT_ID and the
    environment tag. Returns the span processor that links spans to profiles when `span_profiles`
    (the SDK is on) and pyroscope.otel is installed. A failure is logged, never raised: profiling is
    not worth the front."""
    if not settings.pyroscope_enabled:
        return []
    try:
        import pyroscope

        pyroscope.configure(
            application_name=settings.service_name or FRONT_SERVICE_NAME,
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

    provider = LoggerProvider(resource=resource)
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


def build_application() -> Any:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "oai.django_settings")
    from django.core.asgi import get_asgi_application

    from oai.asgi import FrontASGI

    return FrontASGI(get_asgi_application(), serve_healthz=True)


def main(argv: list[str] | None = None) -> int:
    settings = load_settings()
    logging.basicConfig(level=settings.log_level)
    telemetry = configure_telemetry(settings)
    from oai import state as front_state

    front_state.configure_front(propagate=telemetry)
    application = build_application()
    # At a stop the requests waiting end answered, then the open and failed cancels are sent
    # (oai.server.FrontServer, docs/adr/0076).
    from oai.server import FrontServer

    log.info(
        "OpenAI front on http://%s:%s/v1/ over %s",
        settings.host,
        settings.port,
        ", ".join(settings.native_roots),
    )
    FrontServer(application=application, endpoints=[f"tcp:port={settings.port}:interface={settings.host}"]).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
