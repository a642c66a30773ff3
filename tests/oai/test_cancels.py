"""The front's cancels and their outcomes (spec: chat_front.md, Metrics, horde.oai.cancels):
acknowledged, already_gone on the horde's 404, timed_out when the answer does not come within
HORDE_OAI_CANCEL_TIMEOUT_SECONDS, not_started when no cancel slot frees up within it, failed
otherwise; a cancel that did not reach an answer is sent again every HORDE_OAI_CANCEL_RETRY_SECONDS
until one comes, for at most 20 minutes after the submit, and at most MAX_FAILED_CANCELS are held.

The horde is the live one; the network between the front and it is a proxy that forwards to it or
fails as a network does (no answer, a reset connection, a load balancer's 502, a slow answer)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from http.server import ThreadingHTTPServer

import httpx
import pytest

from tests.http_fakes import QuietHandler
from tests.oai.conftest import MODEL, HordeTestWorker, wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hello?"}]
HOP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


class FaultyNetwork(QuietHandler):
    """Forwards to the horde (mode forward), or: answers 502 as a load balancer whose upstream is
    down (bad_gateway), its own 404 page as a gateway without the route (not_found_page) or its JSON 404 (not_found_json), closes the connection without an answer (reset), sends a status line
    without a status code, as a broken middlebox might (garbled), answers after `delay`
    seconds (slow), or forwards and sends the answer's first line a byte at a time over `delay`
    seconds, each byte within any read timeout (dribble)."""

    target = ""
    mode = "forward"
    delay = 2.0
    seen: list[tuple[str, str]] = []

    def _handle(self) -> None:
        type(self).seen.append((self.command, self.path))
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        mode = type(self).mode
        if mode == "reset":
            self.close_connection = True
            return
        if mode == "garbled":
            self.wfile.write(b"HTTP/1.1 Gateway Timeout\r\n\r\n")
            self.close_connection = True
            return
        if mode == "bad_gateway":
            self._answer(502, b"<html>502 Bad Gateway</html>", {"Content-Type": "text/html"})
            return
        if mode == "not_found_page":
            self._answer(404, b"<html>404 Not Found</html>", {"Content-Type": "text/html"})
            return
        if mode == "not_found_json":  # Kong's answer for a route it does not hold
            self._answer(404, b'{"message":"no Route matched with those values"}', {"Content-Type": "application/json"})
            return
        if mode == "slow":
            time.sleep(type(self).delay)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        answer = httpx.request(
            self.command, self.target + self.path.removeprefix("/api/v2"), content=body, headers=headers, timeout=10
        )
        kept = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "retry-after")}
        self._answer(answer.status_code, answer.content, kept, dribble=mode == "dribble")

    def _answer(self, status: int, content: bytes, headers: dict[str, str], *, dribble: bool = False) -> None:
        head = f"HTTP/1.1 {status} Answer\r\n".encode()
        if dribble:
            pause = type(self).delay / len(head)
            for byte in head:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(pause)
        else:
            self.wfile.write(head)
        for name, value in {**headers, "Content-Length": str(len(content)), "Connection": "close"}.items():
            self.wfile.write(f"{name}: {value}\r\n".encode())
        self.wfile.write(b"\r\n" + content)
        self.close_connection = True

    do_GET = do_POST = do_DELETE = _handle  # noqa: N815


@pytest.fixture
def network(front, live_horde):
    """The front's native root is the faulty network in front of the live horde."""
    FaultyNetwork.target = f"{live_horde.url}/api/v2"
    FaultyNetwork.mode = "forward"
    FaultyNetwork.delay = 2.0
    FaultyNetwork.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FaultyNetwork)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    front.configure(native_roots=[f"http://127.0.0.1:{server.server_address[1]}/api/v2"], cancel_timeout_seconds=0.3)
    yield FaultyNetwork
    server.shutdown()
    server.server_close()


def _cancel(front, *request_ids: str) -> list[str]:
    """The front's cancels of these ids, at once."""
    from oai.state import get_front_state

    async def cancel() -> list[str]:
        state = await get_front_state()
        return list(await asyncio.gather(*(state.cancels.cancel_within_budget(i) for i in request_ids)))

    return front.live.run(cancel(), timeout=20)


def _outcomes(front) -> dict[str, int]:
    return {a["horde.outcome"]: v for a, v in front.metrics().get("horde.oai.cancels", [])}


def _deletes(network) -> list[str]:
    """The request ids of the cancels that reached the network, in order."""
    return [path.rsplit("/", 1)[1] for method, path in network.seen if method == "DELETE"]



def _requests():
    from chat.models import GenerationRequest

    return list(GenerationRequest.objects.filter(is_chat=True))


# --- outcomes -------------------------------------------------------------------------------------


def test_a_request_the_horde_no_longer_holds_is_already_gone_and_not_retried(front):
    """In process, as mounted: the horde answers 404 for an id it does not hold."""
    front.configure(cancel_retry_seconds=0.2)
    assert _cancel(front, str(uuid.uuid4())) == ["already_gone"]
    time.sleep(0.7)  # over three retry periods
    assert _outcomes(front) == {"already_gone": 1}


def test_an_answer_slower_than_the_cancel_timeout_is_timed_out(front, network):
    """The horde's answer takes 10 s over a 0.3 s cancel timeout (httpx says "timed out"): the cancel
    ends long before the answer would have come."""
    network.mode = "slow"
    network.delay = 10.0
    started = time.monotonic()
    assert _cancel(front, str(uuid.uuid4())) == ["timed_out"]
    assert time.monotonic() - started < network.delay / 2
    assert _outcomes(front) == {"timed_out": 1}


@pytest.mark.postgres_only
def test_an_in_process_cancel_held_past_its_timeout_is_timed_out(front, live_horde, worker_owner, requester):
    """In process, the horde's cancel waits on the request's row, which another transaction holds
    past the 0.3 s cancel timeout; the cancel sent again once the row is free is acknowledged."""
    from django.db import transaction

    from chat.models import GenerationRequest

    front.configure(cancel_timeout_seconds=0.3, cancel_retry_seconds=0.3)
    HordeTestWorker(live=live_horde, key=worker_owner.key).check_in()
    created = httpx.post(
        f"{live_horde.url}/api/v2/generate/chat/async",
        json={"models": [MODEL], "messages": USER},
        headers={"apikey": requester.key},
        timeout=10,
    )
    assert created.status_code == 202, created.text
    request_id = created.json()["id"]
    with transaction.atomic():
        GenerationRequest.objects.select_for_update().get(pk=request_id)
        started = time.monotonic()
        assert _cancel(front, request_id) == ["timed_out"]
        # One that ignored its timeout would wait on the row, held until it ends: to _cancel's 20 s.
        assert time.monotonic() - started < 10
    assert wait_for(lambda: _outcomes(front).get("acknowledged") == 1, 5), _outcomes(front)
    assert GenerationRequest.objects.get(pk=request_id).cancelled is True


@pytest.mark.parametrize("mode", ["bad_gateway", "reset", "garbled"])
def test_an_error_answer_or_a_dropped_connection_is_failed(front, network, mode):
    """None is a timeout: a 502, a connection closed without an answer, and an answer that cannot be
    parsed, whose error text ("illegal status line: ... Gateway Timeout") mentions a timeout."""
    network.mode = mode
    assert _cancel(front, str(uuid.uuid4())) == ["failed"]
    assert _outcomes(front) == {"failed": 1}


@pytest.mark.parametrize("page", ["not_found_page", "not_found_json"])
def test_a_gateways_404_page_is_failed_and_sent_again_not_already_gone(
    front, network, requester, live_horde, worker_owner, page
):
    """Only the horde's own 404 says the request is gone: a gateway's 404 page in its place is a
    failed cancel, sent again until the horde answers, not a request dropped from the retries while
    it stays queued."""
    from chat.models import GenerationRequest

    front.configure(native_roots=front.state().settings.native_roots, cancel_retry_seconds=0.3)
    HordeTestWorker(live=live_horde, key=worker_owner.key).check_in()
    submitted = httpx.post(
        f"{live_horde.url}/api/v2/generate/chat/async",
        json={"model": MODEL, "messages": USER},
        headers={"apikey": requester.key},
        timeout=10,
    )
    request_id = submitted.json()["id"]
    network.mode = page
    assert _cancel(front, request_id) == ["failed"]
    network.mode = "forward"
    assert wait_for(lambda: GenerationRequest.objects.get(pk=request_id).cancelled, 5)
    assert wait_for(lambda: _outcomes(front).get("acknowledged") == 1, 10), _outcomes(front)


def test_an_unreachable_horde_is_failed(front, live_horde):
    front.configure(native_roots=[f"http://127.0.0.1:{free_port()}/api/v2"])
    assert _cancel(front, str(uuid.uuid4())) == ["failed"]


def test_a_cancel_without_a_free_slot_is_not_started_then_sent_again(front, network):
    """One cancel slot, held by a cancel whose answer arrives a byte at a time over 3 s: the second
    cancel does not get the slot within the 1 s cancel timeout, is not sent, and is sent by the
    retries once the slot is free. (The timeout also bounds the wait for the first byte, which comes
    after the network's call to the horde: 0.3 s timed out on a loaded host.)"""
    front.configure(
        native_roots=front.state().settings.native_roots,
        cancel_timeout_seconds=1.0,
        cancel_max_connections=1,
        cancel_retry_seconds=1.0,  # the first retry after the slot is free, unless the host is slow
    )
    network.mode, network.delay = "dribble", 3.0
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    assert _cancel(front, first, second) == ["already_gone", "not_started"]
    assert _deletes(network) == [first]
    network.mode = "forward"
    assert wait_for(lambda: _outcomes(front).get("already_gone") == 2, 5), _outcomes(front)
    assert _deletes(network) == [first, second]
    outcomes = _outcomes(front)
    assert outcomes.pop("not_started") >= 1  # each attempt is counted
    assert outcomes == {"already_gone": 2}


# --- retries --------------------------------------------------------------------------------------


def test_a_failed_cancel_of_a_client_gone_is_sent_again_until_the_horde_answers(
    front, network, requester, live_horde, worker_owner
):
    """End to end: the client leaves while the network answers 502; each retry, every
    HORDE_OAI_CANCEL_RETRY_SECONDS, is counted; once the network forwards again the retry reaches
    the horde, which cancels the request, and the retries stop."""
    from tests.oai.test_front import _post_and_drop

    front.configure(
        native_roots=front.state().settings.native_roots, cancel_timeout_seconds=2.0, cancel_retry_seconds=0.4
    )
    HordeTestWorker(live=live_horde, key=worker_owner.key).check_in()
    thread = threading.Thread(
        target=_post_and_drop,
        args=(f"{front.live.v1}/chat/completions", requester.key, {"model": MODEL, "messages": USER}, 1.0),
    )
    thread.start()
    (request,) = wait_for(_requests, 5)
    network.mode = "bad_gateway"
    thread.join()
    assert wait_for(lambda: _outcomes(front).get("failed", 0) >= 3, 5), _outcomes(front)
    assert _requests()[0].cancelled is False
    network.mode = "forward"
    assert wait_for(lambda: _requests()[0].cancelled, 5)
    assert wait_for(lambda: _outcomes(front).get("acknowledged") == 1, 10), _outcomes(front)
    sent = len(_deletes(network))
    time.sleep(1.0)  # over two retry periods
    assert len(_deletes(network)) == sent
    assert set(_deletes(network)) == {str(request.id)}
    assert _outcomes(front)["failed"] == sent - 1


def test_a_cancel_is_dropped_from_the_retries_once_the_request_would_have_expired(front, network, monkeypatch):
    """The horde expires a request 20 minutes after its submit (HORDE_CHAT_REQUEST_EXPIRY_SECONDS,
    shortened here to 1 s): a cancel still failing then is not sent again."""
    from oai import cancels

    assert cancels.HORDE_CHAT_REQUEST_EXPIRY_SECONDS == 20 * 60
    monkeypatch.setattr(cancels, "HORDE_CHAT_REQUEST_EXPIRY_SECONDS", 1.0)
    front.configure(native_roots=front.state().settings.native_roots, cancel_retry_seconds=0.3)
    network.mode = "bad_gateway"
    request_id = str(uuid.uuid4())
    assert _cancel(front, request_id) == ["failed"]
    time.sleep(1.5)
    sent = len(_deletes(network))
    assert sent >= 3  # the first cancel and at least two retries within the second
    time.sleep(1.0)
    assert len(_deletes(network)) == sent
    assert _outcomes(front) == {"failed": sent}


def test_the_oldest_failed_cancels_are_dropped_over_the_cap(front, network, monkeypatch):
    """At most MAX_FAILED_CANCELS (10,000; 3 here) are held for the retries, oldest dropped first."""
    from oai import cancels

    assert cancels.MAX_FAILED_CANCELS == 10_000
    monkeypatch.setattr(cancels, "MAX_FAILED_CANCELS", 3)
    front.configure(native_roots=front.state().settings.native_roots, cancel_retry_seconds=1.0)
    network.mode = "bad_gateway"
    ids = [str(uuid.uuid4()) for _ in range(4)]
    for request_id in ids:  # one after another: the oldest is the first
        assert _cancel(front, request_id) == ["failed"]
    network.seen.clear()
    assert wait_for(lambda: len(_deletes(network)) >= 3, 10)
    time.sleep(0.2)
    assert _deletes(network)[:3] == ids[1:]
    assert ids[0] not in _deletes(network)


def test_a_defect_before_a_whole_answer_is_a_500_and_its_request_is_cancelled(front, client, start_worker, monkeypatch):
    """A fault injected in the front's own code after the submit (the first read raises): the client
    gets OpenAI's 500 shape, and the request it will never receive does not stay queued to be
    served and charged."""
    import openai

    from chat.models import GenerationRequest
    from oai.run import ChatRun

    start_worker(reply=lambda job: None)  # a worker is online; its jobs are never answered
    first_decision = ChatRun.first_decision

    async def defective(self):
        await first_decision(self)
        raise RuntimeError("a defect in the front")

    monkeypatch.setattr(ChatRun, "first_decision", defective)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["code"] == "InternalError" and caught.value.body["type"] == "api_error"
    assert "cancelled" in caught.value.body["message"]
    assert wait_for(lambda: [r.cancelled for r in GenerationRequest.objects.all()] == [True], 5)
