"""The text model reference the project ships (hordesite/data/text_model_reference.json, the
default of HORDE_TEXT_MODEL_REFERENCE): the suite prices against it, so it holds every model the
tests name with its parameter count (facts from upstream's public reference). Pointed at that public
reference (HORDE_PUBLIC_TEXT_MODEL_REFERENCE=/path/to/text_model_reference.json), the test also
checks that every shipped entry agrees with it; without it, nothing else is needed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.conf import settings

from chat.model_reference import is_known_text_model, text_model_multiplier
from tests.conftest import SHIPPED_MODEL_REFERENCE

# Every model the suite treats as known, with its parameters in billions.
MODELS_THE_TESTS_NAME = {
    "Gryphe/MythoMax-L2-13b": 13,
    "acrastt/Marx-3B-V3": 3,
    "koboldcpp/Marx-3B-V3": 3,
    "koboldcpp/Enterredaas-65b": 65,
    "koboldcpp/LLaMA2-13B-Psyfighter2": 13,
    "koboldcpp/Pernicious_Prophecy_70B": 70,
    "meta-llama/Meta-Llama-3-70B-Instruct": 70,
    "koboldcpp/Qwen3-8B": 8,
}


def _shipped() -> dict[str, dict]:
    return json.loads(SHIPPED_MODEL_REFERENCE.read_text())


def test_the_suite_prices_against_the_shipped_reference_which_is_the_default():
    assert str(SHIPPED_MODEL_REFERENCE) == settings.HORDE_TEXT_MODEL_REFERENCE
    default = Path(settings.BASE_DIR) / "hordesite" / "data" / "text_model_reference.json"
    assert default == SHIPPED_MODEL_REFERENCE
    for name, billions in MODELS_THE_TESTS_NAME.items():
        assert is_known_text_model(name), name
        assert text_model_multiplier(name) == billions, name
    assert not is_known_text_model("koboldcpp/Llama-3-8B")  # the README's unknown example
    assert text_model_multiplier("koboldcpp/Llama-3-8B") == 1.0


def test_every_shipped_entry_is_a_name_with_its_parameter_count():
    shipped = _shipped()
    assert shipped
    for name, entry in shipped.items():
        assert entry["name"] == name
        assert isinstance(entry["parameters"], int) and entry["parameters"] > 0, name
    public_path = os.environ.get("HORDE_PUBLIC_TEXT_MODEL_REFERENCE")
    if public_path:  # an extra check when the public reference is at hand, never a requirement
        public = json.loads(Path(public_path).read_text())
        disagreeing = {
            name: (entry["parameters"], public.get(name, {}).get("parameters"))
            for name, entry in shipped.items()
            if public.get(name, {}).get("parameters") != entry["parameters"]
        }
        assert not disagreeing, f"shipped vs public parameters: {disagreeing}"
