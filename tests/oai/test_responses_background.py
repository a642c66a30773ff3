"""Background responses (`background: true`, docs/adr/0102-responses-background.md) against the live
horde and its mounted front, read with the real openai SDK: answered at once `queued`, read by GET
while the horde works (`queued`, `in_progress`), then finished as the whole reply would have been;
cancelled before a worker pops it (nothing charged) or while one holds it (settled as the native
cancel); a faulted job is `failed`; what another key and `store: false` get. Their streams:
tests/oai/test_responses_background_stream.py."""

from __future__ import annotations

import contextlib
import threading
import time
from decimal import Decimal
from http.server import ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from tests.oai.conftest import MODEL, HordeTestWorker, text_reply, wait_for
from tests.oai.test_front import _GatewayNotFoundProxy

pytestmark = pytest.mark.slow

COLOUR_FORMAT = {
    "type": "json_schema",
    "name": "colour",
    "strict": True,
    "schema": {
        "type": "object",
        "properties": {"shade": {"type": "string"}},
        "required": ["shade"],
        "additionalProperties": False,
    },
}


def _requests():
    from chat.models import GenerationRequest

    return list(GenerationRequest.objects.filter(is_chat=True))


def _charges() -> int:
    from accounts.models import KudosTransaction

    return KudosTransaction.objects.filter(kind=KudosTransaction.Kind.GENERATION_CHARGE).count()


def _raw(front, key: str, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(
        method, f"{front.live.v1}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def _typed(body: dict[str, Any]) -> Response:
    """The body read by the SDK's own type, validated (the SDK itself builds without validating)."""
    return Response.model_validate(body)


def _idle_worker(live_horde, worker_owner, **kwargs: Any) -> HordeTestWorker:
    """A chat worker that checked in (the model is served) and pops nothing until started."""
    worker = HordeTestWorker(live=live_horde, key=worker_owner.key, **kwargs)
    worker.check_in()
    return worker


def _kept_finished(front, key: str, response_id: str) -> bool:
    """Whether the front keeps the response's finished record (a read or its watcher kept it)."""
    from oai.responses.background import pending

    record = front.live.run(front.state().response_items.record(key, response_id))
    return record is not None and not pending(record)


def _poll(client, response_id: str, until: tuple[str, ...], seconds: float = 15) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in until or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_a_background_response_is_queued_then_reads_as_the_whole_reply(
    front, client, requester, live_horde, worker_owner, workers
):
    worker = _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hello?", instructions="Be brief.", background=True)
    assert (created.status, created.background, created.output, created.usage) == ("queued", True, [], None)
    assert created.id.startswith("resp_") and created.instructions == "Be brief." and created.store is True
    raw = _raw(front, requester.key, "GET", f"/responses/{created.id}")
    assert raw.status_code == 200 and raw.json()["status"] == "queued"
    _typed(raw.json())
    (row,) = _requests()
    assert row.front_lease_expires_at is None  # no client waits on it: never cancelled for want of one

    workers.append(worker.start())
    done = _poll(client, created.id, ("completed",))
    assert done.status == "completed" and done.output_text == "Hello from the horde."
    assert done.usage.output_tokens > 0 and done.background is True
    body = _raw(front, requester.key, "GET", f"/responses/{created.id}").json()
    _typed(body)

    # The same request, not in background: the same reply but for its id, time and `background`.
    whole = _raw(
        front, requester.key, "POST", "/responses", {"model": MODEL, "input": "Hello?", "instructions": "Be brief."}
    ).json()

    def same_part(response: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in response.items() if k not in ("id", "created_at", "background", "output")}

    assert same_part(body) == same_part(whole)
    assert (body["background"], whole["background"]) == (True, False)
    assert [item | {"id": ""} for item in body["output"]] == [item | {"id": ""} for item in whole["output"]]
    assert body["output"][0]["id"] == "msg_" + body["id"][len("resp_") :]

    # Finished, it is kept as any response: continued, and its message referred to.
    second = client.responses.create(model=MODEL, input="Go on.", previous_response_id=created.id)
    assert second.status == "completed"
    messages = worker.jobs[-1]["payload"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "Hello from the horde."
    reference = {"type": "item_reference", "id": done.output[0].id}
    client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "Hello?"}, reference, {"role": "user", "content": "And?"}]
    )
    assert worker.jobs[-1]["payload"]["messages"][1]["content"] == "Hello from the horde."


def test_a_response_a_worker_is_generating_is_in_progress(client, live_horde, worker_owner, workers):
    release = threading.Event()

    def reply(job: dict[str, Any]) -> dict[str, Any]:
        release.wait(20)
        return text_reply("Done.")(job)

    worker = _idle_worker(live_horde, worker_owner, reply=reply)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    workers.append(worker.start())
    assert wait_for(lambda: worker.jobs, 10)
    assert _poll(client, created.id, ("in_progress",)).status == "in_progress"
    release.set()
    done = _poll(client, created.id, ("completed",))
    assert done.output_text == "Done."


def test_an_unfinished_background_response_is_not_continued(client, live_horde, worker_owner):
    _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=created.id)
    assert caught.value.body["code"] == "previous_response_in_progress"
    assert caught.value.body["param"] == "previous_response_id"


def test_a_background_response_may_continue_a_previous_one(client, start_worker):
    worker = start_worker()
    first = client.responses.create(model=MODEL, input="Hello?")
    created = client.responses.create(model=MODEL, input="Again?", previous_response_id=first.id, background=True)
    assert created.previous_response_id == first.id
    assert _poll(client, created.id, ("completed",)).status == "completed"
    roles = [m["role"] for m in worker.jobs[-1]["payload"]["messages"]]
    assert roles == ["user", "assistant", "user"]


def test_cancel_before_a_worker_pops_it_charges_nothing(front, client, requester, live_horde, worker_owner, workers):
    from chat.models import Generation
    from chat.services.admission import HORDE_TAX

    kudos = requester.refresh().kudos
    worker = _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    cancelled = client.responses.cancel(created.id)
    assert (cancelled.id, cancelled.status, cancelled.output, cancelled.background) == (created.id, "cancelled", [], True)
    (row,) = _requests()
    assert row.cancelled and row.jobs_waiting == 0 and row.kudos_held == 0
    workers.append(worker.start())
    time.sleep(0.5)
    assert worker.jobs == [] and not Generation.objects.exists()
    user = requester.refresh()
    assert (user.kudos, user.kudos_held) == (kudos - HORDE_TAX, Decimal("0"))
    assert _charges() == 0
    assert client.responses.retrieve(created.id).status == "cancelled"
    assert client.responses.cancel(created.id).status == "cancelled"  # as it is, once finished
    _typed(_raw(front, requester.key, "POST", f"/responses/{created.id}/cancel").json())


def test_cancel_while_a_worker_holds_it_settles_as_the_native_cancel(client, live_horde, worker_owner, workers):
    release = threading.Event()

    def reply(job: dict[str, Any]) -> dict[str, Any]:
        release.wait(20)
        return text_reply("Late.")(job)

    worker = _idle_worker(live_horde, worker_owner, reply=reply)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    workers.append(worker.start())
    assert wait_for(lambda: worker.jobs, 10)
    assert client.responses.cancel(created.id).status == "cancelled"
    (row,) = _requests()
    assert row.cancelled
    release.set()
    # The native cancel's rule: a job handed out before the cancel still submits, and is paid.
    assert wait_for(lambda: worker.submits, 10)
    assert worker.submits[0].status_code == 200
    assert wait_for(lambda: _charges() == 1, 5)
    time.sleep(0.3)
    assert client.responses.retrieve(created.id).status == "cancelled"


def test_a_faulted_request_is_failed_with_its_error(front, client, requester, start_worker):
    start_worker(reply=lambda job: {"message": {"role": "assistant", "content": "not json"}, "finish_reason": "stop"})
    created = client.responses.create(model=MODEL, input="Colour?", text={"format": COLOUR_FORMAT}, background=True)
    failed = _poll(client, created.id, ("failed",))
    assert failed.status == "failed" and failed.output == []
    assert failed.error is not None and failed.error.code == "server_error" and failed.error.message
    _typed(_raw(front, requester.key, "GET", f"/responses/{created.id}").json())


def test_a_request_the_horde_deleted_unread_is_kept_by_the_front_that_sent_it(front, client, requester, start_worker):
    """The submitting process watches its background requests: a reply read after the horde deleted
    its request (past its time to live) is still there."""
    from chat.models import GenerationRequest

    start_worker()
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    assert wait_for(lambda: _charges() == 1, 10)
    # The watcher keeps it at its read after the completion signal, which a loaded box can delay.
    assert wait_for(lambda: _kept_finished(front, requester.key, created.id), 10)
    GenerationRequest.objects.all().delete()
    done = client.responses.retrieve(created.id)
    assert done.status == "completed" and done.output_text == "Hello from the horde."


@pytest.mark.redis_only
def test_a_new_front_state_reads_a_background_response_from_redis(front, client, live_horde, worker_owner, workers):
    """What a restarted front process knows of a background response is what Redis holds."""
    worker = _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    front.configure()  # a new front state: the old one's watcher is gone
    assert client.responses.retrieve(created.id).status == "queued"
    workers.append(worker.start())
    assert _poll(client, created.id, ("completed",)).output_text == "Hello from the horde."


@pytest.mark.redis_only
def test_a_background_record_redis_lost_is_kept_again_by_the_front_that_sent_it(
    front, client, requester, redis_url, live_horde, worker_owner, workers
):
    """Redis restarted without its data (no persistence) while a background request waits: the
    submitting process's watcher keeps its record again, so its reply is read, not run and charged
    for a client that can no longer find it (the drills' Redis fault, docs/reliability.md)."""
    import redis

    worker = _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    redis.Redis.from_url(redis_url).flushdb()  # what a Redis restarted without persistence holds

    def status() -> str:
        raw = _raw(front, requester.key, "GET", f"/responses/{created.id}")
        return raw.json()["status"] if raw.status_code == 200 else str(raw.status_code)

    assert wait_for(lambda: status() == "queued", 5), status()
    workers.append(worker.start())
    done = _poll(client, created.id, ("completed",))
    assert done.status == "completed" and done.output_text == "Hello from the horde."


def test_a_background_create_while_redis_is_down_submits_nothing(front, requester, live_horde, worker_owner, workers):
    """Its record could not be kept, so nobody could read the reply: 503 ResponseItemsUnavailable,
    and no request queued that a worker could pop and its requester pay for (the drills' hung Redis
    found one popped while the record's write timed out, then paid at the front's cancel)."""
    from accounts.models import KudosTransaction

    _idle_worker(live_horde, worker_owner)
    kudos = requester.refresh().kudos
    front.configure(redis_url="redis://127.0.0.1:1/0")  # nothing listens there: Redis down
    answer = _raw(front, requester.key, "POST", "/responses", {"model": MODEL, "input": "Hi", "background": True})
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "ResponseItemsUnavailable"
    assert _requests() == []
    assert requester.refresh().kudos == kudos
    assert not KudosTransaction.objects.filter(user_id=requester.user.pk).exclude(kind="grant").exists()


@pytest.mark.redis_only
def test_a_deleted_background_response_is_not_kept_again(front, client, requester, live_horde, worker_owner, workers):
    """A record a DELETE forgot is not one Redis lost: the watcher does not bring it back, even when
    the job a worker held is paid after the cancel."""
    worker = _idle_worker(live_horde, worker_owner, delay=1.0)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    workers.append(worker.start())
    assert wait_for(lambda: client.responses.retrieve(created.id).status == "in_progress", 10)
    client.responses.delete(created.id)
    assert wait_for(lambda: _charges() == 1, 10)
    time.sleep(1.5)  # past the watcher's next reads (signal_recheck_seconds 0.5 in these tests)
    assert _raw(front, requester.key, "GET", f"/responses/{created.id}").status_code == 404


def test_a_request_nobody_reads_is_not_cancelled_by_the_front_lease(front, client, live_horde, worker_owner, workers):
    from chat.services.front_lease import cancel_lapsed_front_leases

    front.configure(front_lease_seconds=1)
    worker = _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    time.sleep(1.5)  # a lease taken with the submit would have lapsed
    assert cancel_lapsed_front_leases() == 0
    (row,) = _requests()
    assert not row.cancelled
    workers.append(worker.start())
    assert _poll(client, created.id, ("completed",)).status == "completed"


# --- refusals ----------------------------------------------------------------------------------------


def test_background_with_store_false_is_refused(client, start_worker):
    start_worker()
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", background=True, store=False)
    assert caught.value.body["param"] == "store"
    assert _requests() == []


def test_another_keys_read_and_cancel_are_not_found(front, client, requester, make_user, live_horde, worker_owner):
    _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    other = make_user("other-reader", kudos=100)
    for method, path in (("GET", f"/responses/{created.id}"), ("POST", f"/responses/{created.id}/cancel")):
        answer = _raw(front, other.key, method, path)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["message"].startswith(f"Response with id '{created.id}' not found.")
    (row,) = _requests()
    assert not row.cancelled
    unknown = _raw(front, requester.key, "GET", "/responses/resp_0123")
    assert unknown.status_code == 404


def test_cancelling_a_response_not_made_in_background_is_refused(client, start_worker):
    start_worker()
    whole = client.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(whole.id)
    assert caught.value.body["message"] == "Only responses created with background=true can be cancelled."


def test_deleting_an_unfinished_background_response_cancels_its_request(
    client, requester, live_horde, worker_owner, workers
):
    from chat.services.admission import HORDE_TAX

    kudos = requester.refresh().kudos
    worker = _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    assert [item.content[0].text for item in client.responses.input_items.list(created.id).data] == ["Hi"]
    client.responses.delete(created.id)
    (row,) = _requests()
    assert row.cancelled
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    workers.append(worker.start())
    time.sleep(0.5)
    assert worker.jobs == [] and _charges() == 0
    assert requester.refresh().kudos == kudos - HORDE_TAX


class _LateCancelGateway(_GatewayNotFoundProxy):
    """A gateway in front of the horde that passes everything on (it serves no 404 page of its own),
    but holds a cancel until the request's worker has submitted its reply: the reply finishes while
    the cancel is on its way."""

    pages = 0
    before_cancel: Any = None

    def _forward(self) -> None:
        if self.command == "DELETE":
            type(self).before_cancel()
        super()._forward()

    do_GET = do_POST = do_DELETE = _forward  # noqa: N815


@pytest.mark.parametrize("kept_first", [True, False], ids=["kept", "not_yet_kept"])
def test_a_reply_finished_while_the_cancel_was_on_its_way_is_answered_as_it_finished(
    front, client, live_horde, worker_owner, workers, kept_first
):
    """The cancel read the response in progress, but its worker's reply was submitted (and paid)
    before the cancel reached the horde: the cancel answers the response as it finished, as for one
    finished before the cancel, and does not overwrite it with `cancelled`. Kept: the watcher kept
    the reply before the cancel's answer. Not yet kept: nothing had (the watcher reads every 30 s),
    and the cancel changed nothing on the horde, the request being done and paid (found by the
    drills: a background cancel 0-3 s after the create meets the worker's submit)."""
    release = threading.Event()

    def reply(job: dict[str, Any]) -> dict[str, Any]:
        release.wait(20)
        return text_reply("Finished first.")(job)

    worker = _idle_worker(live_horde, worker_owner, reply=reply)

    def before_cancel() -> None:
        release.set()
        wait_for(lambda: worker.submits, 5)
        if kept_first:  # the watcher's read after the completion signal, which a loaded box can delay
            wait_for(lambda: _kept_finished(front, client.api_key, created.id), 10)

    _LateCancelGateway.target = f"{live_horde.url}/api/v2"
    _LateCancelGateway.before_cancel = before_cancel
    gateway = ThreadingHTTPServer(("127.0.0.1", 0), _LateCancelGateway)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    try:
        native_roots = [f"http://127.0.0.1:{gateway.server_address[1]}/api/v2"]
        if kept_first:
            front.configure(native_roots=native_roots, cancel_timeout_seconds=5)
        else:
            front.configure(native_roots=native_roots, cancel_timeout_seconds=5,
                            redis_url=None, poll_seconds=30, signal_recheck_seconds=30)
        created = client.responses.create(model=MODEL, input="Hi", background=True)
        workers.append(worker.start())
        assert wait_for(lambda: worker.jobs, 10)
        answered = client.responses.cancel(created.id)
        assert worker.submits[0].status_code == 200 and wait_for(lambda: _charges() == 1, 5)
        assert (answered.status, answered.output_text) == ("completed", "Finished first.")
        assert client.responses.retrieve(created.id).output_text == "Finished first."
    finally:
        gateway.shutdown()


def test_a_front_without_redis_cancels_its_background_requests_when_it_stops(
    front, client, live_horde, worker_owner, workers
):
    """Without Redis a background response's record lives in the process that kept it: once that
    process stops nobody can read its reply, so its request is cancelled, not left to a worker to
    serve and its requester to pay for a reply no GET can return."""
    front.configure(redis_url=None)
    worker = _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    front.configure(redis_url=None)  # the process stops (its state shuts down); a new one starts
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    (row,) = _requests()
    assert row.cancelled
    workers.append(worker.start())
    time.sleep(0.5)
    assert worker.jobs == [] and _charges() == 0


def test_a_front_without_redis_that_stops_ends_a_held_background_job_unpaid(
    front, client, requester, live_horde, worker_owner, workers
):
    """The stop's cancel of a background request whose record dies with the process is the
    undelivered one: a job a worker holds then ends unpaid, its submit refused (docs/adr/0110; ADR
    0107 left it paid)."""
    from chat.services.admission import HORDE_TAX

    front.configure(redis_url=None)
    release = threading.Event()

    def reply(job: dict[str, Any]) -> dict[str, Any]:
        release.wait(20)
        return text_reply("Nobody reads this.")(job)

    worker = _idle_worker(live_horde, worker_owner, reply=reply)
    kudos = requester.refresh().kudos
    client.responses.create(model=MODEL, input="Hi", background=True)
    workers.append(worker.start())
    assert wait_for(lambda: worker.jobs, 10)
    front.configure(redis_url=None)  # the process stops (its state shuts down); a new one starts
    release.set()
    assert wait_for(lambda: worker.submits, 10)
    assert worker.submits[0].status_code == 400 and worker.submits[0].json()["rc"] == "AbortedGen"
    time.sleep(0.3)
    assert _charges() == 0
    user = requester.refresh()
    assert (user.kudos, user.kudos_held) == (kudos - HORDE_TAX, Decimal("0"))


@pytest.mark.redis_only
def test_a_background_response_deleted_after_its_keep_time_is_not_kept_again(
    front, client, requester, live_horde, worker_owner, workers
):
    """The mark that tells a DELETE from Redis's data loss lives as long as the record the watcher
    keeps reading: a response deleted while its job runs, later than HORDE_OAI_RESPONSE_ITEMS_SECONDS
    after its create, stays deleted; its job paid after the cancel is not brought back (docs/adr/0110)."""
    front.configure(response_items_seconds=2)
    worker = _idle_worker(live_horde, worker_owner, delay=3.0)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    workers.append(worker.start())
    assert wait_for(lambda: client.responses.retrieve(created.id).status == "in_progress", 10)
    time.sleep(2.5)  # the create was over 2 s ago; the watcher read the record every 0.5 s since
    client.responses.delete(created.id)
    assert wait_for(lambda: _charges() == 1, 10)
    time.sleep(1.5)  # past the watcher's next reads (signal_recheck_seconds 0.5 in these tests)
    assert _raw(front, requester.key, "GET", f"/responses/{created.id}").status_code == 404


def test_a_background_reply_is_counted_once_when_it_is_delivered(front, client, live_horde, worker_owner, workers):
    """horde.oai.completions, queue_wait and first_content.duration count a background reply as a
    foreground one: once, when its finished record is kept, not at each read (docs/adr/0110)."""
    worker = _idle_worker(live_horde, worker_owner)
    created = client.responses.create(model=MODEL, input="Hi", background=True)
    assert client.responses.retrieve(created.id).status == "queued"
    workers.append(worker.start())
    assert _poll(client, created.id, ("completed",)).status == "completed"
    with client.responses.create(model=MODEL, input="Hi", background=True, stream=True) as stream:
        events = list(stream)
    assert events[-1].type == "response.completed"
    for response_id in (created.id, created.id, events[-1].response.id):
        assert client.responses.retrieve(response_id).status == "completed"
    metrics = front.metrics()
    delivered = {
        "horde.model": MODEL,
        "horde.estimated_usage": True,
        "horde.finish_reason": "stop",
        "horde.max_length_lowered": False,
    }
    assert metrics["horde.oai.completions"] == [(delivered, 2)]
    assert [value[0] for _, value in metrics["horde.oai.queue_wait"]] == [2]
    first = {attributes["horde.streamed"]: value[0] for attributes, value in metrics["horde.oai.first_content.duration"]}
    assert first == {False: 1, True: 1}
    assert all(attributes["horde.relayed"] is False for attributes, _ in metrics["horde.oai.first_content.duration"])


class _CuttableRedisRelay:
    """A TCP relay in front of the test's Redis that stops answering, on every connection, the moment
    it is armed and the front writes a response record: Redis failing between a background create's
    PING (answered) and its record's keep (never answered)."""

    def __init__(self, redis_url: str):
        import socket
        from urllib.parse import urlsplit

        target = urlsplit(redis_url)
        self.target = (target.hostname or "127.0.0.1", target.port or 6379)
        self.armed = threading.Event()
        self.cut = threading.Event()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))  # a port of the system's choosing, as tests.ports does
        self.listener.listen(16)
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}{target.path}"
        self.sockets: list[Any] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: Any, sink: Any, from_front: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            if from_front and self.armed.is_set() and b"horde:oai:response:" in data:
                self.cut.set()
            if self.cut.is_set():
                continue  # swallowed: Redis does not answer
            try:
                sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.mark.redis_only
@pytest.mark.parametrize("front_lease_seconds", [None, 0])
def test_a_record_redis_fails_to_keep_after_the_submit_leaves_the_held_job_unpaid(
    front, requester, redis_url, live_horde, worker_owner, workers, front_lease_seconds
):
    """Redis answers the create's PING, then fails before the record is kept, while a worker pops the
    job: the client gets the retryable 503 and nobody could ever read the reply, so the request is
    ended as a front's undelivered one: the job in flight unpaid, its late submit refused, the
    requester charged the horde tax alone (docs/adr/0110; ADR 0107 left it paid). The same with the
    front lease off: a background request names its front without one."""
    from chat.services.admission import HORDE_TAX

    relay = _CuttableRedisRelay(redis_url)
    try:
        lease = {} if front_lease_seconds is None else {"front_lease_seconds": front_lease_seconds}
        front.configure(redis_url=relay.url, **lease)
        release = threading.Event()

        def reply(job: dict[str, Any]) -> dict[str, Any]:
            release.wait(20)
            return text_reply("Nobody reads this.")(job)

        worker = _idle_worker(live_horde, worker_owner, reply=reply)
        workers.append(worker.start())
        kudos = requester.refresh().kudos
        relay.armed.set()
        answer = _raw(front, requester.key, "POST", "/responses", {"model": MODEL, "input": "Hi", "background": True})
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "ResponseItemsUnavailable"
        assert relay.cut.is_set() and worker.jobs  # the job was popped while the keep waited
        release.set()
        assert wait_for(lambda: worker.submits, 10)
        assert worker.submits[0].status_code == 400, worker.submits[0].text
        assert worker.submits[0].json()["rc"] == "AbortedGen"
        time.sleep(0.3)
        (row,) = _requests()
        assert row.cancelled
        assert _charges() == 0
        user = requester.refresh()
        assert (user.kudos, user.kudos_held) == (kudos - HORDE_TAX, Decimal("0"))
    finally:
        relay.close()
