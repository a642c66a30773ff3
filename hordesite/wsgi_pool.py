"""Django's WSGI handler on a bounded pool of threads, under daphne's ASGI (docs/adr/0025).

Under ASGI, Django runs each sync view on a new thread per request (ThreadSensitiveContext) and
hops threads for its signals and its response: for the worker loop's routes about as much CPU as
the view itself. A WSGI server's thread runs one request start to end instead. This layer is that
server inside the ASGI application, for every path it is given (hordesite.asgi: all but the
front's /v1/):

- the body is read on the event loop (a slow client holds no thread), bounded by the route's body
  rule: past it 413 RequestTooLarge, from the declared length at once, a chunked body one byte past
  the bound (hordesite.body_limits);
- the PEP 3333 environ is built from the ASGI scope and the WSGI application runs on one of
  HORDE_WEB_THREADS threads, in that thread's own context as on a WSGI server (Django's per-context
  cache backends and connections are made once per thread, not once per request);
- a pop that asked to wait and found nothing (docs/adr/0024) answers with POP_WAIT_HEADER (and
  POP_LISTS_HEADER, its queue lists, and POP_RECHECK_HEADER: ADR 0051): the layer holds it here, on
  the event loop, until the queue's signal for one of those lists or the re-check, then runs the
  same request again, holding no thread while it waits.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import io
import json
import logging
import queue
import sys
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any

from django.conf import settings
from django.db import close_old_connections

from chat.services.pop import popped_jobs_give_back
from chat.services.pop_wait import (
    POP_LISTS_HEADER,
    POP_PATH,
    POP_RECHECK_HEADER,
    POP_REPEATED_ENVIRON,
    POP_WAIT_HEADER,
    queue_listener,
)
from hordesite.body_limits import body_limit, read_body, too_large_body
from hordesite.db_guard import run_wsgi_whole
from oai.asgi import cors_headers

log = logging.getLogger(__name__)

_INTERNAL_ERROR = json.dumps({"message": "Internal server error", "rc": "InternalError"}).encode()


class Answer:
    """A WSGI application's whole answer."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        return next((v for k, v in self.headers if k.lower() == lowered), None)

    def without(self, *names: str) -> list[tuple[str, str]]:
        lowered = {name.lower() for name in names}
        return [(k, v) for k, v in self.headers if k.lower() not in lowered]


# In a pop's environ: whether its worker has left (the layer's watch of the connection).
CLIENT_GONE = "horde.client_gone"
# The answer of a pop not run because its worker left while it waited for a thread (never sent).
_NOT_RUN = 499


def run_wsgi(app: Any, environ: dict[str, Any]) -> Answer:
    """One WSGI call start to end (its iterable read and closed: Django's request_finished)."""
    gone = environ.get(CLIENT_GONE)
    if gone is not None and gone():
        return Answer(_NOT_RUN, [], b"")  # its worker left while it waited for a thread
    status, headers, _exc_info, body = run_wsgi_whole(app, environ)
    return Answer(int(status.split(" ", 1)[0]), list(headers), body)


def wsgi_environ(scope: dict[str, Any], body: Any, length: int) -> dict[str, Any]:
    """PEP 3333's environ for an ASGI HTTP scope whose body was read whole (`length` bytes)."""
    server = scope.get("server") or ("localhost", 80)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": scope.get("root_path", "").encode("utf-8").decode("latin-1"),
        "PATH_INFO": scope["path"].encode("utf-8").decode("latin-1"),
        "QUERY_STRING": scope.get("query_string", b"").decode("latin-1"),
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1] if server[1] is not None else 80),
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": body,
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    client = scope.get("client")
    if client:
        environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = client[0], str(client[1])
    for raw_name, raw_value in scope.get("headers") or ():
        name = raw_name.decode("latin-1").upper().replace("-", "_")
        if name in ("CONTENT_LENGTH", "CONTENT_TYPE"):
            key = name
        else:
            key = f"HTTP_{name}"
        value = raw_value.decode("latin-1")
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    # The body was read whole: its length is known even when it came chunked.
    if length or "CONTENT_LENGTH" in environ:
        environ["CONTENT_LENGTH"] = str(length)
    return environ


class WebThreads:
    """`count` threads that run calls one after another, each in its own context (as a WSGI server's
    threads), started on the first call. A call's result comes back to its event loop with one
    call_soon_threadsafe: run_in_executor chains a concurrent future to an asyncio one and copies
    its state across, about twice the CPU per request for the hop alone."""

    def __init__(self, count: int, *, name: str = "web"):
        self.count = count
        self.name = name
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def run(self, fn: Any, *args: Any) -> asyncio.Future:
        """`fn(*args)` on one of the threads; the future is the running loop's."""
        if not self._threads:
            self._start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((loop, future, fn, args))
        return future

    def _start(self) -> None:
        with self._lock:
            if self._threads:
                return
            self._threads = [
                threading.Thread(target=self._work, name=f"{self.name}_{i}", daemon=True) for i in range(self.count)
            ]
            for thread in self._threads:
                thread.start()
            # At exit the calls already queued finish first, as ThreadPoolExecutor's threads did:
            # daemon threads still run while atexit's handlers do.
            atexit.register(self.close)

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            loop, future, fn, args = call
            outcome: tuple[Any, BaseException | None]
            try:
                outcome = (fn(*args), None)
            except BaseException as error:  # handed to the awaiting request, as run_in_executor does
                outcome = (None, error)
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits for this answer
                loop.call_soon_threadsafe(_settle, future, *outcome)
            del call, loop, future, outcome  # hold nothing of the request while idle

    def close(self) -> None:
        """Every thread ends after the calls queued before this one (each one's last request done)."""
        with self._lock:
            threads, self._threads = self._threads, []
        atexit.unregister(self.close)
        for _ in threads:
            self._calls.put(None)
        for thread in threads:
            thread.join()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class PooledWSGI:
    """ASGI: `app` (a WSGI application) for every HTTP request, on a bounded pool of threads."""

    def __init__(self, app: Any, *, threads: int | None = None, subscribe_queue_signal: bool = False):
        self.app = app
        self.threads = threads or settings.HORDE_WEB_THREADS
        # The web process's layer subscribes with its first pop (its event loop lives as long as the
        # process); a layer driven by short-lived loops (asyncio.run in tests) leaves it to held pops.
        self.subscribe_queue_signal = subscribe_queue_signal
        self.pool = WebThreads(self.threads)
        self._giving_back: set[asyncio.Task] = set()
        # The requests being served (their ASGI tasks) and the held pops' waiters, for the drain.
        self._requests: set[asyncio.Task] = set()
        self._held: set[Any] = set()
        self._draining = False
        _LAYERS.add(self)

    def close(self) -> None:
        self.pool.close()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"PooledWSGI serves HTTP, not {scope['type']!r}")
        task = asyncio.current_task()
        if task is None:
            return await self._call(scope, receive, send)
        self._requests.add(task)
        try:
            return await self._call(scope, receive, send)
        finally:
            self._requests.discard(task)

    async def drain(self, deadline: float) -> None:
        """Until `deadline` (monotonic), let the requests being served end with their answers sent;
        a held pop ends its wait at once with its last (empty) answer, and a pop that arrives now is
        not held. What is still running at the deadline is left to the server's cancel."""
        self._draining = True
        for waiter in list(self._held):
            waiter.event.set()
        while self._requests and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(set(self._requests), timeout=left)

    async def _call(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        method, path = scope["method"], scope["path"]
        limit = body_limit(method, path)
        if limit is None:
            return await self._serve_spooled(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            return await _send_answer(send, _too_large(limit))
        buffered = await read_body(receive, limit)
        if buffered is None:
            return  # the client went away
        if buffered.over_limit:
            return await _send_answer(send, _too_large(limit))
        body = buffered.content
        if method == "POST" and path == POP_PATH:
            return await self._serve_pop(scope, body, receive, send)
        await _send_answer(send, await self._serve(wsgi_environ(scope, io.BytesIO(body), len(body))))

    async def _serve_pop(self, scope: dict[str, Any], body: bytes, receive: Any, send: Any) -> None:
        """A pop, watched for its worker leaving (the connection closed: http.disconnect). A pop
        whose worker left before a thread took it is not run; one that handed out jobs after its
        worker left gives them back to the queue at once (chat.services.pop.popped_jobs_give_back),
        since nobody will ever read its answer, rather than when their leases lapse. An empty pop
        that asked to wait is held (docs/adr/0024)."""
        arrived = time.monotonic()
        if self.subscribe_queue_signal:
            # Started with the first pop: its subscription to the queue's signal is what lets an
            # empty pop be answered from memory without a Redis round trip (docs/adr/0057).
            queue_listener()
        gone = asyncio.ensure_future(receive())  # the body was read whole: the next message is the end
        answer: Answer | None  # None: the worker left while its pop was held (_hold)
        try:
            answer = await self._pop(scope, body, gone)
            held = answer.header(POP_WAIT_HEADER)
            if held is not None:
                lists = answer.header(POP_LISTS_HEADER)
                answer.headers = answer.without(*_HOLD_HEADERS)  # never sent to a client
                if answer.status == 200:
                    tokens = None if lists is None else frozenset(filter(None, lists.split(",")))
                    answer = await self._hold(scope, body, gone, arrived + float(held), tokens)
            if answer is None:
                return  # nothing to send or give back
            if not gone.done():
                await _send_answer(send, answer)
            else:
                await self._give_back(answer)
        finally:
            gone.cancel()

    async def _pop(self, scope: dict[str, Any], body: bytes, gone: asyncio.Future, *, repeated: bool = False) -> Answer:
        """One run of the pop (`repeated`: a held pop's run after its first). daphne cancels the
        request of a client gone for a while (application_close_timeout) while its pop may still
        run, say behind a lock: that pop runs to its end, and its jobs go back."""
        environ = wsgi_environ(scope, io.BytesIO(body), len(body))
        environ[CLIENT_GONE] = gone.done  # read from the serving thread: one attribute, no lock needed
        if repeated:
            environ[POP_REPEATED_ENVIRON] = True
        return await self._serve(environ, if_cancelled=self._give_back_when_run)

    def _give_back_when_run(self, served: asyncio.Future) -> None:
        if served.cancelled() or served.exception() is not None:
            return
        task = asyncio.ensure_future(self._give_back(served.result()))
        self._giving_back.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._giving_back.discard)

    async def _give_back(self, answer: Answer) -> None:
        """The jobs of a pop answer nobody will read, back to the queue."""
        generation_ids = _popped_ids(answer)
        if not generation_ids:
            return
        try:
            given_back = await self.pool.run(_give_back_jobs, generation_ids)
        except Exception:
            log.exception("jobs %s of a pop whose worker left were not given back; their leases will", generation_ids)
        else:
            log.info("gave back %d job(s) of a pop whose worker left before its answer", given_back)

    async def _serve_spooled(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Outside the native API's body rule (GET, the admin, the schema, /healthz): a body past
        Django's in-memory bound is spooled to disk, as Django's ASGI handler does, up to
        Django's DATA_UPLOAD_MAX_MEMORY_SIZE (the admin takes no uploads); past that the answer is 413 and
        no more is read (docs/adr/0069: Twisted has stored what came before it)."""
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            return await _send_answer(send, _too_large(limit))
        message = await receive()
        if message["type"] != "http.request":
            return  # the client went away
        first = message.get("body", b"")
        if not message.get("more_body", False):
            answer = await self._serve(wsgi_environ(scope, io.BytesIO(first), len(first)))
            return await _send_answer(send, answer)
        with tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE) as spooled:
            spooled.write(first)
            length = len(first)
            while message.get("more_body", False):
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                chunk = message.get("body", b"")
                length += len(chunk)
                if length > limit:
                    return await _send_answer(send, _too_large(limit))
                spooled.write(chunk)
            spooled.seek(0)
            answer = await self._serve(wsgi_environ(scope, spooled, length))
        await _send_answer(send, answer)

    async def _serve(self, environ: dict[str, Any], *, if_cancelled: Any = None) -> Answer:
        """The WSGI call's answer; with `if_cancelled`, a cancel of the awaiting request leaves the
        call running, and `if_cancelled` gets its future once it is done."""
        # The pool thread runs the call in its own context (no copy of the loop's), as a WSGI
        # server's thread runs one request after another.
        served = self.pool.run(run_wsgi, self.app, environ)
        try:
            return await (served if if_cancelled is None else asyncio.shield(served))
        except asyncio.CancelledError:
            if if_cancelled is not None:
                served.add_done_callback(if_cancelled)
            raise
        except Exception:
            log.exception("%s %s failed", environ["REQUEST_METHOD"], environ["PATH_INFO"])
            return Answer(500, [("Content-Type", "application/json"), *cors_headers()], _INTERNAL_ERROR)

    async def _hold(
        self, scope: dict[str, Any], body: bytes, gone: asyncio.Future, until: float, tokens: frozenset[str] | None
    ) -> Answer | None:
        """An empty pop that asked to wait (docs/adr/0024): until `until`, wait on the event loop for
        the queue's signal of one of its lists (`tokens`; None: any) or the re-check (the seconds
        the last answer's POP_RECHECK_HEADER gives, else HORDE_POP_WAIT_RECHECK_SECONDS) and pop
        again (same body), holding no thread meanwhile.
        The first pop again comes at once, after registering for the signal: an addition committed
        after the first pop read the queue is seen by it or wakes the wait. The answer of the last
        pop; None when the worker left (`gone`) while it waited."""
        listener = queue_listener()
        waiter = listener.register(tokens)
        self._held.add(waiter)
        try:
            await listener.subscribed(timeout=0.5)
            while True:
                waiter.event.clear()
                answer = await self._pop(scope, body, gone, repeated=True)
                still_held = answer.header(POP_WAIT_HEADER) is not None
                # The long re-check of a remembered answer counts on the signal for its lists'
                # growth: while the listener is not subscribed, the short one stands in for it.
                recheck = _seconds(answer.header(POP_RECHECK_HEADER)) if listener.listening else None
                answer.headers = answer.without(*_HOLD_HEADERS)
                left = until - time.monotonic()
                if answer.status != 200 or not still_held or left <= 0 or gone.done() or self._draining:
                    return answer
                woken = asyncio.ensure_future(waiter.wait(min(recheck or settings.HORDE_POP_WAIT_RECHECK_SECONDS, left)))
                await asyncio.wait((woken, gone), return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                if gone.done():
                    return None
                if self._draining:  # the process is stopping: the empty answer now, not a dropped connection
                    return answer
        finally:
            self._held.discard(waiter)
            listener.unregister(waiter)


_HOLD_HEADERS = (POP_WAIT_HEADER, POP_LISTS_HEADER, POP_RECHECK_HEADER)

# Every serving layer of the process, for the drain at a stop.
_LAYERS: weakref.WeakSet[PooledWSGI] = weakref.WeakSet()


async def drain_layers(seconds: float) -> None:
    """Drain every serving layer of the process for at most `seconds` (PooledWSGI.drain)."""
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(layer.drain(deadline) for layer in list(_LAYERS)))


def _popped_ids(answer: Answer) -> list[uuid.UUID]:
    """The generation ids a pop's answer hands out (none for an empty pop, an error, a pop not run)."""
    if answer.status != 200:
        return []
    try:
        job = json.loads(answer.body)
    except ValueError:
        return []
    ids = job.get("ids") if isinstance(job, dict) else None
    try:
        return [uuid.UUID(str(generation_id)) for generation_id in ids] if isinstance(ids, list) else []
    except ValueError:
        return []


def _give_back_jobs(generation_ids: list[uuid.UUID]) -> int:
    """On a serving thread, outside any request: the service, then the thread's connection back
    to the pool, as at a request's end."""
    try:
        return popped_jobs_give_back(generation_ids=generation_ids)
    finally:
        close_old_connections()


def _seconds(value: str | None) -> float | None:
    """A hold header's seconds; None when absent or not a positive number."""
    try:
        seconds = float(value or "")
    except ValueError:
        return None
    return seconds if seconds > 0 else None


def _too_large(limit: int) -> Answer:
    return Answer(413, [("Content-Type", "application/json"), *cors_headers()], too_large_body(limit))


async def _send_answer(send: Any, answer: Answer) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers]
    if not any(k.lower() == "content-length" for k, _ in answer.headers):
        headers.append((b"Content-Length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})

