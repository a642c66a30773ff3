from __future__ import annotations

import hashlib
from decimal import Decimal

from django.db import models


def hash_api_key(api_key: str) -> str:
    """Keys are stored as SHA-256 hex digests; the plain key is shown once, at creation."""
    return hashlib.sha256(api_key.encode()).hexdigest()


class HordeUser(models.Model):
    """A horde account: requester and worker owner. Identified on the wire by its API key."""

    username = models.CharField(max_length=100)
    api_key_hash = models.CharField(max_length=64, unique=True)
    kudos = models.DecimalField(max_digits=18, decimal_places=2, default=Decimal("0"))
    # Kudos reserved by queued requests above the free output allowance (released as they settle).
    kudos_held = models.DecimalField(max_digits=18, decimal_places=2, default=Decimal("0"))
    trusted = models.BooleanField(default=False)
    moderator = models.BooleanField(default=False)
    is_anonymous = models.BooleanField(default=False)
    concurrency = models.PositiveIntegerField(default=30)
    created = models.DateTimeField(auto_now_add=True)

    # DRF reads this on request.user; every HordeUser is an authenticated caller.
    is_authenticated = True

    class Meta:
        db_table = "horde_users"

    def __str__(self) -> str:
        return self.unique_alias

    @property
    def unique_alias(self) -> str:
        return f"{self.username}#{self.pk}"

    @property
    def kudos_available(self) -> Decimal:
        return self.kudos - self.kudos_held


class KudosTransaction(models.Model):
    """The ledger: every change to a user's kudos, signed, with what it paid for."""

    class Kind(models.TextChoices):
        HORDE_TAX = "horde_tax"
        GENERATION_CHARGE = "generation_charge"
        GENERATION_REWARD = "generation_reward"
        GRANT = "grant"

    user = models.ForeignKey(HordeUser, on_delete=models.CASCADE, related_name="kudos_transactions")
    amount = models.DecimalField(max_digits=18, decimal_places=2)
    kind = models.CharField(max_length=32, choices=Kind.choices)
    # Plain ids, not foreign keys: the ledger outlives the deleted requests it refers to.
    request_id = models.UUIDField(null=True, blank=True)
    generation_id = models.UUIDField(null=True, blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "horde_kudos_transactions"
        indexes = [models.Index(fields=["user", "created"], name="kudos_tx_user_created")]

    def __str__(self) -> str:
        return f"{self.kind} {self.amount} for {self.user_id}"
