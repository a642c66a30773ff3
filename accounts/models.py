from __future__ import annotations

import hashlib
import uuid
from datetime import datetime
from decimal import Decimal

from django.db import models


def hash_api_key(api_key: str) -> str:
    """Keys are stored as SHA-256 hex digests; the plain key is shown once, at creation."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def shared_key_id_of(api_key: str) -> uuid.UUID | None:
    """The shared key id an `apikey` spells, None when it spells none. Python's UUID reads many
    spellings of one id (any case, braces, a urn, hyphens anywhere), and each names the key."""
    try:
        return uuid.UUID(api_key.strip())
    except (ValueError, AttributeError):
        return None


KUDOS_TRANSFER_IDEMPOTENCY_KEY_MAX_LENGTH = 255
KUDOS_TRANSFER_DEFAULT_AMOUNT = 100  # upstream's, when a transfer names no amount
# A transfer straight back to its sender waits this long (upstream's "very recently").
KUDOS_TRANSFER_REVERSE_COOLDOWN_SECONDS = 60


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
        TRANSFER = "transfer"

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


class KudosTransfer(models.Model):
    """One transfer of kudos between users (POST /api/v2/kudos/transfer): its log, what stops one
    sent straight back, and the claim of its client's Idempotency-Key."""

    source = models.ForeignKey(HordeUser, on_delete=models.CASCADE, related_name="kudos_sent")
    dest = models.ForeignKey(HordeUser, on_delete=models.CASCADE, related_name="kudos_received")
    # The target as the sender named it (an alias or a shared key's id), for a retry's comparison.
    target = models.CharField(max_length=255)
    # Set when the transfer named a shared key: its owner was paid and the key's kudos grew.
    shared_key_id = models.UUIDField(null=True, blank=True)
    amount = models.DecimalField(max_digits=18, decimal_places=2)
    idempotency_key = models.CharField(max_length=KUDOS_TRANSFER_IDEMPOTENCY_KEY_MAX_LENGTH, null=True, blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "horde_kudos_transfers"
        constraints = [
            models.UniqueConstraint(
                fields=["source", "idempotency_key"],
                condition=models.Q(idempotency_key__isnull=False),
                name="kudos_transfer_idempotency_key",
            )
        ]
        indexes = [models.Index(fields=["source", "dest", "created"], name="kudos_transfer_pair_created")]


# Shared keys, as upstream's: -1 is "no limit" for the kudos and each per-job limit.
SHARED_KEY_UNLIMITED = -1
SHARED_KEY_DEFAULT_KUDOS = 5000
SHARED_KEY_MAX_KUDOS = 50_000_000
# A century: any longer expiry overflows the calendar (upstream sets no bound).
SHARED_KEY_MAX_EXPIRY_DAYS = 36_500
# How many keys a user may hold at once.
MAX_SHARED_KEYS = 3
MAX_SHARED_KEYS_TRUSTED = 10


class SharedKey(models.Model):
    """A key a user lends: requests made with it are the owner's, within the key's limits.

    The id is the key itself, sent as `apikey` (upstream's shared keys). `kudos` is what may still
    be spent through it (SHARED_KEY_UNLIMITED: no limit; 0: spent); the horde tax and each
    settlement draw it down, to 0 at least, and add to `utilized`.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(HordeUser, on_delete=models.CASCADE, related_name="shared_keys")
    name = models.CharField(max_length=255, null=True, blank=True)
    kudos = models.DecimalField(max_digits=18, decimal_places=2, default=Decimal(SHARED_KEY_DEFAULT_KUDOS))
    utilized = models.DecimalField(max_digits=18, decimal_places=2, default=Decimal("0"))
    expiry = models.DateTimeField(null=True, blank=True)
    # Per-job limits. The image ones are kept for upstream's wire; this horde serves text only.
    max_image_pixels = models.IntegerField(default=SHARED_KEY_UNLIMITED)
    max_image_steps = models.IntegerField(default=SHARED_KEY_UNLIMITED)
    max_text_tokens = models.IntegerField(default=SHARED_KEY_UNLIMITED)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "horde_shared_keys"

    def __str__(self) -> str:
        return f"shared key {self.name or self.pk} of {self.user_id}"

    @property
    def is_spent(self) -> bool:
        return self.kudos == 0

    def is_expired(self, now: datetime) -> bool:
        return self.expiry is not None and self.expiry < now

    @property
    def has_kudos_limit(self) -> bool:
        return self.kudos != SHARED_KEY_UNLIMITED
