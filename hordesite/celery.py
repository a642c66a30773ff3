"""The Celery app: the periodic sweeps run as beat tasks (chat/tasks.py; their schedule is
CELERY_BEAT_SCHEDULE in the settings). Each process that runs tasks configures its telemetry before
its first task and flushes it when it stops (hordesite/telemetry.py); beat runs no task and records
none."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import PersistentScheduler
from celery.signals import celeryd_init, task_prerun, worker_process_shutdown, worker_shutdown

from hordesite.telemetry import start_celery_telemetry_once, stop_telemetry

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hordesite.settings")

app = Celery("hordesite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


class FolderMakingScheduler(PersistentScheduler):
    """Beat's default scheduler, creating its schedule file's folder first: without it beat takes the
    missing folder for a corrupted schedule and dies while the worker carries on."""

    def setup_schedule(self) -> None:
        from hordesite.local_state import make_broker_dirs

        make_broker_dirs()  # a standalone beat publishes into the filesystem broker too
        Path(self.schedule_filename).parent.mkdir(parents=True, exist_ok=True)
        super().setup_schedule()


app.conf.beat_scheduler = "hordesite.celery:FolderMakingScheduler"


@celeryd_init.connect
def _make_broker_dirs(**_kwargs) -> None:
    """The worker consumes from the filesystem broker's folders (embedded default): create them at start."""
    from hordesite.local_state import make_broker_dirs

    make_broker_dirs()


@task_prerun.connect
def _start_telemetry_at_the_first_task(task: Any = None, **_kwargs) -> None:
    """The process that runs a task sets its telemetry up before its first task: a prefork child
    (after its fork), or the worker itself under a pool without children (solo, threads). Not
    earlier: under the solo pool, `worker -B` forks its embedded beat after the worker's start and
    before its first task, and beat would otherwise inherit the worker's providers, their export
    threads restarted by the SDK in the fork, under the worker's service.instance.id (docs/adr/0088).
    Nothing is recorded before a process's first task. Once per process (a second call is a
    comparison of process ids). Not for a task run eagerly, in the caller's process."""
    if task is not None and task.request.is_eager:
        return
    start_celery_telemetry_once()


@worker_process_shutdown.connect
def _flush_telemetry_in_pool_child(**_kwargs) -> None:
    """A prefork child exits without atexit hooks (os._exit): its last metrics are exported here."""
    stop_telemetry()


@worker_shutdown.connect
def _flush_telemetry_of_the_worker(**_kwargs) -> None:
    stop_telemetry()  # solo and threads; nothing to do under prefork, whose children flushed their own
