"""The front's server spans are named by its routes: a request to any other /v1/ path is named by
its method alone (OpenTelemetry's HTTP conventions for a request without a route), so clients
probing paths cannot make span names without bound."""

from __future__ import annotations

import time

import httpx
import pytest

from oai import asgi

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def exporter():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    asgi.set_tracer(provider.get_tracer("test"))
    yield exporter
    asgi.set_tracer(None)
    provider.shutdown()


def test_server_spans_are_named_by_route_or_by_method_alone(live_horde, exporter):
    assert httpx.get(f"{live_horde.v1}/models", timeout=10).status_code == 200
    for path in ("/v1/nope/3f2a", "/v1/nope/9c1d"):
        assert httpx.get(f"{live_horde.url}{path}", timeout=10).status_code == 404
    assert httpx.post(f"{live_horde.v1}/chat/completions", json={}, timeout=10).status_code in (400, 401)
    expected = ["GET /v1/models", "GET", "GET", "POST /v1/chat/completions"]
    deadline = time.monotonic() + 5
    while True:  # a span ends when its handler returns, just after the answer is sent
        names = [span.name for span in exporter.get_finished_spans() if span.kind.name == "SERVER"]
        if names == expected or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert names == expected


def test_a_server_span_carries_the_answers_x_request_id(live_horde, exporter):
    """The id a user quotes from an answer (docs/adr/0128) finds its trace: the server span has it as
    OpenTelemetry's response header attribute."""
    answers = [
        httpx.get(f"{live_horde.v1}/models", timeout=10),
        httpx.post(f"{live_horde.v1}/chat/completions", json={}, timeout=10),
    ]
    expected = [(answer.headers["x-request-id"],) for answer in answers]
    deadline = time.monotonic() + 5
    while True:
        spans = [span for span in exporter.get_finished_spans() if span.kind.name == "SERVER"]
        if len(spans) == len(expected) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [span.attributes.get("http.response.header.x-request-id") for span in spans] == expected
