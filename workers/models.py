from __future__ import annotations

import uuid
from decimal import Decimal

from django.db import models

from accounts.models import HordeUser
from contract.text import MAX_WORKER_NAME_LENGTH

# Upstream's bounds on what an owner writes on a worker (its columns' lengths).
WORKER_INFO_MAX_LENGTH = 1000
WORKER_MAINTENANCE_MESSAGE_MAX_LENGTH = 300


class Worker(models.Model):
    """A text worker, registered on its first pop and updated by each later pop (its check-in)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=MAX_WORKER_NAME_LENGTH, unique=True)
    owner = models.ForeignKey(HordeUser, on_delete=models.CASCADE, related_name="workers")
    served_models = models.JSONField(default=list)
    max_length = models.PositiveIntegerField(default=80)
    max_context_length = models.PositiveIntegerField(default=1024)
    threads = models.PositiveIntegerField(default=1)
    bridge_agent = models.CharField(max_length=1000, default="unknown:0:unknown")
    # is_validated_bridge(bridge_agent), written with it at check-in: the speed gate's SQL asks
    # which online workers a request with validated_backends accepts.
    validated_bridge = models.BooleanField(default=False)
    nsfw = models.BooleanField(default=False)
    softprompts = models.JSONField(default=list)
    priority_usernames = models.JSONField(default=list)
    maintenance = models.BooleanField(default=False)
    paused = models.BooleanField(default=False)
    # Tokens per second of the last WORKER_SPEED_SAMPLES completed jobs; speed is their mean.
    speed_samples = models.JSONField(default=list)
    speed = models.FloatField(null=True, blank=True)
    kudos_earned = models.DecimalField(max_digits=18, decimal_places=2, default=Decimal("0"))
    fulfilments = models.PositiveIntegerField(default=0)
    aborted_jobs = models.PositiveIntegerField(default=0)
    # Upstream's hourly count of aborted jobs (log_aborted_job): the jobs dropped since the window
    # started; past HORDE_WORKER_DROPPED_JOBS_PER_HOUR the worker goes into maintenance.
    aborted_in_window = models.PositiveIntegerField(default=0)
    aborted_window_started_at = models.DateTimeField(null=True, blank=True)
    tokens_generated = models.BigIntegerField(default=0)
    last_check_in = models.DateTimeField(db_index=True)

    # --- Chat declaration of the latest pop (spec: chat_requests.md, "Chat declaration on pop") ---
    accepts_chat_jobs = models.BooleanField(default=False)
    accepts_prompt_jobs = models.BooleanField(default=True)
    chat_features = models.JSONField(default=list, blank=True)
    # chat_features as a bitmask over CHAT_DECLARATION_BITS (see GenerationRequest.chat_required_mask).
    chat_feature_mask = models.BigIntegerField(default=0)
    chat_max_context_length = models.PositiveIntegerField(null=True, blank=True)
    chat_max_length = models.PositiveIntegerField(null=True, blank=True)
    chat_model_id = models.CharField(max_length=255, null=True, blank=True)
    image_transports = models.JSONField(default=list, blank=True)
    chat_tools_max_temperature = models.FloatField(null=True, blank=True)
    nonconformant_replies = models.PositiveIntegerField(default=0)
    # The owner's note shown in the worker's details, and the message its pops get in maintenance
    # (PUT /api/v2/workers/{id}, as upstream's); null: none set.
    info = models.CharField(max_length=WORKER_INFO_MAX_LENGTH, null=True, blank=True)
    maintenance_msg = models.CharField(max_length=WORKER_MAINTENANCE_MESSAGE_MAX_LENGTH, null=True, blank=True)
    created = models.DateTimeField(auto_now_add=True)
    # When a check-in or a switch last changed what the worker serves (for operators; the readers'
    # signal of such a change is ServingVersion).
    serving_changed_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        db_table = "horde_workers"

    def __str__(self) -> str:
        return self.name


class ServingVersion(models.Model):
    """The workers' serving version (workers.serving_version): one row, whose counter every
    check-in or switch that changes what a worker serves increments once that change is visible.
    No row yet means no such change since the table was made (the version is None)."""

    id = models.PositiveSmallIntegerField(primary_key=True)
    version = models.BigIntegerField()

    class Meta:
        db_table = "horde_serving_version"

    def __str__(self) -> str:
        return f"serving version {self.version}"
