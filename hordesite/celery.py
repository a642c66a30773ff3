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
    # A third of the lease (contract.front_lease, 30 s): a dead front's requests are cancelled
    # within about 40 s of its last renewal.
    "cancel-lapsed-front-leases": {"task": "chat.tasks.cancel_lapsed_front_leases", "schedule": 10.0},
}
