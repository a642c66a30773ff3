"""POST /v1/completions with the sampler keys SillyTavern's text completion types and KoboldAI Lite's
"Non-Standard Fields" send, replayed with their headers against a live horde and a scribe text worker:
the native text request stores the mapped samplers, the reply reads as those programs read it, and the
keys nobody sends are still refused (docs/adr/0014-legacy-completions.md, "Sampler keys").

The bodies are SillyTavern's `createTextGenGenerationData` output for its default settings (temperature
0.7, top_p 0.5, top_k 40, rep_pen 1.2, typical_p 1, tfs 1, ...; no dynamic temperature, no token
probabilities) as its server forwards them to `{base}/v1/completions`: whole for the Default
(text-generation-webui) and KoboldCpp types, reduced to OpenAI's keys (stop cut to four) for the Generic
type, to vLLM's keys for the vLLM type. JSON.stringify drops the undefined values, so those keys are absent.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from tests.oai.conftest import MODEL

pytestmark = pytest.mark.slow

ST_PROMPT = "Aqua's Persona: a cheerful goddess.\nUser: Hello there!\nAqua:"
# A chat with an instruct template: more stop strings than OpenAI's four.
ST_STOPS = ["\nUser:", "\nAqua:", "<|im_end|>", "<|im_start|>user", "<|im_start|>assistant", "</s>"]
ST_REPLY = " Hi! I am Aqua, the goddess of water."
ST_GENERATION = ST_REPLY + "\nUser: and then?"
RESPONSE_TOKENS = 300  # the user's "Response (tokens)"
CONTEXT_TOKENS = 8192  # the user's "Context (tokens)"

# Keys every type but vLLM, Aphrodite and Generic sends (the body built before the type's own keys).
ST_COMMON = {
    "prompt": ST_PROMPT,
    "max_new_tokens": RESPONSE_TOKENS,
    "max_tokens": RESPONSE_TOKENS,
    "temperature": 0.7,
    "top_p": 0.5,
    "typical_p": 1,
    "typical": 1,
    "min_p": 0,
    "repetition_penalty": 1.2,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "top_k": 40,
    "skew": 0,
    "min_tokens": 0,
    "add_bos_token": True,
    "smoothing_factor": 0,
    "smoothing_curve": 1,
    "dry_allowed_length": 2,
    "dry_multiplier": 0,
    "dry_base": 1.75,
    "dry_sequence_breakers": '["\\n", ":", "\\"", "*"]',
    "dry_penalty_last_n": 0,
    "max_tokens_second": 0,
    "stopping_strings": ST_STOPS,
    "stop": ST_STOPS,
    "truncation_length": CONTEXT_TOKENS,
    "ban_eos_token": False,
    "skip_special_tokens": True,
    "include_reasoning": True,
    "top_a": 0,
    "tfs": 1,
    "mirostat_mode": 0,
    "mirostat_tau": 5,
    "mirostat_eta": 0.1,
    "custom_token_bans": "",
    "banned_strings": [],
    "xtc_threshold": 0.1,
    "xtc_probability": 0,
    "nsigma": 0,
    "top_n_sigma": 0,
    "min_keep": 0,
    "adaptive_target": -0.01,
    "adaptive_decay": 0.9,
}
# The keys the non-vLLM, non-Aphrodite types add, llama.cpp's aliases among them.
ST_NON_APHRODITE = {
    "rep_pen": 1.2,
    "rep_pen_range": 0,
    "repetition_penalty_range": 0,
    "guidance_scale": 1,
    "negative_prompt": "",
    "repeat_penalty": 1.2,
    "repeat_last_n": 0,
    "n_predict": RESPONSE_TOKENS,
    "num_predict": RESPONSE_TOKENS,
    "num_ctx": CONTEXT_TOKENS,
    "mirostat": 0,
    "ignore_eos": False,
    "rep_pen_slope": 1,
}


def st_body(api_type: str, api_server: str, *, stream: bool) -> dict[str, Any]:
    """The body SillyTavern's server posts to {base}/v1/completions for `api_type`."""
    body = {**ST_COMMON, "api_type": api_type, "api_server": api_server}
    if api_type == "ooba":  # "Default (oobabooga)": no model unless a custom one is typed
        body.update(
            min_length=0,
            num_beams=1,
            length_penalty=1,
            early_stopping=False,
            epsilon_cutoff=0,
            eta_cutoff=0,
            sampler_priority=[
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "dry",
                "temperature",
                "dynamic_temperature",
                "quadratic_sampling",
                "top_n_sigma",
                "top_k",
                "top_p",
                "typical_p",
                "epsilon_cutoff",
                "eta_cutoff",
                "tfs",
                "top_a",
                "min_p",
                "mirostat",
                "xtc",
                "encoder_repetition_penalty",
                "no_repeat_ngram",
            ],
            **ST_NON_APHRODITE,
            encoder_repetition_penalty=1,
            no_repeat_ngram_size=0,
            penalty_alpha=0,
            temperature_last=True,
            do_sample=True,
        )
    elif api_type == "koboldcpp":  # no model: KoboldCpp serves the one it runs
        body.update(sampler_order=[6, 0, 1, 3, 4, 2, 5], trim_stop=True, **ST_NON_APHRODITE)
        body["dry_sequence_breakers"] = ["\n", ":", '"', "*"]  # parsed for KoboldCpp
    elif api_type == "generic":  # reduced to OpenAI's keys, stop cut to four
        body = {
            "model": MODEL,
            "prompt": ST_PROMPT,
            "temperature": 0.7,
            "top_p": 0.5,
            "frequency_penalty": 0,
            "presence_penalty": 0,
            "stop": ST_STOPS[:4],
            "max_tokens": RESPONSE_TOKENS,
        }
    elif api_type == "vllm":  # reduced to vLLM's keys; the model picked from /v1/models
        body = {
            "model": MODEL,
            "prompt": ST_PROMPT,
            "max_tokens": RESPONSE_TOKENS,
            "temperature": 0.7,
            "top_p": 0.5,
            "min_p": 0,
            "repetition_penalty": 1.2,
            "frequency_penalty": 0,
            "presence_penalty": 0,
            "top_k": 40,
            "min_tokens": 0,
            "stop": ST_STOPS,
            "skip_special_tokens": True,
            "n": 1,
            "ignore_eos": False,
            "spaces_between_special_tokens": True,
        }
    elif api_type == "aphrodite":  # Aphrodite's own keys over the common ones
        body.update(
            model=MODEL,
            n=1,
            temperature_last=True,
            eta_cutoff=0,
            epsilon_cutoff=0,
            ignore_eos=False,
            spaces_between_special_tokens=True,
            early_stopping=False,
            include_stop_str_in_output=False,
            custom_token_bans=[],
            no_repeat_ngram_size=0,
        )
    if stream:
        body["stream"] = True
    return body


def st_headers(key: str, api_type: str) -> dict[str, str]:
    """SillyTavern's server-side fetch (node-fetch): its JSON content type, the type's key headers, and
    node-fetch's own."""
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {key}",
        "Accept": "*/*",
        "User-Agent": "node-fetch",
        "Accept-Encoding": "gzip, deflate, br",
        "Connection": "close",
    }
    if api_type == "aphrodite":
        headers["X-API-KEY"] = key
    return headers


def st_read_whole(data: dict[str, Any]) -> str:
    """extractMessageFromData for a text completion type."""
    return data.get("choices", [{}])[0].get("text") or data.get("content") or data.get("response") or ""


def st_event_data(event: str) -> str | None:
    """SillyTavern's EventSourceStream on one event: its `data:` lines joined, None when it has none
    (a comment line names no field it reads)."""
    data = ""
    for line in re.split(r"\n|\r|\r\n", event):
        match = re.search(r"([^:]+)(?:: ?(.*))?", line)
        if match and match.group(1) == "data":
            data += (match.group(2) or "") + "\n"
    return data[:-1] if data else None


def st_read_stream(raw: str) -> str:
    """SillyTavern's EventSourceStream and streamData: events split at a blank line, `field: value`
    lines (a comment line names no field it reads), an error message in a data event thrown, the text
    of choices[0] appended, [DONE] ending it."""
    text = ""
    for event in re.split(r"\r\n\r\n|\r\r|\n\n", raw):
        data = st_event_data(event)
        if data is None:
            continue
        if data == "[DONE]":
            return text
        parsed = json.loads(data)
        error = (parsed.get("error") or {}).get("message") if isinstance(parsed.get("error"), dict) else None
        assert not error, error
        choices = parsed.get("choices") or []
        if choices and choices[0].get("index", 0) > 0:
            raise AssertionError("a swipe index SillyTavern would read as another swipe")
        text += (choices[0].get("text") if choices else None) or parsed.get("content") or ""
    raise AssertionError("the stream ended without [DONE]")


def stored_request():
    from chat.models import GenerationRequest

    return GenerationRequest.objects.get()


# The native samplers every SillyTavern type but Generic carries, from its default settings.
ST_DEFAULT_SAMPLERS = {"top_k": 40, "min_p": 0, "rep_pen": 1.2}
ST_FULL_SAMPLERS = {
    **ST_DEFAULT_SAMPLERS,
    "top_a": 0,
    "typical": 1,
    "tfs": 1,
    "rep_pen_range": 0,
    "rep_pen_slope": 1,
    "smoothing_factor": 0,
    "use_default_badwordsids": False,
}
ST_EXPECTED = {
    "ooba": ST_FULL_SAMPLERS,
    "koboldcpp": {**ST_FULL_SAMPLERS, "sampler_order": [6, 0, 1, 3, 4, 2, 5]},
    "generic": {},
    "vllm": {**ST_DEFAULT_SAMPLERS, "use_default_badwordsids": False},
    "aphrodite": {
        **ST_DEFAULT_SAMPLERS,
        "top_a": 0,
        "typical": 1,
        "tfs": 1,
        "smoothing_factor": 0,
        "use_default_badwordsids": False,
    },
}
# What the native text params would carry had nothing been mapped.
UNMAPPED_NATIVE = {"n", "max_length", "max_context_length", "temperature", "top_p", "stop_sequence"}


@pytest.mark.parametrize("api_type", ["ooba", "koboldcpp", "generic", "vllm", "aphrodite"])
def test_sillytavern_text_completion_types_whole(front, requester, start_text_worker, api_type):
    worker = start_text_worker(generation=lambda job: ST_GENERATION)
    body = st_body(api_type, front.live.url, stream=False)
    response = httpx.post(
        f"{front.live.url}/v1/completions",
        content=json.dumps(body),
        headers=st_headers(requester.key, api_type),
        timeout=30,
    )
    assert response.status_code == 200, response.text
    data = response.json()
    assert st_read_whole(data) == ST_REPLY  # the stop string cut, as OpenAI does
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["model"] == MODEL
    row = stored_request()
    stops = body["stop"]
    assert row.params["stop_sequence"] == stops
    assert row.max_length == RESPONSE_TOKENS
    assert row.params["temperature"] == 0.7 and row.params["top_p"] == 0.5
    mapped = {k: v for k, v in row.params.items() if k not in UNMAPPED_NATIVE}
    assert mapped == ST_EXPECTED[api_type]
    assert row.any_model is ("model" not in body)
    assert row.requested_models == ([] if "model" not in body else [MODEL])
    payload = worker.jobs[0]["payload"]
    for key, value in ST_EXPECTED[api_type].items():
        assert payload[key] == value, key


@pytest.mark.parametrize("api_type", ["koboldcpp", "generic"])
def test_sillytavern_streamed(front, requester, start_text_worker, api_type):
    start_text_worker(generation=lambda job: ST_GENERATION)
    body = st_body(api_type, front.live.url, stream=True)
    with httpx.stream(
        "POST",
        f"{front.live.url}/v1/completions",
        content=json.dumps(body),
        headers=st_headers(requester.key, api_type),
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert st_read_stream(raw) == ST_REPLY
    mapped = {k: v for k, v in stored_request().params.items() if k not in UNMAPPED_NATIVE}
    assert mapped == ST_EXPECTED[api_type]


def test_sillytavern_connect_probes(front, requester):
    """The status check: GET {base}/v1/models must answer 200 with a `data` array (its first id, or
    "Valid", is the status); the Default type also asks /v1/internal/model/info and takes a failure
    as "no tokenizer endpoint"."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {requester.key}"}
    models = httpx.get(f"{front.live.url}/v1/models", headers=headers, timeout=10)
    assert models.status_code == 200 and isinstance(models.json()["data"], list)
    assert models.headers.get("x-powered-by") != "Express"  # else it would be taken for LM Studio
    info = httpx.get(f"{front.live.url}/v1/internal/model/info", headers=headers, timeout=10)
    assert info.status_code == 404 and info.json()["error"]["code"] == "unknown_url"


# KoboldAI Lite, "OpenAI Compatible API" in text mode with "Non-Standard Fields" ticked: its OpenAI keys,
# then every native param of its horde request (Object.assign), its first four stop sequences, and
# presence_penalty = rep_pen - 1 over its own presence_penalty of 0. Its default settings.
LITE_NONSTANDARD_BODY = {
    "max_tokens": 768,
    "model": MODEL,
    "temperature": 0.75,
    "top_p": 0.92,
    "n": 1,
    "max_context_length": 6144,
    "max_length": 768,
    "rep_pen": 1.05,
    "top_k": 100,
    "top_a": 0,
    "typical": 1,
    "tfs": 1,
    "rep_pen_range": 360,
    "rep_pen_slope": 0.7,
    "sampler_order": [6, 0, 1, 3, 4, 2, 5],
    "presence_penalty": 1.05 - 1.0,
    "logit_bias": {},
    "stop": ["\nYou:", "\nKoboldAI:"],
    "prompt": "\nYou: Hello there!\nKoboldAI:",
    "stream": True,
}


def test_kobold_lite_non_standard_fields_replay(front, requester, start_text_worker):
    worker = start_text_worker(max_length=1024, generation=lambda job: " Hi! How can I help?\nYou: more")
    text = ""
    with httpx.stream(
        "POST",
        f"{front.live.v1}/completions",
        content=json.dumps(LITE_NONSTANDARD_BODY),
        headers={
            "Origin": "null",
            "Content-Type": "application/json",
            "Authorization": f"Bearer {requester.key}",
        },
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "*"
        buffer = response.read().decode()
    for event in buffer.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            data = json.loads(event[len("data: ") :])
            if data["choices"] and data["choices"][0]["text"]:
                text += data["choices"][0]["text"]
    assert text == " Hi! How can I help?"
    params = stored_request().params
    assert {k: params[k] for k in ("rep_pen", "top_k", "top_a", "typical", "tfs")} == {
        "rep_pen": 1.05,
        "top_k": 100,
        "top_a": 0,
        "typical": 1,
        "tfs": 1,
    }
    assert params["rep_pen_range"] == 360 and params["rep_pen_slope"] == 0.7
    assert params["sampler_order"] == [6, 0, 1, 3, 4, 2, 5]
    # Its max_context_length is not the request's: the front asks for the context the prompt needs.
    row = stored_request()
    assert row.max_context_length < 6144 and row.max_length == 768
    assert worker.jobs[0]["payload"]["top_k"] == 100


# --- refusals ------------------------------------------------------------------------------------------

SAMPLER_REFUSALS = [
    # (keys, param, code): a value the native text route would refuse, named as the client sent it
    ({"top_k": 250}, "top_k", "UnsupportedChatParameter"),
    ({"top_k": -1}, "top_k", "UnsupportedChatParameter"),  # llama.cpp's "off"; KoboldAI's is 0
    ({"top_k": 40.5}, "top_k", "BadRequest"),
    ({"top_k": "40"}, "top_k", "BadRequest"),
    ({"typical_p": 1.5}, "typical_p", "UnsupportedChatParameter"),
    ({"repetition_penalty": 0.9}, "repetition_penalty", "UnsupportedChatParameter"),
    ({"rep_pen_range": 8192}, "rep_pen_range", "UnsupportedChatParameter"),
    ({"repeat_last_n": -1}, "repeat_last_n", "UnsupportedChatParameter"),
    ({"dynatemp_exponent": 6}, "dynatemp_exponent", "UnsupportedChatParameter"),
    ({"min_p": True}, "min_p", "BadRequest"),
    ({"sampler_order": [6, 0, 11]}, "sampler_order[2]", "UnsupportedChatParameter"),
    ({"sampler_order": "6,0,1"}, "sampler_order", "BadRequest"),
    ({"ban_eos_token": "yes"}, "ban_eos_token", "BadRequest"),
    # two aliases of one native param, disagreeing
    ({"typical": 0.9, "typical_p": 0.95}, "typical_p", "ChatRequestConflict"),
    ({"rep_pen": 1.1, "repetition_penalty": 1.2}, "repetition_penalty", "ChatRequestConflict"),
    # what the text workers cannot keep, away from its default
    ({"grammar_string": 'root ::= "yes"'}, "grammar_string", "UnsupportedChatParameter"),
    ({"guided_json": {"type": "object"}}, "guided_json", "UnsupportedChatParameter"),
    ({"banned_strings": ["sword"]}, "banned_strings", "UnsupportedChatParameter"),
    ({"custom_token_bans": "1,2"}, "custom_token_bans", "UnsupportedChatParameter"),
    ({"n_probs": 10}, "n_probs", "UnsupportedChatParameter"),
    # keys nobody sends
    ({"top_kk": 40}, "top_kk", "UnsupportedChatParameter"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages", "UnsupportedChatParameter"),
    ({"stop": [f"s{i}" for i in range(129)]}, "stop", "UnsupportedChatParameter"),
]


@pytest.mark.parametrize(("keys", "param", "code"), SAMPLER_REFUSALS)
def test_sampler_refusals(front, requester, keys, param, code):
    from chat.models import GenerationRequest

    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, **keys}
    response = httpx.post(
        f"{front.live.v1}/completions",
        json=body,
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=20,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert error["type"] == "invalid_request_error"
    assert not GenerationRequest.objects.exists()  # refused by the front, nothing queued


def test_aliases_agreeing_and_unapplied_keys_pass(front, requester, start_text_worker):
    start_text_worker()
    body = {
        "model": "",  # SillyTavern's vLLM type before a model is picked: any model
        "prompt": "Once upon a time",
        "max_tokens": 32,
        "typical": 0.9,
        "typical_p": 0.9,
        "tfs_z": 0.95,
        "ignore_eos": True,
        "ban_eos_token": False,
        "singleline": True,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,  # a repetition penalty sent governs: not 1 + 0.5
        "mirostat_mode": 2,
        "dry_new_knob": 3,  # a family member no program sends yet
        "grammar_string": "",
        "custom_token_bans": [],
        "stop": [f"s{i}" for i in range(32)],
    }
    response = httpx.post(
        f"{front.live.v1}/completions",
        json=body,
        headers={"Authorization": f"Bearer {requester.key}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    row = stored_request()
    assert row.any_model is True
    keys = ("typical", "tfs", "use_default_badwordsids", "singleline", "rep_pen")
    assert {k: row.params[k] for k in keys} == {
        "rep_pen": 1.1,
        "typical": 0.9,
        "tfs": 0.95,
        "use_default_badwordsids": True,
        "singleline": True,
    }
    assert len(row.params["stop_sequence"]) == 32
    assert not {"mirostat_mode", "dry_new_knob", "grammar_string", "custom_token_bans"} & set(row.params)
