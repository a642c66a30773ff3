"""Beat tasks: thin wrappers over the sweeps in chat.services.sweeps (and the front lease's), each recording when it finished
(SweepRun, read by /healthz)."""

from celery import shared_task
from django.utils import timezone

from chat.models import SweepRun
from chat.services import front_lease, sweeps


def _finished(task: str, rows: int) -> int:
    # One UPDATE, in autocommit: update_or_create's transaction, row lock and read cost each sweep
    # three more round trips. Its race-safe create only for a task's first run.
    values = {"finished_at": timezone.now(), "rows": rows}
    if not SweepRun.objects.filter(task=task).update(**values):
        SweepRun.objects.update_or_create(task=task, defaults=values)
    return rows


@shared_task(name="chat.tasks.abort_stale_generations")
def abort_stale_generations() -> int:
    return _finished("chat.tasks.abort_stale_generations", sweeps.abort_stale_generations())


@shared_task(name="chat.tasks.expire_requests")
def expire_requests() -> int:
    return _finished("chat.tasks.expire_requests", sweeps.expire_requests())


@shared_task(name="chat.tasks.sweep_maintenance")
def sweep_maintenance() -> int:
    return _finished("chat.tasks.sweep_maintenance", sweeps.sweep_maintenance())


@shared_task(name="chat.tasks.cancel_lapsed_front_leases")
def cancel_lapsed_front_leases() -> int:
    return _finished("chat.tasks.cancel_lapsed_front_leases", front_lease.cancel_lapsed_front_leases())


@shared_task(name="chat.tasks.delete_orphaned_chat_objects")
def delete_orphaned_chat_objects() -> int:
    return _finished("chat.tasks.delete_orphaned_chat_objects", sweeps.delete_orphaned_chat_objects())
