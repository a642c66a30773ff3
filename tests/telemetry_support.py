"""What the telemetry tests share: a small OTLP/HTTP collector, a real HTTP server that takes the
protobuf POSTs an OpenTelemetry exporter sends to /v1/metrics, /v1/traces and /v1/logs, decodes
them with opentelemetry-proto and keeps what arrived (each metric's data points and each span's
name, with their resource's attributes); and the OpenTelemetry globals put back after a test that
configured this process's telemetry (oai.telemetry)."""

from __future__ import annotations

import contextlib
import gzip
import logging
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.http_fakes import QuietHandler


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


@dataclass
class Point:
    """One data point of a metric as it arrived (a sum's value or a histogram's count)."""

    metric: str
    resource: dict[str, Any]
    attributes: dict[str, Any]
    value: float


@dataclass
class Collector:
    url: str = ""
    points: list[Point] = field(default_factory=list)
    spans: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    log_records: int = 0
    paths: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def metric_names(self) -> set[str]:
        with self.lock:
            return {point.metric for point in self.points}

    def points_of(self, metric: str) -> list[Point]:
        with self.lock:
            return [point for point in self.points if point.metric == metric]

    def wait_for(self, found: Callable[[], Any], seconds: float = 30.0) -> Any:
        deadline = time.monotonic() + seconds
        while not (value := found()):
            if time.monotonic() > deadline:
                return value
            time.sleep(0.1)
        return value

    def receive(self, path: str, body: bytes) -> bytes:
        with self.lock:
            self.paths.append(path)
        if path == "/v1/metrics":
            metrics_request = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
            points = []
            for resource_metrics in metrics_request.resource_metrics:
                resource = _attributes(resource_metrics.resource.attributes)
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        kind = metric.WhichOneof("data")
                        for point in getattr(metric, kind).data_points:
                            if kind in ("sum", "gauge"):
                                value = point.as_int if point.WhichOneof("value") == "as_int" else point.as_double
                            else:
                                value = point.count
                            points.append(Point(metric.name, resource, _attributes(point.attributes), value))
            with self.lock:
                self.points.extend(points)
            return metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
        if path == "/v1/traces":
            trace_request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            spans = []
            for resource_spans in trace_request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    spans.extend((span.name, resource) for span in scope_spans.spans)
            with self.lock:
                self.spans.extend(spans)
            return trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        logs_request = logs_service_pb2.ExportLogsServiceRequest.FromString(body)
        with self.lock:
            self.log_records += sum(
                len(scope_logs.log_records)
                for resource_logs in logs_request.resource_logs
                for scope_logs in resource_logs.scope_logs
            )
        return logs_service_pb2.ExportLogsServiceResponse().SerializeToString()


@contextmanager
def otlp_collector(port: int = 0) -> Iterator[Collector]:
    """A collector listening on a local port (0: a free one); its url is the OTLP endpoint to give
    OTEL_EXPORTER_OTLP_ENDPOINT."""
    collector = Collector()

    class Handler(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802  (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            encoding = (self.headers.get("Content-Encoding") or "").lower()
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            if self.path not in ("/v1/metrics", "/v1/traces", "/v1/logs"):
                self.send_response(404)
                self.end_headers()
                return
            answer = collector.receive(self.path, body)
            self.send_body(200, answer, "application/x-protobuf")

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    collector.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield collector
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def silent_collector() -> Iterator[str]:
    """A collector that is up but never answers (hung, or overloaded): it accepts each connection
    and reads nothing. Yields the OTLP endpoint to give OTEL_EXPORTER_OTLP_ENDPOINT."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed at the end
            while True:
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for connection in accepted:
            connection.close()


@contextmanager
def fresh_otel_globals() -> Iterator[None]:
    """A test may set the global tracer, meter and logger providers (each settable once per
    process), the front's server-span tracer and the request log's bridge: all are put back, and
    the providers it configured shut down, when it ends."""
    import opentelemetry._logs._internal as logs_api
    import opentelemetry.metrics._internal as metrics_api
    from opentelemetry import trace
    from opentelemetry.util._once import Once

    from chat import metrics as horde_metrics
    from oai import asgi
    from oai.telemetry import process_telemetry

    saved = {
        (trace, "_TRACER_PROVIDER"): trace._TRACER_PROVIDER,
        (trace, "_TRACER_PROVIDER_SET_ONCE"): trace._TRACER_PROVIDER_SET_ONCE,
        (metrics_api, "_METER_PROVIDER"): metrics_api._METER_PROVIDER,
        (metrics_api, "_METER_PROVIDER_SET_ONCE"): metrics_api._METER_PROVIDER_SET_ONCE,
        (logs_api, "_LOGGER_PROVIDER"): logs_api._LOGGER_PROVIDER,
        (logs_api, "_LOGGER_PROVIDER_SET_ONCE"): logs_api._LOGGER_PROVIDER_SET_ONCE,
    }
    for module, name in saved:
        if name.endswith("_SET_ONCE"):
            setattr(module, name, Once())
    tracer = asgi._tracer
    request_log = logging.getLogger("oai.requests")
    handlers = list(request_log.handlers)
    # The horde's lazy instruments are made again from the provider this test sets.
    horde_metrics.use_meter_provider(None)
    try:
        yield
    finally:
        process_telemetry.shutdown()
        for (module, name), value in saved.items():
            setattr(module, name, value)
        horde_metrics.use_meter_provider(None)
        asgi.set_tracer(tracer)
        for handler in request_log.handlers[:]:
            if handler not in handlers:
                request_log.removeHandler(handler)
