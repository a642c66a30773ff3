import pytest

from contract.chat_declaration import (
    CHAT_WORKER_FAULT_MESSAGES,
    ChatDeclaration,
    ChatFaultReason,
    ChatFinishReason,
    ChatImageTransport,
    ChatLimits,
    chat_worker_fault_message,
    chat_worker_fault_metric_reason,
    parse_chat_declaration,
)
from contract.chat_errors import ChatDeclarationInvalid

MODELS = ["koboldcpp/llama-3", "llama-3"]


def pop(**fields):
    data = {
        "chat_jobs": True,
        "chat_limits": {"max_context_length": 8192, "max_length": 1024},
        "model_id": "llama-3",
    }
    data.update(fields)
    return {k: v for k, v in data.items() if v is not ...}


def test_vocabularies():
    assert [t.value for t in ChatImageTransport] == ["url", "base64", "messages_url"]
    assert [r.value for r in ChatFinishReason] == ["stop", "length", "content_filter", "tool_calls"]
    assert [r.value for r in ChatFaultReason] == [
        "prompt_overflow",
        "unbuildable_grammar",
        "tool_violation",
        "reply_refused",
        "generation_error",
    ]
    assert CHAT_WORKER_FAULT_MESSAGES == {
        "prompt_overflow": "The worker could not fit the prompt into its context.",
        "unbuildable_grammar": "The worker could not build the grammar the request's tool choice or response format needs.",
        "tool_violation": "The model's reply broke the request's tool controls.",
        "reply_refused": "The AI Horde refused the worker's reply.",
        "generation_error": "The worker's backend failed while generating.",
    }


def test_fault_reason_lookup_and_metric_label():
    assert (
        chat_worker_fault_message("tool_violation") == "The model's reply broke the request's tool controls."
    )
    assert chat_worker_fault_message("my own words") is None
    assert chat_worker_fault_message(["x"]) is None
    assert chat_worker_fault_metric_reason("prompt_overflow") == "prompt_overflow"
    assert chat_worker_fault_metric_reason("my own words") == "unknown"
    assert chat_worker_fault_metric_reason(None) == "none"


def test_full_declaration():
    declaration = parse_chat_declaration(
        pop(
            prompt_jobs=False,
            chat_features=["tools", "vision", "tool_choice_enforced", "telepathy", 3],
            chat_limits={"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 0.7},
            image_transports=["base64", "carrier_pigeon"],
        ),
        models=MODELS,
    )
    assert declaration == ChatDeclaration(
        chat_jobs=True,
        prompt_jobs=False,
        chat_features=frozenset({"tools", "vision", "tool_choice_enforced"}),
        chat_limits=ChatLimits(8192, 1024, 0.7),
        model_id="llama-3",
        image_transports=frozenset({"base64"}),
    )
    assert declaration.receives_images
    assert declaration.serves_model(["other", "llama-3"])
    assert not declaration.serves_model(["other"])
    assert declaration.details() == {
        "model_id": "llama-3",
        "features": ["tool_choice_enforced", "tools", "vision"],
        "limits": {"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 0.7},
        "image_transports": ["base64"],
    }


def test_absent_fields_mean_none_and_a_pop_without_chat_jobs_withdraws():
    bare = parse_chat_declaration(pop(), models=MODELS)
    assert bare.chat_features == frozenset() and bare.image_transports == frozenset()
    assert not bare.receives_images
    assert (
        parse_chat_declaration(pop(image_transports=["messages_url"]), models=MODELS).receives_images is False
    )
    withdrawn = parse_chat_declaration({"chat_features": ["tools"], "model_id": "x"}, models=MODELS)
    assert withdrawn == ChatDeclaration()
    assert withdrawn.details() is None
    assert not withdrawn.serves_model(MODELS)


def test_model_id_is_opaque():
    declaration = parse_chat_declaration(pop(model_id="koboldcpp/llama-3"), models=MODELS)
    assert declaration.model_id == "koboldcpp/llama-3"


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        (
            {"chat_limits": ...},
            "chat_limits",
            "chat_jobs needs chat_limits with max_context_length and max_length.",
        ),
        (
            {"chat_limits": {"max_length": 10}},
            "chat_limits.max_context_length",
            "chat_jobs needs chat_limits.max_context_length.",
        ),
        ({"model_id": ...}, "model_id", "chat_jobs needs a model_id."),
        ({"model_id": "mistral"}, "model_id", "model_id 'mistral' is not one of the worker's models."),
        (
            {"chat_limits": {"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": -0.1}},
            "chat_limits.tools_max_temperature",
            "chat_limits.tools_max_temperature cannot be negative.",
        ),
        (
            {"chat_jobs": ..., "prompt_jobs": False},
            "prompt_jobs",
            "prompt_jobs false needs chat_jobs: a worker has to accept text or chat jobs.",
        ),
        ({"chat_jobs": "yes"}, "chat_jobs", "chat_jobs has to be a boolean."),
    ],
)
def test_invalid_declarations(fields, param, text):
    with pytest.raises(ChatDeclarationInvalid) as info:
        parse_chat_declaration(pop(**fields), models=MODELS)
    refusal = info.value
    assert (refusal.status, refusal.rc, refusal.param, refusal.text) == (
        400,
        "ChatDeclarationInvalid",
        param,
        text,
    )
    assert refusal.body() == {"message": f"'{param}': {text}", "rc": "ChatDeclarationInvalid"}


def test_pop_fields_round_trip():
    declaration = parse_chat_declaration(pop(chat_features=["seed"], image_transports=["url"]), models=MODELS)
    assert parse_chat_declaration(declaration.pop_fields(), models=MODELS) == declaration
