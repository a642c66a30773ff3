"""The request side of POST /v1/completions, OpenAI's legacy completions, over native text requests
(docs/adr/0014-legacy-completions.md); its reply is oai.text_reply.

`screen_text_request` refuses what the text API cannot serve (an unknown key, a chat-only
horde option, more than one prompt, n above 1, echo/suffix/logprobs/best_of/logit_bias, grammars and
token bans away from their defaults), applies the front's bounds shared with chat completions
(oai.schema), and builds the native text body: the prompt unchanged, max_tokens as params.max_length,
stop as params.stop_sequence, the KoboldAI / text-generation-webui / llama.cpp / vLLM sampler keys
SillyTavern and KoboldAI Lite send as the native samplers (top_k, typical, rep_pen, ...), checked against
the native ranges, presence_penalty as rep_pen when no repetition penalty is sent, the worker filters
from the horde object. The sampler keys the horde cannot apply are accepted and dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from contract.chat_limits import CHAT_MAX_TOKENS_DEFAULT, CHAT_SEED_MAX, CHAT_SEED_MIN
from contract.text import (
    TEXT_BOOLEAN_PARAMS,
    TEXT_MAX_CONTEXT_LENGTH_RANGE,
    TEXT_MAX_LENGTH_RANGE,
    TEXT_MAX_STOP_SEQUENCES,  # the native list's length; OpenAI's 4 would refuse SillyTavern's instruct stops
    TEXT_PARAM_RANGES,
    TEXT_SAMPLER_ORDER_RANGE,
)
from oai.errors import ChatFrontError
from oai.mapping import estimate_context_tokens
from oai.schema import _bad, _check_models, _check_ranges, _is_number, _shown, _unsupported

# Keys validated and forwarded, or applied by the front (stream, stream_options, user, echo, seed).
TEXT_REQUEST_FIELDS = frozenset(
    {
        "model",
        "models",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "frequency_penalty",
        "presence_penalty",
        "stop",
        "seed",
        "n",
        "stream",
        "stream_options",
        "user",
        "echo",
        "horde",
    }
)
# Accepted only at their default (or null), then dropped: key -> its defaults.
TEXT_DEFAULT_NO_OP_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "logprobs": (),
    # constrained decoding and token bans: a promise about the output the text workers cannot keep
    "grammar": ("",),
    "grammar_string": ("",),
    "guided_grammar": ("",),
    "guided_regex": ("",),
    "guided_choice": ([],),
    "guided_json": ({},),
    "json_schema": ({},),
    "custom_token_bans": ("", []),
    "banned_tokens": ("", []),
    "banned_strings": ([],),
    # llama.cpp's token probabilities, as logprobs
    "n_probs": (0,),
}
# Sampler keys of KoboldAI, text-generation-webui, llama.cpp and vLLM, as SillyTavern's text completion
# types and KoboldAI Lite's "Non-Standard Fields" send them: client key -> native text param.
SAMPLER_ALIASES: dict[str, str] = {
    "top_k": "top_k",
    "top_a": "top_a",
    "min_p": "min_p",
    "typical": "typical",
    "typical_p": "typical",
    "tfs": "tfs",
    "tfs_z": "tfs",
    "rep_pen": "rep_pen",
    "repetition_penalty": "rep_pen",
    "repeat_penalty": "rep_pen",
    "rep_pen_range": "rep_pen_range",
    "repetition_penalty_range": "rep_pen_range",
    "repeat_last_n": "rep_pen_range",
    "rep_pen_slope": "rep_pen_slope",
    "smoothing_factor": "smoothing_factor",
    "dynatemp_range": "dynatemp_range",
    "dynatemp_exponent": "dynatemp_exponent",
}
# The native samplers the front maps, each with its JSON type and inclusive range (contract.text).
NATIVE_SAMPLER_RANGES: dict[str, tuple[str, float, float]] = {
    name: TEXT_PARAM_RANGES[name]
    for name in (
        "top_k",
        "top_a",
        "min_p",
        "typical",
        "tfs",
        "rep_pen",
        "rep_pen_range",
        "rep_pen_slope",
        "smoothing_factor",
        "dynatemp_range",
        "dynatemp_exponent",
    )
}
NATIVE_SAMPLER_ORDER_RANGE = TEXT_SAMPLER_ORDER_RANGE
# KoboldAI's output formatting switches, forwarded under their native names (the EOS ban below
# has aliases of its own).
NATIVE_BOOLEAN_PARAMS = tuple(name for name in TEXT_BOOLEAN_PARAMS if name != "use_default_badwordsids")
# "Ban the EOS token": KoboldAI's use_default_badwordsids, SillyTavern's ban_eos_token, llama.cpp's and
# vLLM's ignore_eos; any of them true asks for it.
EOS_BAN_KEYS = ("use_default_badwordsids", "ban_eos_token", "ignore_eos")
# Sent by those programs and accepted, not applied: samplers the text workers' API has no field for
# (mirostat, DRY, XTC, ...), aliases of keys that govern (max_tokens, stop, seed), the native names of
# what the front computes (max_length, max_context_length), and the programs' own routing keys.
ACCEPTED_UNAPPLIED_KEYS = frozenset(
    {
        # token counts and context: max_tokens governs, the front asks for the context the prompt needs
        "max_new_tokens",
        "max_length",
        "n_predict",
        "num_predict",
        "truncation_length",
        "num_ctx",
        "max_context_length",
        "min_tokens",
        "min_length",
        "minimum_message_content_tokens",
        # aliases of stop and seed
        "stopping_strings",
        "sampler_seed",
        # samplers and penalties the native text params do not have
        "skew",
        "epsilon_cutoff",
        "eta_cutoff",
        "dynamic_temperature",
        "temperature_last",
        "nsigma",
        "top_n_sigma",
        "min_keep",
        "encoder_repetition_penalty",
        "no_repeat_ngram_size",
        "penalty_alpha",
        "repetition_decay",
        "num_beams",
        "length_penalty",
        "early_stopping",
        "do_sample",
        "guidance_scale",
        "negative_prompt",
        "sampler_priority",
        "samplers",
        "speculative_ngram",
        "max_tokens_second",
        # tokenizer and output switches of the backends
        "add_bos_token",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "include_reasoning",
        "trim_stop",
        "render_special",
        "bypass_eos",
        "cache_prompt",
        "grammar_retain_state",
        # SillyTavern's own routing keys, forwarded with the body
        "api_type",
        "api_server",
        "legacy_api",
    }
)
# Sampler families sent under more names than the programs have settled on (dry_multiplier, xtc_threshold,
# mirostat_tau, dynatemp_low, smoothing_curve, adaptive_target, ...): accepted, not applied.
ACCEPTED_UNAPPLIED_PREFIXES = ("dry_", "xtc_", "mirostat", "dynatemp", "smoothing_", "adaptive_")
# The horde options a text request has; the chat-only ones are refused at their path.
TEXT_HORDE_KEYS = frozenset(
    {
        "availability_mode",
        "max_context_length",
        "only",
        "ignore",
        "trusted_workers",
        "validated_backends",
        "slow_workers",
    }
)
AVAILABILITY_MODES = ("wait", "fail_fast")


@dataclass
class TextCompletionRequest:
    """A screened legacy completions request and its native text body."""

    models: list[str]
    model_key: str
    prompt: str
    max_tokens: int
    stop: list[str]
    stop_is_string: bool
    echo: bool
    stream: bool
    include_usage: bool
    fail_fast: bool
    worker_list_key: str | None
    native_body: dict[str, Any] = field(default_factory=dict)
    # The horde's answer to the submit: max_tokens lowered to its workers' (docs/adr/0095).
    context_adjustments: list[dict[str, Any]] | None = None

    is_text = True

    @property
    def requested_models(self) -> list[str]:
        return self.models

    @property
    def lists_models(self) -> bool:
        """Whether the client sent models (a list), not model."""
        return self.model_key == "models"


def _type_error(param: str, expected: str) -> ChatFrontError:
    return _bad(param, f"Invalid type for '{param}': expected {expected}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_accepted_unapplied(key: str) -> bool:
    return key in ACCEPTED_UNAPPLIED_KEYS or (
        key not in SAMPLER_ALIASES and key.startswith(ACCEPTED_UNAPPLIED_PREFIXES)
    )


def _refused_parameter(body: Mapping[str, Any]) -> ChatFrontError | None:
    for key, value in body.items():
        if (
            key in TEXT_REQUEST_FIELDS
            or key in SAMPLER_ALIASES
            or key in EOS_BAN_KEYS
            or key in NATIVE_BOOLEAN_PARAMS
            or key == "sampler_order"
            or is_accepted_unapplied(str(key))
        ):
            continue
        if key in TEXT_DEFAULT_NO_OP_PARAMETERS:
            defaults = TEXT_DEFAULT_NO_OP_PARAMETERS[key]
            if value is None or any(value == d and type(value) is type(d) for d in defaults):
                continue
            shown = ", ".join(json.dumps(d) for d in (*defaults, None))
            return _unsupported(
                key,
                f"Unsupported value: '{key}' is not supported by the AI Horde's text completions; send it "
                f"at its default ({shown}) or leave it out.",
            )
        return _unsupported(str(key), f"Unrecognized request argument supplied: {key}")
    return None


def _prompt(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if len(value) == 1 and isinstance(value[0], str):
            return value[0]
        # OpenAI's token id forms, int[] (one prompt) and int[][]: told apart from several prompts first.
        if value and (_is_int(value[0]) or (isinstance(value[0], list) and value[0] and _is_int(value[0][0]))):
            raise _unsupported("prompt", "Token id prompts are not supported by the AI Horde: send text.")
        if len(value) > 1:
            raise _unsupported(
                "prompt",
                f"'prompt' holds {len(value)} prompts; the AI Horde serves one prompt per request.",
            )
    raise _type_error("prompt", "a string or an array of one string")


def _check_types(body: Mapping[str, Any]) -> None:
    if "prompt" not in body:
        raise _bad("prompt", "Missing required parameter: 'prompt'.")
    for key in ("max_tokens", "n", "seed"):
        if key in body and not _is_int(body[key]):
            raise _type_error(key, "an integer")
    if body.get("seed") is not None and not CHAT_SEED_MIN <= body["seed"] <= CHAT_SEED_MAX:
        raise _bad("seed", f"Invalid value for 'seed': expected an integer from {CHAT_SEED_MIN} to {CHAT_SEED_MAX}.")
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        if key in body and not _is_number(body[key]):
            raise _type_error(key, "a number")
    for key in ("stream", "echo"):
        if key in body and not isinstance(body[key], bool):
            raise _type_error(key, "a boolean")
    if "user" in body and not isinstance(body["user"], str):
        raise _type_error("user", "a string")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _type_error("stop", "a string or an array of strings")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string")
    models = body.get("models")
    if models is not None and not (
        isinstance(models, list) and models and all(isinstance(m, str) for m in models)
    ):
        raise _type_error("models", "a non-empty array of strings")
    if body.get("n", 1) > 1:
        raise _unsupported("n", "Invalid 'n': the AI Horde serves one completion per request (n = 1).")


def _range_error(key: str, kind: str, bound: float, above: bool, value: Any) -> ChatFrontError:
    word = "integer" if kind == "integer" else "decimal"
    side, relation = ("above maximum", "<=") if above else ("below minimum", ">=")
    return _unsupported(
        key,
        f"Invalid '{key}': {word} {side} value. Expected a value {relation} {bound:g}, but got "
        f"{_shown(value)} instead.",
    )


def native_samplers(body: Mapping[str, Any]) -> dict[str, Any]:
    """The native text params the body's sampler keys ask for, each value checked at the client's key
    against the native type and range (the native route would refuse it); two keys setting one param
    to different values conflict."""
    params: dict[str, Any] = {}
    set_by: dict[str, str] = {}
    for key, native in SAMPLER_ALIASES.items():
        if key not in body:
            continue
        value = body[key]
        kind, low, high = NATIVE_SAMPLER_RANGES[native]
        if not (_is_int(value) if kind == "integer" else _is_number(value)):
            raise _type_error(key, "an integer" if kind == "integer" else "a number")
        if value > high or value < low:
            raise _range_error(key, kind, high if value > high else low, value > high, value)
        if native in params and params[native] != value:
            raise ChatFrontError(
                400,
                "ChatRequestConflict",
                f"'{set_by[native]}' and '{key}' both set the AI Horde's '{native}', to different values "
                f"({_shown(params[native])} and {_shown(value)}); send one of them, or the same value.",
                param=key,
                should_retry=False,
            )
        params[native] = value
        set_by[native] = key
    if "sampler_order" in body:
        order = body["sampler_order"]
        if not isinstance(order, list) or not all(_is_int(i) for i in order):
            raise _type_error("sampler_order", "an array of integers")
        low, high = NATIVE_SAMPLER_ORDER_RANGE
        for i, entry in enumerate(order):
            if not low <= entry <= high:
                raise _range_error(
                    f"sampler_order[{i}]", "integer", high if entry > high else low, entry > high, entry
                )
        params["sampler_order"] = list(order)
    for key in (*NATIVE_BOOLEAN_PARAMS, *EOS_BAN_KEYS):
        if key in body and not isinstance(body[key], bool):
            raise _type_error(key, "a boolean")
    for key in NATIVE_BOOLEAN_PARAMS:
        if key in body:
            params[key] = body[key]
    bans = [body[key] for key in EOS_BAN_KEYS if key in body]
    if bans:
        params["use_default_badwordsids"] = any(bans)
    return params


def _check_stop_count(stop: Any) -> None:
    if isinstance(stop, list) and len(stop) > TEXT_MAX_STOP_SEQUENCES:
        raise _unsupported(
            "stop",
            f"Invalid 'stop': array too long. Expected an array with maximum length {TEXT_MAX_STOP_SEQUENCES}, "
            f"but got an array with length {len(stop)} instead.",
        )


def _check_horde(horde: Any) -> dict[str, Any]:
    if not isinstance(horde, Mapping):
        raise _type_error("horde", "an object")
    horde = {key: value for key, value in horde.items() if value is not None}
    for key in horde:
        if key not in TEXT_HORDE_KEYS:
            raise _unsupported(
                f"horde.{key}",
                f"Unsupported parameter: 'horde.{key}' is not served on /v1/completions (text requests); "
                "use /v1/chat/completions for it.",
            )
    mode = horde.get("availability_mode", "wait")
    if mode not in AVAILABILITY_MODES:
        raise _bad(
            "horde.availability_mode", "Invalid 'horde.availability_mode': expected 'wait' or 'fail_fast'."
        )
    for key in ("trusted_workers", "validated_backends", "slow_workers"):
        if key in horde and not isinstance(horde[key], bool):
            raise _type_error(f"horde.{key}", "a boolean")
    if "max_context_length" in horde and not (
        _is_int(horde["max_context_length"]) and horde["max_context_length"] > 0
    ):
        raise _type_error("horde.max_context_length", "a positive integer")
    if "only" in horde and "ignore" in horde:
        raise ChatFrontError(
            400,
            "ChatRequestConflict",
            "Send one of 'horde.only' and 'horde.ignore', not both.",
            param="horde.ignore",
            should_retry=False,
        )
    for key in ("only", "ignore"):
        listed = horde.get(key)
        if listed is not None and not (
            isinstance(listed, list) and listed and all(isinstance(i, str) and i for i in listed)
        ):
            raise _type_error(f"horde.{key}", "a non-empty array of worker ids")
    return horde


def screen_text_request(raw_body: Any) -> TextCompletionRequest:
    """Screening, the front's bounds and the native text body; raises ChatFrontError with OpenAI's
    message and param."""
    if not isinstance(raw_body, Mapping):
        raise _bad(None, "The request body has to be a JSON object.")
    refused = _refused_parameter(raw_body)
    if refused is not None:
        raise refused
    body = {
        key: value
        for key, value in raw_body.items()
        if value is not None and key not in TEXT_DEFAULT_NO_OP_PARAMETERS
    }
    if body.get("model") == "":
        del body["model"]  # SillyTavern's vLLM and Aphrodite types before a model is chosen
    _check_types(body)
    any_model = "model" not in body and "models" not in body
    if not any_model:
        _check_models(body)
    # OpenAI's bounds, but the stop count: the native text route takes up to 128 stop sequences.
    _check_ranges({key: value for key, value in body.items() if key != "stop"})
    max_tokens_ceiling = TEXT_MAX_LENGTH_RANGE[1]  # the native text route's bound, said at the client's key
    if _is_number(body.get("max_tokens")) and body["max_tokens"] > max_tokens_ceiling:
        raise _range_error("max_tokens", "integer", max_tokens_ceiling, True, body["max_tokens"])
    _check_stop_count(body.get("stop"))
    samplers = native_samplers(body)
    horde = _check_horde(body.get("horde", {}))
    prompt = _prompt(body["prompt"])
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    max_tokens = body.get("max_tokens", CHAT_MAX_TOKENS_DEFAULT)
    # No model: any text model, as KoboldCpp and text-generation-webui serve the one they run (SillyTavern's
    # KoboldCpp and Default types send none).
    models = list(body["models"]) if "models" in body else [] if any_model else [body["model"]]

    params: dict[str, Any] = {"n": 1, "max_length": max_tokens}
    # The context the request needs: its prompt (an estimate that errs high) and its completion,
    # unless the client says. A worker with a smaller context cannot take it; the horde lowers it to
    # the largest an online worker declares (lower_max_context_length_to_workers, ADR 0111); the
    # client's own horde.max_context_length is not lowered.
    low, high = TEXT_MAX_CONTEXT_LENGTH_RANGE  # within the native range: a client never sent this
    params["max_context_length"] = horde.get(
        "max_context_length", min(high, max(low, estimate_context_tokens(prompt) + max_tokens))
    )
    for key in ("temperature", "top_p"):
        if key in body:
            params[key] = body[key]
    if stops:
        params["stop_sequence"] = stops
    params.update(samplers)
    if "rep_pen" not in samplers and body.get("presence_penalty", 0) > 0:
        # KoboldAI's repetition penalty, as KoboldAI Lite maps it to presence_penalty (rep_pen - 1); a
        # repetition penalty the client sends itself governs.
        params["rep_pen"] = 1 + body["presence_penalty"]
    native: dict[str, Any] = {
        "prompt": prompt,
        "models": models,
        "params": params,
        "trusted_workers": horde.get("trusted_workers", False),
        "validated_backends": horde.get("validated_backends", False),
        "slow_workers": horde.get("slow_workers", True),
        # OpenAI's max_tokens is an upper bound: above every serving worker's limit it is lowered,
        # as the chat route does, instead of waiting for a worker that never comes (docs/adr/0095).
        "lower_max_length_to_workers": True,
        **({} if "max_context_length" in horde else {"lower_max_context_length_to_workers": True}),
    }
    worker_list_key = "only" if "only" in horde else "ignore" if "ignore" in horde else None
    if worker_list_key is not None:
        native["workers"] = list(horde[worker_list_key])
        native["worker_blacklist"] = worker_list_key == "ignore"
    options = body.get("stream_options") or {}
    return TextCompletionRequest(
        models=models,
        model_key="models" if "models" in body else "model",
        prompt=prompt,
        max_tokens=max_tokens,
        stop=stops,
        stop_is_string=isinstance(stop, str),
        echo=body.get("echo", False),
        stream=body.get("stream", False),
        include_usage=bool(options.get("include_usage")),
        fail_fast=horde.get("availability_mode") == "fail_fast",
        worker_list_key=worker_list_key,
        native_body=native,
    )
