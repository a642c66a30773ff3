"""Beat tasks: thin wrappers over the sweeps in chat.services."""

from celery import shared_task

from chat import front_lease, services


@shared_task(name="chat.tasks.abort_stale_generations")
def abort_stale_generations() -> int:
    return services.abort_stale_generations()


@shared_task(name="chat.tasks.expire_requests")
def expire_requests() -> int:
    return services.expire_requests()


@shared_task(name="chat.tasks.cancel_lapsed_front_leases")
def cancel_lapsed_front_leases() -> int:
    return front_lease.cancel_lapsed_front_leases()
