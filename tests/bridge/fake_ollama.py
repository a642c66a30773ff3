"""A local fake of Ollama (a real HTTP server) as the reference worker sees it.

It reproduces the wire of Ollama's source (server/routes.go, openai/openai.go, middleware/openai.go,
api/types.go), not a model:

- GET /api/version: {"version"}; GET /v1/models: the local models, `owned_by` the name's namespace
  ("library" for an official model).
- POST /api/show {"model"}: `capabilities` (from 0.6.4: "completion", "tools", "thinking",
  "vision"...), `model_info` (the GGUF keys: "general.architecture", "<arch>.context_length" the
  trained context), `parameters` (the Modelfile's PARAMETER lines as "%-30s %#v", e.g. num_ctx),
  404 {"error": "model 'x' not found"} for an unknown one.
- The context a model is loaded with (scheduleRunner, modelOptions): the request's options.num_ctx,
  else the Modelfile's num_ctx, else OLLAMA_CONTEXT_LENGTH, else the server's default (2048 before
  0.6.7, 4096 until 0.15.5, then 4096/32768/262144 by VRAM), at most the trained context, at least
  2048 for a vision model. A loaded model is kept for a request whose context is automatic too
  (needsReload), reloaded for another. The /v1 routes never send num_ctx.
- GET /api/ps: the loaded models with their `context_length` (from 0.10.0); an unloaded model
  (keep_alive ran out, `ollama stop`, a crashed runner) is not listed.
- At runtime, as a long-running Ollama does: `fits` holds an automatic context to what fits in
  memory (another model took VRAM); `unload()` drops the model, so the next request loads it
  again with the settings of then (a restart with another OLLAMA_CONTEXT_LENGTH or VRAM tier);
  `crash_next()` answers the next generation 500 "model runner has unexpectedly stopped" (the
  runner ran out of memory) and unloads the model.
- POST /api/generate {"model"} without a prompt loads the model: {"done": true, "done_reason": "load"}.
- POST /api/generate with a prompt: `raw: true` continues the prompt as written; without it the
  prompt is the user message of the model's chat template and a thinking model thinks first
  (unless `think: false`), its thinking left out of `response` but counted in `num_predict`.
  /v1/completions is that templated generate (FromCompleteRequest sets no raw), answered as a
  text_completion.
- POST /v1/chat/completions as Ollama's OpenAI layer answers it: `reasoning` beside `content`,
  tool calls complete in one chunk with an `index` and an id Ollama mints, streamed as SSE chunks
  (role on the first, content "" kept, a reasoning chunk apart from a content chunk, a finish chunk
  with an empty delta, the usage chunk with `choices: []` under stream_options.include_usage, then
  `data: [DONE]`), errors as {"error": {"message", "type", "param", "code"}}: a reasoning_effort the
  version does not read (400 "invalid reasoning value" for minimal and xhigh from 0.11.5 until
  0.32.11, which clamps them), thinking asked of a model that cannot think ("does not support
  thinking"), tools for a model without the capability ("does not support tools"), an image URL
  that is not base64 data ("image URLs are not currently supported...").
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from tests.bridge.fake_backend import QuietServer
from tests.http_fakes import QuietHandler

DEFAULT_REPLY = "Hello from the fake Ollama."
CONTINUATION = " there lived a dragon."
THINKING_TOKENS = 120  # what the fake thinking model thinks before it answers a templated prompt
REASONING = "The user greets me."


def version_tuple(text: str) -> tuple[int, int, int]:
    major, minor, patch = (int(part) for part in re.findall(r"\d+", text)[:3])
    return major, minor, patch


class OllamaError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class FakeOllama:
    def __init__(
        self,
        *,
        version: str = "0.33.0",
        model: str = "qwen3:8b",
        arch: str = "qwen3",
        n_ctx_train: int = 40960,
        capabilities: tuple[str, ...] = ("completion", "tools", "thinking"),
        modelfile_num_ctx: int | None = None,
        context_length_env: int | None = None,  # OLLAMA_CONTEXT_LENGTH
        vram_default: int = 4096,  # the VRAM tier's default (0.15.5 on)
        pulled_later: dict[str, tuple[str, ...]] | None = None,  # other models and their capabilities
        fits: int | None = None,  # the largest automatic context that fits in memory
    ):
        self.version = version
        self.model = model
        self.arch = arch
        self.n_ctx_train = n_ctx_train
        self.capabilities = capabilities
        self.modelfile_num_ctx = modelfile_num_ctx
        self.context_length_env = context_length_env
        self.vram_default = vram_default
        self.pulled_later = pulled_later or {}
        self.fits = fits
        self.crashing = False
        self.loaded: dict[str, Any] | None = None  # {"context": n, "auto": bool}
        self.loads = 0
        self.requests: list[tuple[str, str, Any]] = []
        self.chunk_chars = 4
        self.reply = DEFAULT_REPLY  # what a chat request is answered
        self._server: QuietServer | None = None

    @property
    def v(self) -> tuple[int, int, int]:
        return version_tuple(self.version)

    # -- lifecycle

    def start(self) -> str:
        fake = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, status: int, body: Any) -> None:
                data = (json.dumps(body) + "\n").encode()  # gin's encoder ends the body with a newline
                self.send_body(status, data, "application/json; charset=utf-8")

            def _native_error(self, error: OllamaError) -> None:
                self._send(error.status, {"error": error.message})

            def _openai_error(self, error: OllamaError) -> None:
                kind = {400: "invalid_request_error", 404: "not_found_error"}.get(error.status, "api_error")
                self._send(error.status, {"error": {"message": error.message, "type": kind, "param": None, "code": None}})

            def _stream(self, events: list[Any]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for event in events:
                        data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def do_GET(self) -> None:
                fake.requests.append(("GET", self.path, None))
                if self.path == "/api/version":
                    self._send(200, {"version": fake.version})
                elif self.path == "/v1/models":
                    self._send(200, fake.models())
                elif self.path == "/api/ps":
                    self._send(200, fake.ps())
                else:
                    self.send_response(404)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", "18")
                    self.end_headers()
                    self.wfile.write(b"404 page not found")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                fake.requests.append(("POST", self.path, body))
                try:
                    if self.path == "/api/show":
                        self._send(200, fake.show(body))
                    elif self.path == "/api/generate":
                        self._send(200, fake.generate(body))
                    elif self.path == "/v1/completions":
                        self._send(200, fake.completion(body))
                    elif self.path == "/v1/chat/completions":
                        try:
                            answer = fake.chat(body)
                        except OllamaError as error:
                            self._openai_error(error)
                            return
                        if body.get("stream"):
                            self._stream(fake.stream_events(answer, body))
                        else:
                            self._send(200, answer)
                    else:
                        self._native_error(OllamaError(404, "404 page not found"))
                except OllamaError as error:
                    self._native_error(error)

        self._server = QuietServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- the native routes

    def _known(self, name: Any) -> str:
        name = str(name or "")
        full = name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"
        if full != self.model and full not in self.pulled_later:
            raise OllamaError(404, f"model '{name}' not found")
        return full

    def _served(self, name: Any, route: str) -> str:
        """The model of a generation: one that cannot generate (an embedding model) is refused."""
        full = self._known(name)
        if full in self.pulled_later and "completion" not in self.pulled_later[full]:
            raise OllamaError(400, f'"{name}" does not support {route}')
        return full

    def models(self) -> dict[str, Any]:
        # Newest first (sortListModelResponses): the models pulled later come first.
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 1760000000 + i,
             "owned_by": name.split("/")[0] if "/" in name else "library"}
            for i, name in enumerate([*self.pulled_later, self.model])]}

    def show(self, body: dict[str, Any]) -> dict[str, Any]:
        name = self._known(body.get("model") or body.get("name"))
        if name in self.pulled_later:
            return {"details": {"format": "gguf", "family": "nomic-bert"}, "capabilities": list(self.pulled_later[name]),
                    "model_info": {"general.architecture": "nomic-bert", "nomic-bert.context_length": 2048}}
        answer: dict[str, Any] = {
            "license": "Apache License 2.0",
            "modelfile": f"# Modelfile generated by \"ollama show\"\nFROM {self.model}\n",
            "template": "{{ .Prompt }}",
            "details": {"parent_model": "", "format": "gguf", "family": self.arch, "families": [self.arch],
                        "parameter_size": "8.2B", "quantization_level": "Q4_K_M"},
            "model_info": {
                "general.architecture": self.arch,
                "general.parameter_count": 8190735360,
                f"{self.arch}.context_length": self.n_ctx_train,
                f"{self.arch}.embedding_length": 4096,
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.tokens": [],
            },
            "modified_at": "2026-11-30T10:00:00.000000000Z",
        }
        params = [f"{'stop':<30} {json.dumps('<|im_end|>')}"]
        if self.modelfile_num_ctx is not None:
            params.insert(0, f"{'num_ctx':<30} {self.modelfile_num_ctx}")
        answer["parameters"] = "\n".join(params)
        if self.v >= (0, 6, 4):
            answer["capabilities"] = list(self.capabilities)
        return answer

    def ps(self) -> dict[str, Any]:
        if self.loaded is None:
            return {"models": []}
        entry: dict[str, Any] = {
            "name": self.model, "model": self.model, "size": 6000000000, "digest": "500a1f067a9f",
            "details": {"parent_model": "", "format": "gguf", "family": self.arch, "families": [self.arch],
                        "parameter_size": "8.2B", "quantization_level": "Q4_K_M"},
            "expires_at": "2026-12-06T15:00:00Z", "size_vram": 6000000000,
        }
        if self.v >= (0, 10, 0):
            entry["context_length"] = self.loaded["context"]
        return {"models": [entry]}

    def default_num_ctx(self) -> int:
        if self.v < (0, 6, 7):
            return 2048
        if self.v < (0, 15, 5):
            return 4096
        return self.vram_default

    def schedule(self, options: dict[str, Any] | None) -> None:
        """Load the model as scheduleRunner does, or keep the loaded one (needsReload)."""
        options = options or {}
        if "num_ctx" in options:
            requested, auto = int(options["num_ctx"]), False
        elif self.modelfile_num_ctx is not None:
            requested, auto = self.modelfile_num_ctx, False
        elif self.context_length_env:
            requested, auto = self.context_length_env, False
        else:
            requested, auto = self.default_num_ctx(), True
            if self.fits:
                requested = min(requested, self.fits)
        if "vision" in self.capabilities:
            requested = max(requested, 2048)
        context = min(requested, self.n_ctx_train) if self.n_ctx_train else requested
        if self.loaded is not None and (self.loaded["context"] == context or (self.loaded["auto"] and auto)):
            return
        self.loaded = {"context": context, "auto": auto}
        self.loads += 1

    def unload(self) -> None:
        self.loaded = None

    def crash_next(self) -> None:
        self.crashing = True

    def _crash(self) -> None:
        """A runner that ran out of memory: the request fails, the model is unloaded."""
        if self.crashing:
            self.crashing, self.loaded = False, None
            raise OllamaError(500, "model runner has unexpectedly stopped, this may be due to resource limitations "
                                   "or an internal error, check ollama server logs for details")

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        name = self._served(body.get("model"), "generate")
        if "completion" not in self.capabilities:
            raise OllamaError(400, f'"{body.get("model")}" does not support generate')
        self.schedule(body.get("options"))
        if not body.get("prompt"):
            return {"model": body.get("model"), "created_at": "2026-12-06T14:00:00Z", "response": "", "done": True,
                    "done_reason": "load"}
        self._crash()
        think = body.get("think")
        if think is None and "thinking" in self.capabilities:
            think = True  # GenerateHandler: a thinking model thinks unless told not to
        options = body.get("options") or {}
        budget = int(options.get("num_predict") or 10**6)
        if body.get("raw"):
            text, used = CONTINUATION, len(CONTINUATION) // 4
        else:  # the prompt as the user message of the chat template: an answer, not a continuation
            text, used = DEFAULT_REPLY, len(DEFAULT_REPLY) // 4
            if think:
                used += THINKING_TOKENS
        done_reason = "stop"
        if used > budget:
            kept = max(0, budget - (used - len(text) // 4))
            text, done_reason, used = text[: kept * 4], "length", budget
        return {"model": name, "created_at": "2026-12-06T14:00:00Z", "response": text, "done": True,
                "done_reason": done_reason, "context": [151644, 872, 198], "total_duration": 912000000,
                "prompt_eval_count": 12, "eval_count": used}

    # -- the OpenAI layer

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """/v1/completions: FromCompleteRequest's GenerateRequest (no raw, no think), as a text_completion."""
        options: dict[str, Any] = {"temperature": body.get("temperature", 1.0), "top_p": body.get("top_p") or 1.0}
        if body.get("max_tokens") is not None:
            options["num_predict"] = body["max_tokens"]
        answer = self.generate({"model": body.get("model"), "prompt": body.get("prompt"), "options": options})
        return {"id": "cmpl-871", "object": "text_completion", "created": 1765029600, "model": body.get("model"),
                "system_fingerprint": "fp_ollama",
                "choices": [{"text": answer["response"], "index": 0, "finish_reason": answer["done_reason"]}],
                "usage": {"prompt_tokens": answer["prompt_eval_count"], "completion_tokens": answer["eval_count"],
                          "total_tokens": answer["prompt_eval_count"] + answer["eval_count"]}}

    def _think(self, body: dict[str, Any]) -> Any:
        """The think value FromChatRequest makes of reasoning_effort, for this version."""
        effort = body.get("reasoning_effort")
        if effort is None or self.v < (0, 11, 5):
            return None  # not read before 0.11.5
        if self.v >= (0, 32, 11):
            clamp = {"none": False, "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                     "max": "max", "xhigh": "max", "ultra": "max"}
            if effort not in clamp:
                raise OllamaError(400, f'invalid reasoning value: "{effort}"')
            return clamp[effort]
        accepted = ["high", "medium", "low", "none"] + (["max"] if self.v >= (0, 22, 0) else [])
        if effort not in accepted:
            raise OllamaError(400, f"invalid reasoning value: '{effort}' (must be {', '.join(map(repr, accepted))})")
        return False if effort == "none" else effort

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages") or []
        if not messages:
            raise OllamaError(400, "[] is too short - 'messages'")
        for message in messages:
            content = message.get("content")
            for part in content if isinstance(content, list) else []:
                if part.get("type") == "image_url":
                    url = (part.get("image_url") or {}).get("url") or ""
                    if url.startswith(("http://", "https://")):
                        raise OllamaError(400, "image URLs are not currently supported, please use base64 encoded data instead")
                    if not re.match(r"data:(image/(jpeg|jpg|png|webp))?;base64,", url):
                        raise OllamaError(400, "invalid image input")
        think = self._think(body)
        name = self._served(body.get("model"), "chat")
        thinking_model = "thinking" in self.capabilities
        if thinking_model and think is None:
            think = True
        elif not thinking_model and think not in (None, False):
            raise OllamaError(400, f'"{body.get("model")}" does not support thinking')
        if body.get("tools") and "tools" not in self.capabilities:
            raise OllamaError(400, f"registry.ollama.ai/library/{name} does not support tools")
        self.schedule(None)  # the OpenAI layer's options hold no runner option
        self._crash()
        message: dict[str, Any] = {"role": "assistant", "content": self.reply}
        finish = "stop"
        tools = body.get("tools") or []
        if tools and messages[-1].get("role") != "tool":
            message = {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_k3x9a2mq", "index": 0, "type": "function",
                "function": {"name": tools[0]["function"]["name"], "arguments": '{"city":"Paris"}'}}]}
            finish = "tool_calls"
        if think not in (None, False):
            message["reasoning"] = REASONING
        max_tokens = body.get("max_tokens")
        if max_tokens and len(message.get("content") or "") // 4 > max_tokens:
            message["content"], finish = message["content"][: max_tokens * 4], "length"
        return {
            "id": "chatcmpl-417", "object": "chat.completion", "created": 1765029600, "model": body.get("model"),
            "system_fingerprint": "fp_ollama",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 14, "completion_tokens": 9, "total_tokens": 23},
        }

    def stream_events(self, answer: dict[str, Any], body: dict[str, Any]) -> list[Any]:
        """The SSE events Ollama's ChatWriter writes for the reply, one per generated piece."""
        message = answer["choices"][0]["message"]

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
                    "model": answer["model"], "system_fingerprint": "fp_ollama",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        pieces: list[dict[str, Any]] = []
        reasoning, content = message.get("reasoning") or "", message.get("content") or ""
        size = self.chunk_chars
        pieces += [{"content": "", "reasoning": reasoning[i : i + size]} for i in range(0, len(reasoning), size)]
        pieces += [{"content": content[i : i + size]} for i in range(0, len(content), size)]
        if message.get("tool_calls"):
            pieces.append({"content": "", "tool_calls": message["tool_calls"]})
        if not pieces:
            pieces.append({"content": ""})
        pieces[0] = {"role": "assistant", **pieces[0]}
        events: list[Any] = [chunk(delta) for delta in pieces]
        events.append(chunk({}, answer["choices"][0]["finish_reason"]))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = chunk({})
            usage["choices"] = []
            usage["usage"] = answer["usage"]
            events.append(usage)
        events.append("[DONE]")
        return events
