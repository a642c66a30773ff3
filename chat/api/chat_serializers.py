"""Wire shapes of the native chat routes, for the OpenAPI schema.

The route validates bodies with the contract (contract.chat_shapes.validate_chat_request), whose
refusals carry the spec's rc and path; these serializers describe the same shapes.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from chat.api.serializers import TextStatusOutputSerializer
from contract.chat_limits import (
    CHAT_MAX_TOKENS_DEFAULT,
    MAX_CHAT_MAX_TOKENS,
    MAX_CHAT_MESSAGE_COUNT,
    MAX_CHAT_MODEL_COUNT,
    MAX_CHAT_TOOL_CALL_COUNT,
    MAX_CHAT_TOOL_COUNT,
    MIN_CHAT_MAX_TOKENS,
)
from contract.chat_policy import ChatConformance
from contract.chat_shapes import CHAT_ROLES, ChatAvailabilityMode, ChatContextFit, ChatReasoningEffort

_CONTENT_SCHEMA = {
    "oneOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "type": {"type": "string", "enum": ["text", "image_url"]},
                    "text": {"type": "string"},
                    "image_url": {
                        "type": "object",
                        "properties": {
                            "url": {"type": "string"},
                            "detail": {"type": "string", "enum": ["auto", "low", "high"]},
                        },
                        "required": ["url"],
                    },
                },
                "required": ["type"],
            },
        },
    ],
    "nullable": True,
}


@extend_schema_field(_CONTENT_SCHEMA)
class ChatContentField(serializers.JSONField):
    """A string or an array of text (and, on user messages, image_url) parts."""


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]})
class StopField(serializers.JSONField):
    pass


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}},
                        "required": ["name"],
                    },
                },
                "required": ["type", "function"],
            },
        ]
    }
)
class ToolChoiceField(serializers.JSONField):
    pass


class ChatHistoryToolCallFunctionSerializer(serializers.Serializer):
    name = serializers.CharField()
    arguments = serializers.CharField(allow_blank=True)


class ChatHistoryToolCallSerializer(serializers.Serializer):
    id = serializers.CharField(min_length=1, max_length=256)
    type = serializers.ChoiceField(choices=["function"])
    function = ChatHistoryToolCallFunctionSerializer()


class ChatRequestMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=list(CHAT_ROLES))
    content = ChatContentField(required=False)
    name = serializers.CharField(required=False)
    tool_calls = ChatHistoryToolCallSerializer(many=True, required=False, max_length=MAX_CHAT_TOOL_CALL_COUNT)
    tool_call_id = serializers.CharField(required=False, min_length=1, max_length=256)


class ChatRequestToolFunctionSerializer(serializers.Serializer):
    name = serializers.RegexField(r"^[A-Za-z0-9_-]{1,64}$")
    description = serializers.CharField(required=False)
    parameters = serializers.DictField(required=False)
    strict = serializers.BooleanField(required=False)


class ChatRequestToolSerializer(serializers.Serializer):
    type = serializers.ChoiceField(choices=["function"])
    function = ChatRequestToolFunctionSerializer()


class ChatRequestResponseFormatSerializer(serializers.Serializer):
    type = serializers.ChoiceField(choices=["text", "json_object", "json_schema"])
    json_schema = serializers.DictField(required=False, help_text="{name, schema, description?, strict?}")


class ChatHordeOptionsSerializer(serializers.Serializer):
    """The `horde` object: request options OpenAI has no key for."""

    only = serializers.ListField(child=serializers.CharField(), min_length=1, required=False)
    ignore = serializers.ListField(child=serializers.CharField(), min_length=1, required=False)
    trusted_workers = serializers.BooleanField(default=False)
    validated_backends = serializers.BooleanField(default=False)
    slow_workers = serializers.BooleanField(default=True)
    max_context_length = serializers.IntegerField(min_value=1, required=False)
    context_fit = serializers.ChoiceField(
        choices=[c.value for c in ChatContextFit], default=ChatContextFit.TRUNCATE_OLDEST.value
    )
    conformance = serializers.ChoiceField(
        choices=[c.value for c in ChatConformance], default=ChatConformance.STRICT.value
    )
    openai_guards = serializers.BooleanField(default=False)
    include_reasoning = serializers.BooleanField(default=True)
    availability_mode = serializers.ChoiceField(
        choices=[c.value for c in ChatAvailabilityMode], default=ChatAvailabilityMode.WAIT.value
    )
    max_kudos = serializers.IntegerField(min_value=1, required=False)
    dry_run = serializers.BooleanField(default=False)
    operation_key = serializers.UUIDField(required=False)


class ChatAsyncInputSerializer(serializers.Serializer):
    """An OpenAI chat completion body, plus `models` and the `horde` object."""

    model = serializers.CharField(required=False, help_text="Exactly one of model and models")
    models = serializers.ListField(
        child=serializers.CharField(min_length=1),
        min_length=1,
        max_length=MAX_CHAT_MODEL_COUNT,
        required=False,
    )
    messages = ChatRequestMessageSerializer(many=True, min_length=1, max_length=MAX_CHAT_MESSAGE_COUNT)
    max_tokens = serializers.IntegerField(
        min_value=MIN_CHAT_MAX_TOKENS,
        max_value=MAX_CHAT_MAX_TOKENS,
        required=False,
        help_text=f"max_length; default {CHAT_MAX_TOKENS_DEFAULT}",
    )
    max_completion_tokens = serializers.IntegerField(
        min_value=MIN_CHAT_MAX_TOKENS, max_value=MAX_CHAT_MAX_TOKENS, required=False
    )
    temperature = serializers.FloatField(required=False)
    top_p = serializers.FloatField(required=False)
    frequency_penalty = serializers.FloatField(min_value=-2, max_value=2, required=False)
    presence_penalty = serializers.FloatField(min_value=-2, max_value=2, required=False)
    seed = serializers.IntegerField(required=False)
    reasoning_effort = serializers.ChoiceField(choices=[e.value for e in ChatReasoningEffort], required=False)
    stop = StopField(required=False)
    n = serializers.IntegerField(min_value=1, max_value=1, required=False)
    stream = serializers.BooleanField(required=False)
    stream_options = serializers.DictField(required=False)
    user = serializers.CharField(required=False)
    metadata = serializers.DictField(required=False)
    tools = ChatRequestToolSerializer(many=True, required=False, max_length=MAX_CHAT_TOOL_COUNT)
    tool_choice = ToolChoiceField(required=False)
    parallel_tool_calls = serializers.BooleanField(required=False)
    response_format = ChatRequestResponseFormatSerializer(required=False)
    horde = ChatHordeOptionsSerializer(required=False)


class ChatWarningSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()


class ChatAsyncOutputSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    kudos = serializers.FloatField()
    message = serializers.CharField(allow_null=True)
    warnings = ChatWarningSerializer(many=True)


class ChatResolvedSerializer(serializers.Serializer):
    context_fit = serializers.CharField()
    max_length = serializers.IntegerField()
    max_context_length = serializers.IntegerField()


class ChatAsyncRepeatSerializer(serializers.Serializer):
    """A repeated operation key ({id, kudos}), or a dry run's quote ({kudos, ...})."""

    id = serializers.UUIDField(required=False)
    kudos = serializers.FloatField()
    estimated_prompt_tokens = serializers.IntegerField(required=False)
    context_adjustments = serializers.ListField(
        child=serializers.DictField(), allow_null=True, required=False
    )
    resolved = ChatResolvedSerializer(required=False)


class ErrorSerializer(serializers.Serializer):
    message = serializers.CharField()
    rc = serializers.CharField()


class ChatStatusGenerationSerializer(serializers.Serializer):
    text = serializers.CharField(allow_null=True)
    seed = serializers.IntegerField()
    gen_metadata = serializers.ListField(child=serializers.DictField())
    worker_id = serializers.UUIDField()
    worker_name = serializers.CharField()
    model = serializers.CharField()
    state = serializers.CharField()
    message = serializers.JSONField(
        allow_null=True, help_text="{role, content, tool_calls?, reasoning_content?}"
    )
    finish_reason = serializers.CharField(allow_null=True)
    native_finish_reason = serializers.CharField(allow_null=True)
    prompt_tokens = serializers.IntegerField(allow_null=True)
    completion_tokens = serializers.IntegerField(allow_null=True)
    reasoning_tokens = serializers.IntegerField(allow_null=True)
    charge_basis = serializers.CharField(allow_null=True)
    queue_wait_seconds = serializers.FloatField()


class ChatContextAdjustmentSerializer(serializers.Serializer):
    # `from` is a Python keyword: declared below under its wire name.
    to = serializers.IntegerField()
    reason = serializers.CharField()
    dropped_messages = serializers.IntegerField(required=False)


ChatContextAdjustmentSerializer._declared_fields["from"] = serializers.IntegerField()


class ChatStatusOutputSerializer(TextStatusOutputSerializer):
    """The text status keys, with structured generations, plus the chat request's own keys."""

    generations = ChatStatusGenerationSerializer(many=True)
    eligible_worker_threads = serializers.IntegerField()
    impossible_reason = serializers.DictField(allow_null=True)
    context_adjustments = ChatContextAdjustmentSerializer(many=True, allow_null=True)
    fault_reason = serializers.CharField(allow_null=True)
    fault_rc = serializers.CharField(allow_null=True)
