"""The web process's and the Celery worker's telemetry (docs/adr/0075, hordesite/telemetry.py): the
set-up of `python -m oai` (oai.telemetry) at each process's start, so the horde's instruments
(chat/metrics.py) and the mounted front's (oai/metrics.py) reach the OTLP endpoint, and a flush at
each process's clean stop.

Before, only `python -m oai` configured a provider: every instrument the web process and the Celery
worker recorded (horde.text.*, horde.chat.*, the mounted front's horde.oai.*) was dropped.

The real processes export to a local collector (tests/telemetry_support.py) with an export interval
longer than the test: what arrives was exported by the stop's flush.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from chat.models import Generation
from oai import state as front_state
from oai.metrics import BUCKETS_REQUEST_LIFECYCLE_SECONDS, FrontMetrics
from tests.hordesite.clone import ROOT
from tests.hordesite.test_web_processes import _children, _listening, _start, _until_serving, call
from tests.hordesite.test_web_restart import TEXT_MODEL, web_env
from tests.ports import free_port
from tests.telemetry_support import fresh_otel_globals, otlp_collector

# No periodic export while a test runs: what the collector gets, a stop flushed.
NO_PERIODIC_EXPORT = {"OTEL_METRIC_EXPORT_INTERVAL": "600000", "OTEL_BSP_SCHEDULE_DELAY": "600000"}


@pytest.fixture
def collector(monkeypatch):
    with otlp_collector() as running, fresh_otel_globals():
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", running.url)
        yield running
        front_state.configure_front(propagate=False)


def _points(reader, name: str) -> list:
    data = reader.get_metrics_data()
    return [
        point
        for resource in (data.resource_metrics if data else ())
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


@pytest.mark.django_db
def test_the_web_set_up_records_the_horde_and_front_instruments(collector, monkeypatch, horde, make_user):
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from hordesite.telemetry import start_web_telemetry
    from oai.settings import load_telemetry_settings

    monkeypatch.setenv("HORDE_TELEMETRY_ENABLED", "true")
    reader = InMemoryMetricReader()
    assert start_web_telemetry(load_telemetry_settings(), metric_readers=[reader]) is True
    requester = make_user("telemetry-requester", kudos=1000)
    assert horde.text_async(requester.key, models=[TEXT_MODEL]).status_code == 202
    (decision,) = _points(reader, "horde.text.free_allowance.decisions")
    assert decision.value == 1 and decision.attributes["horde.chat"] is False
    # The front's histograms keep their boundaries (its views) in the web process too.
    FrontMetrics().request_duration.record(0.3)
    (duration,) = _points(reader, "horde.oai.request.duration")
    assert tuple(duration.explicit_bounds) == BUCKETS_REQUEST_LIFECYCLE_SECONDS
    resource = reader.get_metrics_data().resource_metrics[0].resource.attributes
    assert resource["service.name"] == "horde-web" and len(resource["service.instance.id"]) == 32


def test_telemetry_off_configures_no_provider(collector, monkeypatch):
    from opentelemetry import metrics

    from hordesite.telemetry import start_celery_telemetry, start_web_telemetry
    from oai.settings import load_telemetry_settings

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    before = metrics.get_meter_provider()
    off = load_telemetry_settings()
    assert start_web_telemetry(off) is False and start_celery_telemetry(off) is False
    assert metrics.get_meter_provider() is before
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert start_web_telemetry(load_telemetry_settings()) is False


def test_contradicting_switches_stop_the_worker_at_its_start(tmp_path):
    env = web_env(tmp_path, HORDE_TELEMETRY_ENABLED="true", HORDE_OAI_TELEMETRY_ENABLED="false")
    env.update(DATABASE_URL=f"sqlite:///{tmp_path / 'never.sqlite3'}", REDIS_URL="")
    started = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "hordesite", "worker", "--pool=solo"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert started.returncode != 0
    assert "HORDE_TELEMETRY_ENABLED and HORDE_OAI_TELEMETRY_ENABLED disagree" in started.stderr


def _manage(env: dict[str, str], *args: str) -> str:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout


def _resources(points) -> set[tuple[str, str]]:
    return {(point.resource["service.name"], point.resource["service.instance.id"]) for point in points}


@pytest.mark.slow
@pytest.mark.redis_only
@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_each_web_process_exports_its_metrics_and_spans_when_it_stops(tmp_path):
    with otlp_collector() as collector:
        env = web_env(
            tmp_path,
            HORDE_WEB_PROCESSES="2",
            HORDE_TELEMETRY_ENABLED="true",
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
            **NO_PERIODIC_EXPORT,
        )
        port, log = free_port(), tmp_path / "web.log"
        launcher = _start(env, port, log)
        try:
            deadline = time.monotonic() + 60
            while len(_children(launcher.pid)) < 2 or not all(_listening(port, p) for p in _children(launcher.pid)):
                assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            requester = _manage(env, "horde_user", "create", "otel-requester", "--kudos", "1000").split()[-1]
            worker = _manage(env, "horde_user", "create", "otel-volunteer", "--trusted").split()[-1]
            pop = {"name": "otel-worker", "models": [TEXT_MODEL], "max_length": 512, "max_context_length": 4096}
            for _ in range(6):  # new connections: the kernel spreads them over both processes
                time.sleep(0.6)  # within the requester's 2 creations a second
                created = call(http.client.HTTPConnection("127.0.0.1", port, timeout=30), "POST",
                               "generate/text/async", {"prompt": "Hi", "models": [TEXT_MODEL],
                                                        "params": {"max_length": 16}}, requester)
                assert created[0] == 202, created
                popped = call(http.client.HTTPConnection("127.0.0.1", port, timeout=30), "POST",
                              "generate/text/pop", pop, worker)
                assert popped[0] == 200 and popped[1]["id"], popped
                submitted = call(http.client.HTTPConnection("127.0.0.1", port, timeout=30), "POST",
                                 "generate/text/submit", {"id": popped[1]["id"], "generation": "Hello."}, worker)
                assert submitted[0] == 200, submitted
            front = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            front.request("GET", "/v1/models")
            assert front.getresponse().status == 200
            assert collector.metric_names() == set(), "exported before the stop"
            launcher.send_signal(signal.SIGTERM)
            assert launcher.wait(30) == 0, log.read_text()
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        decisions = collector.points_of("horde.text.free_allowance.decisions")
        assert sum(point.value for point in decisions) == 6, collector.metric_names()
        waits = collector.points_of("horde.text.queue_wait_seconds")
        assert sum(point.value for point in waits) == 6  # a histogram's count: one per pop
        # Each process its own provider: its own service.instance.id, both named horde-web.
        assert {name for name, _ in _resources(decisions)} == {"horde-web"}
        assert len(_resources(decisions + waits + collector.points_of("horde.oai.inflight"))) >= 1
        assert len({instance for _, instance in _resources(collector.points)}) == 2, _resources(collector.points)
        # The mounted front's server span.
        assert ("GET /v1/models", "horde-web") in {(name, resource["service.name"]) for name, resource in collector.spans}


def _a_job_past_its_lease(horde, make_user, tag: str) -> dict:
    """A popped text job whose lease ended five minutes ago: the next stale sweep aborts it."""
    requester, volunteer = make_user(f"{tag}-requester", kudos=1000), make_user(f"{tag}-volunteer", trusted=True)
    assert horde.text_async(requester.key, models=[TEXT_MODEL]).status_code == 202
    job = horde.pop(volunteer.key, name=f"{tag}-worker", models=[TEXT_MODEL]).json()
    assert job["id"], job
    Generation.objects.filter(pk=job["id"]).update(lease_expires_at=timezone.now() - timedelta(minutes=5))
    return job


@pytest.mark.slow
@pytest.mark.redis_only
@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("pool", ["--concurrency=1", "--pool=solo"])  # tasks in a pool child, or in the worker
def test_the_celery_process_running_the_sweeps_exports_their_metrics_when_the_worker_stops(
    tmp_path, horde, make_user, pool
):
    job = _a_job_past_its_lease(horde, make_user, "sweep")
    with otlp_collector() as collector:
        env = web_env(
            tmp_path,
            HORDE_TELEMETRY_ENABLED="true",
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
            HORDE_SWEEP_INTERVAL_SECONDS="1",
            CELERY_BEAT_SCHEDULE_FILENAME=str(tmp_path / "celerybeat-schedule"),
            **NO_PERIODIC_EXPORT,
        )
        log = tmp_path / "celery.log"
        with log.open("wb") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "hordesite", "worker", "-B", pool, "--loglevel=INFO"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0,
            )
        try:
            deadline = time.monotonic() + 90
            while Generation.objects.get(pk=job["id"]).state != Generation.State.FAULTED:
                assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
            assert collector.metric_names() == set(), "exported before the stop"
            worker.send_signal(signal.SIGTERM)  # the main process only, as systemd's KillMode=mixed
            assert worker.wait(60) == 0, log.read_text()
        finally:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
    (abort,) = collector.points_of("horde.text.stale_aborts")
    assert abort.value == 1 and abort.attributes == {"horde.worker_trusted": True, "horde.chat": False}
    assert abort.resource["service.name"] == "horde-celery"


@pytest.mark.slow
def test_the_launcher_serves_and_exports_nothing_with_telemetry_off(tmp_path):
    """`make run`'s web process with telemetry switched off, even with an OTLP endpoint set: it
    serves, stops cleanly and sends the collector nothing."""
    with otlp_collector() as collector:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "HORDE_"))}
        env.update(DATABASE_URL=f"sqlite:///{tmp_path / 'off.sqlite3'}", REDIS_URL="", CELERY_BROKER_URL="",
                   PYTHONUNBUFFERED="1", HORDE_TELEMETRY_ENABLED="false", OTEL_EXPORTER_OTLP_ENDPOINT=collector.url)
        _manage(env, "migrate", "--noinput", "-v0")
        port, log = free_port(), tmp_path / "web.log"
        launcher = _start(env, port, log)
        try:
            _until_serving(launcher, port, log)
            front = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            front.request("GET", "/v1/models")
            assert front.getresponse().status == 200
            launcher.send_signal(signal.SIGTERM)
            assert launcher.wait(30) == 0, log.read_text()
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        assert collector.paths == []


def _threads(pid: int) -> int:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["Threads"])


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_beat_of_a_solo_worker_holds_no_copy_of_the_workers_telemetry(tmp_path, horde, make_user):
    """`celery worker -B --pool=solo`: the worker runs the tasks and forks its embedded beat at its
    start. Before, the worker set its telemetry up before that fork, so beat held copies of its
    providers, their three export threads restarted by the SDK in the fork, under the worker's
    service.instance.id (a point recorded before the fork would have been exported twice). Now the
    worker sets up at its first task, after the fork: beat runs its one thread, and what arrives
    comes from the worker, once."""
    job = _a_job_past_its_lease(horde, make_user, "beat")
    with otlp_collector() as collector:
        env = web_env(
            tmp_path,
            HORDE_TELEMETRY_ENABLED="true",
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
            OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,process",  # process.pid in each point's resource
            HORDE_SWEEP_INTERVAL_SECONDS="1",
            CELERY_BEAT_SCHEDULE_FILENAME=str(tmp_path / "celerybeat-schedule"),
            **NO_PERIODIC_EXPORT,
        )
        log = tmp_path / "celery.log"
        with log.open("wb") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "hordesite", "worker", "-B", "--pool=solo", "--loglevel=INFO"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0,
            )
        try:
            deadline = time.monotonic() + 90
            while Generation.objects.get(pk=job["id"]).state != Generation.State.FAULTED:
                assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
            (beat,) = _children(worker.pid)  # the solo pool's only child process
            assert _threads(beat) == 1
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(60) == 0, log.read_text()
        finally:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
    (abort,) = collector.points_of("horde.text.stale_aborts")
    assert abort.value == 1 and abort.resource["service.name"] == "horde-celery"
    assert {point.resource["process.pid"] for point in collector.points} == {worker.pid}
