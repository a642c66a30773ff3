"""Wire shapes of the native routes (upstream field names, ranges and defaults).

An input serializer's validated data is what its service takes; an output serializer renders
what the service returns. Views render through one instance of each output serializer, made
here once (`*_OUTPUT`): building a DRF serializer deep-copies its declared fields, about a
millisecond a pop on the benchmark box, while representing through a built one costs tens of
microseconds (docs/adr/0031-chat-api-schema-from-contract.md). The chat request's shape and the
chat status body are the contract's pydantic models (contract.chat_shapes, contract.chat_status).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from chat.api.strict_fields import (
    NulReplacingCharField,
    StrictBooleanField,
    StrictCharField,
    StrictFloatField,
    StrictIntegerField,
    WorkerIdField,
)
from chat.services.pop import PoppedJob, build_job_payload
from contract.text import (
    GENERATION_STATES,
    MAX_BRIDGE_AGENT_LENGTH,
    MAX_TEXT_REQUEST_MODELS,
    MAX_WORKER_NAME_LENGTH,
    TEXT_MAX_CONTEXT_LENGTH_DEFAULT,
    TEXT_MAX_LENGTH_DEFAULT,
    TEXT_PARAM_RANGES,
    TEXT_POP_AMOUNT_RANGE,
    TEXT_POP_MAX_CONTEXT_LENGTH_DEFAULT,
    TEXT_POP_MAX_LENGTH_DEFAULT,
    TEXT_POP_MAX_THREADS,
    TEXT_POP_WAIT_MAX_SECONDS,
    TEXT_SAMPLER_ORDER_RANGE,
    bridge_agent_within_limit,
)


def _ranged(name: str, **kwargs):
    """The field of a numeric text param, its JSON type and range as contract.text defines them."""
    kind, low, high = TEXT_PARAM_RANGES[name]
    if kind == "integer":
        assert isinstance(low, int) and isinstance(high, int)  # an integer param's bounds are integers
        return StrictIntegerField(min_value=low, max_value=high, **kwargs)
    return StrictFloatField(min_value=low, max_value=high, **kwargs)


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
        child=StrictCharField(allow_blank=True, trim_whitespace=False), required=False
    )

    def validate(self, attrs):
        """The empty stop sequences dropped: one stops nothing, and KoboldAI Lite sends an empty
        instruct tag as one; and each sequence kept once, in order, since upstream's bound counts
        the distinct ones and a worker was sent every copy (docs/adr/0092). Here, not in a
        validate_stop_sequence, so the canonical path runs it too. Upstream's bounds are the
        service's (contract.text.text_params_refusal)."""
        stops = attrs.get("stop_sequence")
        if stops is not None:
            attrs["stop_sequence"] = list(dict.fromkeys(stop for stop in stops if stop))
        return attrs


# The params of a body without them: each param's default (n and the two lengths).
_TEXT_PARAMS_DEFAULTS = {
    name: field.default
    for name, field in TextParamsSerializer().fields.items()
    if field.default is not serializers.empty
}


class TextAsyncInputSerializer(serializers.Serializer):
    """The text request body. Every key upstream's schema types is held to its JSON type; the ones
    this horde does not apply (webhook, style, proxied_account, extra_slow_workers,
    extra_source_images) are accepted as upstream accepts them and dropped."""

    # Blank is upstream's 400 MissingPrompt, refused by the service (text_request_create).
    prompt = StrictCharField(trim_whitespace=False, allow_blank=True, max_length=4_000_000)
    params = TextParamsSerializer(required=False)
    softprompt = StrictCharField(required=False, allow_blank=True, allow_null=True, max_length=255)
    trusted_workers = StrictBooleanField(default=False)
    # Upstream's request parser defaults it to false (ADR 0012).
    validated_backends = StrictBooleanField(default=False)
    slow_workers = StrictBooleanField(default=True)
    worker_blacklist = StrictBooleanField(default=False)
    models = serializers.ListField(
        child=StrictCharField(max_length=255), max_length=MAX_TEXT_REQUEST_MODELS, required=False, default=list
    )
    workers = serializers.ListField(child=WorkerIdField(), max_length=20, required=False, default=list)
    dry_run = StrictBooleanField(default=False)
    allow_downgrade = StrictBooleanField(default=False)
    disable_batching = StrictBooleanField(default=False)
    extra_slow_workers = StrictBooleanField(required=False, help_text="accepted, not applied")
    webhook = StrictCharField(required=False, allow_blank=True, help_text="accepted, not applied")
    # The metaclass takes declared fields out of the class: Field.style, each instance's own, is untouched.
    style = StrictCharField(  # type: ignore[assignment]
        required=False, min_length=3, max_length=1024, help_text="accepted, not applied"
    )
    proxied_account = StrictCharField(required=False, allow_blank=True, help_text="accepted, not applied")
    extra_source_images = serializers.ListField(
        child=serializers.DictField(), required=False, help_text="accepted, not applied"
    )
    # As the chat route's horde.operation_key (docs/adr/0020-front-lease.md).
    operation_key = serializers.UUIDField(required=False, allow_null=True, default=None)
    # Not upstream's: the OpenAI front's legacy completions ask for the chat route's lowering (ADR 0095).
    lower_max_length_to_workers = StrictBooleanField(
        default=False,
        help_text="a max_length above every online worker's serving the models is lowered to the largest",
    )
    # The front's own context sizing, not a client's (ADR 0111): a context the client chose decides.
    lower_max_context_length_to_workers = StrictBooleanField(
        default=False,
        help_text=(
            "a max_context_length above that of every online worker that could take the request (its models, "
            "max_length and worker list) is lowered to the largest, not below the prompt's estimate (four "
            "characters a token) and the max_length"
        ),
    )

    NOT_APPLIED = ("extra_slow_workers", "webhook", "style", "proxied_account", "extra_source_images")

    def validate(self, attrs):
        """The body as services.TextRequestInput takes it: n and the two lengths out of params,
        the keys not applied dropped, an absent softprompt as ""."""
        params = dict(attrs.pop("params", None) or _TEXT_PARAMS_DEFAULTS)
        for key in self.NOT_APPLIED:
            attrs.pop(key, None)
        return {
            **attrs,
            "softprompt": attrs.get("softprompt") or "",
            "params": params,
            "n": params.pop("n", 1),
            "max_length": params.pop("max_length"),
            "max_context_length": params.pop("max_context_length"),
        }


def _without_empty(data: dict, *keys: str) -> dict:
    """Upstream leaves these keys out, rather than null or false, when they do not apply."""
    for key in keys:
        if not data.get(key):
            data.pop(key, None)
    return data


class TextAsyncOutputSerializer(serializers.Serializer):
    """A services.CreatedRequest: {id, kudos, message?} queued (202), {id, kudos} for a repeated
    operation key, {kudos} for a dry run (200)."""

    id = serializers.UUIDField(source="request.id", required=False, help_text="absent on a dry run")
    kudos = serializers.FloatField()
    message = serializers.CharField(required=False)
    context_adjustments = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        help_text="only with lower_max_length_to_workers, when the max_length was lowered",
    )

    def to_representation(self, instance):
        return _without_empty(super().to_representation(instance), "message", "context_adjustments")


class GenerationSerializer(serializers.Serializer):
    text = serializers.CharField(allow_null=True)
    seed = serializers.IntegerField()
    gen_metadata = serializers.ListField(child=serializers.DictField())
    worker_id = serializers.UUIDField()
    worker_name = serializers.CharField()
    model = serializers.CharField()
    state = serializers.CharField()


class SinglePeriodTxtStatSerializer(serializers.Serializer):
    """Upstream's SinglePeriodTxtStat (the schema's; the selector builds the body)."""

    requests = serializers.IntegerField(help_text="The amount of text requests generated during this period.")
    tokens = serializers.IntegerField(help_text="The amount of tokens generated during this period.")


class StatsTxtTotalsSerializer(serializers.Serializer):
    """Upstream's StatsTxtTotals."""

    minute = SinglePeriodTxtStatSerializer()
    hour = SinglePeriodTxtStatSerializer()
    day = SinglePeriodTxtStatSerializer()
    month = SinglePeriodTxtStatSerializer()
    total = SinglePeriodTxtStatSerializer()


class TxtModelStatsSerializer(serializers.Serializer):
    """Upstream's TxtModelStats: per period, requests fulfilled per model name."""

    day = serializers.DictField(child=serializers.IntegerField(), help_text="Requests per model in the past day.")
    month = serializers.DictField(child=serializers.IntegerField(), help_text="Requests per model in the past month.")
    total = serializers.DictField(child=serializers.IntegerField(), help_text="Requests per model, all time.")


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
    # Upstream's defaults for a pop that leaves them out (its parser and PopInputKobold).
    max_length = serializers.IntegerField(min_value=1, max_value=1_048_576, default=TEXT_POP_MAX_LENGTH_DEFAULT)
    max_context_length = serializers.IntegerField(
        min_value=1, max_value=1_048_576, default=TEXT_POP_MAX_CONTEXT_LENGTH_DEFAULT
    )
    threads = serializers.IntegerField(min_value=1, max_value=TEXT_POP_MAX_THREADS, default=1)
    amount = serializers.IntegerField(
        min_value=TEXT_POP_AMOUNT_RANGE[0], max_value=TEXT_POP_AMOUNT_RANGE[1], default=1
    )
    bridge_agent = serializers.CharField(
        max_length=MAX_BRIDGE_AGENT_LENGTH, default="unknown:0:unknown", allow_blank=True
    )
    nsfw = serializers.BooleanField(default=False)
    # Bounded as models is: each pop matches every priority user's queue (docs/adr/0069).
    softprompts = serializers.ListField(child=serializers.CharField(max_length=255), max_length=100, default=list)
    priority_usernames = serializers.ListField(
        # Blank is let through to the pop's own check, which refuses it with upstream's rc.
        child=serializers.CharField(max_length=200, allow_blank=True), max_length=100, default=list
    )
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

    def to_internal_value(self, data):
        """A bridge_agent over the bound, the scribe's after hours of config reloads, read with
        its repeated engine segments collapsed before the bound applies (docs/adr/0097). The
        canonical path (fast_validation) never takes a value over the bound: it comes here."""
        agent = data.get("bridge_agent") if isinstance(data, Mapping) else None
        if isinstance(agent, str) and len(agent) > MAX_BRIDGE_AGENT_LENGTH:
            data = {**data, "bridge_agent": bridge_agent_within_limit(agent)}
        return super().to_internal_value(data)


class TextPopOutputSerializer(serializers.Serializer):
    """A chat.services.pop.PoppedJob: a job, or an empty pop (no request). messages and
    extra_source_images are upstream's keys for what this horde never sends."""

    payload = serializers.SerializerMethodField()
    id = serializers.SerializerMethodField()
    ids = serializers.SerializerMethodField()
    messages = serializers.SerializerMethodField()
    ttl = serializers.SerializerMethodField()
    extra_source_images = serializers.SerializerMethodField()
    skipped = serializers.DictField(child=serializers.IntegerField())
    softprompt = serializers.SerializerMethodField()
    model = serializers.CharField(allow_null=True)
    chat = serializers.BooleanField(source="request.is_chat", required=False, help_text="true on a chat job only")

    def get_payload(self, job: PoppedJob) -> dict[str, Any]:
        return build_job_payload(job.request, job.messages_url) if job.request is not None else {}

    @extend_schema_field(serializers.UUIDField(allow_null=True))
    def get_id(self, job: PoppedJob) -> str | None:
        return str(job.generations[0].id) if job.generations else None

    @extend_schema_field(serializers.ListField(child=serializers.UUIDField()))
    def get_ids(self, job: PoppedJob) -> list[str]:
        return [str(generation.id) for generation in job.generations]

    @extend_schema_field(serializers.ListField(child=serializers.DictField(), allow_null=True))
    def get_messages(self, job: PoppedJob) -> None:
        return None

    def get_ttl(self, job: PoppedJob) -> int | None:
        return settings.HORDE_TEXT_JOB_LEASE_SECONDS if job.request is not None else None

    @extend_schema_field(serializers.ListField(child=serializers.DictField()))
    def get_extra_source_images(self, job: PoppedJob) -> list:
        return []

    def get_softprompt(self, job: PoppedJob) -> str | None:
        return None if job.request is None or job.request.is_chat else job.request.softprompt or None

    def to_representation(self, instance):
        # Only a chat job carries the key; text jobs are unchanged.
        return _without_empty(super().to_representation(instance), "chat")


class GenMetadataSerializer(serializers.Serializer):
    type = serializers.CharField(max_length=64)
    value = serializers.CharField(max_length=64)
    ref = serializers.CharField(max_length=255, required=False)


class TextSubmitInputSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    # Required, as upstream's parser: a text submit without it is refused (spec: Structured submit).
    generation = NulReplacingCharField(allow_blank=True, trim_whitespace=False)
    state = serializers.ChoiceField(choices=GENERATION_STATES, default="ok")
    seed = serializers.IntegerField(default=0, min_value=-(2**63), max_value=2**63 - 1)
    gen_metadata = GenMetadataSerializer(many=True, required=False, default=list)


class SubmitOutputSerializer(serializers.Serializer):
    reward = serializers.FloatField()


# --- the chat route's answers ------------------------------------------------------------------


class ChatWarningSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()


class ChatAsyncOutputSerializer(serializers.Serializer):
    """A queued chat request (202), from chat_create.ChatCreated."""

    id = serializers.UUIDField(source="request.id")
    kudos = serializers.FloatField()
    message = serializers.CharField(allow_null=True)
    warnings = ChatWarningSerializer(many=True)


class ChatAsyncRepeatSerializer(serializers.Serializer):
    """A repeated operation key (200): the claim's request, nothing queued."""

    id = serializers.UUIDField(source="request.id")
    kudos = serializers.FloatField()


class ChatResolvedSerializer(serializers.Serializer):
    context_fit = serializers.CharField()
    max_length = serializers.IntegerField()
    max_context_length = serializers.IntegerField()


class ChatQuoteSerializer(serializers.Serializer):
    """A dry run's quote (200): the price and the sizes the request would run at."""

    kudos = serializers.FloatField()
    estimated_prompt_tokens = serializers.IntegerField(source="dry_run.estimated_prompt_tokens")
    context_adjustments = serializers.ListField(
        child=serializers.DictField(), allow_null=True, source="dry_run.context_adjustments"
    )
    resolved = ChatResolvedSerializer(source="dry_run.resolved")


# One instance of each, shared by every request (see the module's docstring).
TEXT_ASYNC_OUTPUT = TextAsyncOutputSerializer()
POP_OUTPUT = TextPopOutputSerializer()
SUBMIT_OUTPUT = SubmitOutputSerializer()
CHAT_ASYNC_OUTPUT = ChatAsyncOutputSerializer()
CHAT_ASYNC_REPEAT_OUTPUT = ChatAsyncRepeatSerializer()
CHAT_QUOTE_OUTPUT = ChatQuoteSerializer()
