"""The Celery app: the periodic sweeps run as beat tasks (chat/tasks.py; their schedule is
CELERY_BEAT_SCHEDULE in the settings). Each process that runs tasks configures its telemetry when it
starts and flushes it when it stops (hordesite/telemetry.py); beat runs no task and records none."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import PersistentScheduler
from celery.signals import (
    celeryd_init,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
)

from hordesite.telemetry import start_celery_telemetry, stop_telemetry

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


def _runs_tasks_in_children(worker: Any) -> bool:
    from celery import concurrency
    from celery.concurrency.prefork import TaskPool

    pool = concurrency.get_implementation(worker.pool_cls)
    return isinstance(pool, type) and issubclass(pool, TaskPool)


@worker_process_init.connect
def _start_telemetry_in_pool_process(**_kwargs) -> None:
    """A prefork child, after its fork: its own providers (the parent configures none, so no export
    thread or service.instance.id is shared between processes). The solo pool sends it too, in the
    worker itself."""
    start_celery_telemetry()


@worker_process_shutdown.connect
def _flush_telemetry_in_pool_child(**_kwargs) -> None:
    """A prefork child exits without atexit hooks (os._exit): its last metrics are exported here."""
    stop_telemetry()


@worker_init.connect
def _start_telemetry_without_pool_children(sender: Any = None, **_kwargs) -> None:
    """Under a pool without child processes (solo, threads) the tasks run in the worker itself; the
    solo pool's worker_process_init then finds the providers running."""
    if sender is not None and not _runs_tasks_in_children(sender):
        start_celery_telemetry()


@worker_shutdown.connect
def _flush_telemetry_of_the_worker(**_kwargs) -> None:
    stop_telemetry()  # solo and threads; nothing to do under prefork, whose children flushed their own
