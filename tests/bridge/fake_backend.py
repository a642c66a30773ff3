"""A local fake of llama.cpp's `llama-server` (a real HTTP server) as the reference worker sees it.

It reproduces the server's wire, not its model: GET /v1/models (the id is the -m path as typed,
or --alias), GET /props (default_generation_settings.n_ctx, total_slots, model_path, chat
template and its caps, modalities), GET /slots, GET /health, POST /tokenize, POST
/apply-template, POST /v1/chat/completions and /v1/completions (stream off), and its error bodies
{"error": {"code", "message", "type"}}. What the server does that the bridge has to live with:

- Slots: `total_slots` generations run at once; a request past them waits for a free slot, as
  llama-server defers a task. `max_in_flight` records the most that ran at once.
- Context: with `kv_unified` (llama-server's default when -np is not given) every slot reports the
  whole cache, `n_ctx`, and the slots share it: a request whose prompt and reply do not fit in
  what the running ones leave gets 500 "Context size has been exceeded.", and so does every
  generation running then (the server fails each processing slot); without it each slot
  has n_ctx / total_slots of its own and /props reports that. A prompt of at least a slot's
  context is refused 400 exceed_context_size_error.
- Tokens: a deterministic tokenizer (up to 4 ASCII letters a token, 2 tokens a non-ASCII
  character, as byte-level BPE splits CJK; chat markers are single special tokens); usage
  reports what it counts.
- Chat templates: `jinja` False is --no-jinja: /props looks the same, but any request with tools
  answers 500 "tools param requires --jinja flag" (and a tool_choice other than "auto", 500
  "tool_choice param requires --jinja flag").
- tool_choice: read as a string; an object (a named function) is the wrong type, so the server
  logs a warning and uses its default "auto"; a string other than auto, none or required is 400
  "Invalid tool_choice: ...". Under "auto" the tool grammar is lazy (it starts at the call's
  trigger), so a model that would rather answer in text (`model_prefers_text`) does; under
  "required" the grammar constrains the reply from its first token and holds it open until one
  call is complete, text allowed before it, so the reply carries a call (content "", or the
  `text_before_call` the model writes first; finish_reason "tool_calls"; a max_tokens reached
  before the call ends the reply there, at "length" with no call), unless
  `tool_grammar` is False: a template whose tool-call format llama.cpp's parser generator does
  not recognise gets no grammar at all, and the model answers as it likes.
- response_format: a json_schema (or a json_object carrying "schema") is compiled to a grammar
  (the reply is the schema's minimal instance); a bare json_object becomes an empty schema and
  no grammar, so the reply is prose.

By default a chat request with tools forwarded gets one tool call (an id the server mints),
anything else a text reply; `chat_handler` / `completion_handler` replace the reply, `delay`
holds each generation (in its slot), `fail_with` answers an error instead. A chat request with
stream: true is answered as llama-server streams it: SSE `data: {chat.completion.chunk}` events
(role first, then reasoning_content, content and tool call deltas of `chunk_chars` characters,
a call's first delta carrying its id, name and first arguments piece, `chunk_delay` apart, a
final chunk with finish_reason, the usage chunk under stream_options.include_usage, `timings` on
the last of them, then `data: [DONE]`), chunked over HTTP/1.1; a client that closes
the stream stops the generation (`streams` records what each stream sent). A generation that
fails in its slot (`stream_fail_after` chunks in, or before any) ends its stream with
`data: {"error": ...}`, or with `sse_error_event` as builds until late 2025 did: `error: {...}`, then
`data: [DONE]`. Every request body is
kept in `requests`, and the client address it came from in `peers`.
"""

from __future__ import annotations

import json
import re
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

from tests.http_fakes import QuietHandler, close_server, serve
from workers.bridge.scripted import minimal_instance

LLAMA_CONTEXT_OVERFLOW = (
    400,
    {
        "error": {
            "code": 400,
            "message": "request (9000 tokens) exceeds the available context size (8192 tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 9000,
            "n_ctx": 8192,
        }
    },
)
LLAMA_GRAMMAR_ERROR = (
    400,
    # As b1-0c1e570 refuses a schema it cannot compile (ADR 0112).
    {"error": {"code": 400, "message": "Unable to generate parser for this template. Automatic parser generation failed: "
               "JSON schema error at #/properties/a: minimum must be a number", "type": "invalid_request_error"}},
)
LLAMA_SERVER_ERROR = (500, {"error": {"code": 500, "message": "llama_decode failed: KV cache full", "type": "server_error"}})
LLAMA_KV_CACHE_EXCEEDED = (500, {"error": {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}})
TOOL_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<tool_call>{% endfor %}"
DEFAULT_REPLY = "Hello from the fake llama.cpp."

_SPECIAL = {"<|im_start|>": 151644, "<|im_end|>": 151645}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in _SPECIAL) + ")")
_PIECE = re.compile(r"[A-Za-z]{1,4}|[0-9]{1,3}|[^\x00-\x7f]|\s+|.", re.DOTALL)
BOS_ID = 151643


def fake_tokenize(text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
    """The fake model's tokens: deterministic, and CJK costs two tokens a character."""
    ids = [BOS_ID] if add_special else []
    chunks = _SPECIAL_SPLIT.split(text) if parse_special else [text]
    for chunk in chunks:
        if chunk in _SPECIAL and parse_special:
            ids.append(_SPECIAL[chunk])
            continue
        for piece in _PIECE.findall(chunk):
            base = zlib.crc32(piece.encode()) % 150000 + 10
            ids.extend([base, base + 1] if ord(piece[0]) > 0x7F else [base])
    return ids


class FakeError(Exception):
    def __init__(self, status: int, message: str, kind: str, **extra: Any):
        super().__init__(message)
        self.status, self.body = status, {"error": {"code": status, "message": message, "type": kind, **extra}}


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """No traceback: a client that gave up a slow generation (the lease and stop tests) closes its end."""


class FakeLlamaCpp:
    def __init__(
        self,
        *,
        n_ctx: int = 8192,
        n_ctx_train: int = 32768,
        model: str = "qwen3-8b-q4_k_m.gguf",
        total_slots: int = 4,
        kv_unified: bool = True,
        jinja: bool = True,
    ):
        self.n_ctx = n_ctx  # -c: the whole KV cache
        self.n_ctx_train = n_ctx_train
        self.model = model  # -m as typed
        self.alias: str | None = None  # --alias
        self.total_slots = total_slots  # -np
        self.kv_unified = kv_unified
        self.jinja = jinja
        self.endpoint_slots = True  # --no-slots turns /slots off
        self.has_apply_template = True  # builds before /apply-template answer it 404
        self.chat_template = TOOL_TEMPLATE
        self.vision = False
        self.tool_grammar = True  # the template's tool-call format is recognised: "required" is a grammar
        self.model_prefers_text = False  # the model answers in text unless a grammar forces the call
        # Under "required", what the model writes before the call: llama-server's grammar allows
        # any text before it (root ::= until-<tool_call>? tool-calls), and max_tokens may end the
        # reply there, at finish_reason "length" with no call (seen on the real server, ADR 0112).
        self.text_before_call = ""
        self.delay = 0.0
        self.fail_with: tuple[int, dict[str, Any]] | None = None
        self.chat_handler: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self.completion_handler: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.peers: list[tuple[str, int]] = []  # the client's address of every POST, by connection
        self.generating = threading.Event()  # set when a generation request arrived
        self.errors: list[tuple[str, int, str]] = []  # (path, status, message) of every error answered
        self.in_flight = 0  # generations running in a slot
        self.max_in_flight = 0
        self._arrived = 0  # generation requests received and not answered (waiting ones too)
        self.max_requests_at_once = 0
        self._kv_used = 0  # tokens the running generations hold in a unified cache
        # Times the shared cache overflowed: llama-server then fails every slot processing, not
        # only the one that did not fit (seen on b1-0c1e570, ADR 0112).
        self._kv_overflows = 0
        self._slots_free: threading.Semaphore | None = None
        self._state = threading.Lock()
        self.chunk_chars = 4
        self.chunk_delay = 0.0
        # A streamed generation that fails in its slot after this many chunks past the role one.
        self.stream_fail_after: int | None = None
        # llama-server builds until late 2025 streamed a slot's failure as an SSE `error:` event (field
        # "error", not "data"), then `data: [DONE]`, as its stream always ended.
        self.sse_error_event = False
        self.streams: list[StreamRecord] = []
        self.stream_ended = threading.Event()  # set when a stream finished or its client went away
        self._server: ThreadingHTTPServer | None = None
        self._calls = 0

    @property
    def slot_n_ctx(self) -> int:
        """A slot's context: the whole cache when unified, else its share."""
        return self.n_ctx if self.kv_unified else self.n_ctx // self.total_slots

    # -- lifecycle

    def start(self) -> str:
        fake = self
        self._slots_free = threading.Semaphore(self.total_slots)

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"  # llama-server streams with chunked transfer encoding

            def _send(self, status: int, body: Any) -> None:
                if status >= 400:
                    error = body.get("error") if isinstance(body, dict) else None
                    fake.errors.append((self.path, status, str((error or {}).get("message"))))
                self.send_json(status, body, "application/json; charset=utf-8")

            def _stream(self, body: dict[str, Any]) -> None:
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                try:
                    events = stream_chunks(fake.generate("/v1/chat/completions", body), fake.chunk_chars,
                                           include_usage=include_usage)
                except FakeError as error:
                    if error.status < 500:
                        raise  # refused before its slot ran it (exceed_context_size_error): a JSON answer
                    # A generation that failed in its slot (the shared cache overflowed) is streamed as
                    # llama-server streams it: 200, then an SSE error event and no [DONE].
                    fake.errors.append((self.path, error.status, str(error)))
                    events = [error.body]
                if fake.stream_fail_after is not None:
                    # The shared cache overflows mid-reply: the slot fails after the first chunks.
                    error = FakeError(500, "Context size has been exceeded.", "server_error")
                    fake.errors.append((self.path, error.status, str(error)))
                    events = [*events[: 1 + fake.stream_fail_after], error.body]
                if fake.sse_error_event and events and isinstance(events[-1], dict) and "error" in events[-1]:
                    events = [*events[:-1], SSEError(events[-1]["error"]), "[DONE]"]
                record = StreamRecord(total=len(events))
                fake.streams.append(record)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for event in events:
                        if isinstance(event, SSEError):
                            data = f"error: {json.dumps(event.error)}\n\n".encode()
                        else:
                            data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.flush()
                        record.sent += 1
                        if fake.chunk_delay:
                            time.sleep(fake.chunk_delay)
                        if isinstance(event, dict) and "error" in event:
                            break
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    record.finished = True
                except (BrokenPipeError, ConnectionResetError):
                    record.closed_early = True  # llama-server cancels the task when its client goes away
                    self.close_connection = True
                finally:
                    fake.stream_ended.set()

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, fake.models())
                elif self.path == "/props":
                    self._send(200, fake.props())
                elif self.path.startswith("/slots"):
                    if fake.endpoint_slots:
                        self._send(200, fake.slots())
                    else:
                        self._send(501, {"error": {"code": 501, "type": "not_supported_error",
                                                   "message": "This server does not support slots endpoint. Start it with `--slots`"}})
                elif self.path == "/health":
                    self._send(200, {"status": "ok"})
                else:
                    self._send(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    self._send(400, {"error": {"code": 400, "message": "Failed to parse the request body as JSON",
                                               "type": "invalid_request_error"}})
                    return
                fake.requests.append((self.path, body))
                fake.peers.append(self.client_address)
                try:
                    if self.path == "/tokenize":
                        self._send(200, fake.tokenize(body))
                    elif self.path == "/apply-template" and fake.has_apply_template:
                        self._send(200, {"prompt": fake.apply_template(body)})
                    elif self.path in ("/v1/chat/completions", "/v1/completions"):
                        fake.generating.set()
                        if fake.fail_with:
                            if fake.delay:
                                time.sleep(fake.delay)
                            self._send(*fake.fail_with)
                        elif self.path == "/v1/chat/completions" and body.get("stream"):
                            self._stream(body)
                        else:
                            self._send(200, fake.generate(self.path, body))
                    else:
                        self._send(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})
                except FakeError as error:
                    self._send(error.status, error.body)

        self._server = serve(Handler, QuietServer)
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def stop(self) -> None:
        if self._server is not None:
            close_server(self._server)

    # -- read-only routes

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.alias or self.model,
                    "aliases": [self.alias or self.model],
                    "object": "model",
                    "created": 1700000000,
                    "owned_by": "llamacpp",
                    "meta": {"vocab_type": 2, "n_vocab": 151936, "n_ctx": self.slot_n_ctx, "n_ctx_train": self.n_ctx_train,
                             "n_embd": 4096},
                }
            ],
        }

    def props(self) -> dict[str, Any]:
        return {
            "default_generation_settings": {
                "id": 0, "id_task": -1, "n_ctx": self.slot_n_ctx, "speculative": False, "is_processing": False,
                "params": {"n_predict": -1, "seed": 4294967295, "temperature": 0.8, "top_k": 40, "top_p": 0.95},
            },
            "total_slots": self.total_slots,
            "model_alias": self.alias or self.model,  # the model's id, with or without --alias
            "model_path": self.model,
            "modalities": {"vision": self.vision, "audio": False},
            "endpoint_slots": self.endpoint_slots,
            "endpoint_props": False,
            "endpoint_metrics": False,
            "webui": True,
            "chat_template": self.chat_template,
            # The template's caps are read from the template, with or without --jinja.
            "chat_template_caps": {"supports_tools": "tools" in self.chat_template, "supports_tool_calls": True},
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "build_info": "b6500-fake",
            "is_sleeping": False,
        }

    def slots(self) -> list[dict[str, Any]]:
        with self._state:
            busy = self.in_flight
        return [
            {"id": i, "n_ctx": self.slot_n_ctx, "speculative": False, "is_processing": i < busy}
            for i in range(self.total_slots)
        ]

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        content = body.get("content")
        if not isinstance(content, str):
            kind = {type(None): "null", bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}
            raise FakeError(500, f"[json.exception.type_error.302] type must be string, but is {kind.get(type(content), 'object')}",
                            "server_error")
        ids = fake_tokenize(content, add_special=bool(body.get("add_special", False)),
                            parse_special=bool(body.get("parse_special", True)))
        return {"tokens": ids}

    def apply_template(self, body: dict[str, Any]) -> str:
        """The chat template (ChatML) as the server renders it, after its request checks."""
        tools = body.get("tools")
        choice = tool_choice(body)
        if isinstance(tools, list) and tools and not self.jinja:
            raise FakeError(500, "tools param requires --jinja flag", "server_error")
        if not self.jinja and choice != "auto":
            raise FakeError(500, "tool_choice param requires --jinja flag", "server_error")
        if choice not in ("auto", "none", "required"):
            raise FakeError(400, f"Invalid tool_choice: {choice}", "invalid_request_error")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise FakeError(500, "'messages' is required", "server_error")
        out = []
        if tools:
            out.append("<|im_start|>system\n# Tools\n" + "\n".join(json.dumps(t) for t in tools) + "<|im_end|>\n")
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            calls = json.dumps(message["tool_calls"]) if message.get("tool_calls") else ""
            out.append(f"<|im_start|>{message.get('role')}\n{content or ''}{calls}<|im_end|>\n")
        out.append("<|im_start|>assistant\n")
        return "".join(out)

    def chat_requests(self) -> list[dict[str, Any]]:
        return [body for path, body in self.requests if path == "/v1/chat/completions"]

    def completion_requests(self) -> list[dict[str, Any]]:
        return [body for path, body in self.requests if path == "/v1/completions"]

    # -- generation

    def generate(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._state:
            self._arrived += 1
            self.max_requests_at_once = max(self.max_requests_at_once, self._arrived)
        try:
            return self._generate(path, body)
        finally:
            with self._state:
                self._arrived -= 1

    def _generate(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        chat = path == "/v1/chat/completions"
        prompt = self.apply_template(body) if chat else str(body.get("prompt") or "")
        n_prompt = len(fake_tokenize(prompt, add_special=True))
        if n_prompt >= self.slot_n_ctx:
            raise FakeError(
                400,
                f"request ({n_prompt} tokens) exceeds the available context size ({self.slot_n_ctx} tokens), try increasing it",
                "exceed_context_size_error",
                n_prompt_tokens=n_prompt,
                n_ctx=self.slot_n_ctx,
            )
        answer = self.chat(body) if chat else self.completion(body)
        choice = answer["choices"][0]
        produced = choice.get("text") if not chat else json.dumps(choice.get("message") or {})
        n_reply = min(len(fake_tokenize(produced or "")), int(body.get("max_tokens") or 10**9))
        assert self._slots_free is not None
        self._slots_free.acquire()  # wait for a free slot, as the server defers the task
        try:
            with self._state:
                if self.kv_unified and self._kv_used + n_prompt + n_reply > self.n_ctx:
                    self._kv_overflows += 1
                    raise FakeError(500, "Context size has been exceeded.", "server_error")
                overflows = self._kv_overflows
                self._kv_used += n_prompt + n_reply if self.kv_unified else 0
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if self.delay:
                    time.sleep(self.delay)
            finally:
                with self._state:
                    self.in_flight -= 1
                    self._kv_used -= n_prompt + n_reply if self.kv_unified else 0
        finally:
            self._slots_free.release()
        if self._kv_overflows != overflows:
            raise FakeError(500, "Context size has been exceeded.", "server_error")
        if (self.chat_handler is None or not chat) and (self.completion_handler is None or chat):
            answer["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": n_reply, "total_tokens": n_prompt + n_reply,
                               "prompt_tokens_details": {"cached_tokens": 0}}
            answer["timings"] = {"prompt_n": n_prompt, "predicted_n": n_reply}
        return answer

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.chat_handler is not None:
            return self.chat_handler(body)
        self._calls += 1
        message: dict[str, Any] = {"role": "assistant", "content": DEFAULT_REPLY}
        finish = "stop"
        tools = body.get("tools") or []
        last = (body.get("messages") or [{}])[-1]
        schema = grammar_schema(body.get("response_format"))
        choice = tool_choice(body)
        forced = choice == "required" and self.tool_grammar
        if tools and choice != "none" and last.get("role") != "tool" and (forced or not self.model_prefers_text):
            said = self.text_before_call if forced else ""
            name = tools[0]["function"]["name"]
            call_text = f'<tool_call>\n{{"name": "{name}", "arguments": {{"city":"Paris"}}}}\n</tool_call>'
            budget = body.get("max_tokens")
            if said and isinstance(budget, int) and len(fake_tokenize(said + call_text)) > budget:
                # The grammar lets text come first; max_tokens ends the reply before the call.
                cut = "".join(_PIECE.findall(said)[:budget])
                return chat_completion({"role": "assistant", "content": cut}, "length", model=self.alias or self.model)
            message = {
                "role": "assistant",
                "content": said if forced else None,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": tools[0]["function"]["name"], "arguments": '{"city":"Paris"}'},
                        "id": f"llama_call_{self._calls:04d}",
                    }
                ],
            }
            finish = "tool_calls"
        elif schema:
            message["content"] = json.dumps(minimal_instance(schema), separators=(",", ":"))
        return chat_completion(message, finish, model=self.alias or self.model)

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.completion_handler is not None:
            return self.completion_handler(body)
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 1700000000,
            "model": self.alias or self.model,
            "choices": [{"text": " the dragon slept.", "index": 0, "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
        }


def tool_choice(body: dict[str, Any]) -> str:
    """tool_choice as llama-server reads it: a string, its default "auto" when absent or null, and
    also when it is not a string (an object naming a function is the wrong type: a warning, then
    the default)."""
    value = body.get("tool_choice")
    return value if isinstance(value, str) else "auto"


def grammar_schema(response_format: Any) -> dict[str, Any] | None:
    """The schema llama-server compiles to a grammar: a json_schema's schema, or the "schema" a
    json_object carries; a bare json_object is an empty schema, which constrains nothing."""
    if not isinstance(response_format, dict):
        return None
    if response_format.get("type") == "json_object":
        schema = response_format.get("schema") or {}
    elif response_format.get("type") == "json_schema":
        inner = response_format.get("json_schema") or {}
        schema = inner.get("schema") or response_format.get("schema") or {}
    else:
        return None
    return schema if isinstance(schema, dict) and schema else None


@dataclass
class SSEError:
    """An `error: {...}` line of the stream (llama-server builds until late 2025)."""

    error: dict[str, Any]


@dataclass
class StreamRecord:
    total: int  # events the whole reply takes, [DONE] included
    sent: int = 0
    finished: bool = False
    closed_early: bool = False


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def stream_chunks(completion: dict[str, Any], size: int, *, include_usage: bool) -> list[Any]:
    """A chat.completion as the events llama-server streams for it."""
    choice = completion["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
            "created": 1700000000,
            "id": "chatcmpl-fake",
            "model": completion.get("model", "fake"),
            "system_fingerprint": "b6000-fake",
            "object": "chat.completion.chunk",
            **extra,
        }

    events: list[Any] = [chunk({"role": "assistant", "content": None})]
    events += [chunk({"reasoning_content": piece}) for piece in _pieces(message.get("reasoning_content") or "", size)]
    events += [chunk({"content": piece}) for piece in _pieces(message.get("content") or "", size)]
    for index, call in enumerate(message.get("tool_calls") or []):
        # The call's first delta carries its id, name and the first piece of its arguments.
        pieces = _pieces(call["function"]["arguments"], size) or [""]
        head = {"index": index, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": pieces[0]}}
        events.append(chunk({"tool_calls": [head]}))
        events += [chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}) for piece in pieces[1:]]
    usage = completion.get("usage")
    events.append(chunk({}, choice["finish_reason"]))
    if include_usage and usage:
        usage_chunk = chunk({}, usage=usage)
        usage_chunk["choices"] = []
        events.append(usage_chunk)
    events[-1]["timings"] = {"predicted_n": len(events)}  # on the last chunk: the usage one when asked
    events.append("[DONE]")
    return events


def chat_completion(
    message: dict[str, Any], finish: str = "stop", *, model: str = "fake", usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "system_fingerprint": "b6500-fake",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage or {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30},
    }


class RouteServer:
    """A local server answering fixed JSON by method and path (another backend's helper routes:
    vLLM's /tokenize, koboldcpp's /api/extra/tokencount); a callable answer gets the body and
    gives (status, answer); an answer that is a str is sent as an HTML page."""

    def __init__(self, routes: dict[tuple[str, str], Any]):
        self.routes = routes
        self.requests: list[tuple[str, str, Any]] = []
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> str:
        fake = self

        class Handler(QuietHandler):
            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                fake.requests.append((method, self.path, body))
                answer = fake.routes.get((method, self.path))
                status, payload = (404, {"detail": "Not Found"}) if answer is None else (200, answer)
                if callable(payload):
                    status, payload = payload(body)
                if isinstance(payload, str):  # a page that is not JSON (a proxy's or a web UI's HTML)
                    self.send_body(status, payload.encode(), "text/html; charset=utf-8")
                    return
                self.send_json(status, payload)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        self._server = serve(Handler, QuietServer)
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def stop(self) -> None:
        if self._server is not None:
            close_server(self._server)
