"""The Celery app: the periodic sweeps run as beat tasks (chat/tasks.py; their schedule is
CELERY_BEAT_SCHEDULE in the settings). Each process that runs tasks configures its telemetry before
its first task and flushes it when it stops (hordesite/telemetry.py); beat runs no task and records
none. A task's database connection goes back to the process's pool after the task, as a request's
does in the web process (docs/adr/0093)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import PersistentScheduler
from celery.contrib.django.task import DjangoTask
from celery.signals import celeryd_init, task_postrun, task_prerun, worker_process_shutdown, worker_shutdown

from hordesite.telemetry import start_celery_telemetry_once, stop_telemetry

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hordesite.settings")


class HordeTask(DjangoTask):
    """A task that loses its PostgreSQL connection before any of its statements completed runs once
    more on a fresh connection, as a native request does (hordesite/db_guard.py): the pool outlives
    the tasks, so after a database restart its idle connections are dead, and the first task to take
    one must not fail for it. The lost connection is discarded and the pool's idle ones checked."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request.is_eager:
            return super().__call__(*args, **kwargs)
        from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections

        from hordesite import db_guard

        for last in (False, True):
            db_guard.start_request()
            try:
                with connections[DEFAULT_DB_ALIAS].execute_wrapper(db_guard.count_statements):
                    return super().__call__(*args, **kwargs)
            except DatabaseError as exc:
                if last or not db_guard.is_connection_failure(exc) or not db_guard.on_connection_failure(exc):
                    raise
        raise AssertionError("unreachable")


app = Celery("hordesite", task_cls=HordeTask)
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


@task_prerun.connect
@task_postrun.connect
def _close_old_connections(task: Any = None, **_kwargs) -> None:
    """What Django does when a request starts and ends, around each task (Celery's fixup no longer
    does: CELERY_DB_REUSE_MAX in the settings). CONN_MAX_AGE is 0 under the pool, so the task's
    connection goes back to the pool, which keeps it for the next task; the pool discards one that
    broke. Not for a task run eagerly, inside its caller's own work."""
    if task is not None and task.request.is_eager:
        return
    from django.db import close_old_connections

    close_old_connections()


@worker_process_shutdown.connect
def _flush_telemetry_in_pool_child(**_kwargs) -> None:
    """A prefork child exits without atexit hooks (os._exit): its last metrics are exported here."""
    stop_telemetry()


@worker_shutdown.connect
def _flush_telemetry_of_the_worker(**_kwargs) -> None:
    stop_telemetry()  # solo and threads; nothing to do under prefork, whose children flushed their own
