"""The queue's signal names the lists that grew, and wakes only the held pops that take from them
(ADR 0051): through real Redis pub/sub, from queue_grew as the creation route and the requeue call it."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

import pytest

from chat.selectors.queue import WorkerView, request_queue_lists
from chat.services.pop_cache import queue_grew, view_list_tokens
from chat.services.pop_wait import QueueSignalListener, queue_growth, queue_signal_message, signalled_tokens
from contract.chat_declaration import parse_chat_declaration

pytestmark = pytest.mark.redis_only

MODEL = "Gryphe/MythoMax-L2-13b"
OTHER = "koboldcpp/LLaMA2-13B-Psyfighter2"


def _view(models: tuple[str, ...], **chat) -> WorkerView:
    """A worker's view; with a chat declaration, one that takes chat jobs only."""
    return WorkerView(
        id=None,
        models=models,
        max_length=512,
        max_context_length=4096,
        owner_trusted=False,
        validated=False,
        slow=False,
        accepts_prompt_jobs=not chat,
        chat=parse_chat_declaration(chat, models=list(models)) if chat else WorkerView.chat,
    )


async def _woken_after(listener: QueueSignalListener, grow, waiters: dict) -> set[str]:
    for waiter in waiters.values():
        waiter.event.clear()
    await asyncio.to_thread(grow)
    await asyncio.sleep(0.3)
    return {name for name, waiter in waiters.items() if waiter.event.is_set()}


def test_a_signal_wakes_the_pops_of_the_lists_that_grew_and_no_other(settings):
    async def scenario() -> None:
        listener = QueueSignalListener(settings.REDIS_URL)
        try:
            waiters = {
                "model": listener.register(frozenset(view_list_tokens(_view((MODEL,))))),
                "other": listener.register(frozenset(view_list_tokens(_view((OTHER,))))),
                "both": listener.register(frozenset(view_list_tokens(_view((MODEL, OTHER))))),
                "chat": listener.register(
                    frozenset(
                        view_list_tokens(
                            _view(
                                (MODEL,),
                                chat_jobs=True,
                                prompt_jobs=False,
                                model_id=MODEL,
                                chat_limits={"max_context_length": 4096, "max_length": 512},
                            )
                        )
                    )
                ),
                "unlisted": listener.register(None),  # a pop held without its lists: any signal
            }
            await listener.subscribed(timeout=5)

            def text(models):
                return lambda: queue_grew(request_queue_lists(is_chat=False, models=models))

            assert await _woken_after(listener, text([OTHER]), waiters) == {"other", "both", "unlisted"}
            assert await _woken_after(listener, text([MODEL]), waiters) == {"model", "both", "unlisted"}
            # A text request naming no model: every worker that takes prompt jobs.
            assert await _woken_after(listener, text([]), waiters) == {"model", "other", "both", "unlisted"}
            chat = lambda: queue_grew(request_queue_lists(is_chat=True, models=[MODEL]))  # noqa: E731
            assert await _woken_after(listener, chat, waiters) == {"chat", "unlisted"}
            assert await _woken_after(listener, queue_grew, waiters) == set(waiters)  # every list
        finally:
            await listener.close()

    asyncio.run(scenario())


def test_a_signal_that_names_no_list_wakes_every_pop():
    tokens = view_list_tokens(_view((MODEL, OTHER)))[1:]
    assert signalled_tokens(queue_signal_message(tokens)) == set(tokens)
    # "every list", an earlier release's payload, and anything else.
    for data in (queue_signal_message(("*",)), b"1", b"", b"a1,b2", tokens[0].encode() + b",*", None, 1):
        assert signalled_tokens(data) is None, data


def test_a_listener_is_listening_once_subscribed_and_not_while_it_cannot_reach_redis(settings):
    """While it is not listening, a held pop whose empty answer is remembered re-checks every
    HORDE_POP_WAIT_RECHECK_SECONDS instead of when the answer ages out (hordesite/wsgi_pool.py):
    no addition would wake it."""

    async def scenario() -> tuple[bool, bool, bool]:
        in_process = QueueSignalListener(None)  # without Redis: the in-process wake always listens
        live = QueueSignalListener(settings.REDIS_URL)
        unreachable = QueueSignalListener("redis://127.0.0.1:9/0")  # the discard port: refused
        try:
            await live.subscribed(timeout=5)
            await unreachable.subscribed(timeout=0.5)
            return in_process.listening, live.listening, unreachable.listening
        finally:
            await live.close()
            await unreachable.close()

    assert asyncio.run(scenario()) == (True, True, False)


async def _holding_proxy(redis_url: str, hold: bytes, seen: asyncio.Event, release: asyncio.Event):
    """A loopback TCP relay to Redis that holds any client bytes containing `hold` until `release`:
    a command sent but not yet taken by Redis, as on a slow network."""
    target = urlsplit(redis_url)

    async def pump(reader, writer, holding: bool) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if holding and hold in data:
                    seen.set()
                    await release.wait()
                writer.write(data)
                await writer.drain()
        writer.close()

    async def relay(client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection(target.hostname, target.port or 6379)
        await asyncio.gather(pump(client_reader, server_writer, True), pump(server_reader, client_writer, False))

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"redis://127.0.0.1:{port}{target.path}"


def test_a_subscription_counts_as_heard_only_once_redis_confirms_it(settings):
    """Until Redis has taken the SUBSCRIBE, a signal published meanwhile is not delivered: neither a
    held pop (listening) nor a remembered empty pop (queue_growth's version) may count on hearing it."""

    async def scenario() -> tuple[tuple, tuple]:
        seen, release = asyncio.Event(), asyncio.Event()
        server, url = await _holding_proxy(settings.REDIS_URL, b"SUBSCRIBE", seen, release)
        listener = QueueSignalListener(url)
        try:
            await asyncio.wait_for(seen.wait(), 5)
            await asyncio.sleep(0.2)  # the listener runs on after sending
            in_flight = (listener.listening, queue_growth.version((MODEL,)))
            release.set()
            await listener.subscribed(timeout=5)
            return in_flight, (listener.listening, queue_growth.version((MODEL,)) is not None)
        finally:
            await listener.close()
            server.close()

    in_flight, confirmed = asyncio.run(scenario())
    assert in_flight == (False, None)
    assert confirmed == (True, True)
