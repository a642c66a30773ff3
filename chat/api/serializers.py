"""Wire shapes of the native text routes (upstream field names, ranges and defaults)."""

from __future__ import annotations

from rest_framework import serializers

from chat.api.strict_fields import (
    StrictBooleanField,
    StrictCharField,
    StrictFloatField,
    StrictIntegerField,
    WorkerIdField,
)
from contract.text import (
    GENERATION_STATES,
    MAX_BRIDGE_AGENT_LENGTH,
    MAX_WORKER_NAME_LENGTH,
    TEXT_MAX_CONTEXT_LENGTH_DEFAULT,
    TEXT_MAX_LENGTH_DEFAULT,
    TEXT_MAX_STOP_SEQUENCE_CHARS,
    TEXT_MAX_STOP_SEQUENCES,
    TEXT_PARAM_RANGES,
    TEXT_POP_AMOUNT_RANGE,
    TEXT_POP_WAIT_MAX_SECONDS,
    TEXT_SAMPLER_ORDER_RANGE,
)


def _ranged(name: str, **kwargs):
    """The field of a numeric text param, its JSON type and range as contract.text defines them."""
    kind, low, high = TEXT_PARAM_RANGES[name]
    field = StrictIntegerField if kind == "integer" else StrictFloatField
    return field(min_value=low, max_value=high, **kwargs)


class TextParamsSerializer(serializers.Serializer):
    """Sampler parameters; every key KoboldAI Lite and the SDKs send is accepted, unknown keys dropped.
    Each value only in its JSON type (strict_fields), as upstream's schema has it."""

    n = _ranged("n", default=1)
    max_length = _ranged("max_length", default=TEXT_MAX_LENGTH_DEFAULT)
    max_context_length = _ranged("max_context_length", default=TEXT_MAX_CONTEXT_LENGTH_DEFAULT)
    frmtadsnsp = StrictBooleanField(required=False)
    frmtrmblln = StrictBooleanField(required=False)
    frmtrmspch = StrictBooleanField(required=False)
    frmttriminc = StrictBooleanField(required=False)
    rep_pen = _ranged("rep_pen", required=False)
    rep_pen_range = _ranged("rep_pen_range", required=False)
    rep_pen_slope = _ranged("rep_pen_slope", required=False)
    singleline = StrictBooleanField(required=False)
    temperature = _ranged("temperature", required=False)
    tfs = _ranged("tfs", required=False)
    top_a = _ranged("top_a", required=False)
    top_k = _ranged("top_k", required=False)
    top_p = _ranged("top_p", required=False)
    typical = _ranged("typical", required=False)
    min_p = _ranged("min_p", required=False)
    smoothing_factor = _ranged("smoothing_factor", required=False)
    dynatemp_range = _ranged("dynatemp_range", required=False)
    dynatemp_exponent = _ranged("dynatemp_exponent", required=False)
    sampler_order = serializers.ListField(
        child=StrictIntegerField(min_value=TEXT_SAMPLER_ORDER_RANGE[0], max_value=TEXT_SAMPLER_ORDER_RANGE[1]),
        required=False,
    )
    use_default_badwordsids = StrictBooleanField(required=False)
    stop_sequence = serializers.ListField(
        child=StrictCharField(allow_blank=False, trim_whitespace=False, max_length=TEXT_MAX_STOP_SEQUENCE_CHARS),
        max_length=TEXT_MAX_STOP_SEQUENCES,
        required=False,
    )


class TextAsyncInputSerializer(serializers.Serializer):
    """The text request body. Every key upstream's schema types is held to its JSON type; the ones
    this horde does not apply (webhook, style, proxied_account, extra_slow_workers,
    extra_source_images) are accepted as upstream accepts them and dropped."""

    prompt = StrictCharField(trim_whitespace=False, allow_blank=False, max_length=4_000_000)
    params = TextParamsSerializer(required=False)
    softprompt = StrictCharField(required=False, allow_blank=True, allow_null=True, max_length=255)
    trusted_workers = StrictBooleanField(default=False)
    # Upstream's request parser defaults it to false (ADR 0012).
    validated_backends = StrictBooleanField(default=False)
    slow_workers = StrictBooleanField(default=True)
    worker_blacklist = StrictBooleanField(default=False)
    models = serializers.ListField(
        child=StrictCharField(max_length=255), max_length=100, required=False, default=list
    )
    workers = serializers.ListField(child=WorkerIdField(), max_length=20, required=False, default=list)
    dry_run = StrictBooleanField(default=False)
    allow_downgrade = StrictBooleanField(default=False)
    disable_batching = StrictBooleanField(default=False)
    extra_slow_workers = StrictBooleanField(required=False, help_text="accepted, not applied")
    webhook = StrictCharField(required=False, allow_blank=True, help_text="accepted, not applied")
    style = StrictCharField(required=False, min_length=3, max_length=1024, help_text="accepted, not applied")
    proxied_account = StrictCharField(required=False, allow_blank=True, help_text="accepted, not applied")
    extra_source_images = serializers.ListField(
        child=serializers.DictField(), required=False, help_text="accepted, not applied"
    )
    # As the chat route's horde.operation_key (docs/adr/0020-front-lease.md).
    operation_key = serializers.UUIDField(required=False, allow_null=True, default=None)


class TextAsyncOutputSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    kudos = serializers.FloatField()
    message = serializers.CharField(required=False)


class GenerationSerializer(serializers.Serializer):
    text = serializers.CharField(allow_null=True)
    seed = serializers.IntegerField()
    gen_metadata = serializers.ListField(child=serializers.DictField())
    worker_id = serializers.UUIDField()
    worker_name = serializers.CharField()
    model = serializers.CharField()
    state = serializers.CharField()


class TextStatusOutputSerializer(serializers.Serializer):
    generations = GenerationSerializer(many=True)
    finished = serializers.IntegerField()
    processing = serializers.IntegerField()
    restarted = serializers.IntegerField()
    waiting = serializers.IntegerField()
    done = serializers.BooleanField()
    faulted = serializers.BooleanField()
    wait_time = serializers.IntegerField()
    queue_position = serializers.IntegerField()
    kudos = serializers.FloatField()
    is_possible = serializers.BooleanField()


class TextPopInputSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=MAX_WORKER_NAME_LENGTH, allow_blank=False)
    models = serializers.ListField(child=serializers.CharField(max_length=255), max_length=100, default=list)
    max_length = serializers.IntegerField(min_value=1, max_value=1_048_576, default=80)
    max_context_length = serializers.IntegerField(min_value=1, max_value=1_048_576, default=1024)
    threads = serializers.IntegerField(min_value=1, max_value=100, default=1)
    amount = serializers.IntegerField(
        min_value=TEXT_POP_AMOUNT_RANGE[0], max_value=TEXT_POP_AMOUNT_RANGE[1], default=1
    )
    bridge_agent = serializers.CharField(
        max_length=MAX_BRIDGE_AGENT_LENGTH, default="unknown:0:unknown", allow_blank=True
    )
    nsfw = serializers.BooleanField(default=False)
    softprompts = serializers.ListField(child=serializers.CharField(max_length=255), default=list)
    priority_usernames = serializers.ListField(child=serializers.CharField(max_length=200), default=list)
    # The chat declaration (spec: "Chat declaration on pop"). Typed loosely here on purpose: the
    # contract's parse_chat_declaration checks them and refuses with ChatDeclarationInvalid.
    chat_jobs = serializers.JSONField(required=False, help_text="boolean, default false")
    prompt_jobs = serializers.JSONField(required=False, help_text="boolean, default true; false needs chat_jobs")
    chat_features = serializers.JSONField(required=False, help_text="array of feature and guarantee names")
    chat_limits = serializers.JSONField(
        required=False, help_text="{max_context_length, max_length, tools_max_temperature?}; needed with chat_jobs"
    )
    model_id = serializers.JSONField(required=False, help_text="one of models; needed with chat_jobs")
    image_transports = serializers.JSONField(required=False, help_text="array of url, base64, messages_url")
    # This project's long poll (docs/adr/0024-pop-long-poll.md); upstream workers never send it.
    wait = serializers.IntegerField(
        min_value=0,
        default=0,
        help_text=f"seconds an empty pop may wait for a job (held at most {TEXT_POP_WAIT_MAX_SECONDS})",
    )


class TextPopOutputSerializer(serializers.Serializer):
    payload = serializers.DictField()
    id = serializers.UUIDField(allow_null=True)
    ids = serializers.ListField(child=serializers.UUIDField())
    messages = serializers.ListField(child=serializers.DictField(), allow_null=True)
    ttl = serializers.IntegerField(allow_null=True)
    extra_source_images = serializers.ListField(child=serializers.DictField())
    skipped = serializers.DictField(child=serializers.IntegerField())
    softprompt = serializers.CharField(allow_null=True)
    model = serializers.CharField(allow_null=True)
    chat = serializers.BooleanField(required=False, help_text="true on a chat job only")


class GenMetadataSerializer(serializers.Serializer):
    type = serializers.CharField(max_length=64)
    value = serializers.CharField(max_length=64)
    ref = serializers.CharField(max_length=255, required=False)


class TextSubmitInputSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    generation = serializers.CharField(allow_blank=True, trim_whitespace=False, default="")
    state = serializers.ChoiceField(choices=GENERATION_STATES, default="ok")
    seed = serializers.IntegerField(default=0, min_value=-(2**63), max_value=2**63 - 1)
    gen_metadata = GenMetadataSerializer(many=True, required=False, default=list)


class SubmitOutputSerializer(serializers.Serializer):
    reward = serializers.FloatField()
