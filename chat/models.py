from __future__ import annotations

import uuid
from decimal import Decimal

from django.db import models

from accounts.models import HordeUser
from workers.models import Worker


class GenerationRequest(models.Model):
    """A queued text (and later chat) request: one row per client submission, n jobs."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(HordeUser, on_delete=models.CASCADE, related_name="requests")
    is_chat = models.BooleanField(default=False)
    prompt = models.TextField()
    params = models.JSONField(default=dict)
    softprompt = models.CharField(max_length=255, blank=True, default="")
    n = models.PositiveSmallIntegerField(default=1)
    # Jobs not yet handed to a worker; a faulted job returns here.
    jobs_waiting = models.PositiveSmallIntegerField(default=1)
    max_length = models.PositiveIntegerField()
    max_context_length = models.PositiveIntegerField()
    # The requested models, in order; `any_model` when the client named none.
    requested_models = models.JSONField(default=list)
    any_model = models.BooleanField(default=True)
    # The worker list (a whitelist, or a blacklist when worker_blacklist) is in RequestWorker rows.
    has_worker_list = models.BooleanField(default=False)
    worker_blacklist = models.BooleanField(default=False)
    trusted_workers = models.BooleanField(default=False)
    validated_backends = models.BooleanField(default=False)
    slow_workers = models.BooleanField(default=True)
    allow_downgrade = models.BooleanField(default=False)
    disable_batching = models.BooleanField(default=False)
    # Priority is the requester's kudos at activation; the queue adds QUEUE_PRIORITY_STEP every
    # QUEUE_PRIORITY_STEP_SECONDS of waiting, on a horde-wide tick. Ordering by
    # priority - STEP * tick_at_creation is therefore the same order at every instant, so it is stored.
    priority = models.BigIntegerField(default=0)
    queue_score = models.BigIntegerField(default=0)
    faulted = models.BooleanField(default=False)
    cancelled = models.BooleanField(default=False)
    kudos_quote = models.DecimalField(max_digits=18, decimal_places=2, default=Decimal("0"))
    kudos_held = models.DecimalField(max_digits=18, decimal_places=2, default=Decimal("0"))
    consumed_kudos = models.DecimalField(max_digits=18, decimal_places=2, default=Decimal("0"))
    client_agent = models.CharField(max_length=255, blank=True, default="")
    ip_address = models.CharField(max_length=64, blank=True, default="")
    created = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()

    # --- Chat requests (spec: chat_requests.md, "Schema") ---
    messages = models.JSONField(null=True, blank=True)
    submitted_prompt = models.TextField(blank=True, default="")
    operation_key = models.UUIDField(null=True, blank=True)
    operation_fingerprint = models.CharField(max_length=64, blank=True, default="")
    context_adjustments = models.JSONField(null=True, blank=True)
    chat_extras = models.JSONField(null=True, blank=True)
    chat_required_features = models.JSONField(default=list, blank=True)
    # The same set as a bitmask over CHAT_DECLARATION_BITS, so the pop tests it in SQL on any database.
    chat_required_mask = models.BigIntegerField(default=0)
    chat_conformance = models.CharField(max_length=16, default="strict")
    chat_tools_temperature = models.FloatField(null=True, blank=True)
    chat_messages_offloaded = models.BooleanField(default=False)
    chat_has_images = models.BooleanField(default=False)
    chat_fault_reason = models.CharField(max_length=1000, null=True, blank=True)
    chat_fault_rc = models.CharField(max_length=32, null=True, blank=True)
    # Until when a front waits for this request (contract.front_lease); null: no front lease.
    front_lease_expires_at = models.DateTimeField(null=True, blank=True)
    # The pricing's context multiplier (chat.pricing.context_multiplier of prompt and max_length),
    # fixed at creation: the pop prices its jobs from it without reading the prompt (ADR 0026).
    kudos_context = models.FloatField(null=True, blank=True)
    # The front process holding that lease (contract.front_lease.FRONT_ID_HEADER); null: unnamed.
    front_id = models.CharField(max_length=320, null=True, blank=True)
    # The shared key the request was made with, whose kudos its tax and settlements draw down. A
    # plain id, as the ledger's: a deleted key leaves its requests charged to the owner alone.
    shared_key_id = models.UUIDField(null=True, blank=True)
    # What the request reserves of a limited shared key's kudos per job not yet settled (waiting or
    # processing): its quote per job at its dearest model, the tax aside (docs/adr/0089). 0 without one.
    # The database's own default too, so a process still running the previous code during a
    # deploy (migrated first, restarted after) can still insert requests.
    shared_key_reserve = models.DecimalField(
        max_digits=18, decimal_places=2, default=Decimal("0"), db_default=Decimal("0")
    )

    class Meta:
        db_table = "horde_requests"
        constraints = [
            # One request per (user, operation key); built CONCURRENTLY on PostgreSQL (migration 0003).
            models.UniqueConstraint(
                fields=["user", "operation_key"],
                condition=models.Q(operation_key__isnull=False),
                name="ix_requests_user_operation_key",
            ),
        ]
        indexes = [
            # The pop walks waiting requests in queue order.
            models.Index(
                fields=["-queue_score", "created"],
                name="request_queue_order",
                condition=models.Q(jobs_waiting__gt=0, faulted=False, cancelled=False),
            ),
            models.Index(fields=["user", "jobs_waiting"], name="request_user_waiting"),
            models.Index(fields=["expires_at"], name="request_expiry"),
            # The front-lease sweep reads only requests under a lease (migration 0004).
            models.Index(
                fields=["front_lease_expires_at"],
                name="request_front_lease",
                condition=models.Q(front_lease_expires_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return str(self.id)


class RequestModel(models.Model):
    """One requested model of a request, so the pop can match models with an indexed join."""

    request = models.ForeignKey(GenerationRequest, on_delete=models.CASCADE, related_name="model_rows")
    name = models.CharField(max_length=255)

    class Meta:
        db_table = "horde_request_models"
        indexes = [models.Index(fields=["name", "request"], name="request_model_name")]
        constraints = [models.UniqueConstraint(fields=["request", "name"], name="request_model_unique")]


class QueueEntry(models.Model):
    """A waiting request under one of its models, in queue order: the pop walks the lists of the
    models its worker serves, not the whole queue (docs/adr/0050-a-queue-list-per-model.md).

    PostgreSQL keeps these rows itself, by trigger on horde_requests (migration 0009): a row per
    requested model (and one under "" for a text request that named none) while the request has a
    job waiting and is neither faulted nor cancelled. Nothing in Python writes them; elsewhere
    (SQLite) the table stays empty and the pop walks the queue in the ORM."""

    pk = models.CompositePrimaryKey("request_id", "is_chat", "model")
    # No constraint: the trigger removes a request's rows when it stops waiting or is deleted.
    request = models.ForeignKey(
        GenerationRequest, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    is_chat = models.BooleanField()
    model = models.TextField()
    # The requester, for the pop's first walk: its worker's owner's and priority users' requests.
    user_id = models.BigIntegerField()
    # The request's own order (GenerationRequest.queue_score, created), fixed at its creation.
    queue_score = models.BigIntegerField()
    created = models.DateTimeField()

    class Meta:
        db_table = "horde_queue_entries"
        indexes = [
            models.Index(fields=["is_chat", "model", "-queue_score", "created"], name="queue_entry_order"),
            models.Index(fields=["user_id", "is_chat", "model", "-queue_score", "created"], name="queue_entry_user_order"),
        ]


class RequestWorker(models.Model):
    """One worker of a request's worker list."""

    request = models.ForeignKey(GenerationRequest, on_delete=models.CASCADE, related_name="worker_rows")
    worker_id = models.UUIDField()

    class Meta:
        db_table = "horde_request_workers"
        constraints = [models.UniqueConstraint(fields=["request", "worker_id"], name="request_worker_unique")]


class HordeModes(models.Model):
    """Horde-wide switches a moderator sets at run time (one row)."""

    maintenance = models.BooleanField(default=False)

    class Meta:
        db_table = "horde_modes"


class Generation(models.Model):
    """One job handed to a worker, and its result once submitted."""

    class State(models.TextChoices):
        PROCESSING = "processing"
        OK = "ok"
        CENSORED = "censored"
        CSAM = "csam"
        FAULTED = "faulted"
        CANCELLED = "cancelled"

    FINISHED_STATES = (State.OK, State.CENSORED, State.CSAM)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    request = models.ForeignKey(GenerationRequest, on_delete=models.CASCADE, related_name="generations")
    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="generations")
    model = models.CharField(max_length=255, blank=True, default="")
    state = models.CharField(max_length=16, choices=State.choices, default=State.PROCESSING)
    text = models.TextField(null=True, blank=True)
    seed = models.BigIntegerField(default=0)
    gen_metadata = models.JSONField(default=list)
    kudos = models.DecimalField(max_digits=18, decimal_places=2, default=Decimal("0"))
    created = models.DateTimeField(auto_now_add=True)
    lease_expires_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    # --- Chat jobs ---
    message = models.JSONField(null=True, blank=True)
    finish_reason = models.CharField(max_length=32, null=True, blank=True)
    native_finish_reason = models.CharField(max_length=32, null=True, blank=True)
    prompt_tokens = models.IntegerField(null=True, blank=True)
    completion_tokens = models.IntegerField(null=True, blank=True)
    reasoning_tokens = models.IntegerField(null=True, blank=True)
    charge_basis = models.CharField(max_length=16, null=True, blank=True)
    assigned_model = models.CharField(max_length=255, null=True, blank=True)
    assigned_max_context_length = models.IntegerField(null=True, blank=True)
    assigned_max_length = models.IntegerField(null=True, blank=True)
    image_transport = models.CharField(max_length=16, null=True, blank=True)
    chat_refusal_rc = models.CharField(max_length=32, null=True, blank=True)
    settled_character_count = models.IntegerField(null=True, blank=True)
    over_capacity_at_assignment = models.BooleanField(default=False)

    # --- Priced at pop (docs/adr/0026-price-at-pop.md): a text submit settles from these alone ---
    # reward = round(tokens * price_rate + price_flat, 2), tokens capped at price_max_length;
    # null on a job popped before they existed (its submit reads the rows and prices them).
    price_rate = models.FloatField(null=True, blank=True)
    price_flat = models.FloatField(null=True, blank=True)
    price_max_length = models.IntegerField(null=True, blank=True)
    price_owner_trusted = models.BooleanField(null=True, blank=True)

    class Meta:
        db_table = "horde_generations"
        indexes = [
            models.Index(
                fields=["lease_expires_at"],
                name="generation_open_lease",
                condition=models.Q(state="processing"),
            ),
        ]

    def __str__(self) -> str:
        return str(self.id)


class SweepRun(models.Model):
    """When each periodic sweep (a beat task, chat/tasks.py) last finished: /healthz shows a dead beat."""

    task = models.CharField(primary_key=True, max_length=100)
    finished_at = models.DateTimeField()
    rows = models.IntegerField(default=0)  # what the last run changed (jobs faulted, requests deleted)

    class Meta:
        db_table = "horde_sweep_runs"


class TextGenerationStat(models.Model):
    """The finished text generations of expired (deleted) requests, per model and minute: what
    GET /stats/text/totals and /stats/text/models count once the generations are gone (ADR 0100).
    Folded in by the expiry sweep in the transaction that deletes the request, so each generation
    is counted either here or live, never both."""

    model = models.CharField(max_length=255)
    minute = models.DateTimeField()  # the minute the generations finished in (its start)
    requests = models.BigIntegerField(default=0)
    tokens = models.BigIntegerField(default=0)  # the requests' max_length, as upstream counts tokens

    class Meta:
        db_table = "horde_text_generation_stats"
        constraints = [models.UniqueConstraint(fields=["model", "minute"], name="horde_text_stats_model_minute")]
        indexes = [models.Index(fields=["minute"], name="horde_text_stats_minute")]
