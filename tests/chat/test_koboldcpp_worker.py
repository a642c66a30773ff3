"""koboldcpp's embedded horde worker (koboldcpp.py, run_horde_worker: "KoboldCppEmbedWorker:2")
against the live routes, with the bytes its urllib requests carry.

It sends `Apikey`, `User-Agent: KoboldCppEmbeddedWorkerV2`, `Client-Agent: KoboldCppEmbedWorker:2`
and `Content-Type` (urllib title-cases header names), `Accept-Encoding: identity` and
`Connection: close`, and no `Accept`. Its pop has no `threads`. It reads `pop["id"]` (a KeyError
would end its worker thread), posts the whole `payload` to its own `/api/v1/generate`, which copies
each sampler value into a ctypes structure (a float refused for an int field, a null for a string),
and submits `{id, generation, state: "ok"}`, reading `reply["reward"]` as a number. Any answer but a
200 counts as an error: five of them pause it for minutes.

Run for real (docs/adr/0113-koboldcpp-embedded-worker.md): koboldcpp 1.76 (2da346a5) on a tiny
random GGUF, its hard-coded https://aihorde.net redirected to this horde through a local CA and a
logging TLS relay. The bodies and answers below are the ones that relay logged.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from accounts.models import HordeUser, KudosTransaction
from chat import tasks
from chat.models import Generation
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


# koboldcpp 1.76's sampler_order_max and stop_token_max: the lengths of its two arrays.
SAMPLER_ORDER_MAX, STOP_TOKEN_MAX = 7, 32


class KoboldCppInputs(ctypes.Structure):
    """The fields koboldcpp's generate() fills from a horde payload, with their C types."""

    _fields_ = [
        ("prompt", ctypes.c_char_p), ("max_context_length", ctypes.c_int), ("max_length", ctypes.c_int),
        ("temperature", ctypes.c_float), ("top_k", ctypes.c_int), ("top_a", ctypes.c_float),
        ("top_p", ctypes.c_float), ("min_p", ctypes.c_float), ("typical_p", ctypes.c_float),
        ("tfs", ctypes.c_float), ("rep_pen", ctypes.c_float), ("rep_pen_range", ctypes.c_int),
        ("rep_pen_slope", ctypes.c_float), ("mirostat", ctypes.c_int),
        ("sampler_order", ctypes.c_int * SAMPLER_ORDER_MAX), ("sampler_len", ctypes.c_int),
        ("stop_sequence", ctypes.c_char_p * STOP_TOKEN_MAX), ("dynatemp_range", ctypes.c_float),
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
    # An order longer than its array is left out (its defaults apply); stops past it are dropped.
    order = payload.get("sampler_order", [6, 0, 1, 3, 4, 2, 5])
    if order and 0 < len(order) <= SAMPLER_ORDER_MAX:
        for n, sampler in enumerate(order):
            inputs.sampler_order[n] = sampler
        inputs.sampler_len = len(order)
    stops = payload.get("stop_sequence") or []
    for n in range(STOP_TOKEN_MAX):
        stop = stops[n] if n < len(stops) else None
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


# --- the run (ADR 0113): `--hordemodelname tiny --hordeworkername kcpp-tiny --hordegenlen 120
# --hordemaxctx 1024`, its key a trusted user's ---------------------------------------------------

RUN_MODEL = "koboldcpp/tiny"  # koboldcpp prefixes --hordemodelname with "koboldcpp/"
RUN_POP_BYTES = (
    b'{"name": "kcpp-tiny", "models": ["koboldcpp/tiny"], "max_length": 120, "max_context_length": 1024, '
    b'"priority_usernames": [], "softprompts": [], '
    b'"bridge_agent": "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"}'
)
RUN_POP = {
    "name": "kcpp-tiny", "models": [RUN_MODEL], "max_length": 120, "max_context_length": 1024,
    "priority_usernames": [], "softprompts": [], "bridge_agent": BRIDGE_AGENT,
}
IDLE_ANSWER = {
    "payload": {}, "id": None, "ids": [], "messages": None, "ttl": None, "extra_source_images": [], "skipped": {},
    "softprompt": None, "model": None,
}
PROMPT = "User: Hello there\nAssistant:"
# A random model's reply, control characters and all, as its submit carried it.
GENERATION = "n&%#HV\u0015$\t0\rI\u0005W\u00d8pBKVm$VZEH"


def run_pop(live: LiveStack, key: str) -> dict:
    # LiveStack encodes as urllib's caller does (json.dumps' default separators): the relay's bytes.
    assert json.dumps(RUN_POP).encode() == RUN_POP_BYTES
    response = live.request(
        "POST", "/api/v2/generate/text/pop", headers=kcpp_headers(key), body=RUN_POP, exact_headers=True
    )
    assert response.status_code == 200 and response.headers["content-type"] == "application/json", response.text
    return response.json()


def run_submit(live: LiveStack, key: str, job_id: str, generation: str = GENERATION):
    return live.request(
        "POST",
        "/api/v2/generate/text/submit",
        headers=kcpp_headers(key),
        body={"id": job_id, "generation": generation, "state": "ok"},
        exact_headers=True,
    )


def ask(live: LiveStack, key: str, params: dict) -> str:
    created = live.request(
        "POST",
        "/api/v2/generate/text/async",
        headers={"apikey": key, "Client-Agent": "kcpp-run:1"},
        body={"prompt": PROMPT, "params": params, "models": [RUN_MODEL]},
    )
    assert created.status_code == 202, created.text
    return created.json()["id"]


def status(live: LiveStack, request_id: str) -> dict:
    return live.request("GET", f"/api/v2/generate/text/status/{request_id}", headers={}).json()


def test_the_runs_pop_job_and_submit_as_the_relay_logged_them(live, make_user):
    """An idle pop, then a job: the answers it reads (`id`, then `payload`, whose `max_length` and
    `max_context_length` it prints and whose keys it posts to its own generate), and the submit's
    `{"reward":0.65}`, printed as "earned 1 kudos"."""
    owner, requester = make_user("kcpp-owner", trusted=True), make_user("requester", kudos=1000)
    assert run_pop(live, owner.key) == IDLE_ANSWER

    request_id = ask(live, requester.key, {"max_length": 40, "max_context_length": 1024, "temperature": 0.7})
    job = run_pop(live, owner.key)
    assert job == {
        "payload": {"temperature": 0.7, "prompt": PROMPT, "n": 1, "max_length": 40, "max_context_length": 1024},
        "id": job["id"], "ids": [job["id"]], "messages": None, "ttl": 150, "extra_source_images": [],
        "skipped": {}, "softprompt": None, "model": RUN_MODEL,
    }
    inputs = koboldcpp_generate_inputs({**job["payload"], "genkey": "HORDEREQ_123"})
    assert (inputs.max_length, inputs.max_context_length, inputs.prompt) == (40, 1024, PROMPT.encode())

    submitted = run_submit(live, owner.key, job["id"])
    assert submitted.status_code == 200 and submitted.content == b'{"reward":0.65}'
    assert f"{submitted.json()['reward']:.0f}" == "1"

    done = status(live, request_id)
    assert (done["done"], done["faulted"], done["kudos"]) == (True, False, 1.65)
    assert [g["text"] for g in done["generations"]] == [GENERATION]
    assert owner.refresh().kudos == Decimal("0.65")
    assert requester.refresh().kudos == Decimal("1000") - Decimal("1.65")  # the reward and the horde tax


def test_a_request_past_what_it_declared_never_reaches_it(live, make_user):
    """It declared 120 tokens and a 1024 context: a request for more of either waits, is_possible
    false, and its pops come back empty with the count of what was skipped."""
    owner, requester = make_user("kcpp-owner", trusted=True), make_user("requester", kudos=1000)
    run_pop(live, owner.key)
    too_long = ask(live, requester.key, {"max_length": 200, "max_context_length": 1024})
    too_wide = ask(live, requester.key, {"max_length": 100, "max_context_length": 2048})

    answer = run_pop(live, owner.key)
    assert answer == {**IDLE_ANSWER, "skipped": {"max_length": 1, "max_context_length": 1}}
    for request_id in (too_long, too_wide):
        waiting = status(live, request_id)
        assert (waiting["waiting"], waiting["processing"], waiting["is_possible"]) == (1, 0, False)
    assert not Generation.objects.exists()


def test_a_cancel_while_it_generates_still_pays_its_submit(live, make_user):
    """It never reads the status: it submits what it generated after the requester's DELETE, and
    that submit is stored and paid (ADR 0003), not refused as an error it would count."""
    owner, requester = make_user("kcpp-owner", trusted=True), make_user("requester", kudos=1000)
    request_id = ask(live, requester.key, {"max_length": 100, "max_context_length": 1024})
    job = run_pop(live, owner.key)
    cancelled = live.request(
        "DELETE", f"/api/v2/generate/text/status/{request_id}", headers={"apikey": requester.key}
    )
    assert cancelled.status_code == 200 and cancelled.json()["processing"] == 1 and not cancelled.json()["done"]

    submitted = run_submit(live, owner.key, job["id"])
    assert submitted.status_code == 200, submitted.text
    reward = Decimal(str(submitted.json()["reward"]))
    assert reward > 0
    done = status(live, request_id)
    assert done["done"] is True and [g["text"] for g in done["generations"]] == [GENERATION]
    assert owner.refresh().kudos == reward
    assert requester.refresh().kudos == Decimal("1000") - reward - 1


def test_a_job_whose_submit_came_too_late_or_never_is_served_again(live, make_user):
    """A slow CPU worker past the 150 s lease, or a submit lost to a gateway's 502 (both seen): the
    sweep restarts the job; the late submit gets 400 AbortedGen with a JSON body (it prints it and
    counts an error, nothing else); its next pop gets the request again, charged once."""
    owner, requester = make_user("kcpp-owner", trusted=True), make_user("requester", kudos=1000)
    request_id = ask(live, requester.key, {"max_length": 100, "max_context_length": 1024})
    first = run_pop(live, owner.key)["id"]
    Generation.objects.filter(pk=first).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert tasks.abort_stale_generations.apply().get() == 1
    restarted = status(live, request_id)
    assert (restarted["waiting"], restarted["processing"], restarted["restarted"]) == (1, 0, 1)

    late = run_submit(live, owner.key, first)
    assert late.status_code == 400 and late.headers["content-type"] == "application/json"
    assert late.json() == {
        "message": f"Processing Generation with ID {first} took too long to process and has been aborted! "
        "Please check your worker's speed and make sure it can finish within the lease.",
        "rc": "AbortedGen",
    }

    second = run_pop(live, owner.key)
    assert second["id"] not in (None, first) and second["payload"]["prompt"] == PROMPT
    assert run_submit(live, owner.key, second["id"]).status_code == 200
    done = status(live, request_id)
    assert (done["done"], done["finished"], done["restarted"], len(done["generations"])) == (True, 1, 1, 1)
    assert requester.refresh().kudos == Decimal("1000") - owner.refresh().kudos - 1


def test_in_maintenance_it_serves_its_owner_and_is_refused_the_rest(live, make_user):
    """Seen: with the worker in maintenance its pops are 403 WorkerMaintenance carrying the owner's
    message (it prints the body and waits 10 s), except when the owner's own request waits."""
    owner, requester = make_user("kcpp-owner", trusted=True), make_user("requester", kudos=1000)
    run_pop(live, owner.key)
    worker_id = str(Worker.objects.get(name="kcpp-tiny").pk)
    put = live.request(
        "PUT", f"/api/v2/workers/{worker_id}", headers={"apikey": owner.key},
        body={"maintenance": True, "maintenance_msg": "kcpp run: maintenance check"},
    )
    assert put.status_code == 200, put.text
    others = ask(live, requester.key, {"max_length": 30, "max_context_length": 512})
    refused = live.request(
        "POST", "/api/v2/generate/text/pop", headers=kcpp_headers(owner.key), body=RUN_POP, exact_headers=True
    )
    assert refused.status_code == 403
    assert refused.json() == {"message": "kcpp run: maintenance check", "rc": "WorkerMaintenance"}

    owners = ask(live, owner.key, {"max_length": 30, "max_context_length": 512})
    job = run_pop(live, owner.key)
    assert str(Generation.objects.get(pk=job["id"]).request_id) == owners
    assert run_submit(live, owner.key, job["id"]).status_code == 200
    assert status(live, others)["waiting"] == 1


@pytest.mark.parametrize(
    ("key", "code", "rc"),
    [("not-a-key-of-this-horde", 401, "InvalidAPIKey"), ("0000000000", 403, "AnonForbiddenWorker")],
)
def test_a_wrong_key_is_answered_with_a_json_body_it_prints(live, key, code, rc):
    """`--hordekey` mistyped, or left as the anonymous key: it prints "Error: HTTP Error <code>: ...
    - <body>" and "Make sure your Horde API key and worker name is valid!"."""
    # The anonymous user comes from a data migration, which the transactional test's flush removes.
    HordeUser.objects.get_or_create(
        api_key_hash=hashlib.sha256(b"0000000000").hexdigest(),
        defaults={"username": "Anonymous", "is_anonymous": True},
    )
    refused = live.request(
        "POST", "/api/v2/generate/text/pop", headers=kcpp_headers(key), body=RUN_POP, exact_headers=True
    )
    assert refused.status_code == code and refused.headers["content-type"] == "application/json"
    assert refused.json()["rc"] == rc and refused.json()["message"]


# --- The newest koboldcpp stored: the mirror's HEAD is tag v1.76 itself (2da346a5, 2024-10-11), and
# the unreleased branch after it (concedo_experimental 94a5a27b, 2024-10-24, KcppVersion "1.77") has
# make_url_request and run_horde_worker byte for byte as 1.76. The exchange is the one above; what
# follows are the parts of it the run did not reach. --------------------------------------------------


def test_its_next_pop_can_reach_the_horde_before_its_submit(live, make_user):
    """run_horde_worker (1.76): the submit goes out on its own thread (submit_completed_generation)
    and the loop pops again 0.1 s later, so the next pop may arrive first, and two submit threads
    may finish in either order. Here the two jobs of one `n: 2` request: both popped, then submitted
    last first; each is paid, and the request is done with both texts, charged once for each."""
    owner, requester = make_user("kcpp-owner", trusted=True), make_user("requester", kudos=1000)
    request_id = ask(live, requester.key, {"n": 2, "max_length": 40, "max_context_length": 1024})
    first = run_pop(live, owner.key)
    second = run_pop(live, owner.key)  # sent while the first job's submit is still on its way
    assert None not in (first["id"], second["id"]) and first["id"] != second["id"]
    for job in (first, second):
        assert job["payload"] == {"prompt": PROMPT, "n": 1, "max_length": 40, "max_context_length": 1024}
        assert (job["ids"], job["model"], job["ttl"]) == ([job["id"]], RUN_MODEL, 150)
    assert status(live, request_id)["processing"] == 2

    rewards = []
    for job, text in ((second, " second"), (first, GENERATION)):
        submitted = run_submit(live, owner.key, job["id"], text)
        assert submitted.status_code == 200, submitted.text
        rewards.append(Decimal(str(submitted.json()["reward"])))
    assert all(reward > 0 for reward in rewards)

    done = status(live, request_id)
    assert (done["done"], done["finished"], done["processing"], done["faulted"]) == (True, 2, 0, False)
    assert sorted(g["text"] for g in done["generations"]) == sorted([GENERATION, " second"])
    assert owner.refresh().kudos == sum(rewards)
    assert requester.refresh().kudos == Decimal("1000") - sum(rewards) - 1
    assert Decimal(str(done["kudos"])) == sum(rewards) + 1


def test_an_empty_generation_is_taken_as_it_submits_it(live, make_user):
    """koboldcpp submits `current_generation["results"][0]["text"]` whatever it holds: "" when the
    model's first token ends the text (generate() answers status 1 with no text). The submit is a
    200 with a numeric `reward` (it prints it with :.0f), and the requester sees the empty text."""
    owner, requester = make_user("kcpp-owner", trusted=True), make_user("requester", kudos=1000)
    request_id = ask(live, requester.key, {"max_length": 40, "max_context_length": 1024})
    job = run_pop(live, owner.key)

    submitted = run_submit(live, owner.key, job["id"], "")
    assert submitted.status_code == 200 and submitted.headers["content-type"] == "application/json"
    assert submitted.content == b'{"reward":0.65}'  # counted as the 20 tokens a text counts at least

    done = status(live, request_id)
    assert (done["done"], done["faulted"]) == (True, False)
    assert [g["text"] for g in done["generations"]] == [""]
    assert owner.refresh().kudos == Decimal("0.65")
    assert requester.refresh().kudos == Decimal("1000") - Decimal("1.65")


def test_a_payload_past_its_arrays_is_generated_not_failed(live, make_user):
    """The horde takes up to 128 distinct stop sequences and a sampler order of more than 7; koboldcpp
    1.76's generate() has room for 32 stops and 7 samplers. It copies the first 32 stops, leaves a
    longer order out for its default one, and generates: the job is served, not lost to an error
    of its own generate (which the horde would see as a job never submitted)."""
    owner, requester = make_user("kcpp-owner", trusted=True), make_user("requester", kudos=1000)
    stops = [f"\nName{n}:" for n in range(40)]
    order = [6, 0, 1, 3, 4, 2, 5, 7]
    request_id = ask(live, requester.key, {
        "max_length": 40, "max_context_length": 1024, "stop_sequence": stops, "sampler_order": order,
    })
    job = run_pop(live, owner.key)
    assert (job["payload"]["stop_sequence"], job["payload"]["sampler_order"]) == (stops, order)

    inputs = koboldcpp_generate_inputs({**job["payload"], "genkey": "HORDEREQ_123"})
    assert [inputs.stop_sequence[n] for n in range(STOP_TOKEN_MAX)] == [stop.encode() for stop in stops[:32]]
    assert inputs.sampler_len == 0  # its own default order applies

    assert run_submit(live, owner.key, job["id"]).status_code == 200
    assert [g["text"] for g in status(live, request_id)["generations"]] == [GENERATION]


def test_its_loop_at_a_fast_models_pace_is_never_refused(live, make_user, settings):
    """With jobs waiting and a fast model, run_horde_worker pops again 0.1 s after each job (no
    sleep but time.sleep(0.1)): several pops and submits a second under the same key. Under the
    default limits (2 a second per key) pops and submits count against none (only the generate
    routes do), so none is a 429 that it would count as an error towards its pause."""
    settings.HORDE_API_KEY_RATE_LIMITS = ["2/second"]
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["2/second", "90/minute"]
    owner, requester = make_user("kcpp-owner", trusted=True), make_user("requester", kudos=1000)
    request_id = ask(live, requester.key, {"n": 4, "max_length": 40, "max_context_length": 1024})
    served = []
    for _ in range(4):
        job = run_pop(live, owner.key)
        assert job["id"] is not None
        assert run_submit(live, owner.key, job["id"]).status_code == 200
        served.append(job["id"])
    assert run_pop(live, owner.key) == IDLE_ANSWER
    done = status(live, request_id)
    assert (done["done"], done["finished"], len(set(served))) == (True, 4, 4)
