"""/healthz reports when each beat sweep last finished, and answers 503 once one is late."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from chat import tasks
from chat.models import GenerationRequest, SweepRun
from hordesite.sweep_health import scheduled_sweeps

SWEEPS = set(scheduled_sweeps())

pytestmark = pytest.mark.django_db


def test_the_sweeps_record_when_they_finished_and_healthz_reports_it(api, horde, make_user):
    requester = make_user("requester", kudos=1000)
    queued = horde.text_async(requester.key, models=["Gryphe/MythoMax-L2-13b"]).json()["id"]
    GenerationRequest.objects.filter(pk=queued).update(expires_at=timezone.now() - timedelta(seconds=1))
    before = timezone.now()
    assert tasks.expire_requests.apply().get() == 1
    assert tasks.abort_stale_generations.apply().get() == 0
    assert tasks.sweep_maintenance.apply().get() == 0
    assert tasks.cancel_lapsed_front_leases.apply().get() == 0
    assert tasks.delete_orphaned_chat_objects.apply().get() == 0

    runs = {run.task: run for run in SweepRun.objects.all()}
    assert set(runs) == SWEEPS
    assert runs["chat.tasks.expire_requests"].rows == 1 and runs["chat.tasks.abort_stale_generations"].rows == 0
    assert all(run.finished_at >= before for run in runs.values())

    response = api.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["sweeps"] == {
        task: {"last_finished_at": runs[task].finished_at.isoformat(), "late": False} for task in SWEEPS
    }


def test_healthz_is_unhealthy_when_a_sweep_is_late(api, settings):
    settings.HORDE_SWEEP_LATE_SECONDS = 180
    now = timezone.now()
    # Every sweep has a run, so none is judged from this process's start (the suite may be older
    # than the late bound by the time this test runs).
    for task in SWEEPS:
        SweepRun.objects.create(task=task, finished_at=now - timedelta(seconds=10))
    SweepRun.objects.filter(task="chat.tasks.expire_requests").update(finished_at=now - timedelta(seconds=181))

    response = api.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unhealthy"
    assert body["sweeps"]["chat.tasks.expire_requests"]["late"] is True
    assert body["sweeps"]["chat.tasks.abort_stale_generations"]["late"] is False

    SweepRun.objects.filter(task="chat.tasks.expire_requests").update(finished_at=now)
    assert api.get("/healthz").status_code == 200


def test_an_hourly_sweep_is_late_after_three_of_its_intervals(api, settings):
    settings.HORDE_SWEEP_LATE_SECONDS = 180
    now = timezone.now()
    for task in SWEEPS:
        SweepRun.objects.create(task=task, finished_at=now)
    orphans = "chat.tasks.delete_orphaned_chat_objects"
    SweepRun.objects.filter(task=orphans).update(finished_at=now - timedelta(hours=2))
    assert api.get("/healthz").json()["sweeps"][orphans]["late"] is False
    SweepRun.objects.filter(task=orphans).update(finished_at=now - timedelta(hours=3, seconds=1))
    answer = api.get("/healthz")
    assert answer.status_code == 503 and answer.json()["sweeps"][orphans]["late"] is True


def test_healthz_is_unhealthy_when_no_sweep_ever_ran_within_the_late_delay(api, settings):
    settings.HORDE_SWEEP_LATE_SECONDS = 3600  # this process started less than an hour ago: not late yet
    response = api.get("/healthz")
    assert response.status_code == 200
    assert response.json()["sweeps"]["chat.tasks.expire_requests"] == {"last_finished_at": None, "late": False}

    settings.HORDE_SWEEP_LATE_SECONDS = 0
    response = api.get("/healthz")
    assert response.status_code == 503
    assert response.json()["sweeps"]["chat.tasks.expire_requests"] == {"last_finished_at": None, "late": True}


def test_a_sweep_records_its_run_in_one_statement():
    """Each sweep runs every few seconds: after a task's first run, its record is one UPDATE, not
    update_or_create's transaction, row lock and read (three more round trips per sweep)."""
    assert tasks.sweep_maintenance.apply().get() == 0
    first = SweepRun.objects.get(task="chat.tasks.sweep_maintenance").finished_at
    with CaptureQueriesContext(connection) as queries:
        assert tasks.sweep_maintenance.apply().get() == 0
    on_the_record = [query["sql"] for query in queries if "horde_sweep_runs" in query["sql"]]
    assert len(on_the_record) == 1 and on_the_record[0].startswith("UPDATE"), on_the_record
    assert SweepRun.objects.get(task="chat.tasks.sweep_maintenance").finished_at > first
