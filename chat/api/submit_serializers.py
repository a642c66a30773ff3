"""Wire shapes of the submit route's chat form (spec: chat_requests.md, "Structured submit").

The chat fields are checked by contract.chat_verify.parse_chat_submit, so every refusal is the
spec's 400 ChatSubmitInvalid; these serializers read the job id and document the shape.
"""

from __future__ import annotations

from drf_spectacular.utils import PolymorphicProxySerializer
from rest_framework import serializers

from chat.api.serializers import TextSubmitInputSerializer
from contract.chat_declaration import ChatFaultReason, ChatFinishReason
from contract.chat_limits import (
    MAX_CHAT_NATIVE_FINISH_REASON_LENGTH,
    MAX_CHAT_REPORTED_TOKENS,
    MAX_CHAT_TOOL_CALL_COUNT,
)
from contract.chat_verify import CHAT_SUBMIT_STATES


class SubmitIdSerializer(serializers.Serializer):
    """The job id every submit carries; a malformed one is a schema failure, as on text submits."""

    id = serializers.UUIDField()


class ChatSubmitToolCallFunctionSerializer(serializers.Serializer):
    name = serializers.CharField()
    arguments = serializers.CharField(allow_blank=True)


class ChatSubmitToolCallSerializer(serializers.Serializer):
    id = serializers.CharField(max_length=256)
    type = serializers.ChoiceField(choices=["function"])
    function = ChatSubmitToolCallFunctionSerializer()


class ChatSubmitReplyMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=["assistant"])
    content = serializers.CharField(allow_null=True, allow_blank=True, help_text="null only with tool_calls")
    # many=True hands max_length to its ListSerializer (DRF 3.14); the stubs' __init__ lacks it.
    tool_calls = ChatSubmitToolCallSerializer(  # type: ignore[call-arg]
        many=True, required=False, max_length=MAX_CHAT_TOOL_CALL_COUNT
    )
    reasoning_content = serializers.CharField(required=False, allow_blank=True)


class ChatSubmitInputSerializer(serializers.Serializer):
    """A chat job's submit: a structured reply, or {id, state: faulted, model_id, fault_reason?}."""

    id = serializers.UUIDField()
    message = ChatSubmitReplyMessageSerializer(required=False)
    finish_reason = serializers.ChoiceField(choices=[r.value for r in ChatFinishReason], required=False)
    native_finish_reason = serializers.CharField(
        max_length=MAX_CHAT_NATIVE_FINISH_REASON_LENGTH, required=False
    )
    prompt_tokens = serializers.IntegerField(min_value=0, max_value=MAX_CHAT_REPORTED_TOKENS, required=False)
    completion_tokens = serializers.IntegerField(
        min_value=0, max_value=MAX_CHAT_REPORTED_TOKENS, required=False
    )
    reasoning_tokens = serializers.IntegerField(
        min_value=0, max_value=MAX_CHAT_REPORTED_TOKENS, required=False
    )
    model_id = serializers.CharField(help_text="The generation's assigned model")
    state = serializers.ChoiceField(choices=list(CHAT_SUBMIT_STATES), default="ok")
    fault_reason = serializers.CharField(
        required=False, help_text="With state faulted only: " + ", ".join(r.value for r in ChatFaultReason)
    )


JobSubmitInputSerializer = PolymorphicProxySerializer(
    component_name="JobSubmitInput",
    serializers=[TextSubmitInputSerializer, ChatSubmitInputSerializer],
    resource_type_field_name=None,
)
