"""POST /v1/completions (OpenAI's legacy completions) over native text requests, with the real openai
client and the programs that call it (LangChain's OpenAI class, KoboldAI Lite's text mode) against a
live horde and a text worker popping as the AI-Horde-Worker scribe does (docs/adr/0014-legacy-completions.md)."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest

from chat.models import GenerationRequest
from tests.oai.conftest import MODEL, wait_for
from tests.ports import free_port
from workers.models import Worker

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


def _post_completion(front, requester, body: dict) -> httpx.Response:
    """POST /v1/completions with the requester's key, as a plain HTTP client sends it (no SDK, no retries)."""
    return httpx.post(
        f"{front.live.v1}/completions",
        json=body,
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=20,
    )


def test_whole_completion_through_the_openai_client(client, start_text_worker):
    worker = start_text_worker()
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64)
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.model == MODEL
    choice = completion.choices[0]
    assert (choice.text, choice.index, choice.logprobs, choice.finish_reason) == (
        " there was a horde.",
        0,
        None,
        "stop",
    )
    assert completion.system_fingerprint.startswith("fp_")
    assert completion.usage.prompt_tokens == 4 and completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == 9
    payload = worker.jobs[0]["payload"]
    assert payload["prompt"] == PROMPT and payload["max_length"] == 64


# A story opening beyond ASCII: four characters a token (English's average) would ask for a third of
# the context its tokens take, and the worker would cut the prompt from its start to fit (ADR 0111).
CYRILLIC_PROMPT = "Жили-были старик со старухой у самого синего моря. " * 8


def _asked_context(prompt: str, max_tokens: int) -> int:
    ascii_characters = sum(1 for c in prompt if c < "\x80")
    return -(-ascii_characters // 3) + (len(prompt) - ascii_characters) + max_tokens


def test_a_prompt_is_asked_a_context_that_errs_high(client, start_text_worker):
    """Three ASCII characters a token and a token for each other character: the job's context
    holds the prompt as a real tokenizer counts it, so the worker does not cut its start."""
    worker = start_text_worker(max_context_length=4096)
    client.completions.create(model=MODEL, prompt=CYRILLIC_PROMPT, max_tokens=100)
    payload = worker.jobs[0]["payload"]
    assert payload["prompt"] == CYRILLIC_PROMPT
    assert payload["max_context_length"] == _asked_context(CYRILLIC_PROMPT, 100)
    assert payload["max_context_length"] > len(CYRILLIC_PROMPT) // 4 + 100 + 200

    client.completions.create(model=MODEL, prompt=PROMPT * 30, max_tokens=64)
    assert worker.jobs[1]["payload"]["max_context_length"] == _asked_context(PROMPT * 30, 64)


def test_a_context_above_every_workers_is_lowered_to_the_largest(client, start_text_worker):
    """Asked more context than any online worker serving the model declares, the request asks for
    the largest one (a worker that fits the prompt by four characters a token still takes it)."""
    needed = len(CYRILLIC_PROMPT) // 4 + 100 + 20
    assert needed < _asked_context(CYRILLIC_PROMPT, 100)
    small = start_text_worker(max_context_length=needed + 10)
    completion = client.completions.create(model=MODEL, prompt=CYRILLIC_PROMPT, max_tokens=100)
    assert completion.choices[0].text == " there was a horde."
    assert small.jobs[0]["payload"]["max_context_length"] == needed + 10


# The aphrodite scribe is on the validated backends list (contract.text.VALIDATED_TEXT_BRIDGES).
VALIDATED_BRIDGE_AGENT = "AI Horde Worker~aphrodite~kai:24:https://github.com/db0/AI-Horde-Worker"


@pytest.mark.parametrize("why", ["completion", "worker_list", "trusted_workers", "validated_backends"])
def test_a_worker_that_cannot_take_the_request_does_not_hold_the_context_up(
    client, start_text_worker, make_user, why
):
    """The context is lowered to the largest of the workers that could take the request: one with a
    larger context but too small a completion limit, left out by the request's worker list, or
    refused by its trusted-workers or validated-backends rule, would keep the ask above the worker
    that can serve it, which the old four-characters-a-token ask let take it (ADR 0111)."""
    prompt = PROMPT * 30
    old_ask = len(prompt) // 4 + 512
    assert old_ask < _asked_context(prompt, 512)
    start_text_worker(max_context_length=8192, max_length=256 if why == "completion" else 1024)
    serving = start_text_worker(
        max_context_length=old_ask + 10,
        max_length=1024,
        key=make_user(f"trusted-{uuid.uuid4().hex[:6]}", trusted=True).key,
        bridge_agent=VALIDATED_BRIDGE_AGENT,
    )
    horde = {
        "completion": {},
        "worker_list": {"only": [str(Worker.objects.get(name=serving.name).id)]},
        "trusted_workers": {"trusted_workers": True},
        "validated_backends": {"validated_backends": True},
    }[why]
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=512, extra_body={"horde": horde})
    assert completion.choices[0].text == " there was a horde."
    assert serving.jobs[0]["payload"]["max_context_length"] == old_ask + 10


def test_a_context_the_client_asks_is_not_lowered(client, start_text_worker):
    """`horde.max_context_length`, when the client sends it, decides (ADR 0111): above every online
    worker's context it waits for a worker that has it, as before, and is not lowered to a context
    in which the worker would cut the prompt the client sized it for."""
    worker = start_text_worker(max_context_length=2048)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=64, extra_body={"horde": {"max_context_length": 4096}}
        )
    assert caught.value.status_code == 503 and "No online worker could take this request" in caught.value.message
    assert worker.jobs == []
    assert GenerationRequest.objects.get().max_context_length == 4096


def test_a_text_completion_is_woken_by_its_submit_not_by_the_next_poll(front, client, start_text_worker):
    """The text submit of a request a front waits on publishes the completion signal (over Redis,
    or in process without it), so the reply comes before a poll 30 s away (docs/adr/0055)."""
    front.configure(poll_seconds=30)
    start_text_worker()
    for stream in (False, True):
        started = time.monotonic()
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64).choices[0].text
        assert text == " there was a horde."
        assert time.monotonic() - started < 10


def test_streamed_completion_with_usage(client, start_text_worker):
    start_text_worker()
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=64, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " there was a horde."
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 9


def test_stream_options_include_obfuscation_is_accepted(client, start_text_worker):
    start_text_worker()
    options = {"include_usage": True, "include_obfuscation": False}
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, stream=True, stream_options=options)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " there was a horde."
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 9


def test_stream_wire_ends_with_done_and_no_usage_unasked(front, requester, start_text_worker):
    start_text_worker()
    with httpx.stream(
        "POST",
        f"{front.live.v1}/completions",
        json={"model": MODEL, "prompt": PROMPT, "stream": True},
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=20,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert lines[0].startswith(":")  # the opening comment, before the first read's decision
    assert data[-1] == "[DONE]"
    assert all("usage" not in json.loads(d) for d in data[:-1])


def test_stop_sequence_is_cut_off_and_forwarded(client, start_text_worker):
    worker = start_text_worker(generation=lambda job: " a dragon slept.\nYou: and then?")
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, stop="\nYou:")
    assert completion.choices[0].text == " a dragon slept."
    assert completion.choices[0].finish_reason == "stop"
    assert worker.jobs[0]["payload"]["stop_sequence"] == ["\nYou:"]


def test_length_finish_and_echo(client, start_text_worker):
    start_text_worker(generation=lambda job: "x" * 64 * 4)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, echo=True)
    assert completion.choices[0].text == PROMPT + "x" * 256
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 64


# --- the programs' own requests ----------------------------------------------------------------------


def test_langchain_openai_class_replay(client, start_text_worker):
    """langchain_openai.OpenAI (1.x) calls `client.completions.create(prompt=[prompt], **params)` with its
    default params, and streams with `prompt=prompt, stream=True`."""
    worker = start_text_worker()
    params = {
        "model": MODEL,
        "temperature": 0.7,
        "top_p": 1,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "n": 1,
        "seed": None,
        "logprobs": None,
        "max_tokens": 256,
    }
    completion = client.completions.create(prompt=["Tell me a joke."], stop=["\n\n"], **params)
    assert completion.choices[0].text == " there was a horde."
    assert {"completion_tokens", "prompt_tokens", "total_tokens"} <= set(completion.usage.model_dump())
    streamed = list(client.completions.create(prompt="Tell me a joke.", stream=True, **params))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == " there was a horde."
    payload = worker.jobs[0]["payload"]
    assert payload["prompt"] == "Tell me a joke."
    assert payload["max_length"] == 256 and payload["temperature"] == 0.7 and payload["top_p"] == 1
    assert payload["stop_sequence"] == ["\n\n"] and "rep_pen" not in payload


def test_a_text_stream_that_fails_after_its_headers_raises_in_the_sdk_and_in_langchain(
    front, client, requester, live_horde, worker_owner
):
    """The legacy route's stream (LangChain's `OpenAI`, SillyTavern's and Lite's text modes) ends an
    error after its 200 headers as the chat route does: a `data:` event holding `error`, which the
    openai SDK raises as APIError (code a string) and LangChain's `OpenAI.stream` lets through, then
    [DONE]. The scribe checked in but never pops, so the stream's budget runs out."""
    from langchain_openai import OpenAI

    from tests.oai.conftest import ScribeTextWorker

    # Long enough that the headers go out before it ends on a loaded box (at 1 s, one CI run's
    # submit took the whole budget and the answer was a 408 before any header).
    front.configure(stream_timeout_seconds=3.0)
    ScribeTextWorker(live=live_horde, key=worker_owner.key).check_in()
    with pytest.raises(openai.APIError) as caught:
        list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, stream=True))
    assert caught.value.code == "ChatRequestTimeout" and caught.value.type == "timeout_error"
    llm = OpenAI(base_url=front.live.v1, api_key=requester.key, model=MODEL, max_retries=0, timeout=30, max_tokens=32)
    with pytest.raises(openai.APIError, match="No worker finished the request within 3 seconds."):
        list(llm.stream(PROMPT))
    with httpx.stream(
        "POST",
        f"{front.live.v1}/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "stream": True},
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=10,
    ) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 2
    error = json.loads(events[0].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("ChatRequestTimeout", "timeout_error")
    assert wait_for(lambda: all(r.cancelled for r in GenerationRequest.objects.all()), 10)


LITE_BODY = {
    # KoboldAI Lite's text mode ("OpenAI Compatible API", "Use ChatCompletions API" unticked): its
    # default settings (max_length 768, temperature 0.75, top_p 0.92, rep_pen 1.05 sent as
    # presence_penalty = rep_pen - 1, its first four stop sequences), streamed over SSE.
    "max_tokens": 768,
    "model": MODEL,
    "temperature": 0.75,
    "top_p": 0.92,
    "stop": ["\nYou:", "\nKoboldAI:"],
    "presence_penalty": 1.05 - 1.0,
    "prompt": "\nYou: Hello there!\nKoboldAI:",
    "stream": True,
}


def test_kobold_lite_text_mode_replay(front, requester, start_text_worker):
    worker = start_text_worker(max_length=1024, generation=lambda job: " Hi! How can I help?\nYou: more")
    origin = {"Origin": "null"}  # Lite from file://
    preflight = httpx.options(
        f"{front.live.v1}/completions",
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 204
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    text = ""
    with httpx.stream(
        "POST",
        f"{front.live.v1}/completions",
        content=json.dumps(LITE_BODY),
        headers={**origin, "Content-Type": "application/json", "Authorization": f"Bearer {requester.key}"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "*"
        buffer = response.read().decode()
    # As Lite parses it: every `data: <json>` event, reading choices[0].text.
    for event in buffer.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            data = json.loads(event[len("data: ") :])
            if data["choices"] and data["choices"][0]["text"]:
                text += data["choices"][0]["text"]
    assert text == " Hi! How can I help?"
    assert buffer.rstrip().endswith("data: [DONE]")
    payload = worker.jobs[0]["payload"]
    assert payload["prompt"] == LITE_BODY["prompt"] and payload["max_length"] == 768
    assert payload["stop_sequence"] == ["\nYou:", "\nKoboldAI:"]
    assert payload["rep_pen"] == pytest.approx(1.05) and payload["top_p"] == 0.92


# --- refusals, in OpenAI's error shape -----------------------------------------------------------------

REFUSALS = [
    # (request keys, SDK exception, param, code)
    ({"foo": 1}, openai.BadRequestError, "foo", "UnsupportedChatParameter"),
    ({"n": 2}, openai.BadRequestError, "n", "UnsupportedChatParameter"),
    ({"prompt": ["one", "two"]}, openai.BadRequestError, "prompt", "UnsupportedChatParameter"),
    ({"prompt": [1, 2, 3]}, openai.BadRequestError, "prompt", "UnsupportedChatParameter"),
    ({"prompt": 5}, openai.BadRequestError, "prompt", "BadRequest"),
    ({"logprobs": 5}, openai.BadRequestError, "logprobs", "UnsupportedChatParameter"),
    ({"best_of": 2}, openai.BadRequestError, "best_of", "UnsupportedChatParameter"),
    ({"suffix": "The end."}, openai.BadRequestError, "suffix", "UnsupportedChatParameter"),
    ({"logit_bias": {"50256": -100}}, openai.BadRequestError, "logit_bias", "UnsupportedChatParameter"),
    ({"max_tokens": 8}, openai.BadRequestError, "max_tokens", "UnsupportedChatParameter"),
    ({"seed": 2**63}, openai.BadRequestError, "seed", "BadRequest"),
    # The native text route's bound, said in OpenAI's words before the request is sent on.
    ({"max_tokens": 5000}, openai.BadRequestError, "max_tokens", "UnsupportedChatParameter"),
    ({"temperature": 2.5}, openai.BadRequestError, "temperature", "UnsupportedChatParameter"),
    ({"stop": ["a"] * 129}, openai.BadRequestError, "stop", "UnsupportedChatParameter"),
    ({"models": [MODEL]}, openai.BadRequestError, "models", "ChatRequestConflict"),
    ({"model": "a:b"}, openai.NotFoundError, "model", "model_not_found"),
    ({"horde": {"include_reasoning": False}}, openai.BadRequestError, "horde.include_reasoning", None),
    (
        {"horde": {"availability_mode": "now"}},
        openai.BadRequestError,
        "horde.availability_mode",
        "BadRequest",
    ),
    # Refused by the native text route, its field named as the client sent it.
    ({"stop": ["\nYou:", "a\x00b"]}, openai.BadRequestError, "stop[1]", "BadRequest"),
    # Upstream's refusals of the text params, their rc as the code (ADR 0073).
    ({"stop": "x" * 2001}, openai.BadRequestError, "stop", "ExcessiveStopSequence"),
    ({"max_tokens": 200, "horde": {"max_context_length": 100}}, openai.BadRequestError, "max_tokens", "TokenOverflow"),
    ({"sampler_order": [6, 0, 1]}, openai.BadRequestError, "sampler_order", "MissingFullSamplerOrder"),
    # Upstream refuses a blank prompt (OpenAI serves one): the param is the prompt, not null.
    ({"prompt": ""}, openai.BadRequestError, "prompt", "MissingPrompt"),
    ({"prompt": [""]}, openai.BadRequestError, "prompt", "MissingPrompt"),
    ({"top_p": 0}, openai.BadRequestError, "top_p", "BadRequest"),
    ({"horde": {"only": ["scribe-1"]}}, openai.BadRequestError, "horde.only[0]", "BadRequest"),
    ({"horde": {"max_context_length": 10}}, openai.BadRequestError, "horde.max_context_length", "BadRequest"),
]


@pytest.mark.parametrize(("keys", "exception", "param", "code"), REFUSALS)
def test_refusals(front, requester, keys, exception, param, code):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, **keys}
    response = _post_completion(front, requester, body)
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert response.headers["x-should-retry"] == "false"
    # The SDK raises the class a client catches, with the same param.
    sdk = openai.OpenAI(base_url=front.live.v1, api_key=requester.key, max_retries=0)
    with pytest.raises(exception) as caught:
        sdk.post("/completions", body=body, cast_to=object)
    assert caught.value.body["param"] == param


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2, 3]], [[1, 2], [3]]])
def test_a_token_id_prompt_is_refused_as_token_ids(front, requester, prompt):
    """OpenAI's prompt may be token ids (int[] or int[][], as lm-evaluation-harness sends them): one
    prompt of three tokens is refused as token ids, not as three prompts nor as a wrong type."""
    response = _post_completion(front, requester, {"model": MODEL, "prompt": prompt, "max_tokens": 32})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Token id prompts are not supported by the AI Horde: send text.",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "UnsupportedChatParameter",
    }


def test_chat_route_stop_refusal_names_the_openai_param(client, start_worker):
    start_worker()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stop=["x", ""]
        )
    assert caught.value.body["param"] == "stop[1]"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stop="")
    assert caught.value.body["param"] == "stop"


def test_authentication(front, requester):
    bad = openai.OpenAI(base_url=front.live.v1, api_key="not-a-horde-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.completions.create(model=MODEL, prompt=PROMPT)
    assert caught.value.body["type"] == "authentication_error"
    front.configure(allow_anonymous=False)
    response = httpx.post(f"{front.live.v1}/completions", json={"model": MODEL, "prompt": PROMPT}, timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_no_worker_is_503_after_the_grace_and_the_request_is_cancelled(client):
    from chat.models import GenerationRequest

    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32)
    assert caught.value.status_code == 503 and caught.value.code == "no_eligible_worker"
    assert caught.value.response.headers["retry-after"] == "30"
    request = GenerationRequest.objects.get()
    assert request.is_chat is False and request.cancelled is True


def test_client_disconnect_cancels_the_text_request(front, requester):
    import time

    from chat.models import GenerationRequest

    front.configure(fail_fast_grace_seconds=30.0)
    with httpx.stream(
        "POST",
        f"{front.live.v1}/completions",
        json={"model": MODEL, "prompt": PROMPT, "stream": True},
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=20,
    ) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the stream is open: the request is queued
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not GenerationRequest.objects.filter(cancelled=True).exists():
        time.sleep(0.1)
    assert GenerationRequest.objects.get().cancelled is True


# --- every other /v1 path --------------------------------------------------------------------------------


def test_unknown_v1_paths_are_404_in_openai_shape(front, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model=MODEL, input="Hello")
    assert caught.value.body["code"] == "unknown_url"
    assert caught.value.body["type"] == "invalid_request_error"
    for method, path in (("GET", "/v1/"), ("POST", "/v1/engines/x/completions"), ("GET", "/v1/files")):
        response = httpx.request(method, f"{front.live.url}{path}", timeout=10)
        assert response.status_code == 404
        assert response.json()["error"]["message"] == (
            f"Invalid URL ({method} {path}): the AI Horde serves /v1/chat/completions, /v1/completions, "
            "/v1/responses and /v1/models."
        )
        assert response.headers["access-control-allow-origin"] == "*"
    # A known path with another method keeps its 405, in the same shape, typed as OpenAI types a
    # client error.
    for method, path in (
        ("GET", "/completions"), ("GET", "/chat/completions"), ("POST", "/models"), ("DELETE", "/models/x")
    ):
        response = httpx.request(method, f"{front.live.v1}{path}", timeout=10)
        assert response.status_code == 405, (method, path)
        error = response.json()["error"]
        assert (error["code"], error["type"]) == ("method_not_allowed", "invalid_request_error"), (method, path)
        assert response.headers["x-should-retry"] == "false"


def test_unknown_v1_paths_on_the_standalone_front(settings):
    from django.test import Client

    settings.ROOT_URLCONF = "oai.standalone_urls"
    response = Client().post("/v1/embeddings", data={}, content_type="application/json")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"


def test_the_standalone_fronts_openapi_json_is_json(settings):
    # It answered YAML (application/vnd.oai.openapi), which schemathesis, pointed at the URL its
    # name promises JSON from, could not load (ADR 0114).
    from django.test import Client

    settings.ROOT_URLCONF = "oai.standalone_urls"
    response = Client().get("/v1/openapi.json")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/vnd.oai.openapi+json")  # as /api/v2/openapi.json
    assert "/v1/chat/completions" in response.json()["paths"]


# --- metrics -------------------------------------------------------------------------------------------


def test_body_bytes_counts_every_body_received_whole(front, requester):
    front.configure(allow_anonymous=False, max_body_bytes=1000)
    bodies = [
        (f"{front.live.v1}/completions", {"model": MODEL, "prompt": PROMPT}, {}),  # 401: no key
        (f"{front.live.v1}/completions", {"model": MODEL, "prompt": PROMPT, "foo": 1}, {}),  # 400
        (f"{front.live.v1}/chat/completions", {"model": MODEL, "messages": []}, {}),  # 400
        (f"{front.live.v1}/embeddings", {"model": MODEL, "input": "x"}, {}),  # 404
    ]
    sizes = []
    statuses = []
    for url, body, _ in bodies:
        content = json.dumps(body).encode()
        sizes.append(len(content))
        headers = {"Content-Type": "application/json"}
        if "foo" in body or "messages" in body:
            headers["Authorization"] = f"Bearer {requester.key}"
        statuses.append(httpx.post(url, content=content, headers=headers, timeout=10).status_code)
    assert statuses == [401, 400, 400, 404]
    # Over the limit: a refusal (413), not a body received whole.
    too_large = httpx.post(
        f"{front.live.v1}/completions",
        json={"model": MODEL, "prompt": "x" * 2000},
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=10,
    )
    assert too_large.status_code == 413
    metrics = front.metrics()
    [(attributes, (count, total))] = metrics["horde.oai.request.body_bytes"]
    assert attributes == {} and (count, total) == (4, sum(sizes))
    refused = {(a["horde.status_code"], a["horde.code"]): v for a, v in metrics["horde.oai.requests.refused"]}
    assert refused[(401, "invalid_api_key")] == 1 and refused[(413, "RequestTooLarge")] == 1


class DelayingProxy:
    """A TCP relay in front of the live horde that holds back the answer to each request whose first
    line starts with one of `delays` (a slow network or a slow root, nothing of the horde changed);
    with `times`, only the first that many answers of a prefix are held back."""

    def __init__(self, upstream_port: int, delays: dict[bytes, float], times: dict[bytes, int] | None = None):
        import socket
        import threading

        self.upstream_port = upstream_port
        self.delays = delays
        self.times = dict(times or {})
        self.lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v2"

    def close(self) -> None:
        self.closed = True
        self.listener.close()

    def _accept(self) -> None:
        import socket
        import threading

        while not self.closed:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            hold = {"seconds": 0.0}
            threading.Thread(target=self._requests, args=(downstream, upstream, hold), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, downstream, hold), daemon=True).start()

    def _requests(self, source, target, hold) -> None:
        try:
            while data := source.recv(65536):
                for prefix, seconds in self.delays.items():
                    if data.startswith(prefix) and self._take(prefix):
                        hold["seconds"] = seconds
                target.sendall(data)
        except OSError:
            pass
        finally:
            target.close()

    def _take(self, prefix: bytes) -> bool:
        with self.lock:
            if prefix not in self.times:
                return True
            self.times[prefix] -= 1
            return self.times[prefix] >= 0

    def _answers(self, source, target, hold) -> None:
        import time

        try:
            while data := source.recv(65536):
                if hold["seconds"]:
                    time.sleep(hold["seconds"])
                    hold["seconds"] = 0.0
                target.sendall(data)
        except OSError:
            pass
        finally:
            target.close()


@pytest.fixture
def delaying_proxy(live_horde):
    proxies = []

    def make(delays: dict[bytes, float], times: dict[bytes, int] | None = None) -> DelayingProxy:
        proxy = DelayingProxy(live_horde.port, delays, times)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()


def test_a_status_read_the_budget_outlives_is_abandoned(front, client, delaying_proxy):
    from chat.models import GenerationRequest

    proxy = delaying_proxy({b"GET /api/v2/generate/text/status/": 4.0})
    front.configure(native_roots=[proxy.root], nonstream_timeout_seconds=1.5)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32)
    assert caught.value.status_code == 408 and caught.value.code == "ChatRequestTimeout"

    def durations() -> dict:
        return {(a["horde.call_type"], a["horde.outcome"]): v for a, v in front.metrics()["horde.oai.native.duration"]}

    # The cancel may still be on its way when the 408 reaches the client (a loaded box).
    assert wait_for(lambda: ("cancel", "ok") in durations(), 10)
    count, seconds = durations()[("status", "abandoned")]
    assert count == 1 and seconds < 1.5  # abandoned when the budget ended, not when the answer came
    assert durations()[("submit", "ok")][0] == 1
    assert durations()[("cancel", "ok")][0] == 1
    assert GenerationRequest.objects.get().cancelled is True


def test_a_lost_text_submit_is_sent_again_with_its_operation_key(front, client, delaying_proxy, start_text_worker):
    """The text route takes the operation key (docs/adr/0020-front-lease.md): a submit whose answer was
    lost is sent again with it, and the horde answers with the request the first one queued."""
    from chat.models import GenerationRequest

    start_text_worker()
    proxy = delaying_proxy({b"POST /api/v2/generate/text/async": 3.0}, times={b"POST /api/v2/generate/text/async": 1})
    front.configure(native_roots=[proxy.root], native_timeout_seconds=1.0)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32)
    assert completion.choices[0].text == " there was a horde."
    metrics = front.metrics()
    assert [(a, v) for a, v in metrics["horde.oai.submit.recoveries"]] == [({"horde.existing_claim": True}, 1)]
    request = GenerationRequest.objects.get()  # the one submit landed; nothing was queued twice
    assert request.operation_key is not None and not request.cancelled


def test_fail_fast_is_served_by_an_idle_worker_and_refused_without_one(client, start_text_worker):
    fail_fast = {"horde": {"availability_mode": "fail_fast"}}
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, extra_body=fail_fast)
    # The text status reports no eligible worker threads: no worker is refused by the grace.
    assert caught.value.status_code == 503 and caught.value.code == "no_eligible_worker"
    start_text_worker()
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, extra_body=fail_fast)
    assert completion.choices[0].text == " there was a horde."


@pytest.fixture
def standalone_front(live_horde):
    """`python -m oai` in its own process, over HTTP to the live horde."""
    import os
    import subprocess
    import sys
    import time

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(
        HORDE_OAI_PORT=str(port),
        HORDE_OAI_NATIVE_ROOTS=f"{live_horde.url}/api/v2",
        HORDE_OAI_REDIS_URL="",
        HORDE_OAI_POLL_SECONDS="0.1",
        HORDE_OAI_FAIL_FAST_GRACE_SECONDS="1",
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "oai"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


def test_standalone_front_serves_completions_and_404s_unknown_paths(
    transactional_db, standalone_front, requester, start_text_worker
):
    from tests.oai.conftest import _restore_anonymous_user

    _restore_anonymous_user()
    start_text_worker()
    sdk = openai.OpenAI(base_url=f"{standalone_front}/v1", api_key=requester.key, max_retries=0, timeout=30)
    completion = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32)
    assert completion.choices[0].text == " there was a horde."
    streamed = list(sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == " there was a horde."
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.embeddings.create(model=MODEL, input="Hello")
    assert caught.value.body["code"] == "unknown_url"
    assert httpx.get(f"{standalone_front}/v1/openapi.json", timeout=10).status_code == 200


def test_max_tokens_above_the_text_bound_is_refused_in_openai_words(front, requester):
    response = _post_completion(front, requester, {"model": MODEL, "prompt": PROMPT, "max_tokens": 100_000})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Invalid 'max_tokens': integer above maximum value. Expected a value <= 4096, but got 100000 instead.",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "UnsupportedChatParameter",
    }
    assert not GenerationRequest.objects.exists()  # refused before anything was queued


def test_a_prompt_too_long_for_the_native_range_is_asked_the_ranges_largest_context(client, start_text_worker):
    """A prompt whose high estimate passes the native route's largest context (1,048,576) asks for
    that, and no worker can take it: answered as any request no worker takes, not with a range
    error on a horde.max_context_length the client never sent."""
    start_text_worker(max_context_length=4096)
    prompt = "ж" * (1048576 + 100)  # a token a character; 2 MiB of UTF-8, under the route's 2.5 MiB body limit
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=16)
    error = caught.value
    assert (error.status_code, error.body["code"]) == (503, "no_eligible_worker"), error.body
