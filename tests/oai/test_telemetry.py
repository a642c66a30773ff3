"""configure_telemetry of `python -m oai` (spec: chat_front.md, Telemetry configuration; the set-up
is oai.telemetry's, shared with the web process and the Celery worker: docs/adr/0075): the Flask
application's variables, resource attributes and sampling (upstream horde/telemetry.py), the
service name horde-oai unless OTEL_SERVICE_NAME sets another, and Pyroscope with the same
PYROSCOPE_* variables, started also with the SDK disabled. Pyroscope is outside the project: a fake
`pyroscope` module records how it was started. The OpenTelemetry globals configure_telemetry sets
are put back after each test; the OTLP exporters send to a local collector (tests/otlp_collector.py)."""

from __future__ import annotations

import logging
import sys
import time
import types
from typing import Any

import pytest
from environ import ImproperlyConfigured
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from oai.__main__ import configure_telemetry
from oai.settings import load_settings, load_telemetry_settings
from oai.telemetry import configure_telemetry as configure_process_telemetry
from oai.telemetry import shutdown_telemetry, telemetry_resource
from tests.telemetry_support import fresh_otel_globals, otlp_collector, silent_collector

ON = {"HORDE_OAI_TELEMETRY_ENABLED": "true"}
# The lower 64 bits of a trace id decide a ratio sampler: kept when below ratio * 2**64.
AT_20_PERCENT = int(0.20 * 2**64)
AT_30_PERCENT = int(0.30 * 2**64)


@pytest.fixture(autouse=True)
def otel_globals(monkeypatch):
    """The OpenTelemetry globals put back after each test, and the OTLP exporters pointed at a local
    collector."""
    with otlp_collector() as collector, fresh_otel_globals():
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        yield


class FakeSpanProcessor(SpanProcessor):
    started: list[str] = []

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        FakeSpanProcessor.started.append(span.name)


@pytest.fixture
def pyroscope(monkeypatch):
    """A fake pyroscope package (with pyroscope.otel): its configure calls are recorded."""
    module = types.ModuleType("pyroscope")
    module.calls = []
    module.configure = lambda **kwargs: module.calls.append(kwargs)
    otel = types.ModuleType("pyroscope.otel")
    otel.PyroscopeSpanProcessor = FakeSpanProcessor
    module.otel = otel
    FakeSpanProcessor.started = []
    monkeypatch.setitem(sys.modules, "pyroscope", module)
    monkeypatch.setitem(sys.modules, "pyroscope.otel", otel)
    return module


def _provider() -> TracerProvider:
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), "configure_telemetry did not set the SDK's tracer provider"
    return provider


def _kept(trace_id: int, parent_sampled: bool | None = None) -> bool:
    """Whether the configured provider keeps a span of this trace id: a root span, or the child of
    a remote parent sampled or not."""
    context = None
    if parent_sampled is not None:
        flags = TraceFlags(TraceFlags.SAMPLED if parent_sampled else TraceFlags.DEFAULT)
        parent = SpanContext(trace_id=trace_id, span_id=1, is_remote=True, trace_flags=flags)
        context = set_span_in_context(NonRecordingSpan(parent))
    return _provider().sampler.should_sample(context, trace_id, "span").decision.is_sampled()


def test_default_service_name_environment_and_sampling():
    settings = load_settings(ON)
    assert configure_telemetry(settings) is True
    attributes = _provider().resource.attributes
    assert attributes["service.name"] == "horde-oai"
    assert attributes["deployment.environment.name"] == "development"
    assert len(attributes["service.instance.id"]) == 32
    from opentelemetry import metrics

    assert metrics.get_meter_provider()._sdk_config.resource.attributes["service.name"] == "horde-oai"
    # Everything is kept by default.
    assert _kept(AT_20_PERCENT) and _kept(2**64 - 1)
    from oai import asgi

    assert asgi._tracer is not None  # the server spans are on


def test_otel_service_name_and_deployment_environment_are_read(pyroscope):
    settings = load_settings(
        {
            **ON,
            "OTEL_SERVICE_NAME": "front-eu",
            "DEPLOYMENT_ENVIRONMENT": "production",
            "PYROSCOPE_ENABLED": "true",
        }
    )
    assert configure_telemetry(settings) is True
    attributes = _provider().resource.attributes
    assert (attributes["service.name"], attributes["deployment.environment.name"]) == ("front-eu", "production")
    assert pyroscope.calls[0]["application_name"] == "front-eu"


def test_otel_resource_attributes_name_the_environment_unless_deployment_environment_does(monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=staging,team=horde")
    assert configure_telemetry(load_settings(ON)) is True
    attributes = _provider().resource.attributes
    assert (attributes["deployment.environment.name"], attributes["team"]) == ("staging", "horde")
    named = telemetry_resource(
        load_settings({**ON, "DEPLOYMENT_ENVIRONMENT": "production"}).telemetry, service_name="horde-oai"
    )
    assert named.attributes["deployment.environment.name"] == "production"


def test_otel_traces_sampler_is_the_sdks_to_build(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    settings = load_settings({**ON, "OTEL_TRACES_SAMPLER": "always_off", "OTEL_TRACES_SAMPLER_ARG": "1"})
    assert configure_telemetry(settings) is True
    assert _kept(AT_20_PERCENT) is False and _kept(2**64 - 1) is False


def test_pyroscope_starts_with_the_sdk_disabled_and_its_variables(pyroscope):
    settings = load_settings(
        {
            **ON,
            "OTEL_SDK_DISABLED": "true",
            "PYROSCOPE_ENABLED": "true",
            "PYROSCOPE_SERVER_ADDRESS": "http://pyroscope.internal:4040",
            "PYROSCOPE_TENANT_ID": "horde",
            "DEPLOYMENT_ENVIRONMENT": "staging",
        }
    )
    before = trace.get_tracer_provider()
    assert configure_telemetry(settings) is False
    assert pyroscope.calls == [
        {
            "application_name": "horde-oai",
            "server_address": "http://pyroscope.internal:4040",
            "tags": {"environment": "staging"},
            "tenant_id": "horde",
        }
    ]
    assert trace.get_tracer_provider() is before  # no SDK, so no span profiles


def test_pyroscope_without_a_tenant_and_off_by_default(pyroscope):
    assert configure_telemetry(load_settings({})) is False
    assert pyroscope.calls == []
    configure_telemetry(load_settings({"PYROSCOPE_ENABLED": "true"}))
    assert pyroscope.calls == [
        {
            "application_name": "horde-oai",
            "server_address": "http://localhost:4040",
            "tags": {"environment": "development"},
            "tenant_id": None,
        }
    ]


def test_with_the_sdk_on_spans_are_linked_to_profiles(pyroscope):
    assert configure_telemetry(load_settings({**ON, "PYROSCOPE_ENABLED": "true"})) is True
    with trace.get_tracer("test").start_as_current_span("profiled"):
        pass
    assert FakeSpanProcessor.started == ["profiled"]


def test_a_pyroscope_failure_is_logged_not_raised(pyroscope, caplog):
    def refuse(**kwargs):
        raise RuntimeError("no profiler here")

    pyroscope.configure = refuse
    with caplog.at_level(logging.WARNING, logger="oai"):
        assert configure_telemetry(load_settings({**ON, "PYROSCOPE_ENABLED": "true"})) is True
    (record,) = [r for r in caplog.records if r.name == "oai" and r.levelno == logging.ERROR]
    assert "Pyroscope could not be started" in record.getMessage()
    assert "no profiler here" in record.exc_text
    with trace.get_tracer("test").start_as_current_span("unprofiled"):
        pass
    assert FakeSpanProcessor.started == []


def test_pyroscope_not_installed_is_a_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pyroscope", None)  # import pyroscope raises ImportError
    with caplog.at_level(logging.WARNING, logger="oai"):
        assert configure_telemetry(load_settings({"PYROSCOPE_ENABLED": "true"})) is False
    (record,) = [r for r in caplog.records if r.name == "oai"]
    assert record.levelno == logging.WARNING and "pyroscope package is not installed" in record.getMessage()


@pytest.mark.parametrize(
    ("value", "ratio"), [("0.25", 0.25), ("0", 0.0), ("7", 1.0), ("-1", 0.0), ("often", 1.0), ("nan", 1.0)]
)
def test_the_sampler_ratio_is_read_and_clamped(value, ratio):
    settings = load_settings({**ON, "OTEL_TRACES_SAMPLER_ARG": value})
    assert settings.telemetry.traces_sample_ratio == ratio


def test_a_root_span_is_kept_at_the_ratio_and_a_child_follows_its_parent():
    assert configure_telemetry(load_settings({**ON, "OTEL_TRACES_SAMPLER_ARG": "0.25"})) is True
    assert _kept(AT_20_PERCENT) is True
    assert _kept(AT_30_PERCENT) is False
    # A request the horde's caller sampled is kept whatever the ratio, and one it dropped is not.
    assert _kept(AT_30_PERCENT, parent_sampled=True) is True
    assert _kept(AT_20_PERCENT, parent_sampled=False) is False


def test_an_otlp_endpoint_turns_telemetry_on_unless_told_otherwise():
    assert load_settings({}).telemetry.enabled is False
    assert load_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}).telemetry.enabled is True
    assert load_settings({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}).telemetry.enabled
    for switch in ("HORDE_TELEMETRY_ENABLED", "HORDE_OAI_TELEMETRY_ENABLED"):
        settings = load_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", switch: "false"})
        assert settings.telemetry.enabled is False


def test_either_switch_turns_telemetry_on_and_disagreeing_switches_are_refused():
    assert load_telemetry_settings({"HORDE_TELEMETRY_ENABLED": "true"}).enabled is True
    assert load_telemetry_settings({"HORDE_OAI_TELEMETRY_ENABLED": "true"}).enabled is True  # the older name
    agreeing = {"HORDE_TELEMETRY_ENABLED": "yes", "HORDE_OAI_TELEMETRY_ENABLED": "1"}
    assert load_telemetry_settings(agreeing).enabled is True
    # Empty is unset: the other switch, or an endpoint, decides.
    assert load_telemetry_settings({"HORDE_TELEMETRY_ENABLED": "", "HORDE_OAI_TELEMETRY_ENABLED": "true"}).enabled
    with pytest.raises(ImproperlyConfigured, match="HORDE_TELEMETRY_ENABLED and HORDE_OAI_TELEMETRY_ENABLED"):
        load_telemetry_settings({"HORDE_TELEMETRY_ENABLED": "false", "HORDE_OAI_TELEMETRY_ENABLED": "true"})


def _record_one_of_each() -> None:
    """A metric point, a span and a finished-request log line: each provider has something to export."""
    from opentelemetry import metrics

    metrics.get_meter("test").create_counter("test.stops").add(1)
    with trace.get_tracer("test").start_as_current_span("test-stop"):
        pass
    logging.getLogger("oai.requests").warning("finished")


@pytest.mark.parametrize("collector", ["silent", "down"])
def test_a_stop_waits_at_most_its_bound_for_a_collector_that_does_not_take_the_last_export(
    monkeypatch, collector
):
    """A clean stop exports the last points, but a collector that hangs (or is down) delays the stop
    by at most HORDE_TELEMETRY_STOP_SECONDS, not by each exporter's own timeout and retries (16 s
    and 12.7 s before, past the launcher's 20 s after a 10 s drain)."""
    with silent_collector() as silent:
        down = otlp_collector()
        with down as stopped:
            closed = stopped.url  # a port nothing listens on once the collector is stopped
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", silent if collector == "silent" else closed)
        monkeypatch.setenv("HORDE_TELEMETRY_STOP_SECONDS", "2")
        assert configure_process_telemetry(load_telemetry_settings(), default_service_name="horde-test") is True
        _record_one_of_each()
        started = time.monotonic()
        shutdown_telemetry()
        # One bound for the whole stop: not two of them one after another (one per exporter).
        assert time.monotonic() - started < 2 * 2


def test_the_stop_bound_is_read_and_must_be_positive():
    assert load_telemetry_settings({}).stop_seconds == 5.0
    assert load_telemetry_settings({"HORDE_TELEMETRY_STOP_SECONDS": "1.5"}).stop_seconds == 1.5
    for value in ("0", "-1"):
        with pytest.raises(ImproperlyConfigured, match="HORDE_TELEMETRY_STOP_SECONDS"):
            load_telemetry_settings({"HORDE_TELEMETRY_STOP_SECONDS": value})
