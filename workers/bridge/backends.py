"""Backends: an OpenAI-compatible server (llama.cpp, vLLM, Ollama, koboldcpp, TabbyAPI, any other),
probed for what it really does, and the errors a job can end in.

A backend takes OpenAI-shaped request bodies and returns OpenAI-shaped response bodies; turning a
horde job into one and the answer into a submit is `jobs`' work, so the scripted backend and a real
one go through the same code.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from contract.chat_declaration import ChatFaultReason, ChatImageTransport
from contract.chat_limits import CHAT_IMAGE_PROMPT_TOKENS
from contract.chat_policy import ChatFeature, ChatGuarantee
from workers.bridge import BRIDGE_AGENT
from workers.bridge.connections import Connections, Unreachable, json_body

DEFAULT_CONTEXT = 4096


class BackendError(Exception):
    """A job the backend could not answer; `fault_reason` is what the faulted submit carries."""

    def __init__(
        self,
        message: str,
        fault_reason: str = ChatFaultReason.GENERATION_ERROR,
        *,
        status: int | None = None,
        load: bool = False,
    ):
        super().__init__(message)
        self.fault_reason = str(fault_reason)
        self.status = status
        # The jobs run at once did not fit together (llama.cpp's shared KV cache): the backend
        # works, so this is no failure of it that pausing the pops would help (ADR 0131).
        self.load = load


class BackendDown(BackendError):
    """The backend cannot be reached (or timed out): fault the job, and pop no more until it is back."""


class BackendRefused(Exception):
    """The backend refuses the bridge itself (its key): no retry can help, the bridge does not start."""


class GenerationStopped(Exception):
    """The horde told the worker to stop generating (the request was cancelled or the job aborted):
    the backend's stream was closed, and nothing is submitted."""


class ProgressSink(Protocol):
    """Where a streaming backend sends what it generates (spec: "Streaming progress").

    `delta` gets the text read since its previous call, content and reasoning apart; `flush` is
    called once the stream finished. Either returns False when the horde says stop generating.
    `lease_extension` is how many seconds the horde's renewals have moved the job's lease past its
    end at pop (0 until a post renews it): the stream's deadline moves with it.
    """

    def delta(self, content: str, reasoning_content: str | None = None) -> bool: ...

    def flush(self) -> bool: ...

    def lease_extension(self) -> float: ...


@dataclass
class Capabilities:
    """What the backend really does, as the chat declaration states it."""

    kind: str
    model: str
    context: int | None  # tokens, as the backend reports it; None when it does not say
    features: set[str] = field(default_factory=set)  # ChatFeature and ChatGuarantee values
    image_transports: set[str] = field(default_factory=set)
    chat: bool = True
    completions: bool = True
    # Generations the backend runs at once (llama.cpp's slots); None when it does not say.
    slots: int | None = None
    # The reported context may be one cache the slots share (llama.cpp's unified KV cache), so
    # jobs run at once have to divide it.
    context_shared: bool = False
    tokenizer: str | None = None  # the route that counts tokens, for the start log; None: none
    public_model: str | None = None  # the model's name without a folder path, when the id is a path
    notes: list[str] = field(default_factory=list)  # how each value was found, for the start log


class Backend(Protocol):
    name: str

    def probe(self, model: str | None) -> Capabilities: ...

    def healthy(self) -> bool: ...

    def chat(self, body: dict[str, Any], *, timeout: float, progress: ProgressSink | None = None) -> dict[str, Any]: ...

    def complete(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]: ...

    def count_tokens(self, text: str) -> int | None:
        """The prompt's tokens by the backend's tokenizer; None when it has none (or it failed)."""
        ...

    def count_chat_tokens(self, body: dict[str, Any]) -> int | None:
        """The rendered chat prompt's tokens (template, tools, images); None when it cannot say."""
        ...

    def runtime_context(self, *, load: bool) -> int | None:
        """The context the backend holds the model with now, where it can change while the bridge
        runs (Ollama reloads a model); None when it does not say or cannot change. `load`: load
        the model first, as a job would (after a fault the model may be unloaded)."""
        ...

    def close(self) -> None: ...


# --- what each kind of server does ------------------------------------------------------------
# Only what the server applies as sent. Guarantees need the server to enforce the contract:
# grammar-constrained output (structured_output_enforced, tool_choice_enforced) or a refusal of
# a prompt over its context instead of truncation (prompt_overflow_refused).
F, G = ChatFeature, ChatGuarantee
KIND_FEATURES: dict[str, set[str]] = {
    # llama.cpp server: sampling keys, response_format json_schema compiled to a grammar (a
    # json_object is sent as the schema {"type": "object"}: alone it gets no grammar), tools
    # when the server takes them (probed), refuses an over-long prompt (exceed_context_size_error).
    # tool_choice_enforced once probed: under tool_choice "required" its tool grammar is not lazy
    # (it holds the reply from the first token until a call is complete); under "auto" it is, so
    # a named choice is sent as "required" with that tool alone (ADR 0091). Not
    # tools_with_response_format: with a response_format it builds the format's grammar alone.
    "llamacpp": {F.SEED, F.PRESENCE_PENALTY, F.FREQUENCY_PENALTY, F.JSON_OBJECT, F.JSON_SCHEMA,
                 G.STRUCTURED_OUTPUT_ENFORCED, G.PROMPT_OVERFLOW_REFUSED},
    # vLLM: structured outputs for response_format (json_object sent as the schema
    # {"type": "object"}) and for named/required tool choice; 400 on overflow.
    "vllm": {F.SEED, F.PRESENCE_PENALTY, F.FREQUENCY_PENALTY, F.JSON_OBJECT, F.JSON_SCHEMA,
             G.STRUCTURED_OUTPUT_ENFORCED, G.PROMPT_OVERFLOW_REFUSED},
    # Ollama: format grammars (its /v1 turns a json_object into format "json"), tools,
    # think/reasoning_effort; it truncates an over-long prompt.
    "ollama": {F.SEED, F.PRESENCE_PENALTY, F.FREQUENCY_PENALTY, F.JSON_OBJECT, F.JSON_SCHEMA,
               G.STRUCTURED_OUTPUT_ENFORCED, F.TOOLS, F.REASONING_EFFORT},
    # koboldcpp's OpenAI adapter: sampling; it truncates (context shifting).
    "koboldcpp": {F.SEED, F.PRESENCE_PENALTY, F.FREQUENCY_PENALTY},
    # TabbyAPI (exllama): json_schema through its constrained sampler (its json_schema field;
    # a json_object is sent there as {"type": "object"}), tools.
    "tabbyapi": {F.SEED, F.PRESENCE_PENALTY, F.FREQUENCY_PENALTY, F.JSON_OBJECT, F.JSON_SCHEMA,
                 G.STRUCTURED_OUTPUT_ENFORCED},
    # Unknown server: the OpenAI keys every compatible server takes, nothing it may ignore.
    "openai": set(),
}
# Non-OpenAI sampling keys each kind accepts (rep_pen, top_k, min_p of the job payload).
KIND_EXTRA_SAMPLING: dict[str, dict[str, str]] = {
    "llamacpp": {"rep_pen": "repeat_penalty", "top_k": "top_k", "min_p": "min_p"},
    "vllm": {"rep_pen": "repetition_penalty", "top_k": "top_k", "min_p": "min_p"},
    "ollama": {},
    "koboldcpp": {"rep_pen": "rep_pen", "top_k": "top_k", "min_p": "min_p"},
    "tabbyapi": {"rep_pen": "repetition_penalty", "top_k": "top_k", "min_p": "min_p"},
    "openai": {},
}


# Servers that run one model and answer any model name with it: a --model they do not list is
# a name, not an error.
SERVES_ITS_ONE_MODEL = frozenset({"llamacpp", "koboldcpp"})


# --- errors -------------------------------------------------------------------------------------

_OVERFLOW = re.compile(
    r"exceed_context_size|exceeds? the available context|context[ _-]?(length|window|size)|"
    r"maximum context|too many tokens|prompt is too long|input is too long|n_ctx|longer than the model",
    re.IGNORECASE,
)
_GRAMMAR = re.compile(
    r"grammar|json[ _-]?schema|response_format|tool_choice|unsupported schema|failed to parse schema",
    re.IGNORECASE,
)


# llama.cpp's 500 when its KV cache, shared by the slots, fills up while several jobs run: the
# prompt itself fits, so it is no prompt_overflow.
_KV_CACHE_FULL = re.compile(r"context size has been exceeded", re.IGNORECASE)


_HTML_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_HTML_TAG = re.compile(r"<[^>]+>")


def answer_text(text: str, limit: int = 300) -> str:
    """A backend's answer body for a log line: one line, short; an HTML page (a proxy's 502, a web
    UI's 404) by its title, not its markup."""
    head = text.lstrip()[:200].lower()
    if head.startswith(("<!doctype html", "<html")) or "<html" in head:
        title = _HTML_TITLE.search(text)
        text = f"an HTML page: {title.group(1) if title else _HTML_TAG.sub(' ', text)}"
    return " ".join(text.split())[:limit]


def classify_backend_error(status: int, text: str) -> BackendError:
    """The fault a backend's error answer means for the job."""
    message = f"backend answered {status}: {answer_text(text)}"
    if _KV_CACHE_FULL.search(text) and status >= 500:
        return BackendError(
            f"{message} (the KV cache the slots share was full: run fewer --threads or a larger -c)",
            ChatFaultReason.GENERATION_ERROR,
            status=status,
            load=True,
        )
    if _OVERFLOW.search(text):
        return BackendError(message, ChatFaultReason.PROMPT_OVERFLOW, status=status)
    if _GRAMMAR.search(text):
        return BackendError(message, ChatFaultReason.UNBUILDABLE_GRAMMAR, status=status)
    if status in (502, 503, 504):
        return BackendDown(message, status=status)
    return BackendError(message, ChatFaultReason.GENERATION_ERROR, status=status)


# --- the OpenAI-compatible backend ----------------------------------------------------------------


def _down(error: Unreachable) -> BackendDown:
    if error.timed_out:
        return BackendDown(f"backend timed out: {error}")
    return BackendDown(f"backend unreachable: {error}")


def normalise_base_url(url: str) -> tuple[str, str]:
    """(the OpenAI base ending in /v1, the server root without it)."""
    parts = urlsplit(url.rstrip("/"))
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path = f"{path}/v1"
    base = urlunsplit((parts.scheme, parts.netloc, path, "", ""))
    root = urlunsplit((parts.scheme, parts.netloc, path[: -len("/v1")], "", ""))
    return base, root


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


# Ollama: /api/ps reports a loaded model's context_length from 0.10.0; its default context was
# 2048 before 0.6.7; /api/show's parameters list the Modelfile's PARAMETER lines ("%-30s %v").
OLLAMA_PS_CONTEXT_VERSION = (0, 10, 0)
OLLAMA_4096_DEFAULT_VERSION = (0, 6, 7)
OLLAMA_OLD_DEFAULT_CONTEXT = 2048
OLLAMA_NUM_CTX = re.compile(r"^num_ctx\s+(\d+)\s*$", re.MULTILINE)


def ollama_version(text: Any) -> tuple[int, int, int] | None:
    """(major, minor, patch) of /api/version's "0.12.3"; None for none, or a source build's 0.0.0."""
    match = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", text) if isinstance(text, str) else None
    version = (int(match.group(1)), int(match.group(2)), int(match.group(3))) if match else None
    return version if version and any(version) else None


def ollama_model_name(name: Any) -> str:
    """A model name with its tag, as Ollama reads it ("qwen3" is "qwen3:latest")."""
    name = str(name or "")
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


# A model id that is a file path as typed (llama-server's -m, `vllm serve /models/x`).
_PATH_LIKE = re.compile(r"^(/|\./|\.\./|~|[A-Za-z]:[\\/])|\\|\.gguf$", re.IGNORECASE)


def public_model_name(model_id: str, model_path: str | None = None) -> str | None:
    """The model's name without the folder it was loaded from, when its id is a file path
    (a volunteer's folders are not published); None when the id is a name already."""
    if model_id != model_path and not _PATH_LIKE.search(model_id):
        return None
    name = re.split(r"[\\/]", model_id.rstrip("/\\"))[-1]
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return name or None


# The tool a start-up probe offers: llama-server without --jinja refuses any request with tools
# ("tools param requires --jinja flag") while its /props looks the same.
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "horde_probe",
        "description": "Never call this; it checks that the server takes tools.",
        "parameters": {"type": "object", "properties": {}},
    },
}


def _text_only(messages: list[Any]) -> tuple[list[dict[str, Any]], int]:
    """The messages with image parts left out (counted apart), and how many there were."""
    images = 0
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            parts = [p for p in content if isinstance(p, dict)]
            images += sum(1 for p in parts if p.get("type") == "image_url")
            message = {**message, "content": "".join(str(p.get("text") or "") for p in parts if p.get("type") == "text")}
        out.append(message)
    return out, images


def _flatten(messages: list[dict[str, Any]], tools: Any) -> str:
    lines = [f"{m.get('role')}: {m.get('content') or ''}" for m in messages]
    for message in messages:
        if message.get("tool_calls"):
            lines.append(json.dumps(message["tool_calls"], separators=(",", ":")))
    if tools:
        lines.append(json.dumps(tools, separators=(",", ":")))
    return "\n".join(lines)


class OpenAIBackend:
    """Any server with OpenAI-compatible /v1/chat/completions (and /v1/completions for text jobs)."""

    def __init__(self, url: str, *, api_key: str | None = None, kind: str = "auto", timeout: float = 600.0):
        self.base, self.root = normalise_base_url(url)
        self.name = self.base
        self.kind = kind
        self.detected_kind: str | None = None  # what probe found (or was told)
        self.model: str | None = None
        self.timeout = timeout
        # Ollama: its version and the model's trained context, read at probe for runtime_context.
        self._ollama_version: tuple[int, int, int] | None = None
        self._trained_context: int | None = None
        headers = {"Accept": "application/json", "Content-Type": "application/json", "User-Agent": BRIDGE_AGENT}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._keyed = bool(api_key)
        self._http = Connections(self.base, headers=headers)

    def close(self) -> None:
        self._http.close()

    # -- plumbing

    def _read_timeout(self, timeout: float) -> float:
        """Seconds any one read may wait: the call's, within --backend-timeout."""
        return min(max(timeout, 0.1), self.timeout)

    def _exchange(self, method: str, url: str, body: Any, timeout: float) -> tuple[int, bytes]:
        payload = None if body is None else json_body(body)
        return self._http.request(method, url, body=payload, timeout=self._read_timeout(timeout))

    def _json_or_none(self, method: str, url: str, body: Any = None, timeout: float = 10.0) -> Any:
        """A probe's or helper route's answer (tokenize, apply-template); None on any failure."""
        try:
            status, data = self._exchange(method, url, body, timeout)
        except Unreachable:
            return None
        if status != 200:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None

    def _get_json(self, url: str, timeout: float = 10.0) -> Any:
        return self._json_or_none("GET", url, timeout=timeout)

    def _post_json(self, url: str, body: dict[str, Any], timeout: float = 30.0) -> Any:
        return self._json_or_none("POST", url, body, timeout)

    def _post_answer(self, url: str, body: dict[str, Any], timeout: float) -> Any:
        """A generation's 200 answer, read as JSON; any other answer is the backend's error."""
        try:
            status, data = self._exchange("POST", url, body, timeout)
        except Unreachable as error:
            raise _down(error) from None
        if status != 200:
            raise classify_backend_error(status, data.decode("utf-8", "replace"))
        try:
            return json.loads(data)
        except ValueError:
            raise BackendError("backend answered 200 with a body that is not JSON") from None

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        answer = self._post_answer(f"{self.base}/{path}", body, timeout)
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list) or not answer["choices"]:
            if isinstance(answer, dict) and answer.get("error"):
                raise classify_backend_error(200, str(answer["error"]))
            raise BackendError("backend answered without choices")
        return answer

    # -- Backend

    def healthy(self) -> bool:
        try:
            return self._exchange("GET", f"{self.base}/models", None, 5.0)[0] == 200
        except Unreachable:
            return False

    def chat(self, body: dict[str, Any], *, timeout: float, progress: ProgressSink | None = None) -> dict[str, Any]:
        """The reply as one chat.completion body; streamed from the backend (SSE) when `progress`
        takes the deltas, whole otherwise."""
        if progress is None:
            return self._post("chat/completions", {**body, "stream": False}, timeout)
        return self._stream_chat(body, timeout, progress)

    def _stream_chat(self, body: dict[str, Any], timeout: float, progress: ProgressSink) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        request = {**body, "stream": True, "stream_options": {"include_usage": True}}
        reader = ChatStreamReader()
        stopped = False
        try:
            with self._http.stream(
                "POST", f"{self.base}/chat/completions", body=json_body(request), timeout=self._read_timeout(timeout)
            ) as response:
                if response.status != 200:
                    raise classify_backend_error(response.status, response.read().decode("utf-8", "replace"))
                for line in response.lines():
                    if time.monotonic() > deadline + progress.lease_extension():
                        raise BackendDown("backend timed out while streaming")
                    content, reasoning = reader.feed_line(line)
                    if (content or reasoning) and not progress.delta(content, reasoning or None):
                        stopped = True  # leaving the block half-read closes the stream: the server stops generating
                        break
                    if reader.done:
                        response.finish()
                        break
        except Unreachable as error:
            raise _down(error) from None
        if not stopped:
            content, reasoning = reader.finish()
            if (content or reasoning) and not progress.delta(content, reasoning or None):
                stopped = True
        if stopped or not progress.flush():
            raise GenerationStopped(getattr(progress, "stopped", None) or "the horde said stop")
        return reader.response()

    def complete(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        if self.detected_kind == "ollama":
            return self._ollama_generate(body, timeout)
        return self._post("completions", {**body, "stream": False}, timeout)

    def _ollama_generate(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """A text job on Ollama's native /api/generate, raw: its /v1/completions makes the prompt the
        user message of the chat template (an answer, not a continuation), and a thinking model
        thinks first, within max_tokens, its thinking left out of the text. Answered as a
        text_completion."""
        options = {"num_predict" if key == "max_tokens" else key: value
                   for key, value in body.items() if key not in ("model", "prompt")}
        request = {"model": body.get("model"), "prompt": body.get("prompt") or "", "raw": True, "think": False,
                   "stream": False, "options": options}
        answer = self._post_answer(f"{self.root}/api/generate", request, timeout)
        if not isinstance(answer, dict) or not isinstance(answer.get("response"), str):
            raise BackendError("Ollama answered /api/generate without a response")
        return {
            "object": "text_completion",
            "model": answer.get("model"),
            "choices": [{"index": 0, "text": answer["response"], "finish_reason": answer.get("done_reason") or None}],
            "usage": {"prompt_tokens": answer.get("prompt_eval_count"), "completion_tokens": answer.get("eval_count")},
        }

    # -- token counts

    def count_tokens(self, text: str) -> int | None:
        kind = self.detected_kind
        if kind == "llamacpp":
            # As the server counts a prompt: special tokens added (BOS) and parsed.
            answer = self._post_json(f"{self.root}/tokenize", {"content": text, "add_special": True, "parse_special": True})
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            return len(tokens) if isinstance(tokens, list) else None
        if kind == "vllm":
            answer = self._post_json(f"{self.root}/tokenize", {"model": self.model, "prompt": text})
            if isinstance(answer, dict):
                return _positive_int(answer.get("count")) or (
                    len(answer["tokens"]) if isinstance(answer.get("tokens"), list) else None
                )
            return None
        if kind == "koboldcpp":
            answer = self._post_json(f"{self.root}/api/extra/tokencount", {"prompt": text})
            value = answer.get("value") if isinstance(answer, dict) else None
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
        return None

    def count_chat_tokens(self, body: dict[str, Any]) -> int | None:
        messages, images = _text_only(body.get("messages") or [])
        tools = body.get("tools") or None
        counted: int | None = None
        if self.detected_kind == "llamacpp":
            # The server's own rendering (chat template, tools), then its tokenizer.
            request: dict[str, Any] = {"messages": messages, **({"tools": tools} if tools else {})}
            rendered = self._post_json(f"{self.root}/apply-template", request)
            prompt = rendered.get("prompt") if isinstance(rendered, dict) else None
            counted = self.count_tokens(prompt if isinstance(prompt, str) else _flatten(messages, tools))
        elif self.detected_kind == "vllm":
            request = {"model": self.model, "messages": messages, "add_generation_prompt": True,
                       **({"tools": tools} if tools else {})}
            answer = self._post_json(f"{self.root}/tokenize", request)
            if isinstance(answer, dict):
                counted = _positive_int(answer.get("count"))
        elif self.detected_kind == "koboldcpp":
            counted = self.count_tokens(_flatten(messages, tools))
        if counted is None:
            return None
        return counted + images * CHAT_IMAGE_PROMPT_TOKENS

    def probe(self, model: str | None) -> Capabilities:
        """Ask the server what it serves; raise BackendDown when it does not answer."""
        listing = self._model_list()
        entries = [e for e in listing.get("data") or [] if isinstance(e, dict) and isinstance(e.get("id"), str)]
        ids = [e["id"] for e in entries]
        given = model
        if model is None:
            if not ids:
                raise BackendDown(f"{self.base}/models lists no model: pass --model")
            model = ids[0]
        entry = next((e for e in entries if e["id"] == model), {})
        props = self._get_json(f"{self.root}/props")
        # A --model it does not list: its kind is read from the models it does list.
        kind = self.kind if self.kind != "auto" else self._detect_kind(entry or (entries[0] if entries else {}), props)
        listed = model in ids or (kind == "ollama" and ollama_model_name(model) in {ollama_model_name(i) for i in ids})
        if not listed and kind not in SERVES_ITS_ONE_MODEL:
            # The server picks the model by name: every job would be answered 404 and faulted.
            raise BackendError(
                f"the backend does not serve the model {model!r} (--model): {self.base}/models lists "
                f"{', '.join(repr(i) for i in ids[:10]) or 'none'}; pass one of them"
                + (", or pull it (ollama pull)" if kind == "ollama" else "")
            )
        if kind == "ollama" and given is None:
            model = self._ollama_text_model(ids)
            entry = next((e for e in entries if e["id"] == model), {})
        self.detected_kind, self.model = kind, model
        caps = Capabilities(kind=kind, model=model, context=None, features=set(KIND_FEATURES.get(kind, set())))
        caps.notes.append(f"kind {kind}" + (" (detected)" if self.kind == "auto" else ""))
        if not listed:
            caps.notes.append(f"model {model!r} is not listed ({', '.join(ids)}): the server answers with its one model whatever the name")
        if model != ids[0] and given is None:
            caps.notes.append(f"model {model}: the newest listed that generates text (/api/show capabilities)")
        caps.context = self._context(kind, entry, props, caps.notes)
        model_path = props.get("model_path") if isinstance(props, dict) else None
        caps.public_model = public_model_name(model, model_path if isinstance(model_path, str) else None)
        if kind == "llamacpp" and isinstance(props, dict):
            self._llamacpp_abilities(props, caps)
        elif kind == "llamacpp":
            # No /props: the slots are not known, and they may share the reported cache.
            caps.context_shared = True
            caps.notes.append("no /props: slots unknown, the context is divided among --threads (--no-context-split if not shared)")
        if kind == "ollama":
            self._ollama_abilities(caps)
        if kind in ("vllm", "koboldcpp"):
            caps.tokenizer = "/tokenize" if kind == "vllm" else "/api/extra/tokencount"
        if kind == "vllm":
            # vLLM's tool parser is a launch flag the API does not report: declare tools with
            # --feature tools --feature tool_choice_enforced when it runs with --enable-auto-tool-choice.
            caps.notes.append("tools: declare with --feature tools when vLLM runs --enable-auto-tool-choice")
        # The bridge fetches an offloaded messages array itself, whatever the backend.
        caps.image_transports.add(ChatImageTransport.MESSAGES_URL)
        return caps

    def _model_list(self) -> dict[str, Any]:
        """GET /models; unanswered or refused, why: BackendRefused for a refused key (no retry can
        help), BackendDown for the rest (not up yet, or --backend is not an OpenAI base URL)."""
        url = f"{self.base}/models"
        try:
            status, data = self._exchange("GET", url, None, 10.0)
        except Unreachable as error:
            raise BackendDown(f"no model list at {url}: {'timed out' if error.timed_out else error}") from None
        text = answer_text(data.decode("utf-8", "replace"), 200)
        if status in (401, 403):
            fix = ("the key given with --backend-key (BRIDGE_BACKEND_KEY) is not one it takes" if self._keyed
                   else "pass the backend's API key with --backend-key (BRIDGE_BACKEND_KEY)")
            raise BackendRefused(f"the backend refused the bridge: GET {url} answered {status} {text}; {fix}")
        if status != 200:
            raise BackendDown(f"no model list at {url}: it answered {status} {text}")
        try:
            listing = json.loads(data)
        except ValueError:
            listing = None
        if not isinstance(listing, dict):
            raise BackendDown(
                f"no model list at {url}: it answered 200 with {text!r}; --backend is the server's OpenAI base URL"
            )
        return listing

    def _detect_kind(self, entry: dict[str, Any], props: Any) -> str:
        owned_by = str(entry.get("owned_by") or "").lower()
        if isinstance(props, dict) and ("default_generation_settings" in props or "n_ctx" in props):
            return "llamacpp"
        if owned_by == "llamacpp":  # llama-server's /v1/models, its /props out of reach (a proxy of /v1)
            return "llamacpp"
        if owned_by == "vllm" or "max_model_len" in entry:
            return "vllm"
        if owned_by in ("library", "ollama") or self._get_json(f"{self.root}/api/version") is not None:
            return "ollama"
        if owned_by == "koboldcpp" or self._get_json(f"{self.root}/api/extra/version") is not None:
            return "koboldcpp"
        if owned_by == "tabbyapi" or self._get_json(f"{self.base}/model") is not None:
            return "tabbyapi"
        return "openai"

    def _context(self, kind: str, entry: dict[str, Any], props: Any, notes: list[str]) -> int | None:
        """The context the server runs with, where it reports one."""
        candidates: list[tuple[str, Callable[[], Any]]] = []
        if kind == "llamacpp":
            def llama_props() -> Any:
                if not isinstance(props, dict):
                    return None
                settings = props.get("default_generation_settings") or {}
                return settings.get("n_ctx") or props.get("n_ctx")

            candidates.append(("/props n_ctx", llama_props))
            # Newer builds list the slot's context (n_ctx) in the model's meta too.
            candidates.append(("/v1/models meta.n_ctx", lambda: (entry.get("meta") or {}).get("n_ctx")))
            candidates.append(("/v1/models meta.n_ctx_train", lambda: (entry.get("meta") or {}).get("n_ctx_train")))
        candidates.append(("/v1/models max_model_len", lambda: entry.get("max_model_len")))
        if kind == "koboldcpp":
            candidates.append(
                ("/api/extra/true_max_context_length",
                 lambda: (self._get_json(f"{self.root}/api/extra/true_max_context_length") or {}).get("value"))
            )
        if kind == "tabbyapi":
            candidates.append(
                ("/v1/model parameters.max_seq_len",
                 lambda: ((self._get_json(f"{self.base}/model") or {}).get("parameters") or {}).get("max_seq_len"))
            )
        candidates.append(("/v1/models context_length", lambda: entry.get("context_length")))
        for source, read in candidates:
            value = _positive_int(read())
            if value:
                notes.append(f"context {value} from {source}")
                return value
        return None

    def _llamacpp_abilities(self, props: dict[str, Any], caps: Capabilities) -> None:
        caps.tokenizer = "/tokenize"
        slots = _positive_int(props.get("total_slots"))
        if slots is None:
            listing = self._get_json(f"{self.root}/slots")
            slots = len(listing) if isinstance(listing, list) and listing else None
        if slots is not None:
            caps.slots = slots
            # /props n_ctx is a slot's context; with a unified KV cache (llama-server's default
            # when -np is not given) every slot reports the whole cache, which they share.
            caps.context_shared = slots > 1
            caps.notes.append(f"{slots} slot(s)" + (" that may share one KV cache" if slots > 1 else ""))
        template = str(props.get("chat_template") or "")
        caps_props = props.get("chat_template_caps") or {}
        if caps_props.get("supports_tools") or ("tools" in template and "tool_call" in template):
            taken, detail = self._llamacpp_takes_tools(caps.model)
            if taken:
                caps.features.add(ChatFeature.TOOLS)
                caps.notes.append("tools: the chat template renders tools and the server took a tool request")
                forced, detail = self._llamacpp_takes_tools(caps.model, tool_choice="required")
                if forced:
                    caps.features.add(ChatGuarantee.TOOL_CHOICE_ENFORCED)
                    caps.notes.append("tool_choice_enforced: the server took tool_choice required, "
                                      "which it holds to a call by grammar; a reply without one is faulted")
                else:
                    caps.notes.append(f"tool_choice_enforced: not declared, the server refused tool_choice required ({detail})")
            else:
                caps.notes.append(f"tools: not declared, the server refused a tool request ({detail}; start it with --jinja)")
        modalities = props.get("modalities") or {}
        if modalities.get("vision"):
            caps.features.add(ChatFeature.VISION)
            caps.image_transports.add(ChatImageTransport.BASE64)  # llama.cpp reads data URLs, not http
            caps.notes.append("vision: /props modalities.vision (base64 transport)")


    def _ollama_text_model(self, ids: list[str]) -> str:
        """The first model Ollama lists (the newest pulled) that generates text: an embedding model
        (pulled for a RAG front, say) answers every chat and text job 400 "does not support chat"."""
        for model in ids:
            show = self._post_json(f"{self.root}/api/show", {"model": model})
            capabilities = show.get("capabilities") if isinstance(show, dict) else None
            if not isinstance(capabilities, list) or "completion" in capabilities:
                return model
        return ids[0]

    def _ollama_abilities(self, caps: Capabilities) -> None:
        """What Ollama runs the model with for its /v1 routes: its capabilities (/api/show) and
        the context it loads the model with (/api/ps), which no route reports beforehand."""
        answer = self._get_json(f"{self.root}/api/version")
        version = ollama_version(answer.get("version") if isinstance(answer, dict) else None)
        show = self._post_json(f"{self.root}/api/show", {"model": caps.model})
        show = show if isinstance(show, dict) else {}
        capabilities = show.get("capabilities")
        if isinstance(capabilities, list):
            names = {str(name) for name in capabilities}
            if "completion" not in names:
                caps.notes.append("warning: /api/show capabilities has no completion, Ollama will refuse every job")
            if "vision" in names:
                caps.features.add(ChatFeature.VISION)
                caps.image_transports.add(ChatImageTransport.BASE64)  # its /v1 refuses image URLs
                caps.notes.append("vision: /api/show capabilities (base64 transport)")
            if "tools" not in names:
                caps.features.discard(ChatFeature.TOOLS)  # it answers 400 "does not support tools"
                caps.notes.append("tools: not declared, /api/show capabilities has no tools")
            if "thinking" not in names:
                caps.features.discard(ChatFeature.REASONING_EFFORT)  # 400 "does not support thinking"
                caps.notes.append("reasoning_effort: not declared, /api/show capabilities has no thinking")
        else:
            caps.notes.append("/api/show reports no capabilities (Ollama before 0.6.4): vision not declared")
        caps.context = self._ollama_context(caps, version, show)

    def _ollama_context(self, caps: Capabilities, version: tuple[int, int, int] | None, show: dict[str, Any]) -> int:
        """The context Ollama gives a /v1 request: a /v1 request carries no num_ctx, so the model
        is loaded with its Modelfile's num_ctx, else OLLAMA_CONTEXT_LENGTH, else Ollama's default
        (2048 before 0.6.7, then 4096, from 0.15.5 4096/32768/262144 by VRAM), at most its trained
        context. Only /api/ps tells it, once the model is loaded; the bridge loads it as a /v1
        request would (a model another client loaded with its own num_ctx is loaded again)."""
        info = show["model_info"] if isinstance(show.get("model_info"), dict) else {}
        trained = _positive_int(info.get(f"{info.get('general.architecture')}.context_length"))
        self._ollama_version, self._trained_context = version, trained
        parameters = show.get("parameters")
        match = OLLAMA_NUM_CTX.search(parameters) if isinstance(parameters, str) else None

        def held(value: int) -> int:
            return min(value, trained) if trained else value

        loaded = None
        if version is None or version >= OLLAMA_PS_CONTEXT_VERSION:
            loaded = self._ollama_loaded_context(caps.model)
        if loaded:
            caps.notes.append(f"context {held(loaded)} from /api/ps (the model loaded as the /v1 routes load it)")
            return held(loaded)
        if match:
            caps.notes.append(f"context {held(int(match.group(1)))} from /api/show parameters num_ctx")
            return held(int(match.group(1)))
        default = held(OLLAMA_OLD_DEFAULT_CONTEXT if version and version < OLLAMA_4096_DEFAULT_VERSION else DEFAULT_CONTEXT)
        caps.notes.append(
            f"context {default}: Ollama's smallest default, as its API does not report the one it runs with "
            "(OLLAMA_CONTEXT_LENGTH or its VRAM tier); pass --max-context-length when it is larger"
        )
        return default

    def _ollama_loaded_context(self, model: str) -> int | None:
        """/api/ps's context_length for the model, after a load request with no options (as
        `ollama run` preloads; answered at once when the model is loaded as a /v1 request needs it)."""
        self._post_json(f"{self.root}/api/generate", {"model": model}, timeout=self.timeout)
        return self._ollama_ps_context(model)

    def runtime_context(self, *, load: bool) -> int | None:
        """Ollama's /api/ps context_length for the model, held to its trained context (one GET; a
        load request first when `load`); None for another kind, an Ollama before 0.10.0, or a
        model not loaded now."""
        if self.detected_kind != "ollama" or self.model is None:
            return None
        if self._ollama_version is not None and self._ollama_version < OLLAMA_PS_CONTEXT_VERSION:
            return None
        loaded = self._ollama_loaded_context(self.model) if load else self._ollama_ps_context(self.model)
        if loaded and self._trained_context:
            return min(loaded, self._trained_context)
        return loaded

    def _ollama_ps_context(self, model: str) -> int | None:
        listing = self._get_json(f"{self.root}/api/ps")
        wanted = ollama_model_name(model)
        for entry in (listing.get("models") if isinstance(listing, dict) else None) or []:
            if isinstance(entry, dict) and wanted in (ollama_model_name(entry.get("model")), ollama_model_name(entry.get("name"))):
                return _positive_int(entry.get("context_length"))
        return None

    def _llamacpp_takes_tools(self, model: str, *, tool_choice: str | None = None) -> tuple[bool, str]:
        """Whether the server takes a request with tools (and `tool_choice`): /apply-template
        parses it as a chat completion does, building the tool grammar, without generating; a
        build without that route gets a one-token chat."""
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "ping"}], "tools": [PROBE_TOOL]}
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        try:
            status, data = self._exchange("POST", f"{self.root}/apply-template", body, 30.0)
            if status == 404:
                status, data = self._exchange(
                    "POST", f"{self.base}/chat/completions",
                    {**body, "model": model, "max_tokens": 1, "stream": False}, 120.0,
                )
        except Unreachable as exc:
            return False, exc.reason
        if status == 200:
            return True, "200"
        try:
            error = json.loads(data).get("error") or {}
            message = error.get("message") if isinstance(error, dict) else str(error)
        except (ValueError, AttributeError):
            message = data[:200].decode("utf-8", "replace")
        return False, f"{status} {message!r}"


# --- streamed replies (SSE chunks of chat.completion.chunk) ---------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _held_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could start `tag` (held back until the next delta)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ThinkSplitter:
    """Splits streamed content into (content, reasoning) as `jobs.split_reasoning` splits a whole
    reply: a <think> block at the start is reasoning (all of it while unclosed), the rest content.
    Text that may still be part of a tag is held back until the next delta or `finish`."""

    def __init__(self) -> None:
        self.state = "start"  # start | think | after | content
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        content, reasoning = "", ""
        self.buffer += text
        while self.buffer:
            if self.state == "start":
                head = self.buffer.lstrip()
                if not head or (THINK_OPEN.startswith(head) and head != THINK_OPEN):
                    break  # only whitespace, or a part of "<think>" so far
                if head.startswith(THINK_OPEN):
                    self.state, self.buffer = "think", head[len(THINK_OPEN):].lstrip()
                    continue
                self.state = "content"
            elif self.state == "think":
                end = self.buffer.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += self.buffer[:end]
                    self.state, self.buffer = "after", self.buffer[end + len(THINK_CLOSE):]
                    continue
                keep = _held_tail(self.buffer, THINK_CLOSE)
                reasoning += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            elif self.state == "after":
                self.buffer = self.buffer.lstrip()
                if self.buffer:
                    self.state = "content"
            else:
                content, self.buffer = content + self.buffer, ""
        return content, reasoning

    def finish(self) -> tuple[str, str]:
        text, self.buffer = self.buffer, ""
        if self.state == "think":
            return "", text  # a block cut off at max_length is all reasoning
        if self.state == "after":
            return "", ""
        return text, ""


class ChatStreamReader:
    """Reads an OpenAI-compatible SSE stream line by line (llama.cpp, vLLM, Ollama, TabbyAPI):
    content and reasoning deltas (reasoning_content, or vLLM's and Ollama's `reasoning`), tool call
    deltas accumulated by index, the finish reason and the usage chunk; `response` is the
    chat.completion body the whole reply would have been."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.chunks = 0
        self.done = False
        self.splitter = ThinkSplitter()
        # The reply as the splitter posted it: the submit keeps this split, so the stored reply
        # starts with the content relayed (a lone </think> is known only after it was posted).
        self.posted_content: list[str] = []
        self.posted_think: list[str] = []

    def feed_line(self, line: str) -> tuple[str, str]:
        """One line of the stream; the (content, reasoning) it adds to the reply as posted."""
        if line.startswith("error:"):
            # llama-server builds of 2024-2025 stream a failed slot as an `error: {...}` field, then
            # `data: [DONE]`: the reply stopped where the generation failed, and is no reply.
            text = line[len("error:"):].strip()
            try:
                error: Any = json.loads(text)
            except ValueError:
                error = text
            status = error["code"] if isinstance(error, dict) and isinstance(error.get("code"), int) else 500
            raise classify_backend_error(status, json.dumps(error) if not isinstance(error, str) else error)
        if not line.startswith("data:"):
            return "", ""  # blank separators, `event:`, `: keep-alive` comments
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.done = True
            return "", ""
        try:
            chunk = json.loads(data)
        except ValueError:
            raise BackendError("backend streamed a chunk that is not JSON") from None
        if not isinstance(chunk, dict):
            raise BackendError("backend streamed a chunk that is not an object")
        if chunk.get("error"):
            error = chunk["error"]
            status = error["code"] if isinstance(error, dict) and isinstance(error.get("code"), int) else 500
            raise classify_backend_error(status, json.dumps(error) if not isinstance(error, str) else error)
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return "", ""  # the usage chunk has no choices
        self.chunks += 1
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        delta = choice["delta"] if isinstance(choice.get("delta"), dict) else {}
        content, reasoning = "", ""
        piece = delta.get("content")
        if isinstance(piece, str) and piece:
            self.content.append(piece)
            content, reasoning = self.splitter.feed(piece)
            self.posted_content.append(content)
            self.posted_think.append(reasoning)
        for key in ("reasoning_content", "reasoning"):
            piece = delta.get(key)
            if isinstance(piece, str) and piece:
                self.reasoning.append(piece)
                reasoning += piece
                break
        for call in delta.get("tool_calls") or []:
            if isinstance(call, dict):
                self._call_delta(call)
        return content, reasoning

    def _call_delta(self, call: dict[str, Any]) -> None:
        index = call["index"] if isinstance(call.get("index"), int) else len(self.calls)
        slot = self.calls.setdefault(index, {"id": None, "type": "function", "name": "", "arguments": []})
        if isinstance(call.get("id"), str) and call["id"] and not slot["id"]:
            slot["id"] = call["id"]
        function = call["function"] if isinstance(call.get("function"), dict) else {}
        if isinstance(function.get("name"), str) and function["name"] and not slot["name"]:
            slot["name"] = function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            slot["arguments"].append(arguments)
        elif arguments is not None:
            slot["arguments"].append(json.dumps(arguments, separators=(",", ":")))

    def finish(self) -> tuple[str, str]:
        """What the splitter still held when the stream ended."""
        content, think = self.splitter.finish()
        self.posted_content.append(content)
        self.posted_think.append(think)
        return content, think

    def response(self) -> dict[str, Any]:
        """The chat.completion body, its content and reasoning split as they were posted (read
        with `parse_chat_response(..., split_think=False)`)."""
        if not self.chunks:
            raise BackendError("backend streamed no choices")
        if not self.done and self.finish_reason is None:
            raise BackendError("backend's stream ended before the reply finished")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.posted_content) or None}
        reasoning = [part for part in ("".join(self.reasoning), "".join(self.posted_think).strip()) if part]
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": slot["id"],
                    "type": "function",
                    "function": {"name": slot["name"], "arguments": "".join(slot["arguments"])},
                }
                for _, slot in sorted(self.calls.items())
            ]
        answer: dict[str, Any] = {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}],
        }
        if self.usage is not None:
            answer["usage"] = self.usage
        return answer


def apply_overrides(caps: Capabilities, *, add: Iterable[str], remove: Iterable[str], transports: set[str] | None) -> None:
    caps.features |= set(add)
    caps.features -= set(remove)
    if transports is not None:
        caps.image_transports = set(transports)
    if not caps.image_transports & {ChatImageTransport.URL, ChatImageTransport.BASE64}:
        caps.features.discard(ChatFeature.VISION)
