"""Beat tasks: thin wrappers over the sweeps in chat.services."""

from celery import shared_task

from chat import services


@shared_task(name="chat.tasks.abort_stale_generations")
def abort_stale_generations() -> int:
    return services.abort_stale_generations()


@shared_task(name="chat.tasks.expire_requests")
def expire_requests() -> int:
    return services.expire_requests()


@shared_task(name="chat.tasks.sweep_maintenance")
def sweep_maintenance() -> int:
    return services.sweep_maintenance()
