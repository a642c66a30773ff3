"""The reference worker in front of Ollama: what it declares (the context Ollama's /v1 routes run
the model with, vision, tools and thinking as /api/show reports them) and how its replies and
errors are read, against the fake that reproduces Ollama's wire (tests/bridge/fake_ollama.py)."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from PIL import Image

from tests.bridge.conftest import running_bridge
from tests.bridge.fake_ollama import CONTINUATION, DEFAULT_REPLY, REASONING, FakeOllama
from workers.bridge.backends import OpenAIBackend, ollama_model_name, ollama_version
from workers.bridge.config import BridgeConfig, ConfigError, load_config
from workers.bridge.jobs import chat_backend_request
from workers.bridge.worker import job_context, jobs_at_once
from workers.models import Worker

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


PNG = _png()


@contextmanager
def ollama(**options) -> Iterator[FakeOllama]:
    fake = FakeOllama(**options)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


def _probe(fake: FakeOllama, **config):
    backend = OpenAIBackend(fake.url, timeout=10)
    caps = backend.probe(None)
    bridge_config = BridgeConfig(api_key="k", worker_name="w", backend=fake.url, **config)
    return caps, job_context(bridge_config, caps, jobs_at_once(bridge_config, caps))


# --- the fake speaks as Ollama's source says ---------------------------------------------------------


def test_the_fake_loads_as_ollama_schedules_a_model():
    with ollama(vram_default=32768) as fake:
        assert httpx.get(fake.url.replace("/v1", "/api/ps")).json() == {"models": []}
        load = httpx.post(fake.url.replace("/v1", "/api/generate"), json={"model": "qwen3:8b"}).json()
        assert load["done"] and load["done_reason"] == "load"
        assert httpx.get(fake.url.replace("/v1", "/api/ps")).json()["models"][0]["context_length"] == 32768
        # A native request with its own num_ctx reloads it; the /v1 routes then load the default again.
        httpx.post(fake.url.replace("/v1", "/api/generate"), json={"model": "qwen3:8b", "options": {"num_ctx": 8192}})
        assert fake.loaded == {"context": 8192, "auto": False}
        httpx.post(f"{fake.url}/chat/completions", json={"model": "qwen3:8b", "messages": [{"role": "user", "content": "hi"}]})
        assert fake.loaded == {"context": 32768, "auto": True} and fake.loads == 3


def test_the_fake_refuses_what_ollama_refuses():
    with ollama(model="gemma2:2b", arch="gemma2", capabilities=("completion",)) as fake:
        def chat(**body):
            return httpx.post(f"{fake.url}/chat/completions", json={
                "model": "gemma2:2b", "messages": [{"role": "user", "content": "hi"}], **body})

        thinking = chat(reasoning_effort="low")
        assert thinking.status_code == 400
        assert thinking.json()["error"]["message"] == '"gemma2:2b" does not support thinking'
        assert chat(reasoning_effort="none").status_code == 200  # think false is no thinking asked
        assert "does not support tools" in chat(tools=[WEATHER_TOOL]).json()["error"]["message"]
        image = chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
        assert image.status_code == 400 and "image URLs are not currently supported" in image.text


@pytest.mark.parametrize(("text", "version"), [("0.12.3", (0, 12, 3)), ("0.6.8-rc1", (0, 6, 8)), ("0.0.0", None),
                                               (None, None), ("dev", None)])
def test_ollama_version(text, version):
    assert ollama_version(text) == version  # a source build says 0.0.0: unknown, not ancient


def test_a_model_without_a_tag_is_its_latest():
    assert ollama_model_name("qwen3") == "qwen3:latest" == ollama_model_name("qwen3:latest")
    assert ollama_model_name("hf.co/bartowski/Qwen3-8B-GGUF:Q4_K_M") == "hf.co/bartowski/Qwen3-8B-GGUF:Q4_K_M"
    assert ollama_model_name("localhost:5000/me/model") == "localhost:5000/me/model:latest"


def test_the_context_of_a_model_named_without_its_tag_is_found():
    with ollama(model="qwen3:latest", vram_default=32768) as fake:
        backend = OpenAIBackend(fake.url, timeout=10)
        caps = backend.probe("qwen3")
    assert caps.context == 32768


def test_without_model_the_newest_model_that_generates_text_is_served():
    # /v1/models lists the newest first: an embedding model pulled for a RAG front would be served,
    # and every job answered 400 "does not support chat".
    with ollama(pulled_later={"nomic-embed-text:latest": ("embedding",)}) as fake:
        assert [m["id"] for m in httpx.get(f"{fake.url}/models").json()["data"]] == ["nomic-embed-text:latest", "qwen3:8b"]
        caps, _ = _probe(fake)
    assert caps.model == "qwen3:8b"


# --- context ------------------------------------------------------------------------------------------


def test_the_context_is_the_one_ollama_loads_the_model_with_for_the_v1_routes():
    # Ollama 0.15.5+ on a 24 GiB GPU: the default context is 32768 (its VRAM tier), which no route
    # reports before the model is loaded; /api/ps reports it once it is.
    with ollama(vram_default=32768, n_ctx_train=40960) as fake:
        caps, (context, source) = _probe(fake)
    assert (caps.kind, caps.context) == ("ollama", 32768)
    assert context == 32768 and source == "the backend"
    assert fake.loads == 1 and any(path == "/api/generate" for _, path, _ in fake.requests)
    assert any("context 32768 from /api/ps" in note for note in caps.notes)


def test_the_context_is_read_again_when_another_client_loaded_the_model_with_its_own():
    with ollama(vram_default=4096) as fake:
        fake.schedule({"num_ctx": 16384})  # e.g. a chat front's native request with options.num_ctx
        caps, _ = _probe(fake)
    assert caps.context == 4096  # what a /v1 request will get: the model is loaded again with it


def test_a_loaded_context_is_held_to_the_trained_one():
    with ollama(context_length_env=65536, n_ctx_train=32768) as fake:
        caps, _ = _probe(fake)
    assert caps.context == 32768


def test_without_ps_context_the_modelfile_num_ctx_is_the_context():
    # Ollama before 0.10.0: /api/ps has no context_length; a Modelfile's num_ctx is what it loads.
    with ollama(version="0.9.6", modelfile_num_ctx=8192) as fake:
        caps, (context, _) = _probe(fake)
    assert context == 8192 and fake.loads == 0  # nothing to learn from loading it
    assert any("num_ctx" in note for note in caps.notes)


@pytest.mark.parametrize(("version", "train", "expected"), [("0.9.6", 40960, 4096), ("0.6.2", 40960, 2048), ("0.9.6", 2048, 2048)])
def test_an_unknown_context_is_ollamas_smallest_default_and_the_log_says_so(version, train, expected):
    with ollama(version=version, n_ctx_train=train) as fake:
        caps, (context, _) = _probe(fake)
    assert context == expected
    assert any("--max-context-length" in note for note in caps.notes)


def test_max_context_length_still_overrides_what_ollama_reports():
    with ollama(vram_default=32768) as fake:
        _, (context, source) = _probe(fake, max_context_length=12000)
    assert (context, source) == (12000, "--max-context-length")


def _declared(bridge) -> int | None:
    return Worker.objects.get(name=bridge.config.worker_name).chat_max_context_length


def _until_declared(bridge, context: int, out, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _declared(bridge) != context:
        assert time.monotonic() < deadline, f"declared {_declared(bridge)}, not {context}:\n{out.text()}"
        time.sleep(0.1)


def _ps_reads(fake: FakeOllama) -> int:
    return sum(1 for method, path, _ in fake.requests if path == "/api/ps")


def test_a_smaller_context_ollama_reloads_the_model_with_is_declared_on_the_next_pops(live_horde):
    # Another model took VRAM: Ollama's next automatic load of ours fits 8192 tokens, not 32768.
    with ollama(vram_default=32768) as fake, \
            running_bridge(live_horde, fake.url, pop_wait=1, context_check_interval=0.3) as (bridge, out):
        assert _declared(bridge) == 32768, out.text()
        fake.fits = 8192
        fake.unload()
        httpx.post(f"{fake.url}/chat/completions", json={"model": "qwen3:8b", "messages": [{"role": "user", "content": "hi"}]})
        _until_declared(bridge, 8192, out)
    assert "context 8192 from /api/ps (was 32768)" in out.text()
    assert fake.loads == 2  # the bridge read /api/ps; it loaded nothing itself


def test_a_larger_context_is_declared_once_the_workers_own_job_ran_with_it(live_horde):
    with ollama(vram_default=4096) as fake, \
            running_bridge(live_horde, fake.url, pop_wait=1, context_check_interval=0.3) as (bridge, out):
        # Another client's own num_ctx: the /v1 routes would load the model again with 4096.
        httpx.post(fake.url.replace("/v1", "/api/generate"), json={"model": "qwen3:8b", "options": {"num_ctx": 16384}})
        reads = _ps_reads(fake)
        deadline = time.monotonic() + 10
        while _ps_reads(fake) < reads + 3:
            assert time.monotonic() < deadline, out.text()
            time.sleep(0.1)
        assert _declared(bridge) == 4096, out.text()
        # Ollama restarted on a larger GPU: the next load (a job's) gets 16384.
        fake.vram_default = 16384
        fake.unload()
        status = live_horde.wait(live_horde.chat(horde={"conformance": "best_effort"}))
        assert status["done"] and not status["faulted"], out.text()
        _until_declared(bridge, 16384, out)


def test_a_faulted_job_reads_the_context_again_at_once(live_horde):
    # The runner ran out of memory: the job faults, and Ollama's next load fits only 8192 tokens.
    with ollama(vram_default=32768) as fake, \
            running_bridge(live_horde, fake.url, pop_wait=1, context_check_interval=3600) as (bridge, out):
        fake.fits = 8192
        fake.crash_next()
        live_horde.wait(live_horde.chat(horde={"conformance": "best_effort"}))  # the horde hands it out again
        assert "chat faulted (generation_error)" in out.text()
        _until_declared(bridge, 8192, out)


def test_a_reply_cut_at_its_length_reads_the_context_again_at_once(live_horde):
    with ollama(vram_default=32768) as fake, \
            running_bridge(live_horde, fake.url, pop_wait=1, context_check_interval=3600) as (bridge, out):
        fake.fits = 8192
        fake.unload()
        fake.reply = "A long answer. " * 20
        status = live_horde.wait(live_horde.chat(max_tokens=16, horde={"conformance": "best_effort"}))
        assert status["done"] and status["generations"][0]["finish_reason"] == "length", out.text()
        _until_declared(bridge, 8192, out)


def test_max_context_length_overrides_a_reloaded_context(live_horde):
    with ollama(vram_default=32768) as fake, running_bridge(
            live_horde, fake.url, pop_wait=1, context_check_interval=0.3, max_context_length=12000) as (bridge, out):
        fake.fits = 8192
        fake.crash_next()
        live_horde.wait(live_horde.chat(horde={"conformance": "best_effort"}))
        assert "chat faulted (generation_error)" in out.text()
        time.sleep(1)
        assert _declared(bridge) == 12000
    assert _ps_reads(fake) == 1  # the start's read only


# --- capabilities ---------------------------------------------------------------------------------------


def test_vision_is_declared_with_base64_when_the_model_sees():
    with ollama(model="qwen2.5vl:7b", arch="qwen25vl", capabilities=("completion", "vision", "tools")) as fake:
        caps, _ = _probe(fake)
    assert "vision" in caps.features
    assert caps.image_transports == {"base64", "messages_url"}  # its /v1 refuses image URLs
    assert "reasoning_effort" not in caps.features  # no "thinking": a reasoning_effort is answered 400


def test_a_model_without_tools_or_thinking_declares_neither():
    with ollama(model="gemma2:2b", arch="gemma2", capabilities=("completion",)) as fake:
        caps, _ = _probe(fake)
    assert not {"tools", "reasoning_effort", "vision"} & caps.features
    assert {"json_object", "json_schema", "seed"} <= caps.features


def test_without_capabilities_tools_and_reasoning_stay_declared_and_vision_is_not():
    with ollama(version="0.6.2", capabilities=("completion", "vision")) as fake:
        caps, _ = _probe(fake)
    assert {"tools", "reasoning_effort"} <= caps.features and "vision" not in caps.features


# --- jobs --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("effort", "sent"), [("minimal", "low"), ("xhigh", "high"), ("low", "low"), ("none", "none")])
def test_reasoning_effort_is_sent_as_every_ollama_version_reads_it(effort, sent):
    body = chat_backend_request({"messages": [], "reasoning_effort": effort}, model="m", kind="ollama")
    assert body["reasoning_effort"] == sent
    assert chat_backend_request({"messages": [], "reasoning_effort": effort}, model="m", kind="vllm")["reasoning_effort"] == effort


def test_a_minimal_reasoning_effort_is_served_by_an_ollama_that_refuses_the_word(live_horde):
    # Ollama 0.11.5 to 0.32.10 answered 400 "invalid reasoning value" to minimal and xhigh.
    with ollama(version="0.20.0") as fake, running_bridge(live_horde, fake.url) as (_, out):
        status = live_horde.wait(live_horde.chat(reasoning_effort="minimal", horde={"conformance": "best_effort"}))
    assert status["done"] and not status["faulted"], out.text()
    message = status["generations"][0]["message"]
    assert message["content"] == DEFAULT_REPLY and message["reasoning_content"] == REASONING


def test_the_worker_declares_ollamas_context_and_vision_and_serves_an_image(live_horde):
    vision = ollama(model="qwen2.5vl:7b", arch="qwen25vl", capabilities=("completion", "vision"),
                    vram_default=32768, n_ctx_train=128000)
    with vision as fake, running_bridge(live_horde, fake.url) as (bridge, out):
        worker = Worker.objects.get(name=bridge.config.worker_name)
        assert worker.chat_max_context_length == 32768 and worker.max_context_length == 32768, out.text()
        assert "vision" in worker.chat_features and "base64" in worker.image_transports
        status = live_horde.wait(live_horde.chat(
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                   {"type": "image_url", "image_url": {"url": PNG}}]}],
            horde={"conformance": "best_effort"},
        ))
    assert status["done"] and not status["faulted"], out.text()
    assert "context 32768 from /api/ps" in out.text()
    sent = next(body for _, path, body in fake.requests if path == "/v1/chat/completions")
    assert sent["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/")


def test_an_ollama_stream_is_read_whole(live_horde):
    # Reasoning and content come in chunks of their own, a tool call whole in one chunk.
    with ollama() as fake, running_bridge(live_horde, fake.url) as (_, out):
        status = live_horde.wait(live_horde.chat(stream=False, horde={"conformance": "best_effort"},
                                                 tools=[WEATHER_TOOL]))
        streamed = live_horde.wait(live_horde.chat(horde={"conformance": "best_effort"}, stream=True))
    assert status["done"] and not status["faulted"], out.text()
    call = status["generations"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert streamed["done"] and not streamed["faulted"], out.text()
    message = streamed["generations"][0]["message"]
    assert message["content"] == DEFAULT_REPLY and message["reasoning_content"] == REASONING
    assert any(body.get("stream") for method, path, body in fake.requests if path == "/v1/chat/completions")


def test_the_fakes_v1_completions_is_the_chat_template_and_thinks_first():
    with ollama() as fake:
        answer = httpx.post(f"{fake.url}/completions", json={"model": "qwen3:8b", "prompt": "Once upon a time",
                                                              "max_tokens": 80}).json()
    # qwen3 thinks past the 80 tokens; its thinking is not in the text: nothing is left.
    assert answer["choices"][0] == {"text": "", "index": 0, "finish_reason": "length"}


def test_a_text_job_continues_the_prompt_as_written(live_horde):
    # A text job is a continuation (KoboldAI's API); Ollama's /v1/completions would wrap the prompt
    # in the chat template as a user message, and a thinking model would spend max_length thinking.
    with ollama() as fake, running_bridge(live_horde, fake.url) as (_, out):
        status = live_horde.wait(live_horde.text(prompt="Once upon a time", params={
            "max_length": 80, "temperature": 0.7, "top_k": 40, "rep_pen": 1.1, "stop_sequence": ["\n\n"]}), chat=False)
    assert status["done"] and not status["faulted"], out.text()
    assert status["generations"][0]["text"] == CONTINUATION
    sent = next(body for _, path, body in fake.requests if path == "/api/generate" and body.get("prompt"))
    assert sent["raw"] is True and sent["think"] is False and sent["stream"] is False
    assert sent["options"]["num_predict"] == 80 and sent["options"]["stop"] == ["\n\n"]
    assert sent["options"]["top_k"] == 40 and sent["options"]["repeat_penalty"] == 1.1


def test_the_context_check_interval_is_a_flag_and_a_variable():
    assert load_config(["--api-key", "k"], {}).context_check_interval == 60.0
    assert load_config(["--api-key", "k"], {"BRIDGE_CONTEXT_CHECK_INTERVAL": "5"}).context_check_interval == 5.0
    assert load_config(["--api-key", "k", "--context-check-interval", "0"], {}).context_check_interval == 0.0
    with pytest.raises(ConfigError):
        load_config(["--api-key", "k", "--context-check-interval", "-1"], {})
