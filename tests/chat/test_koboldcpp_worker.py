"""koboldcpp's embedded horde worker (koboldcpp.py, run_horde_worker: "KoboldCppEmbedWorker:2")
against the live routes, with the bytes its urllib requests carry.

It sends `Apikey`, `User-Agent: KoboldCppEmbeddedWorkerV2`, `Client-Agent: KoboldCppEmbedWorker:2`
and `Content-Type` (urllib title-cases header names), `Accept-Encoding: identity` and
`Connection: close`, and no `Accept`. Its pop has no `threads`. It reads `pop["id"]` (a KeyError
would end its worker thread), posts the whole `payload` to its own `/api/v1/generate`, which copies
each sampler value into a ctypes structure (a float refused for an int field, a null for a string),
and submits `{id, generation, state: "ok"}`, reading `reply["reward"]` as a number. Any answer but a
200 counts as an error: five of them pause it for minutes.
"""

from __future__ import annotations

import ctypes
from decimal import Decimal

import pytest

from accounts.models import KudosTransaction
from tests.chat.live_stack import LiveStack
from tests.chat.test_scribe_worker import LITE_PARAMS
from tests.chat.test_text_request_types import SILLYTAVERN_PARAMS
from workers.models import Worker

pytestmark = pytest.mark.django_db(transaction=True)

# `--model Fimbulvetr-11B-v2.Q4_K_M.gguf`: koboldcpp names its model after the file.
MODEL = "koboldcpp/Fimbulvetr-11B-v2.Q4_K_M"
BRIDGE_AGENT = "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"


def kcpp_headers(key: str) -> dict[str, str]:
    return {
        "Accept-Encoding": "identity",
        "Apikey": key,
        "User-Agent": "KoboldCppEmbeddedWorkerV2",
        "Client-Agent": "KoboldCppEmbedWorker:2",
        "Content-Type": "application/json",
        "Connection": "close",
    }


class KoboldCppInputs(ctypes.Structure):
    """The fields koboldcpp's generate() fills from a horde payload, with their C types."""

    _fields_ = [
        ("prompt", ctypes.c_char_p), ("max_context_length", ctypes.c_int), ("max_length", ctypes.c_int),
        ("temperature", ctypes.c_float), ("top_k", ctypes.c_int), ("top_a", ctypes.c_float),
        ("top_p", ctypes.c_float), ("min_p", ctypes.c_float), ("typical_p", ctypes.c_float),
        ("tfs", ctypes.c_float), ("rep_pen", ctypes.c_float), ("rep_pen_range", ctypes.c_int),
        ("rep_pen_slope", ctypes.c_float), ("mirostat", ctypes.c_int), ("sampler_order", ctypes.c_int * 8),
        ("stop_sequence", ctypes.c_char_p * 24), ("dynatemp_range", ctypes.c_float),
        ("dynatemp_exponent", ctypes.c_float), ("smoothing_factor", ctypes.c_float),
    ]


# payload key -> (field, koboldcpp's default when the key is absent)
PAYLOAD_FIELDS = {
    "max_context_length": ("max_context_length", 4096), "max_length": ("max_length", 180),
    "temperature": ("temperature", 0.7), "top_k": ("top_k", 100), "top_a": ("top_a", 0.0), "top_p": ("top_p", 0.92),
    "min_p": ("min_p", 0.0), "typical": ("typical_p", 1.0), "tfs": ("tfs", 1.0), "rep_pen": ("rep_pen", 1.0),
    "rep_pen_range": ("rep_pen_range", 320), "rep_pen_slope": ("rep_pen_slope", 1.0), "mirostat": ("mirostat", 0),
    "dynatemp_range": ("dynatemp_range", 0.0), "dynatemp_exponent": ("dynatemp_exponent", 1.0),
    "smoothing_factor": ("smoothing_factor", 0.0),
}


def koboldcpp_generate_inputs(payload: dict) -> KoboldCppInputs:
    """The payload copied as koboldcpp's generate() copies it; raises TypeError where koboldcpp would."""
    inputs = KoboldCppInputs()
    inputs.prompt = payload.get("prompt", "").encode("UTF-8")
    for key, (field, default) in PAYLOAD_FIELDS.items():
        setattr(inputs, field, payload.get(key, default))
    for n, sampler in enumerate(payload.get("sampler_order", [6, 0, 1, 3, 4, 2, 5])):
        inputs.sampler_order[n] = sampler
    for n, stop in enumerate(payload.get("stop_sequence", [])):
        inputs.stop_sequence[n] = b"" if stop is None else stop.encode("UTF-8")
    return inputs


@pytest.fixture
def live():
    stack = LiveStack()
    yield stack
    stack.close()


def kcpp_pop(live: LiveStack, key: str) -> dict:
    body = {
        "name": "kcpp-worker", "models": [MODEL], "max_length": 400, "max_context_length": 4096,
        "priority_usernames": [], "softprompts": [], "bridge_agent": BRIDGE_AGENT,
    }
    response = live.request(
        "POST", "/api/v2/generate/text/pop", headers=kcpp_headers(key), body=body, exact_headers=True
    )
    assert response.status_code == 200, response.text
    return response.json()


CLIENTS = {
    "lite": ({"apikey": "", "Client-Agent": "KoboldAiLite:17", "Origin": "null"}, {"workers": []},
             {**LITE_PARAMS, "max_context_length": 4096, "max_length": 200}),
    "sillytavern": ({"apikey": "", "Client-Agent": "SillyTavern:UNKNOWN:Cohee#1207"}, {"trusted_workers": False},
                    SILLYTAVERN_PARAMS),
}


@pytest.mark.parametrize("client", CLIENTS)
def test_koboldcpps_worker_serves_a_request_as_it_sends_and_reads_it(live, make_user, client):
    owner, requester = make_user("kcpp-owner"), make_user("client-user", kudos=100)
    idle = kcpp_pop(live, owner.key)  # its first pop registers it
    assert "id" in idle and idle["id"] is None
    worker = Worker.objects.get(name="kcpp-worker")
    assert (worker.bridge_agent, worker.validated_bridge, worker.threads) == (BRIDGE_AGENT, True, 1)

    headers, extra, params = CLIENTS[client]
    created = live.request(
        "POST",
        "/api/v2/generate/text/async",
        headers={**headers, "apikey": requester.key},
        body={"prompt": "User: Hi\nAssistant:", "params": params, "models": [MODEL], **extra},
    )
    assert created.status_code == 202, created.text
    request_id = created.json()["id"]

    job = kcpp_pop(live, owner.key)
    assert job["id"] is not None
    payload = job["payload"]
    assert (payload.get("max_length", 80), payload.get("max_context_length", 1024)) == (200, 4096)
    inputs = koboldcpp_generate_inputs({**payload, "genkey": "HORDEREQ_123"})
    assert inputs.prompt == b"User: Hi\nAssistant:" and inputs.top_k == params["top_k"]
    assert [inputs.stop_sequence[n] for n in range(len(params["stop_sequence"]))] == [
        stop.encode() for stop in params["stop_sequence"]
    ]

    submitted = live.request(
        "POST",
        "/api/v2/generate/text/submit",
        headers=kcpp_headers(owner.key),
        body={"id": job["id"], "generation": " Hello there.", "state": "ok"},
        exact_headers=True,
    )
    assert submitted.status_code == 200, submitted.text
    reward = submitted.json()["reward"]
    assert f"{reward:.0f}" and reward > 0  # it prints the reward with :.0f

    status = live.request("GET", f"/api/v2/generate/text/status/{request_id}", headers={}).json()
    assert status["done"] is True and status["faulted"] is False
    [generation] = status["generations"]
    assert generation["text"] == " Hello there." and (generation["worker_name"], generation["model"]) == (
        "kcpp-worker", MODEL
    )
    # The owner earns the reward; the requester pays it and the horde tax.
    assert owner.refresh().kudos == Decimal(str(reward))
    assert requester.refresh().kudos == Decimal("100") - Decimal(str(reward)) - 1
    assert KudosTransaction.objects.filter(user=owner.user, kind="generation_reward").get().amount == Decimal(
        str(reward)
    )


def test_koboldcpps_worker_is_refused_in_maintenance_with_a_json_body(live, make_user):
    """In maintenance (its owner's PUT), with nothing of the owner's waiting, upstream's pop answers
    403 WorkerMaintenance: koboldcpp prints the body and counts an error, as against upstream."""
    owner = make_user("kcpp-owner")
    kcpp_pop(live, owner.key)
    worker_id = str(Worker.objects.get(name="kcpp-worker").pk)
    put = live.request(
        "PUT", f"/api/v2/workers/{worker_id}", headers={"apikey": owner.key}, body={"maintenance": True}
    )
    assert put.status_code == 200, put.text
    body = {
        "name": "kcpp-worker", "models": [MODEL], "max_length": 400, "max_context_length": 4096,
        "priority_usernames": [], "softprompts": [], "bridge_agent": BRIDGE_AGENT,
    }
    refused = live.request(
        "POST", "/api/v2/generate/text/pop", headers=kcpp_headers(owner.key), body=body, exact_headers=True
    )
    assert refused.status_code == 403 and refused.headers["content-type"] == "application/json"
    assert refused.json()["rc"] == "WorkerMaintenance" and refused.json()["message"]
