"""The reference worker streaming progress (chat_requests.md, "Streaming progress"; ADR 0022): a live
horde, its Redis stream, and the fake llama-server streaming SSE chunks."""

from __future__ import annotations

import time

import pytest

from chat.models import Generation
from chat.services.progress import progress_redis
from contract.chat_progress import chat_progress_stream_key
from tests.bridge.conftest import LogBuffer, bridge_config, running_bridge
from tests.bridge.fake_backend import chat_completion
from tests.bridge.test_live import WEATHER_TOOL
from workers.bridge.backends import OpenAIBackend
from workers.bridge.horde import HordeUnavailable
from workers.bridge.progress import PROGRESS_UNAVAILABLE_SECONDS, ProgressPoster
from workers.bridge.worker import Bridge

pytestmark = pytest.mark.redis_only

CLOSED_PORT = "redis://127.0.0.1:1/0"
REASONING = "The user asks about Paris; answer briefly."
CONTENT = "It is sunny in Paris today, with a light breeze from the west."


def stream_entries(request_id: str) -> list[tuple[int, dict[str, str]]]:
    """(milliseconds the horde appended it at, fields) for each entry of the request's stream."""
    client = progress_redis()
    assert client is not None
    return [
        (int(entry_id.decode().split("-")[0]), {k.decode(): v.decode() for k, v in fields.items()})
        for entry_id, fields in client.xrange(chat_progress_stream_key(request_id))
    ]


def reply(content: str = CONTENT, reasoning: str | None = REASONING):
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    return lambda body: chat_completion(
        message, "stop", usage={"prompt_tokens": 30, "completion_tokens": 19, "total_tokens": 49}
    )


def test_streamed_job_posts_ordered_batched_deltas_and_submits_the_whole_reply(live_horde, fake_backend):
    fake_backend.chat_handler = reply()
    fake_backend.chunk_chars, fake_backend.chunk_delay = 2, 0.02  # ~50 deltas over about a second
    interval = 0.2
    with running_bridge(live_horde, fake_backend.url, progress_interval=interval) as (bridge, out):
        # When each post leaves the worker (its own clock): what the interval governs. Redis's entry
        # times also carry each post's trip through the horde, which a loaded box stretches.
        sent_at: list[float] = []
        post_progress = bridge.horde.progress

        def timed_progress(body):
            sent_at.append(time.monotonic())
            return post_progress(body)

        bridge.horde.progress = timed_progress
        request_id = live_horde.chat(stream=True)
        status = live_horde.wait(request_id)
    sent = fake_backend.chat_requests()[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    generation = status["generations"][0]
    assert status["done"] and not status["faulted"]
    assert generation["message"]["content"] == CONTENT
    assert generation["message"]["reasoning_content"] == REASONING
    assert generation["finish_reason"] == "stop" and generation["completion_tokens"] == 19  # the usage chunk
    job_id = str(Generation.objects.get(request_id=request_id).pk)

    entries = stream_entries(request_id)
    posts = [fields for _, fields in entries]
    assert [p["seq"] for p in posts] == [str(n) for n in range(1, len(posts) + 1)]
    assert {p["gen"] for p in posts} == {job_id}
    assert "".join(p["content"] for p in posts) == CONTENT
    assert "".join(p.get("reasoning_content", "") for p in posts) == REASONING
    # Batched: far fewer posts than deltas, and no two regular posts closer than the interval
    # (the last one is the flush at the stream's end).
    deltas = (len(CONTENT) + len(REASONING)) // 2
    assert 3 <= len(posts) <= deltas // 3, len(posts)
    gaps = [b - a for a, b in zip(sent_at, sent_at[1:], strict=False)][:-1]
    assert gaps and min(gaps) >= interval - 0.005, gaps
    assert fake_backend.streams[0].finished
    assert "summary: 1 jobs (1 ok, 0 faulted, 0 dropped)" in out.text()


def test_think_block_is_posted_as_reasoning_never_as_content(live_horde, fake_backend):
    # Qwen3 on a server without a reasoning parser: the <think> block arrives in the content deltas.
    fake_backend.chat_handler = reply("<think>Paris, so weather.</think>\n\nSunny.", reasoning=None)
    fake_backend.chunk_chars = 3  # tags cut across deltas
    with running_bridge(live_horde, fake_backend.url, progress_interval=0) as (_, _out):
        request_id = live_horde.chat(stream=True)
        message = live_horde.wait(request_id)["generations"][0]["message"]
    assert message["content"] == "Sunny." and message["reasoning_content"] == "Paris, so weather."
    posts = [fields for _, fields in stream_entries(request_id)]
    assert len(posts) > 3
    assert "".join(p["content"] for p in posts) == "Sunny."
    assert "".join(p.get("reasoning_content", "") for p in posts) == "Paris, so weather."
    assert not any("think" in p["content"] for p in posts)


def test_a_streamed_reply_is_stored_as_it_was_posted_around_a_lone_think_close(live_horde, fake_backend):
    # DeepSeek-R1 and QwQ templates open the block in the prompt: the output is reasoning, </think>,
    # then the answer (vLLM without --reasoning-parser, koboldcpp, TabbyAPI). The text before a lone
    # </think> was posted as content before the tag arrived; the front relays the posted content and
    # needs the stored reply to start with it (chat_front.md, "Relayed deltas"), so the submit keeps
    # the split the posts made (ADR 0022). Whole, the same reply is split (test_units).
    fake_backend.chat_handler = reply("Paris, so weather.\n</think>\n\nSunny.", reasoning=None)
    fake_backend.chunk_chars = 3
    with running_bridge(live_horde, fake_backend.url, progress_interval=0) as (_, _out):
        request_id = live_horde.chat(stream=True)
        status = live_horde.wait(request_id)
    message = status["generations"][0]["message"]
    posts = [fields for _, fields in stream_entries(request_id)]
    posted = "".join(p["content"] for p in posts)
    assert posted == message["content"] == "Paris, so weather.\n</think>\n\nSunny."
    assert message.get("reasoning_content") is None and not status["faulted"]


def test_tool_call_deltas_are_accumulated_into_the_submitted_call(live_horde, fake_backend):
    fake_backend.chunk_chars = 3
    with running_bridge(live_horde, fake_backend.url) as (_, _out):
        request_id = live_horde.chat(stream=True, tools=[WEATHER_TOOL], tool_choice="auto")
        generation = live_horde.wait(request_id)["generations"][0]
    assert fake_backend.chat_requests()[0]["stream"] is True
    assert generation["finish_reason"] == "tool_calls"
    assert generation["message"]["tool_calls"] == [
        {"id": "llama_call_0001", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    ]
    assert stream_entries(request_id) == []  # a reply of only a call has no text to post


def test_cancel_mid_stream_closes_the_backend_stream_and_submits_nothing(live_horde, fake_backend):
    fake_backend.chat_handler = reply("word " * 200, reasoning=None)
    fake_backend.chunk_chars, fake_backend.chunk_delay = 5, 0.02  # 200 deltas, about 4 s
    with running_bridge(live_horde, fake_backend.url, progress_interval=0.1) as (bridge, out):
        request_id = live_horde.chat(stream=True, max_tokens=512)
        deadline = time.monotonic() + 10
        while not stream_entries(request_id):
            assert time.monotonic() < deadline, out.text()
            time.sleep(0.05)
        cancelled = live_horde.client.delete(
            f"generate/chat/status/{request_id}", headers={"apikey": live_horde.requester_key}
        )
        assert cancelled.status_code == 200, cancelled.text
        assert fake_backend.stream_ended.wait(5), out.text()
        deadline = time.monotonic() + 5
        while bridge.stats.jobs < 1:
            assert time.monotonic() < deadline, out.text()
            time.sleep(0.05)
    record = fake_backend.streams[0]
    assert record.closed_early and not record.finished
    assert record.sent < record.total / 2, (record.sent, record.total)
    assert (bridge.stats.ok, bridge.stats.faulted, bridge.stats.dropped) == (0, 0, 1)
    assert "stopped generating: the request was cancelled" in out.text()
    generation = Generation.objects.get(request_id=request_id)
    # Settled by the cancel on what was posted; the bridge's submit never came.
    assert generation.state == Generation.State.CANCELLED and generation.settled_character_count > 0
    assert generation.message is None


def test_job_without_the_stream_hint_is_generated_whole_with_no_posts(live_horde, fake_backend):
    fake_backend.chat_handler = reply()
    with running_bridge(live_horde, fake_backend.url) as (_, _out):
        request_id = live_horde.chat()
        message = live_horde.wait(request_id)["generations"][0]["message"]
        text_id = live_horde.text()
        live_horde.wait(text_id, chat=False)
    assert message["content"] == CONTENT
    assert fake_backend.chat_requests()[0]["stream"] is False
    assert fake_backend.completion_requests()[0]["stream"] is False  # text jobs never stream
    assert fake_backend.streams == [] and stream_entries(request_id) == []


def test_progress_unavailable_is_retried_and_the_reply_is_still_submitted(live_horde, fake_backend, settings):
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = CLOSED_PORT  # the horde's progress store is down
    fake_backend.chat_handler = reply()
    fake_backend.chunk_chars, fake_backend.chunk_delay = 4, 0.01
    with running_bridge(live_horde, fake_backend.url, progress_interval=0.05) as (bridge, out):
        posts: list[dict] = []
        post_progress = bridge.horde.progress

        def counted_progress(body):
            posts.append(body)
            return post_progress(body)

        bridge.horde.progress = counted_progress
        request_id = live_horde.chat(stream=True)
        status = live_horde.wait(request_id)
    assert status["done"] and status["generations"][0]["message"]["content"] == CONTENT
    assert fake_backend.streams[0].finished  # generation went on to the end
    # The first post at once, then a retry a second at most (the reply streams for about 0.3 s),
    # and the flush's two tries: the same post each time.
    assert 2 <= len(posts) <= 4 and {p["seq"] for p in posts} == {1}, posts
    log = out.text()
    assert "progress posts stopped" not in log, log
    assert "summary: 1 jobs (1 ok, 0 faulted, 0 dropped)" in log


# --- the poster's answers, one post at a time against the live horde -------------------------------


@pytest.fixture
def streamed_job(live_horde, fake_backend):
    """A streamed chat job popped by a registered bridge: (bridge, request id, job id)."""
    bridge = Bridge(bridge_config(live_horde, fake_backend.url), OpenAIBackend(fake_backend.url), out=LogBuffer())
    bridge.start()
    assert not bridge.horde.pop(bridge.pop_body()).get("id")  # registers the worker and its model
    request_id = live_horde.chat(stream=True, max_tokens=16)
    job = bridge.horde.pop(bridge.pop_body())
    assert job["payload"]["stream_progress"] is True, job
    yield bridge, request_id, str(job["id"])
    bridge.horde.close()


def contents(request_id: str) -> list[tuple[str, str]]:
    return [(fields["seq"], fields["content"]) for _, fields in stream_entries(request_id)]


def test_out_of_sequence_post_is_sent_again_with_the_expected_seq(streamed_job):
    bridge, request_id, job_id = streamed_job
    status, body = bridge.horde.progress({"id": job_id, "seq": 1, "delta": {"content": "Hel"}})
    assert (status, body) == (200, {"accepted_seq": 1, "cancelled": False})
    poster = ProgressPoster(bridge.horde, job_id, max_length=16, interval=0)
    assert poster.delta("lo") is True  # seq 1 with other content: 409, expected_seq 2
    assert poster.accepted_seq == 2 and poster.posts == 2 and poster.posting
    assert contents(request_id) == [("1", "Hel"), ("2", "lo")]


def test_flush_posts_the_rest_after_a_post_whose_answer_was_lost(streamed_job):
    """A post the horde appended but whose answer was lost is sent again at the flush (answered as
    a retry), and what was read since is posted after it, not left to the submit."""
    bridge, request_id, job_id = streamed_job
    progress = bridge.horde.progress
    lost = [True]

    def answer_lost_once(body):
        answer = progress(body)
        if lost.pop() if lost else False:
            raise HordeUnavailable("read timed out")
        return answer

    bridge.horde.progress = answer_lost_once
    poster = ProgressPoster(bridge.horde, job_id, max_length=16, interval=60)
    assert poster.delta("Hel") is True  # the first delta at once: appended, its answer lost
    assert poster.delta("lo") is True  # inside the interval: buffered
    assert poster.flush() is True
    assert contents(request_id) == [("1", "Hel"), ("2", "lo")]
    assert poster.accepted_seq == 2 and poster.posting


def test_posts_resume_after_the_horde_s_redis_comes_back(streamed_job, settings):
    """503 ChatProgressUnavailable is an outage, usually short (the horde refuses Redis calls for
    5 s after a failure): the post is kept and sent again, at least a second apart, so the reader's
    text flows again, and a cancel meanwhile still reaches the worker. It stops only after
    PROGRESS_UNAVAILABLE_SECONDS without an answer."""
    bridge, request_id, job_id = streamed_job
    now = [0.0]
    poster = ProgressPoster(bridge.horde, job_id, max_length=16, interval=0.25, clock=lambda: now[0])
    assert poster.delta("Hel") is True and poster.accepted_seq == 1
    redis_url = settings.HORDE_CHAT_SIGNAL_REDIS_URL
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = CLOSED_PORT  # the horde's Redis is down
    now[0] = 0.5
    assert poster.delta("lo") is True and poster.posting and poster.accepted_seq == 1
    now[0] = 0.9
    assert poster.delta(",") is True and poster.posts == 2  # within the second: not sent again
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = redis_url  # back
    now[0] = 1.6
    assert poster.delta(" you") is True and poster.posts == 3
    assert poster.flush() is True
    assert contents(request_id) == [("1", "Hel"), ("2", "lo"), ("3", ", you")]
    # A longer outage stops the posts, not the generation.
    settings.HORDE_CHAT_SIGNAL_REDIS_URL = CLOSED_PORT
    now[0] = 2.0
    assert poster.delta("!") is True and poster.posting
    now[0] = 2.0 + PROGRESS_UNAVAILABLE_SECONDS + 1
    assert poster.delta("!") is True and not poster.posting


def test_job_aborted_stops_generating(streamed_job):
    bridge, _request_id, job_id = streamed_job
    bridge.horde.submit({"id": job_id, "state": "faulted", "model_id": bridge.horde_model})  # the lease ends
    poster = ProgressPoster(bridge.horde, job_id, max_length=16, interval=0)
    assert poster.delta("late") is False
    assert poster.stopped == "the horde aborted the job (ChatJobAborted)"
    assert poster.flush() is False and poster.posts == 1


def test_caps_stop_posting_but_not_generating(streamed_job):
    bridge, request_id, job_id = streamed_job
    # The worker's own byte cap (16 per max_length token): the second delta would pass it, unsent.
    capped = ProgressPoster(bridge.horde, job_id, max_length=1, interval=0)
    assert capped.delta("a" * 10) is True and capped.delta("b" * 10) is True
    assert not capped.posting and capped.posts == 1 and capped.flush() is True
    # A worker that counts more room than the lease has: the horde's 413 stops the posts.
    generous = ProgressPoster(bridge.horde, job_id, max_length=1000, interval=0)
    generous.accepted_seq, generous.accepted_bytes = 1, 10
    assert generous.delta("c" * 16 * 16) is True
    assert not generous.posting and generous.posts == 1 and generous.flush() is True
    assert contents(request_id) == [("1", "a" * 10)]


def test_a_streamed_job_outlives_its_lease_at_pop_while_its_posts_renew_it(live_horde, fake_backend, settings):
    """The bridge gives a job up a margin before its lease ends; a streamed job's appended posts
    renew that lease (150 s after each), so the bridge's deadline moves with them."""
    settings.HORDE_TEXT_JOB_LEASE_SECONDS = 3  # the pop's ttl: given up at 2 s without renewals
    fake_backend.chat_handler = reply()
    fake_backend.chunk_chars, fake_backend.chunk_delay = 2, 0.1  # ~50 deltas over about five seconds
    with running_bridge(live_horde, fake_backend.url, progress_interval=0.2, lease_margin=1.0) as (bridge, out):
        started = time.monotonic()
        request_id = live_horde.chat(stream=True)
        status = live_horde.wait(request_id)
    assert time.monotonic() - started > 3  # it did run past the lease it was popped with
    assert status["done"] and not status["faulted"], out.text()
    assert status["generations"][0]["message"]["content"] == CONTENT
    assert "gave the job up" not in out.text()
