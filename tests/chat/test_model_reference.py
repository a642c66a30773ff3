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
from tests.http_fakes import QuietHandler, close_server, serve

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


def test_a_reference_url_that_fails_is_read_again_later_not_never(settings, monkeypatch):
    """A reference served from a URL that fails once (a 503, a network blip at start) counted every
    model as unknown, priced at 1B parameters, for the life of the process. The failure is now
    kept for REFERENCE_RETRY_SECONDS, then the URL is read again; an error answer is a failure
    whatever its body (a JSON error object is not a reference with no models)."""
    from chat import model_reference

    answers = [(503, {"message": "Service Unavailable"}), (404, {"message": "Not Found"}), (200, _shipped())]

    class Reference(QuietHandler):
        def do_GET(self) -> None:
            status, body = answers.pop(0) if len(answers) > 1 else answers[0]
            self.send_json(status, body)

    server = serve(Reference)
    clock = [1000.0]
    monkeypatch.setattr(model_reference, "monotonic", lambda: clock[0])
    settings.HORDE_TEXT_MODEL_REFERENCE = f"http://127.0.0.1:{server.server_port}/text_model_reference.json"
    model_reference.reload_reference()
    try:
        assert not is_known_text_model("Gryphe/MythoMax-L2-13b")  # the 503
        clock[0] += model_reference.REFERENCE_RETRY_SECONDS - 1
        assert not is_known_text_model("Gryphe/MythoMax-L2-13b")  # not read again yet
        assert len(answers) == 2
        clock[0] += 1
        assert not is_known_text_model("Gryphe/MythoMax-L2-13b")  # the 404's JSON body is no reference
        clock[0] += model_reference.REFERENCE_RETRY_SECONDS
        assert is_known_text_model("Gryphe/MythoMax-L2-13b")
        assert text_model_multiplier("Gryphe/MythoMax-L2-13b") == 13
        clock[0] += 10 * model_reference.REFERENCE_RETRY_SECONDS
        answers[0] = (503, {})
        assert is_known_text_model("Gryphe/MythoMax-L2-13b")  # a reference read is kept
    finally:
        close_server(server)
        model_reference.reload_reference()
