"""POST /api/v2/generate/text/async holds every field of the body and its params to its JSON type,
as upstream's schema validation does, and answers the schema failure shape (ADR 0012); the bodies
KoboldAI Lite, SillyTavern and the AI Horde SDK send pass unchanged."""

from __future__ import annotations

import uuid

import pytest

from chat.models import GenerationRequest
from tests.chat.live_stack import LiveStack

MODEL = "Gryphe/MythoMax-L2-13b"
FAILURE = "Input payload validation failed"


def refused(horde, make_user, body: dict) -> dict:
    response = horde.text_async(make_user("r", kudos=50).key, **body)
    assert response.status_code == 400, response.content
    assert set(response.json()) == {"errors", "message"} and response.json()["message"] == FAILURE
    assert not GenerationRequest.objects.exists()
    return response.json()["errors"]


@pytest.mark.parametrize(
    ("body", "errors"),
    [
        # the two
        ({"prompt": 5}, {"prompt": "5 is not of type 'string'"}),
        ({"models": [1, 2]}, {"models[0]": "1 is not of type 'string'", "models[1]": "2 is not of type 'string'"}),
        # strings
        ({"prompt": True}, {"prompt": "True is not of type 'string'"}),
        ({"prompt": ["Once"]}, {"prompt": "['Once'] is not of type 'string'"}),
        ({"prompt": {"text": "Once"}}, {"prompt": "{'text': 'Once'} is not of type 'string'"}),
        ({"softprompt": 5}, {"softprompt": "5 is not of type 'string'"}),
        ({"webhook": 5}, {"webhook": "5 is not of type 'string'"}),
        ({"style": 7}, {"style": "7 is not of type 'string'"}),
        ({"proxied_account": False}, {"proxied_account": "False is not of type 'string'"}),
        ({"params": {"stop_sequence": ["END", 3]}}, {"params.stop_sequence[1]": "3 is not of type 'string'"}),
        # integers: not a float, a string or a boolean
        ({"params": {"max_length": "80"}}, {"params.max_length": "'80' is not of type 'integer'"}),
        ({"params": {"max_length": 80.0}}, {"params.max_length": "80.0 is not of type 'integer'"}),
        ({"params": {"max_length": True}}, {"params.max_length": "True is not of type 'integer'"}),
        ({"params": {"n": "1"}}, {"params.n": "'1' is not of type 'integer'"}),
        ({"params": {"max_context_length": 2048.5}}, {"params.max_context_length": "2048.5 is not of type 'integer'"}),
        ({"params": {"top_k": "40"}}, {"params.top_k": "'40' is not of type 'integer'"}),
        ({"params": {"rep_pen_range": 320.0}}, {"params.rep_pen_range": "320.0 is not of type 'integer'"}),
        ({"params": {"sampler_order": [6, "0"]}}, {"params.sampler_order[1]": "'0' is not of type 'integer'"}),
        # numbers: an integer or a float, not a string or a boolean
        ({"params": {"temperature": "0.7"}}, {"params.temperature": "'0.7' is not of type 'number'"}),
        ({"params": {"top_p": True}}, {"params.top_p": "True is not of type 'number'"}),
        ({"params": {"rep_pen": [1.1]}}, {"params.rep_pen": "[1.1] is not of type 'number'"}),
        # booleans: only true and false
        ({"trusted_workers": "false"}, {"trusted_workers": "'false' is not of type 'boolean'"}),
        ({"validated_backends": 0}, {"validated_backends": "0 is not of type 'boolean'"}),
        ({"slow_workers": "yes"}, {"slow_workers": "'yes' is not of type 'boolean'"}),
        ({"worker_blacklist": 1}, {"worker_blacklist": "1 is not of type 'boolean'"}),
        ({"dry_run": "true"}, {"dry_run": "'true' is not of type 'boolean'"}),
        ({"allow_downgrade": 1}, {"allow_downgrade": "1 is not of type 'boolean'"}),
        ({"disable_batching": "no"}, {"disable_batching": "'no' is not of type 'boolean'"}),
        ({"extra_slow_workers": 0}, {"extra_slow_workers": "0 is not of type 'boolean'"}),
        ({"params": {"frmttriminc": 1}}, {"params.frmttriminc": "1 is not of type 'boolean'"}),
        ({"params": {"use_default_badwordsids": "false"}}, {"params.use_default_badwordsids": "'false' is not of type 'boolean'"}),
        # worker ids
        ({"workers": [12]}, {"workers[0]": "12 is not of type 'string'"}),
        # several wrong at once: every one is listed
        (
            {"prompt": 1, "params": {"max_length": "80", "temperature": "hot"}, "dry_run": "yes"},
            {
                "prompt": "1 is not of type 'string'",
                "params.max_length": "'80' is not of type 'integer'",
                "params.temperature": "'hot' is not of type 'number'",
                "dry_run": "'yes' is not of type 'boolean'",
            },
        ),
    ],
)
def test_wrong_types_are_schema_failures(horde, make_user, body, errors):
    body = {"prompt": "Once upon a time", "models": [MODEL], **body}
    assert refused(horde, make_user, body) == errors


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"params": "n=1"}, "params"),
        ({"params": None}, "params"),
        ({"models": "koboldcpp/x"}, "models"),
        ({"models": [None]}, "models[0]"),
        ({"workers": "00000000-0000-0000-0000-000000000000"}, "workers"),
        ({"params": {"stop_sequence": "END"}}, "params.stop_sequence"),
        ({"params": {"sampler_order": 6}}, "params.sampler_order"),
        ({"extra_source_images": "x"}, "extra_source_images"),
        ({"params": {"temperature": None}}, "params.temperature"),
    ],
)
def test_wrong_containers_and_nulls_are_schema_failures(horde, make_user, body, field):
    body = {"prompt": "Once upon a time", "models": [MODEL], **body}
    assert field in refused(horde, make_user, body)


def test_number_fields_take_integers(horde, make_user):
    response = horde.text_async(
        make_user("r", kudos=50).key,
        models=[MODEL],
        params={"temperature": 1, "top_p": 1, "typical": 1, "tfs": 1, "max_length": 80, "rep_pen": 1.5},
    )
    assert response.status_code == 202
    request = GenerationRequest.objects.get(pk=response.json()["id"])
    assert request.params["temperature"] == 1 and request.params["rep_pen"] == 1.5 and request.max_length == 80


# --- what real clients send still passes, over the live routes with their headers ------------------

SILLYTAVERN_PARAMS = {
    # SillyTavern's Kobold generation data as its horde mode sends it, unknown keys included.
    "n": 1, "frmtadsnsp": False, "frmtrmblln": False, "frmtrmspch": False, "frmttriminc": False,
    "gui_settings": False, "sampler_order": [6, 0, 1, 3, 4, 2, 5], "max_context_length": 4096, "max_length": 200,
    "rep_pen": 1.1, "rep_pen_range": 600, "rep_pen_slope": 0, "temperature": 0.7, "tfs": 1, "top_a": 0,
    "top_k": 0, "top_p": 0.9, "min_p": 0.05, "typical": 1, "s1": 6, "s2": 0, "s3": 1, "s4": 3, "s5": 4, "s6": 2,
    "s7": 5, "use_world_info": False, "singleline": False, "stop_sequence": ["\nUser:", "\nAssistant:"],
    "streaming": False, "can_abort": False, "mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1,
    "use_default_badwordsids": False, "grammar": "", "dynatemp_range": 0, "dynatemp_exponent": 1,
    "smoothing_factor": 0,
}


@pytest.fixture
def live():
    stack = LiveStack()
    yield stack
    stack.close()


@pytest.mark.django_db(transaction=True)
def test_sillytavern_request_passes(live, make_user):
    requester = make_user("st", kudos=100)
    response = live.request(
        "POST",
        "/api/v2/generate/text/async",
        headers={"apikey": requester.key, "Client-Agent": "SillyTavern:UNKNOWN:Cohee#1207"},
        body={"prompt": "User: Hi\nAssistant:", "params": SILLYTAVERN_PARAMS, "trusted_workers": False, "models": [MODEL]},
    )
    assert response.status_code == 202, response.text
    request = GenerationRequest.objects.get(pk=response.json()["id"])
    assert (request.max_length, request.max_context_length) == (200, 4096)
    assert request.params["stop_sequence"] == ["\nUser:", "\nAssistant:"] and "grammar" not in request.params


@pytest.mark.django_db(transaction=True)
def test_ai_horde_sdk_request_passes(live, make_user):
    """horde_sdk's TextGenerateAsyncRequest as its client dumps it (by alias, unset and null fields
    left out), every optional field set."""
    requester = make_user("sdk", kudos=100)
    worker_id = str(uuid.uuid4())
    body = {
        "trusted_workers": False,
        "slow_workers": True,
        "extra_slow_workers": False,
        "workers": [worker_id],
        "worker_blacklist": True,
        "models": [MODEL],
        "validated_backends": True,
        "dry_run": False,
        "webhook": "https://example.invalid/hook",
        "allow_downgrade": False,
        "params": {
            "dynatemp_exponent": 1.0, "dynatemp_range": 0.0, "frmtadsnsp": False, "frmtrmblln": False,
            "frmtrmspch": False, "frmttriminc": True, "min_p": 0.0, "rep_pen": 1.1, "rep_pen_range": 320,
            "rep_pen_slope": 0.7, "sampler_order": [6, 0, 1, 3, 4, 2, 5], "singleline": False,
            "smoothing_factor": 0.0, "stop_sequence": ["###"], "temperature": 0.7, "tfs": 1.0, "top_a": 0.0,
            "top_k": 100, "top_p": 0.92, "typical": 1.0, "use_default_badwordsids": True, "n": 1,
            "max_length": 80, "max_context_length": 1024,
        },
        "prompt": "A haiku about the sea:",
        "disable_batching": False,
        "proxied_account": "someone-else",
    }
    response = live.request(
        "POST",
        "/api/v2/generate/text/async",
        headers={"apikey": requester.key, "Client-Agent": "horde_sdk:0.17.0:https://github.com/haidra-org/horde-sdk"},
        body=body,
    )
    assert response.status_code == 202, response.text
    request = GenerationRequest.objects.get(pk=response.json()["id"])
    assert request.validated_backends is True and request.worker_blacklist is True
    assert request.params["top_k"] == 100 and request.params["temperature"] == 0.7
