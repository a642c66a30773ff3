from contract import chat_limits as limits


def test_limits_have_the_spec_values():
    assert limits.MAX_CHAT_MESSAGE_COUNT == 1024
    assert limits.MAX_CHAT_TEXT_BYTES == 1024 * 1024
    assert limits.MAX_CHAT_TOOL_COUNT == 128
    assert limits.MAX_CHAT_TOOL_SPEC_BYTES == 256 * 1024
    assert limits.MAX_CHAT_SCHEMA_NESTING == 10
    assert limits.MAX_CHAT_TOOL_CALL_COUNT == 128
    assert limits.MAX_CHAT_TOOL_CALL_ID_LENGTH == 256
    assert limits.MAX_CHAT_MODEL_COUNT == 5
    assert limits.MAX_CHAT_BODY_BYTES == 36 * 1024 * 1024
    assert limits.MAX_CHAT_IMAGE_COUNT == 20
    assert limits.MAX_CHAT_IMAGE_BYTES == 5 * 1024 * 1024
    assert limits.MAX_CHAT_IMAGE_TOTAL_BYTES == 25 * 1024 * 1024
    assert limits.MAX_CHAT_IMAGE_TOTAL_BYTES_UNTRUSTED == 5 * 1024 * 1024
    assert limits.MAX_CHAT_IMAGE_PIXELS == 3072 * 3072
    assert limits.CHAT_IMAGE_PROMPT_TOKENS == 512
    assert limits.CHAT_IMAGE_PLACEHOLDER == "[image]"
    assert limits.MIN_CHAT_MAX_TOKENS == 16
    assert limits.MAX_CHAT_MAX_TOKENS == 16384
    assert limits.CHAT_MAX_TOKENS_DEFAULT == 512
    assert limits.MAX_CHAT_FAULT_REASON_LENGTH == 1000
    assert limits.MAX_CHAT_NATIVE_FINISH_REASON_LENGTH == 32


def test_body_cap_covers_a_request_at_every_cap():
    images_as_base64 = limits.MAX_CHAT_IMAGE_TOTAL_BYTES * 4 / 3
    assert images_as_base64 + limits.MAX_CHAT_TEXT_BYTES < limits.MAX_CHAT_BODY_BYTES


def test_sampling_ranges_and_defaults():
    assert dict(limits.OPENAI_SAMPLING_RANGES) == {
        "temperature": (0, 2),
        "top_p": (0, 1),
        "frequency_penalty": (-2, 2),
        "presence_penalty": (-2, 2),
    }
    assert dict(limits.CHAT_SAMPLING_DEFAULTS) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "rep_pen": 1.0,
        "top_k": 0,
        "min_p": 0,
    }
