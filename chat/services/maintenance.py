"""Maintenance mode: the switch, and the abort of the waiting requests it implies."""

from __future__ import annotations

import logging

from django.utils import timezone

from accounts.models import HordeUser
from chat.models import GenerationRequest, HordeModes
from chat.services.cancel import request_cancel
from contract.errors import HordeError

log = logging.getLogger(__name__)


def horde_modes_set(*, actor: HordeUser, maintenance: bool) -> None:
    """A moderator switches maintenance mode; switching it on aborts every waiting request."""
    if not actor.moderator:
        raise HordeError("NotModerator", "Only a moderator can change the horde's modes.")
    HordeModes.objects.update_or_create(pk=1, defaults={"maintenance": maintenance})
    if maintenance:
        abort_waiting_for_maintenance()


def abort_waiting_for_maintenance() -> int:
    """Maintenance mode aborts the waiting requests (spec: "Completion signal"): each is cancelled
    as the cancel route cancels it (no more jobs handed out, its hold released, `cancelled`
    published for a chat request), so its client learns at once instead of at expiry. Jobs in
    flight still settle; their stream leases are not flagged. Returns how many it aborted."""
    aborted = 0
    while True:
        batch = list(
            GenerationRequest.objects.filter(
                jobs_waiting__gt=0, faulted=False, cancelled=False, expires_at__gt=timezone.now()
            ).only("id", "is_chat")[:1000]
        )
        for request in batch:
            aborted += request_cancel(request=request, settle_streams=False)
        if len(batch) < 1000:
            break
    if aborted:
        log.warning("maintenance mode aborted %d waiting requests", aborted)
    return aborted

