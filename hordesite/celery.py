"""The Celery app: the periodic sweeps run as beat tasks (chat/tasks.py; their schedule is
CELERY_BEAT_SCHEDULE in the settings)."""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery
from celery.beat import PersistentScheduler
from celery.signals import celeryd_init

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
