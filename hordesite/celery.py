"""The Celery app: the periodic sweeps run as beat tasks (see chat/tasks.py)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hordesite.settings")

app = Celery("hordesite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

app.conf.beat_schedule = {
    "abort-stale-generations": {"task": "chat.tasks.abort_stale_generations", "schedule": 60.0},
    "expire-requests": {"task": "chat.tasks.expire_requests", "schedule": 60.0},
    "sweep-maintenance": {"task": "chat.tasks.sweep_maintenance", "schedule": 60.0},
}
