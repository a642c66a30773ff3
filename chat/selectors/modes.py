"""The horde's modes: maintenance (the setting, or a moderator's switch). This horde has no
invite-only or raid mode."""

from __future__ import annotations

from chat.models import HordeModes


def horde_in_maintenance() -> bool:
    from django.conf import settings

    if settings.HORDE_MAINTENANCE:
        return True
    return HordeModes.objects.filter(maintenance=True).exists()


def horde_modes() -> dict[str, bool]:
    """GET /api/v2/status/modes, as upstream's for a caller without a moderator key."""
    return {"maintenance_mode": horde_in_maintenance(), "invite_only_mode": False}
